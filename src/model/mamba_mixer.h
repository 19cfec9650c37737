// MambaMixer: Mamba-2's token mixer (Dao & Gu 2024, arXiv:2405.21060), as Megatron-LM's
// MambaMixer (megatron/core/ssm/mamba_mixer.py, rmsnorm true, norm_before_gate false, D per
// head, no linear biases, conv bias) computes it in training. With d = d_inner = heads x
// head_dim, G groups, N = state dim, K conv taps, H hidden:
//   [z, xBC, dt] = in_proj(x)                                   [T, d + (d + 2 G N) + heads]
//   xBC          = silu(causal_conv1d(xBC) + conv1d.bias)        depthwise, K taps
//   [x, B, C]    = xBC                                           [T, d], [T, G N], [T, G N]
//   y            = ssd(x, dt, A_log, B, C, D, dt_bias)           the selective scan (ops/ssm.h)
//   y            = norm(y * silu(z)) * norm.weight              RMSNorm per group of d / G,
//                                                                eps 1e-5 (RMSNormGated)
//   out          = out_proj(y)                                   [T, H]
// Parameters (Megatron's names under "decoder.layers.<i>.mixer"): in_proj.weight [P, H]
// (P = 2 d + 2 G N + heads), conv1d.weight [d + 2 G N, 1, K], conv1d.bias, dt_bias, A_log,
// D [heads], norm.weight [d], out_proj.weight [H, d]. Initial values as MambaMixer draws
// them in distribution (normal in_proj / scaled-normal out_proj, conv uniform with
// +-1/sqrt(K), dt_bias the inverse softplus of dt = exp(U[log 1e-3, log 1e-1]) floored at
// 1e-4, A = U[1, 16], D and norm 1), from Philox by name as every Megaton parameter.
//
// Tensor parallelism as MambaMixer's: in_proj column-parallel with each of z, x, B, C, dt
// split (Param::tp_blocks), so rank r holds heads [r heads/tp, ...) and groups [r G/tp,
// ...); conv1d (its x, B, C blocks), dt_bias, A_log, D and norm.weight split alike;
// out_proj row-parallel. Under sequence parallelism in_proj gathers the rows and out_proj
// reduce-scatters them; the scan always sees whole sequences. Packed documents
// (--reset-attention-mask): the scan and the convolution restart at each document
// (mamba_ssm's seq_idx). Context parallelism is refused by the trainer.
#pragma once
#include <any>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/layer_spec.h"
#include "model/layers.h"
#include "model/parallel.h"

namespace megaton {

class MambaMixer final : public Mixer {
 public:
  MambaMixer(const std::string& prefix, const GPTConfig& cfg, int64_t layer, uint64_t seed,
             const ModelParallel& mp = {});
  // x [T, H] (under SP this rank's [T / tp, H] rows) -> [T, H], out_proj's bias (none)
  // left to the caller.
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const ForwardContext& ctx) override;
  Tensor backward(const Tensor& dy, const std::function<Tensor()>& input) override;
  // Generation (one rank, one sequence): x [n, H]. key_cache is the conv state [1, K-1,
  // d + 2 G N] (compute dtype) and value_cache the SSM state [1, heads, head_dim, N] (F32),
  // as mamba_inference_state_shapes gives them: first_position 0 runs the whole prefix and
  // writes both; later calls continue from them token by token.
  Tensor forward_inference(const Tensor& x, int64_t first_position, Tensor& key_cache,
                           Tensor& value_cache) const override;
  void collect_params(std::vector<Param*>& out) override;
  std::vector<Linear*> linears() override { return {&in_proj, &out_proj}; }
  Linear& output_linear() override { return out_proj; }
  // layernorm recompute: in_proj keeps no copy of its input (backward's `input` remakes it).
  void set_recompute(const RecomputeConfig& rc) override;

  struct Saved {
    bool held = false;
    int64_t batch = 0, seq = 0;
    Tensor z, xbc_raw, dt;  // in_proj's parts [T, d], [T, d + 2 G N], [T, heads]
    Tensor x, B, C;         // the convolution's output, split [T, d], [T, G N], [T, G N]
    Tensor y, rstd;         // the scan's output [T, d] and the gated norm's 1/rms
    Tensor doc_positions;   // I32 [T] positions within packed documents, or undefined
    Linear::Saved in_proj, out_proj;
  };
  std::any take_saved() override;
  void restore_saved(std::any&& saved) override;
  void for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) override;

  Linear in_proj;
  Param conv1d_weight, conv1d_bias, dt_bias, A_log, D, norm_weight;
  Linear out_proj;

 private:
  // This rank's sizes.
  int64_t heads_ = 0, head_dim_ = 0, groups_ = 0, state_ = 0, d_inner_ = 0, conv_dim_ = 0;
  int64_t kernel_ = 0, chunk_ = 0;
  bool keep_input_ = true;
  Saved saved_;
};

std::unique_ptr<Mixer> make_mamba_mixer(const std::string& prefix, const GPTConfig& cfg,
                                        int64_t layer, uint64_t seed, const ModelParallel& mp);
// The per-layer generation states of a Mamba layer (one sequence): conv [1, K-1, d + 2 G N]
// and ssm [1, heads, head_dim, N] (GPTConfig's whole sizes; generation runs on one rank).
Shape mamba_conv_state_shape(const GPTConfig& cfg);
Shape mamba_ssm_state_shape(const GPTConfig& cfg);

}  // namespace megaton
