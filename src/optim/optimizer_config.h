// Which optimizer a run trains with (--optimizer) and the settings of the rules other than
// Adam's (optim::AdamWConfig holds Adam's): Megatron-LM's OptimizerConfig fields for SGD,
// Lion and Muon, with the defaults of Megatron's command line (arguments.py,
// _add_regularization_args; docs/research/muon.md section 1).
#pragma once

#include <string>

#include "ops/muon.h"

namespace megaton::optim {

// --optimizer: adam (the default), sgd, muon (dist_muon: Megatron's deprecated alias for
// muon with --use-distributed-optimizer) or lion.
enum class OptimizerKind { Adam, Sgd, Muon, Lion };
const char* optimizer_kind_name(OptimizerKind kind);  // Megatron's spelling
// "adam", "sgd", "muon", "lion" -> the kind. megaton::Error naming --optimizer and the
// accepted names otherwise; Megatron's dist_muon is read by the flag parser, and its soap and
// adaptive_muon (registered, but with no flags for their settings) are refused by name.
OptimizerKind parse_optimizer_kind(const std::string& name);

// --muon-tp-mode: how Newton-Schulz treats a tensor-parallel slice (docs/research/muon.md
// section 4). Blockwise: each slice on its own (the result depends on the TP size);
// Duplicated (Megatron's default): the slices all-gathered, the whole matrix orthogonalised
// on every rank, each keeping its own slice; Distributed: the iteration run on the slices
// with the Gram matrix (and the Frobenius norm) summed over the group every step.
enum class MuonTpMode { Blockwise, Duplicated, Distributed };
const char* muon_tp_mode_name(MuonTpMode mode);
// "blockwise", "duplicated", "distributed" -> the mode; megaton::Error naming --muon-tp-mode
// and the accepted names otherwise.
MuonTpMode parse_muon_tp_mode(const std::string& name);

// --muon-fp32-matmul-prec: the precision of Newton-Schulz's GEMMs on the GPU (Megatron sets
// torch's float32 matmul precision inside the iteration): Medium (the default) runs it in
// bf16, High in TF32, Low in fp32 (Megatron's "low" leaves torch's "highest"). The CPU
// reference always computes in fp64.
enum class MuonMatmulPrecision { Low, Medium, High };
const char* muon_matmul_precision_name(MuonMatmulPrecision precision);
// "low", "medium", "high" -> the precision; megaton::Error naming --muon-fp32-matmul-prec and
// the accepted names otherwise.
MuonMatmulPrecision parse_muon_matmul_precision(const std::string& name);

// The Muon rule's settings (Megatron's muon_* fields).
struct MuonConfig {
  float momentum = 0.9f;  // --muon-momentum (the CLI default; OptimizerConfig says 0.95)
  bool nesterov = false;  // --muon-nesterov
  bool split_qkv = true;  // off with --muon-no-split-qkv
  ops::NsCoefficients coefficients = ops::NsCoefficients::Quintic;  // --muon-coefficient-type
  int num_ns_steps = 5;                                             // --muon-num-ns-steps
  ops::MuonScaleMode scale_mode = ops::MuonScaleMode::Spectral;     // --muon-scale-mode
  float extra_scale_factor = 1.0f;                                  // --muon-extra-scale-factor
  MuonTpMode tp_mode = MuonTpMode::Duplicated;
  MuonMatmulPrecision matmul_precision = MuonMatmulPrecision::Medium;
  // --muon-scalar-optimizer: the rule of the params Muon does not take (adam or lion).
  OptimizerKind scalar_optimizer = OptimizerKind::Adam;
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::Adam;
  MuonConfig muon;
  float sgd_momentum = 0.9f;  // --sgd-momentum (torch SGD: no dampening, no Nesterov)
  // --lion-beta1 / --lion-beta2: Lion under --muon-scalar-optimizer lion. A top-level
  // --optimizer lion takes --adam-beta1 / --adam-beta2 instead, as Megatron's
  // _default_adam_based_eopt_config_to_kwargs does.
  float lion_beta1 = 0.95f;
  float lion_beta2 = 0.98f;
};

}  // namespace megaton::optim
