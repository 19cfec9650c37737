// Memory plan: the parameter state and the activations of the busiest rank, counted from
// what the model code allocates (sources named at each term; docs/memory.md).
#include "train/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "model/layer_spec.h"
#include "train/pipeline_schedule.h"

namespace megaton {

double memory_plan_block_bytes(double bytes, Device device) {
  if (!(bytes > 0)) return 0;
  const double small = device == Device::CUDA ? double(1 << 20) : 4096.0;
  const double unit = device == Device::CUDA ? 512.0 : 64.0;
  if (bytes <= small) return std::ceil(bytes / unit) * unit;
  // The largest power of two below `bytes`, cut in 8 steps.
  int exponent = 0;
  std::frexp(bytes - 1, &exponent);
  const double step = std::ldexp(1.0, exponent - 1) / 8;
  return std::ceil(bytes / step) * step;
}

namespace {

constexpr double kF32 = 4, kI32 = 4, kI64 = 8;

// The numbers every term reads. T: tokens of one micro-batch; Tl: this rank's rows of the
// residual stream (T / tp under sequence parallelism); Tm: rows entering an MoE layer
// (T / tp whenever tp > 1, model/moe.h).
struct Dims {
  const TrainArgs& args;
  const GPTConfig& m;
  Device device;
  double cb;              // compute dtype bytes
  double tp, ep, etp, G;  // G: the expert-model-parallel group, ep x etp
  bool sp, ln_norm;       // sequence parallelism; LayerNorm (keeps a mean) or RMSNorm
  double B, S, T, Tl, Tm, H, V, np, ng, d, fc1, ffn;
  double bytes(double numel, double element_bytes) const {
    return memory_plan_block_bytes(numel * element_bytes, device);
  }
  double act(double rows, double cols) const { return bytes(rows * cols, cb); }
  double norm_stats(double rows) const { return bytes(rows, kF32) * (ln_norm ? 2 : 1); }
};

// One transformer layer's activations (model/gpt.cpp TransformerLayer::forward and the
// layers it calls), for one micro-batch.
struct LayerMemory {
  double saved = 0;      // kept from its forward to its backward (no full recompute)
  double kept_full = 0;  // kept when a full-recompute group re-runs it (MoE routing)
  double input = 0;      // its input [Tl, H] (part of saved; a group's first layer keeps it)
  double backward = 0;   // transient bytes during its backward, beyond what it saved
  double rerun = 0;      // recompute moe: what backward's forward re-run adds, then frees
};

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

// One model chunk's activations for one micro-batch and its peak moments
// (GPTModel::forward_chunk / backward_chunk).
struct ChunkMemory {
  double saved = 0;           // held from its forward to its backward
  double forward_logits = 0;  // at the end of the forward (post_process): logits, loss
  double forward_other = 0;   //   and the rest of the moment's transients
  double backward_logits = 0, backward_other = 0;  // the highest moment of its backward
  std::string forward_at = "the end of a forward (logits and loss)";
  std::string backward_at;
  double offloaded = 0;  // --cpu-offloading: bytes its forward moves to host memory
};

ChunkMemory chunk_memory(const Dims& x, const ChunkLayers& layers, bool pre, bool post,
                         bool training) {
  const GPTConfig& m = x.m;
  const RecomputeConfig& rc = m.recompute;
  const bool full = training && rc.granularity == RecomputeGranularity::Full;
  const int64_t n = layers.num_layers;
  std::vector<LayerMemory> lm;
  for (int64_t i = 0; i < n; ++i) lm.push_back(layer_memory(x, layers.first_layer + i, training));
  // Held per layer: all it saved, or under full recompute its group's input (first layer)
  // and its MoE routing; nothing for a layer --cpu-offloading moves to the host
  // (model/activation_offload.h).
  std::vector<double> held(size_t(n), 0);
  ChunkMemory out;
  auto offloaded = [&](int64_t i) { return training && m.cpu_offloading.offloads(i); };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t group = full ? rc.full_group_start(i, n) : -1;
    held[size_t(i)] = group < 0 ? lm[size_t(i)].saved
                                : lm[size_t(i)].kept_full + (group == i ? lm[size_t(i)].input : 0);
    if (offloaded(i)) {
      out.offloaded += held[size_t(i)];
      held[size_t(i)] = 0;
    }
  }
  for (double h : held) out.saved += h;
  if (pre) out.saved += x.bytes(x.T, kI32);  // the token ids
  // Offloading: during layer l's forward the previous layer's tensors wait for their copy
  // (released after layer l's forward), beside layer l's own and the layers kept before.
  double offload_forward = 0, kept_before = pre ? x.bytes(x.T, kI32) : 0;
  for (int64_t l = 1; l < n; ++l) {
    kept_before += held[size_t(l - 1)];
    if (offloaded(l - 1))
      offload_forward =
          std::max(offload_forward, kept_before + lm[size_t(l - 1)].saved + lm[size_t(l)].saved);
  }
  double tail = 0;
  if (post) {
    // The final norm's input and statistics, the output layer's input (gathered under SP)
    // and the labels.
    tail = x.act(x.Tl, x.H) + x.norm_stats(x.Tl) + x.act(x.T, x.H) + x.bytes(x.T, kI32);
    out.saved += tail;
    const double logits = x.act(x.T, x.V / x.tp);
    // lse, the per-token losses, the loss gradient; vocab-parallel: four [T] statistics.
    const double vectors = 3 * x.bytes(x.T, kF32) + (x.tp > 1 ? 4 * x.bytes(x.T, kF32) : 0);
    out.forward_logits = logits + vectors;
    out.forward_other = x.sp ? x.act(x.Tl, x.H) : 0;  // the final norm's local output
    // output_loss_backward: dlogits in place of the logits, then d hidden [T, H].
    out.backward_logits = logits + vectors;
    out.backward_other = x.act(x.T, x.H) + (x.sp ? x.act(x.Tl, x.H) : 0);
    out.backward_at = "the output layer's backward (logits and d hidden)";
    // Multi-token prediction (model/gpt_mtp.cpp): per depth its layer's saved state, the
    // embedding, the two norms' and final norm's inputs and statistics, eh_proj's input
    // [Tl, 2H], its output layer's input, shifted tokens and labels, all held to backward;
    // and its logits and loss vectors, alive beside the main ones at the end of the forward.
    const double D = double(m.mtp_num_layers);
    if (D > 0) {
      const double depth = layer_memory(x, m.num_layers - 1, training).saved +
                           3 * (x.act(x.Tl, x.H) + x.norm_stats(x.Tl)) + x.act(x.Tl, 2 * x.H) +
                           x.act(x.T, x.H) + 2 * x.bytes(x.T, kI32);
      tail += D * depth;
      out.saved += D * depth;
      out.forward_logits += D * (logits + vectors);
      out.backward_logits += D * (logits + vectors);
    }
  }
  if (offload_forward > out.saved + out.forward_logits + out.forward_other) {
    out.forward_logits = 0;
    out.forward_other = offload_forward - out.saved;
    out.forward_at = "a forward, two offloaded layers' tensors on the device (one being copied)";
  }
  // The layers' backward, last first: a full-recompute group re-runs its forward when its
  // last layer's backward starts; each layer frees what it saved when its backward ends.
  double live = out.saved - tail;  // the final norm's state is gone by then
  double best = post ? out.backward_logits + out.backward_other : -1;
  for (int64_t i = n; i-- > 0;) {
    const int64_t group = full ? rc.full_group_start(i, n) : -1;
    if (group >= 0 && i + 1 == rc.full_group_end(i, n))
      for (int64_t j = group; j <= i; ++j) live += lm[size_t(j)].saved - held[size_t(j)];
    // Offloading: layer i - 1's tensors come back at the start of layer i's backward.
    if (i >= 1 && offloaded(i - 1)) live += lm[size_t(i - 1)].saved;
    const double moment = live + lm[size_t(i)].backward;
    if (moment - out.saved > best) {
      best = moment - out.saved;
      out.backward_logits = 0;
      out.backward_other = best;
      out.backward_at = fmt::format("the backward of layer {}{}", layers.first_layer + i,
                                    m.is_moe_layer(layers.first_layer + i) ? " (MoE)" : "");
    }
    live -= lm[size_t(i)].saved;
  }
  return out;
}

}  // namespace

// Parameters and the persistent state are in memory_plan_state.cpp.
void plan_parameter_state(const TrainArgs& args, const dist::ValidatedLayout& layout, int64_t stage,
                          MemoryPlan& plan);
void plan_parameter_counts(const GPTConfig& m, MemoryPlan& plan);

MemoryPlan plan_memory(const TrainArgs& args, const dist::ValidatedLayout& layout) {
  const GPTConfig& m = args.model;
  MEGATON_CHECK(m.padded_vocab_size > 0, "plan_memory: GPTConfig not finalized");
  MemoryPlan plan;
  plan.device = m.device;
  plan.compute_dtype = m.compute_dtype();
  plan.main_grads_dtype = m.main_grads_dtype;
  if (args.parallel.use_megatron_fsdp) plan.fsdp = args.parallel.data_parallel_sharding_strategy;
  plan.main_params_dtype = args.adam.main_params_dtype;
  plan.sizes = layout.sizes;
  plan.sequence_parallel = layout.sequence_parallel;
  const dist::ParallelSizes& z = layout.sizes;
  const int64_t pp = z.pp, vpp = z.vpp.value_or(1);
  const int64_t gbs = args.global_batch_size > 0 ? args.global_batch_size : args.micro_batch_size;
  plan.micro_batches =
      std::max<int64_t>(gbs / (args.micro_batch_size * std::max<int64_t>(z.dp, 1)), 1);
  const int64_t M = plan.micro_batches;

  Dims x{args, m, m.device, double(dtype_size(m.compute_dtype())), double(z.tp), double(z.ep),
         double(z.etp > 0 ? z.etp : z.tp), 0, layout.sequence_parallel && z.tp > 1,
         m.normalization == Normalization::LayerNorm,
         // Under context parallelism a rank holds S / cp rows of each sample (the CP
         // attention's own K/V buffers are not counted).
         double(args.micro_batch_size), double(m.seq_length / std::max<int64_t>(z.cp, 1)), 0, 0, 0,
         double(m.hidden_size), double(m.padded_vocab_size), double(m.num_attention_heads),
         double(m.num_query_groups), double(m.kv_channels), 0, double(m.ffn_hidden_size)};
  x.G = x.ep * x.etp;
  x.T = x.B * x.S;
  x.Tl = x.sp ? x.T / x.tp : x.T;
  x.Tm = x.T / x.tp;
  plan_parameter_counts(m, plan);

  const std::string recompute_modules = recompute_module_names(m.recompute.modules);
  switch (m.recompute.granularity) {
    case RecomputeGranularity::None:
      plan.recompute = "none";
      break;
    case RecomputeGranularity::Selective:
      plan.recompute = "selective: " + recompute_modules;
      break;
    case RecomputeGranularity::Full:
      plan.recompute =
          fmt::format("full, {}, {} layers",
                      m.recompute.method == RecomputeMethod::Uniform ? "uniform" : "block",
                      m.recompute.num_layers);
  }
  plan.schedule = pp == 1    ? "no pipeline"
                  : vpp == 1 ? "1F1B"
                             : fmt::format("interleaved 1F1B, {} chunks per stage", vpp);

  double best_total = -1;
  for (int64_t s = 0; s < pp; ++s) {
    MemoryPlan sp = plan;  // this stage's candidate
    plan_parameter_state(args, layout, s, sp);
    std::vector<ChunkMemory> chunks;
    double per_micro_batch = 0;
    sp.stage_layers = sp.stage_moe_layers = 0;
    for (int64_t c = 0; c < vpp; ++c) {
      const ChunkLayers cl = chunk_layers(layout.layers_per_stage, vpp, s, c);
      for (int64_t l = cl.first_layer; l < cl.first_layer + cl.num_layers; ++l) {
        ++sp.stage_layers;
        sp.stage_moe_layers += m.is_moe_layer(l);
      }
      chunks.push_back(chunk_memory(x, cl, s == 0 && c == 0, s == pp - 1 && c == vpp - 1, true));
      per_micro_batch += chunks.back().saved;
    }
    sp.activations_per_micro_batch = per_micro_batch;
    // Walk this stage's schedule (pipeline_rank_order): at each forward's end and each
    // backward's highest moment, the held activations of every live (micro-batch, chunk).
    std::vector<PipelineOp> order;
    if (pp == 1) {
      order = {{true, 0, 0}, {false, 0, 0}};  // every micro-batch alike, one at a time
    } else {
      order = pipeline_rank_order(pp, vpp, s, M, false);
    }
    std::vector<int64_t> live(size_t(vpp), 0);
    double best = -1;
    for (const PipelineOp& op : order) {
      const ChunkMemory& c = chunks[size_t(op.chunk)];
      if (op.forward) ++live[size_t(op.chunk)];
      double others = 0;
      int64_t pairs = 0;
      for (int64_t k = 0; k < vpp; ++k) {
        others += double(live[size_t(k)]) * chunks[size_t(k)].saved;
        pairs += live[size_t(k)];
      }
      others -= c.saved;
      const double logits = op.forward ? c.forward_logits : c.backward_logits;
      const double other = op.forward ? c.forward_other : c.backward_other;
      if (others + c.saved + logits + other > best) {
        best = others + c.saved + logits + other;
        sp.activations = c.saved;
        sp.in_flight_activations = others;
        sp.logits_and_loss = logits;
        sp.working_set = other;
        sp.in_flight = pairs;
        sp.peak_at = op.forward ? c.forward_at : c.backward_at;
        if (pp > 1)
          sp.peak_at += fmt::format(", micro-batch {} of model chunk {}", op.micro_batch, op.chunk);
      }
      if (!op.forward) --live[size_t(op.chunk)];
    }
    // Evaluation (pp 1): a forward-only pass (ForwardContext::forward_only) in which each
    // layer drops what it saved right after its forward, but an MoE layer's routing: one
    // layer's activations at a time on top of the routing kept so far, then the final
    // norm, the output layer and the logits.
    if (pp == 1 && args.eval_iters > 0) {
      const ChunkLayers cl = chunk_layers(layout.layers_per_stage, 1, 0, 0);
      const ChunkMemory e = chunk_memory(x, cl, true, true, false);
      double routing = 0, layers_saved = 0, in_layer = 0, in_layer_saved = 0;
      for (int64_t i = 0; i < cl.num_layers; ++i) {
        const LayerMemory l = layer_memory(x, cl.first_layer + i, false);
        if (routing + l.saved > in_layer) {
          in_layer = routing + l.saved;
          in_layer_saved = l.saved;
        }
        routing += l.kept_full;
        layers_saved += l.saved;
      }
      const double fixed = e.saved - layers_saved;  // token ids, the tail's inputs, labels
      const double at_loss = routing + fixed + e.forward_logits + e.forward_other;
      const double during = std::max(at_loss, in_layer + x.bytes(x.T, kI32));
      if (during > best) {
        best = during;
        const bool loss = at_loss >= in_layer + x.bytes(x.T, kI32);
        sp.activations = loss ? routing + fixed : in_layer_saved + x.bytes(x.T, kI32);
        sp.in_flight_activations = loss ? 0 : in_layer - in_layer_saved;
        sp.logits_and_loss = loss ? e.forward_logits : 0;
        sp.working_set = loss ? e.forward_other : 0;
        sp.in_flight = 1;
        sp.peak_at = loss ? "an evaluation forward's loss (each layer's state dropped after it)"
                          : "an evaluation forward's largest layer";
      }
    }
    if (m.device == Device::CUDA) {
      // cuBLASLt's workspace (ops/cuda/gemm.cpp lt_context, 32 MiB) and the cuDNN SDPA
      // workspace, grown to the largest need (ops/cuda/attention.cpp): estimated as the
      // backward's fp32 dQ accumulator [B, heads / tp, S, d] and its [B, heads / tp, S]
      // statistics.
      const double heads = x.np / x.tp;
      sp.workspaces = memory_plan_block_bytes(double(32 << 20), Device::CUDA) +
                      x.bytes(x.B * heads * x.S * (x.d + 1), kF32);
    }
    sp.stage = s;
    plan.stage_totals.push_back(sp.total());
    if (sp.total() > best_total) {
      best_total = sp.total();
      std::vector<double> totals = std::move(plan.stage_totals);
      plan = sp;
      plan.stage_totals = std::move(totals);
    }
  }
  auto& notes = plan.assumptions;
  if (m.num_experts > 0)
    notes.push_back(fmt::format(
        "MoE: balanced routing, each rank's experts get {} of the {} copies per token{}",
        z.etp > 1 ? fmt::format("etp ({}) x their share", z.etp) : std::string("their share"),
        m.moe_router_topk,
        m.moe_expert_capacity_factor > 0 ? ", at most the capacity"
                                         : " (dropless: a skewed "
                                           "step holds more)"));
  if (m.cpu_offloading.enabled && m.cpu_offloading.num_layers > 0) {
    const ChunkLayers cl = chunk_layers(layout.layers_per_stage, 1, 0, 0);
    notes.push_back(fmt::format(
        "CPU offloading: the first {} layers' activations, {:.2f} GiB per micro-batch, in "
        "pinned host memory between forward and backward (not counted above)",
        m.cpu_offloading.num_layers,
        chunk_memory(x, cl, true, pp == 1, true).offloaded / double(1 << 30)));
  }
  if (args.adam.optimizer_cpu_offload)
    notes.push_back(fmt::format(
        "optimizer CPU offload: {:.0f}% of the elements' main params and Adam moments, {:.2f} "
        "GiB, in pinned host memory (not counted above; whole params, so the device keeps up "
        "to one param more or less)",
        100 * args.adam.optimizer_offload_fraction,
        plan.offloaded_optimizer_bytes / double(1 << 30)));
  if (m.fp8.enabled)
    notes.push_back(
        "FP8: saved inputs as FP8 x^T, each expert padded to the FP8 multiple on "
        "average; the transient quantized copies are not counted");
  if (m.device == Device::CUDA)
    notes.push_back(
        "CUDA: tensors counted in the caching allocator's blocks; the CUDA context "
        "and cuBLAS's own workspace (outside the allocator) are not counted");
  return plan;
}

}  // namespace megaton
