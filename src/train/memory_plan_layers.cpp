// The memory plan's per-layer activation terms (train/memory_plan_layers.h): each layer
// kind's saved and transient bytes, counted from what its forward and backward allocate
// (sources named at each term; docs/memory.md).
#include "train/memory_plan_layers.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "model/layer_spec.h"

namespace megaton::memory_plan_detail {

namespace {

// What the layer's selective recompute keeps (TransformerLayer's constructor).
struct Keeps {
  bool qkv_input, core_attn_out, mlp_input, fc1_out, shared_fc1_out, moe_whole;
  bool mla_up_proj_out = true;
};
Keeps keeps_of(const RecomputeConfig& rc, bool training) {
  return {!rc.selective(kRecomputeLayernorm),     !rc.selective(kRecomputeCoreAttn),
          !rc.selective(kRecomputeLayernorm),     !rc.selective(kRecomputeMlp),
          !rc.selective(kRecomputeSharedExperts), !(training && rc.selective(kRecomputeMoe)),
          !rc.selective(kRecomputeMlaUpProj)};
}

// Multi-latent attention's half of a layer (model/mla.cpp MLASelfAttention::forward and
// backward), its norms and pre_mlp_layernorm; FP8's x^T copies are not counted apart.
void mla_memory(const Dims& x, const Keeps& k, LayerMemory& out) {
  const GPTConfig& m = x.m;
  const double n = x.np / x.tp, T = x.T, dq = double(m.qk_head_dim + m.qk_pos_emb_head_dim),
               v = double(m.v_head_dim), rq = double(m.q_lora_rank), rkv = double(m.kv_lora_rank);
  out.input = x.act(x.Tl, x.H);
  double s = out.input + x.norm_stats(x.Tl);  // input_layernorm: x, rstd (mean)
  if (k.qkv_input) s += x.act(x.Tl, x.H);     // the down projections' (shared) input
  // A latent [Tl, r]: kept by its norm (with statistics) and the norm's output by the up
  // projection (or the mla_up_proj recompute), or, without --qk-layernorm, once.
  auto latent = [&](double r) {
    return m.qk_layernorm ? 2 * x.act(x.Tl, r) + x.norm_stats(x.Tl) : x.act(x.Tl, r);
  };
  if (rq > 0)
    s += latent(rq);
  else if (!k.mla_up_proj_out)
    s += x.act(T, n * dq);  // linear_q_proj's output q
  s += latent(rkv);
  if (k.mla_up_proj_out)
    s += 2 * x.act(T, n * dq) + x.act(T, n * v);  // query, key, value
  else
    s += x.act(x.Tl, double(m.qk_pos_emb_head_dim));                         // k_pe rows
  if (k.core_attn_out) s += x.act(T, n * v) + x.bytes(x.B * n * x.S, kF32);  // output, lse
  s += x.act(x.Tl, x.H) + x.norm_stats(x.Tl);  // pre_mlp_layernorm: h = x + attn
  out.saved += s;
  // Backward: dy, dh, linear_proj's gathered dy (SP), dout, the remade query/key/value
  // and output, their gradients, dq and dkv, the up projections' dx and the down
  // projections' dx and (SP) gathered inputs.
  // Two moments: the attention's backward (dout, the query/key/value gradients, and what
  // the recomputes remade) and the RoPE assembly's (those gradients, dq and dkv).
  const double dqkv = 2 * x.act(T, n * dq) + x.act(T, n * v);
  double attn = x.act(T, n * v) + dqkv;
  if (!k.mla_up_proj_out) attn += dqkv;
  if (!k.core_attn_out) attn += x.act(T, n * v) + x.bytes(x.B * n * x.S, kF32);
  const double rope = dqkv + x.act(T, n * dq) + x.act(T, n * (double(m.qk_head_dim) + v));
  double b =
      2 * x.act(x.Tl, x.H) + (x.sp ? x.act(T, x.H) : 0) + std::max(attn, rope) + x.act(x.Tl, x.H);
  if (!k.qkv_input) b += x.act(x.Tl, x.H);
  out.backward = std::max(out.backward, b);
}

// A Mamba-2 layer (model/mamba_mixer.cpp MambaMixer::forward and backward) and its norm.
// Per rank: d = d_inner / tp, conv = d + 2 G N / tp, P = in_proj's width d + conv + heads.
void mamba_memory(const Dims& x, const Keeps& k, LayerMemory& out) {
  const GPTConfig& m = x.m;
  const double T = x.T, heads = double(m.mamba_num_heads) / x.tp,
               d = double(m.mamba_d_inner()) / x.tp;
  const double groups = double(m.mamba_num_groups) / x.tp, N = double(m.mamba_state_dim);
  const double conv = d + 2 * groups * N, P = d + conv + heads;
  out.input = x.act(x.Tl, x.H);
  double s = out.input + x.norm_stats(x.Tl);  // norm: x, rstd (mean)
  if (k.qkv_input) s += x.act(x.Tl, x.H);     // in_proj's input (layernorm recompute: none)
  s += x.act(T, d) + 2 * x.act(T, conv) + x.act(T, heads);  // z, xBC raw and convolved, dt
  s += 2 * x.act(T, d) + x.bytes(T * groups, kF32);         // y, out_proj's input, 1/rms
  out.saved += s;
  // The scan's chunk states (the CUDA kernels' F32 scratch, remade in backward with their
  // gradients): [B, chunks, heads, head_dim, N].
  const double chunks = std::ceil(x.S / double(m.mamba_chunk_size));
  const double states = x.bytes(x.B * chunks * heads * double(m.mamba_head_dim) * N, kF32);
  // Backward: dy (gathered under SP), out_proj's dx, the norm's dy and dz, the scan's dx,
  // dB, dC, ddt, dxBC, the convolution's dxBC, in_proj's dy [T, P] and dx (with the
  // gathered or remade input); all live until in_proj's backward returns.
  double b = x.act(x.Tl, x.H) + (x.sp ? x.act(T, x.H) : 0) + 3 * x.act(T, d) +
             x.act(T, conv + heads) + 2 * x.act(T, conv) + x.act(T, P) + x.act(T, x.H) +
             (x.sp ? x.act(T, x.H) : 0) + 2 * states;
  if (!k.qkv_input) b += x.act(x.Tl, x.H);
  out.backward = std::max(out.backward, b);
}

// The attention half of a layer and its norms; `fp8`: its linears keep FP8 x^T.
void attention_memory(const Dims& x, const Keeps& k, bool fp8, LayerMemory& out) {
  const GPTConfig& m = x.m;
  if (m.multi_latent_attention) return mla_memory(x, k, out);
  const double np = x.np / x.tp, ng = x.ng / x.tp, d = x.d, T = x.T;
  const bool fp8_saves_xt = fp8 && m.fp8.wgrad;
  out.input = x.act(x.Tl, x.H);
  double s = out.input + x.norm_stats(x.Tl);  // input_layernorm: x, rstd (mean)
  if (k.qkv_input)                            // linear_qkv: its input
    s += fp8_saves_xt ? x.bytes(T * x.H, 1) : x.act(x.Tl, x.H);
  s += x.act(T, np * d) + 2 * x.act(T, ng * d);  // q, k, v after RoPE
  if (m.qk_layernorm)                            // the split q, k and their statistics
    s += x.act(T, np * d) + x.act(T, ng * d) +
         (x.bytes(T * np, kF32) + x.bytes(T * ng, kF32)) * (x.ln_norm ? 2 : 1);
  if (k.core_attn_out) {                                    // attention output (linear_proj's
    s += x.act(T, np * d) + x.bytes(x.B * np * x.S, kF32);  // input too) and lse
    if (fp8_saves_xt) s += x.bytes(T * np * d, 1);          // linear_proj's FP8 x^T
  }
  s += x.act(x.Tl, x.H) + x.norm_stats(x.Tl);  // pre_mlp_layernorm: h = x + attn
  out.saved += s;
  // Backward of the attention half (SelfAttention::backward): dy, dh, linear_proj's
  // gathered dy (SP), dout, the recomputed output, dq dk dv, dqkv, linear_qkv's dx and
  // its gathered input (SP) or recomputed norm output.
  double b = 2 * x.act(x.Tl, x.H) + (x.sp ? x.act(T, x.H) : 0) + x.act(T, np * d);
  if (!k.core_attn_out) b += x.act(T, np * d) + x.bytes(x.B * np * x.S, kF32);
  b += 2 * (x.act(T, np * d) + 2 * x.act(T, ng * d)) + x.act(T, x.H);
  if (x.sp) b += x.act(T, x.H);
  if (!k.qkv_input) b += x.act(x.Tl, x.H);
  out.backward = std::max(out.backward, b);
}

// A dense MLP over `rows` of width ffn (model/layers.cpp MLP): saved and backward bytes,
// input_saved: whether it keeps (or its fc1 keeps) its input itself.
void mlp_memory(const Dims& x, double ffn, bool keep_input, bool keep_fc1_out, bool fp8,
                bool input_is_shared, LayerMemory& out) {
  const double T = x.T, f = ffn / x.tp, f1 = (x.m.swiglu ? 2 * ffn : ffn) / x.tp;
  double s = 0;
  if (keep_input && !input_is_shared) {
    // fc1 keeps x (FP8: x^T of all TP rows) when it keeps fc1_out, else the MLP keeps x.
    s += fp8 && x.m.fp8.wgrad && keep_fc1_out ? x.bytes(T * x.H, 1) : x.act(x.Tl, x.H);
  } else if (keep_input && fp8 && x.m.fp8.wgrad && keep_fc1_out) {
    s += x.bytes(T * x.H, 1);  // the shared input, kept again as FP8 x^T
  }
  if (keep_fc1_out) s += x.act(T, f1);
  out.saved += s;
  // MLP::backward: dy (gathered under SP), the recomputed input / fc1 output, dact, the
  // activation remade for fc2's weight gradient, dfc1; then fc1's dx [T, H] (and its
  // gathered input under SP) while dact and dfc1 live.
  const double dy = x.act(x.Tl, x.H);
  const double rec = (keep_fc1_out ? 0 : x.act(T, f1)) + (keep_input ? 0 : x.act(x.Tl, x.H));
  const double fc2 = dy + (x.sp ? x.act(T, x.H) : 0) + rec + 2 * x.act(T, f) + x.act(T, f1);
  const double fc1 =
      dy + rec + x.act(T, f) + x.act(T, f1) + x.act(T, x.H) + (x.sp ? x.act(T, x.H) : 0);
  out.backward = std::max(out.backward, std::max(fc2, fc1));
}

// Rows of the local experts' input on one rank, balanced routing (MoE layer).
struct ExpertRows {
  double kept = 0;  // kept copies of this rank's tokens
  double rows = 0;  // R: expert input rows (padded to capacity or FP8 multiples)
  bool dropping = false;
};
ExpertRows expert_rows(const Dims& x, bool fp8) {
  const GPTConfig& m = x.m;
  const double E = double(m.num_experts), k = double(m.moe_router_topk), L = E / x.ep;
  ExpertRows r;
  r.kept = x.Tm * k;
  if (m.moe_expert_capacity_factor > 0) {
    const double capacity = std::ceil(x.Tm * k / E * double(m.moe_expert_capacity_factor));
    r.dropping = true;
    r.kept = std::min(r.kept, E * capacity);
    r.rows = m.moe_pad_expert_input_to_capacity ? L * capacity * x.G : x.etp * r.kept;
  } else {
    r.rows = x.etp * r.kept;
  }
  if (fp8) r.rows += L * double(m.fp8.dimension_multiple()) / 2;  // each expert padded
  return r;
}

// The MoE half of a layer (model/moe.cpp, router.cpp, token_dispatcher.cpp,
// shared_experts.cpp), with `training` (evaluation routes without loss terms).
void moe_memory(const Dims& x, const Keeps& k, bool fp8, bool training, LayerMemory& out) {
  const GPTConfig& m = x.m;
  const double E = double(m.num_experts), topk = double(m.moe_router_topk), Tm = x.Tm;
  const double f = double(m.moe_ffn_hidden_size) / x.etp;
  const double f1 = (m.swiglu ? 2 : 1) * double(m.moe_ffn_hidden_size) / x.etp;
  const ExpertRows er = expert_rows(x, fp8);
  const double R = er.rows, copies = Tm * topk;
  const bool allgather = x.args.parallel.moe_token_dispatcher_type == "allgather";
  // The routing a recompute keeps (TopKRouter::keep_routing_only): logits, probs, indices,
  // the capacity mask, the load-balancing terms and z-loss lse, the jitter.
  double routing = x.bytes(Tm * E, kF32) + x.bytes(copies, kF32) + x.bytes(copies, kI32);
  if (er.dropping) routing += x.bytes(copies, kF32);
  if (training) {
    for (const std::string& type : m.moe_router_load_balancing_type) {
      if (m.moe_loss_coeff(type) == 0.0f || type == "none" || type == "sinkhorn") continue;
      const double groups = type == "seq_aux_loss" ? Tm * x.tp / double(m.seq_length) : 1;
      routing += x.bytes(Tm * E, kF32) + x.bytes(groups * E, kF32);  // scores, coefficients
    }
    if (m.moe_z_loss_coeff > 0) routing += x.bytes(Tm, kF32);
    if (m.moe_input_jitter_eps > 0) routing += x.bytes(Tm * x.H, kF32) + x.act(Tm, x.H);
  }
  const bool device_counts = x.G == 1 && !er.dropping && !m.moe_pad_expert_input_to_capacity &&
                             m.disable_bias_linear && !fp8;
  if (device_counts) routing += x.bytes(E + 1, kI64);
  out.kept_full += routing;
  // Dispatcher state: row_id_map only (of the gathered copies by all-gather). The experts
  // keep their rows' probabilities [R] fp32 (applied after the activation, Megatron's
  // TEGroupedMLP), so combine keeps no expert output: the probabilities' gradient is
  // <dact, act> from the recomputed activation.
  const double dispatcher = x.bytes(allgather ? x.G * copies : copies, kI32);
  const double expert_probs = x.bytes(R, kF32);
  const bool keeps_expert_in = !(fp8 && m.fp8.wgrad);
  const double expert_in = keeps_expert_in ? x.act(R, x.H) : x.bytes(R * x.H, 1);
  double whole = x.act(x.Tl, x.H)  // the MoE input (pre_mlp_layernorm's output)
                 + routing + dispatcher + expert_probs + expert_in + x.act(R, f1);
  if (m.moe_shared_expert_intermediate_size > 0) {
    LayerMemory shared;
    mlp_memory(x, double(m.moe_shared_expert_intermediate_size), true, k.shared_fc1_out, fp8, true,
               shared);
    whole += shared.saved;
    if (m.moe_shared_expert_gate) whole += x.act(x.Tl, x.H) + x.bytes(x.Tl, kF32);
    out.backward = std::max(out.backward, shared.backward + x.act(Tm, x.H));
  }
  // MoELayer::backward: dy, dprobs, the expert output's gradient, dact, dfc1, then the
  // remade weighted activation with the probabilities' gradient by row (fc2's weight
  // gradient), or later dexpert_in; the all-gather dispatcher with G > 1 first gathers dy
  // and makes the gradient of every gathered copy.
  const double dy = x.act(x.Tl, x.H) + x.bytes(copies, kF32);
  double b = x.act(x.Tl, x.H) + x.act(R, x.H) + x.act(R, f) + x.act(R, f1) +
             std::max(x.act(R, f) + x.bytes(R, kF32), x.act(R, x.H) + x.bytes(copies, kF32));
  if (allgather && x.G > 1)
    b = std::max(b, dy + x.act(x.G * Tm, x.H) + x.act(x.G * copies, x.H) + x.act(R, x.H));
  if (!allgather && (x.ep > 1 || er.dropping)) b += x.act(copies, x.H);  // dcombined
  b = std::max(b, dy + x.act(Tm, x.H) + 2 * x.bytes(Tm * E, kF32));      // router backward
  if (k.moe_whole) {
    out.saved += whole;
  } else {
    // --recompute-modules moe: the layer input and the routing; backward re-runs forward.
    out.saved += x.act(x.Tl, x.H) + routing;
    out.rerun = whole - routing;
  }
  out.backward = std::max(out.backward, b + out.rerun);
}

}  // namespace

LayerMemory layer_memory(const Dims& x, int64_t layer, bool training) {
  const GPTConfig& m = x.m;
  const Keeps k = keeps_of(m.recompute, training);
  const bool fp8 = m.fp8.enabled && m.fp8.layer_in_fp8(layer, m.num_layers);
  LayerMemory out;
  const LayerSpec spec = decoder_layer_spec(m, layer);
  if (spec.mixer == MixerKind::Mamba) {
    mamba_memory(x, k, out);
    return out;  // a hybrid model's Mamba layer has no MLP
  }
  if (spec.mixer == MixerKind::None) {  // an MLP / MoE layer alone: its norm keeps x
    out.input = x.act(x.Tl, x.H);
    out.saved += out.input + x.norm_stats(x.Tl);
  } else {
    attention_memory(x, k, fp8, out);
    if (spec.mlp == MlpKind::None) {  // attention alone: no pre_mlp_layernorm (h = x + attn)
      out.saved -= x.act(x.Tl, x.H) + x.norm_stats(x.Tl);
      return out;
    }
  }
  if (m.is_moe_layer(layer)) {
    // The pre_mlp_layernorm output is the MoE layer's kept input (even under layernorm).
    moe_memory(x, k, fp8, training, out);
  } else {
    mlp_memory(x, double(m.ffn_hidden_size), k.mlp_input, k.fc1_out, fp8, false, out);
  }
  return out;
}

}  // namespace megaton::memory_plan_detail
