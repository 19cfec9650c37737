// The names of the optimizer settings (Megatron's spellings) and their parsing.
#include "optim/optimizer_config.h"

#include "core/error.h"
#include "core/printable.h"

namespace megaton::optim {

const char* optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::Adam:
      return "adam";
    case OptimizerKind::Sgd:
      return "sgd";
    case OptimizerKind::Muon:
      return "muon";
    case OptimizerKind::Lion:
      return "lion";
  }
  MEGATON_CHECK(false, "unknown OptimizerKind {}", int(kind));
}

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "adam") return OptimizerKind::Adam;
  if (name == "sgd") return OptimizerKind::Sgd;
  if (name == "muon") return OptimizerKind::Muon;
  if (name == "lion") return OptimizerKind::Lion;
  if (name == "soap" || name == "adaptive_muon")
    fail(
        "--optimizer {} is not supported in Megaton (Megatron registers it but has no flags for "
        "its settings); use one of adam, sgd, muon, lion, dist_muon",
        name);
  fail("option 'optimizer' must be one of adam, sgd, muon, lion, dist_muon (got '{}')",
       printable(name));
}

const char* muon_tp_mode_name(MuonTpMode mode) {
  switch (mode) {
    case MuonTpMode::Blockwise:
      return "blockwise";
    case MuonTpMode::Duplicated:
      return "duplicated";
    case MuonTpMode::Distributed:
      return "distributed";
  }
  MEGATON_CHECK(false, "unknown MuonTpMode {}", int(mode));
}

MuonTpMode parse_muon_tp_mode(const std::string& name) {
  if (name == "blockwise") return MuonTpMode::Blockwise;
  if (name == "duplicated") return MuonTpMode::Duplicated;
  if (name == "distributed") return MuonTpMode::Distributed;
  fail("option 'muon-tp-mode' must be one of blockwise, duplicated, distributed (got '{}')",
       printable(name));
}

const char* muon_matmul_precision_name(MuonMatmulPrecision precision) {
  switch (precision) {
    case MuonMatmulPrecision::Low:
      return "low";
    case MuonMatmulPrecision::Medium:
      return "medium";
    case MuonMatmulPrecision::High:
      return "high";
  }
  MEGATON_CHECK(false, "unknown MuonMatmulPrecision {}", int(precision));
}

MuonMatmulPrecision parse_muon_matmul_precision(const std::string& name) {
  if (name == "low") return MuonMatmulPrecision::Low;
  if (name == "medium") return MuonMatmulPrecision::Medium;
  if (name == "high") return MuonMatmulPrecision::High;
  fail("option 'muon-fp32-matmul-prec' must be one of low, medium, high (got '{}')",
       printable(name));
}

}  // namespace megaton::optim
