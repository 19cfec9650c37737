// The op catalogue: every numeric op Megaton's model and optimizer use, declared once.
//
// Each op checks shapes and dtypes at the door (megaton::InternalError on a mismatch:
// a wrong shape here is a bug in the caller, not a user mistake) and dispatches on the
// device of its tensors. The CPU implementation (ops/cpu/) is the fp32 reference.
//
// Layout conventions:
//   T = tokens in a micro-batch (= B * S, batch-major: token t = b * S + s),
//   H = hidden size, V = (padded) vocabulary, E = experts, k = router top-k,
//   attention tensors are [B, S, heads, D] with D = kv_channels (head dim).
// "accumulates" means the op adds into its output (gradient accumulation); otherwise
// outputs are overwritten. All float tensors are fp32 unless said otherwise.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops {

// ---- GEMM (ops/cpu/gemm.cpp, OpenBLAS sgemm) ----
// c = alpha * op(a) @ op(b) + beta * c, op(x) = x^T when trans_x.
// a [M, K] ([K, M] if trans_a), b [K, N] ([N, K] if trans_b), c [M, N]. 2-d views of
// higher-rank tensors are taken by merging leading dimensions.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
          float alpha = 1.0f, float beta = 0.0f);
// c = op(a) @ op(b) + bias, bias [N] (c's dtype) added to every row: a Linear's
// y = x W^T + b in one GEMM. CPU: gemm then bias_add_ (the unfused reference). CUDA:
// cuBLASLt's bias epilogue, which adds the bias to the fp32 result before c is rounded (a
// BF16 c is rounded once instead of twice: within one bf16 ulp of gemm then bias_add_),
// or gemm then bias_add_ where cuBLASLt has no algorithm with the epilogue.
void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& bias,
               Tensor& c);

// Grouped GEMM over row segments (MoE experts): group g owns rows
// [r_g, r_g + group_rows[g]) of a and c, r_g = sum of the earlier group_rows, and
//   c[rows_g] = a[rows_g] @ op(b[g]) + beta * c[rows_g].
// a [R, K]; b[g] [N, K] if trans_b else [K, N]; c [R, N]; R = sum(group_rows) (host
// counts; empty groups allowed). One call covers all groups (CUDA: one grouped launch).
void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const std::vector<int64_t>& group_rows, float beta = 0.0f);
// Per-group weight gradient: c[g] = a[rows_g]^T @ b[rows_g] + beta * c[g].
// a [R, M], b [R, N], c[g] [M, N] (fp32 main grads; beta = 1 accumulates).
void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const std::vector<int64_t>& group_rows, float beta = 1.0f);

// The same two ops with the per-group row counts in a tensor on a's device (the MoE
// layer's tokens per expert), so that on the GPU the counts never reach the host: no host
// synchronization, the kernels read them.
//   group_rows: I64 [G], on a's device. Group g owns rows [r_g, r_g + n_g) of the row-cut
//   operands, r_g the sum of the earlier counts. Those operands have R rows, R >= the sum
//   of the counts; rows past the last group are neither read nor written. A count that
//   would run past R is cut at R (later groups are then empty).
//   CUDA: the counts are read by the kernels only (a setup kernel turns them into the
//   groups' shapes and row pointers for the grouped GEMM, whose grid is sized without
//   them), so they cannot be checked there: a negative count counts as 0. CPU: the same
//   cut at R; a negative count is an InternalError naming the group and the value.
// Everything that does not need the counts is checked at the door (InternalError):
// group_rows I64, 1-d, with one count per group, on a's device; every b[g] / c[g] (empty
// groups' included: which groups are empty is not known there) of the shape and dtype the
// host-count op requires; the row-cut operands 2-d with R rows each.

// c[rows_g] = a[rows_g] @ op(b[g]) + beta * c[rows_g] for every group.
// a [R, K]; b[g] [N, K] if trans_b else [K, N]; c [R, N]; G = b.size(). CPU: all F32.
// CUDA: a and every b[g] F32 or BF16 alike; c F32, or BF16 when a is.
void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const Tensor& group_rows, float beta = 0.0f);
// Accumulates the per-group weight gradient: c[g] += a[rows_g]^T @ b[rows_g] for every
// group; an empty group leaves c[g] as it is (beta is always 1).
// a [R, M], b [R, N]; c[g] [M, N]; G = c.size(). CPU: all F32. CUDA: a and b F32 or BF16
// alike; every c[g] F32 (fp32 main grads), or every c[g] BF16 when a is.
void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const Tensor& group_rows);

// ---- elementwise and reductions (ops/cpu/reduce.cpp) ----
// dst = src converted to dst's dtype (same numel; e.g. fp32 main params -> bf16 weights),
// round-to-nearest-even.
void cast(const Tensor& src, Tensor& dst);
// y += alpha * x (same numel).
void add_(Tensor& y, const Tensor& x, float alpha = 1.0f);
// x *= s.
void scale_(Tensor& x, float s);
// y[t, :] += bias[:] for y [T, N], bias [N].
void bias_add_(Tensor& y, const Tensor& bias);
// dbias[:] += sum_t dy[t, :] (accumulates). dy [T, N], dbias [N].
void bias_backward(const Tensor& dy, Tensor& dbias);
// The MoE experts' fc2 bias scaled by each row's routing probability (Megatron's
// TEGroupedMLP._apply_bias: output + bias * permuted_probs, in fp32, then rounded):
// y[r, :] += weights[r] * bias[:]. y [R, N] (CPU: F32; GPU: F32, BF16 or F16), bias [N]
// (any of those dtypes on the GPU), weights F32 [R].
void weighted_bias_add_(Tensor& y, const Tensor& bias, const Tensor& weights);
// Its gradient: dbias[:] += sum_r weights[r] dy[r, :] (fp64 sums in a fixed order, as
// bias_backward) and, when dweights is given, dweights[r] += <dy[r, :], bias> (fp32 on the
// GPU, fp64 on the CPU, accumulated into the F32 [R] tensor). dbias F32 [N].
// InternalError on a shape, dtype or device mismatch.
void weighted_bias_backward(const Tensor& dy, const Tensor& bias, const Tensor& weights,
                            Tensor& dbias, Tensor* dweights = nullptr);
// sum of x^2 over all elements, accumulated in fp64.
double sum_of_squares(const Tensor& x);
// sum of all elements, fp64 accumulation.
double sum(const Tensor& x);
// out[0] = sum_i a[i] * b[i] over all elements, accumulated in fp64 in a fixed order and
// stored as fp32. a, b: F32, the same number of elements (any shapes; a and b may be the
// same tensor: the sum of squares); out: a 1-element F32 tensor on their device,
// overwritten. Unlike sum / sum_of_squares the result stays where the operands are: on the
// GPU it is a device value, with no host synchronization (the MoE router keeps its
// load-balancing statistics on the device until the log line this way). InternalError on
// other dtypes, sizes or devices.
void dot(const Tensor& a, const Tensor& b, Tensor& out);
// out[0] = sum of all elements of x (F32, any shape), accumulated in fp64 in a fixed order
// and stored as fp32 in out (a 1-element F32 tensor on x's device, overwritten): sum(x)
// whose result stays on the device (no host synchronization on the GPU; the trainer's
// loss sums). InternalError on other dtypes, sizes or devices.
void sum(const Tensor& x, Tensor& out);

// ---- embedding (ops/cpu/embedding.cpp) ----
// out[t, :] = table[ids[t], :]. ids [T] int32 in [0, V); table [V, H]; out [T, H].
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
// dtable[ids[t], :] += dout[t, :] (accumulates).
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable);

// ---- normalization (ops/cpu/norm.cpp) ----
// RMSNorm (Zhang & Sennrich 2019; Megatron/TE RMSNorm, HF LlamaRMSNorm):
// y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
// x, y [T, H]; weight [H]; rstd [T] (saved for backward).
void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& y, Tensor& rstd);
// dx overwritten [T, H]; dweight [H] accumulates. dresidual (optional, [T, H] like dy): the
// gradient that reaches the norm's input through the residual connection, added to dx in
// the same pass (dx = norm backward + dresidual, as add_ after the unfused op; dx may be
// dresidual's buffer, not dy's or x's).
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight,
                      const Tensor& dresidual = Tensor());
// LayerNorm: y = (x - mean) * rstd * weight + bias; bias may be undefined (no bias).
// mean, rstd [T] saved for backward.
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& y, Tensor& mean, Tensor& rstd);
// dx overwritten; dweight, dbias accumulate (dbias may be undefined); dresidual as in
// rmsnorm_backward.
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias, const Tensor& dresidual = Tensor());
// The pre-norm residual add fused with the norm that follows it (apex's fused add +
// RMSNorm, vLLM's fused_add_rms_norm): sum = x + residual, rounded to x's dtype, then
// y = norm(sum) exactly as rmsnorm_forward / layernorm_forward of that sum. One pass reads
// x and residual and writes sum and y. x, residual, sum, y [T, H] of one dtype; sum may be
// x's or residual's buffer. The norm's backward then takes sum as its x.
void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                         float eps, Tensor& sum, Tensor& y, Tensor& rstd);
void add_layernorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& sum, Tensor& y, Tensor& mean,
                           Tensor& rstd);

// ---- activations (ops/cpu/activation.cpp) ----
// SwiGLU as Megatron packs it: x [T, 2F] = [gate | up], y [T, F] = silu(gate) * up.
void swiglu_forward(const Tensor& x, Tensor& y);
// dx [T, 2F] overwritten. y (optional, [T, F]): also writes the forward output
// silu(gate) * up, the same bits as swiglu_forward, in the same pass. The MLP recomputes
// its activation this way instead of keeping it (fc2's weight gradient takes it after).
void swiglu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y = nullptr);
// GeLU, exact erf form (torch.nn.functional.gelu, Megatron's default activation).
void gelu_forward(const Tensor& x, Tensor& y);
// y (optional, x's shape): also writes gelu_forward's output, as swiglu_backward's y.
void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y = nullptr);
// Squared ReLU, y = relu(x)^2 (Megatron's activations.squared_relu, --squared-relu;
// Nemotron-H's relu2), not gated: x, y one shape. CPU: F32; GPU: F32, BF16 or F16, the
// math in fp32 with one rounding of y. InternalError on a shape, dtype or device mismatch.
void squared_relu_forward(const Tensor& x, Tensor& y);
// dx = dy * 2 relu(x) (Megatron's _squared_relu_back; 0 at x = 0), overwritten; dy, x, dx
// one shape and dtype. y (optional, x's shape): also writes squared_relu_forward's output,
// the same bits, as swiglu_backward's y.
void squared_relu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y = nullptr);
// Row-weighted activations: the MoE experts' activation with the routing probabilities
// applied, Megatron's weighted_bias_swiglu_impl / weighted_swiglu (fusions/
// fused_bias_swiglu.py, used by TEGroupedMLP in transformer/moe/experts.py): fc1's output
// activated, then row r scaled by weights[r], its routing probability (0 for a padding
// row), so that the combine adds the experts' outputs unweighted; squared ReLU's is
// Megatron's weighted_squared_relu (fusions/fused_weighted_squared_relu.py).
//   forward:  y[r, :] = act(x[r, :]) * weights[r]
//   backward: dx[r, :] = act'(x[r, :]) (dy[r, :] * weights[r]),
//             dweights[r] = sum_f dy[r, f] act(x[r, :])[f]
// act: SwiGLU (x [R, 2F] = [gate | up], y [R, F]), exact GeLU or squared ReLU (x, y
// [R, F]). x, y, dy, dx one dtype (CPU: F32; GPU: F32, BF16 or F16), weights and dweights
// F32 [R]; the math is fp32 with one rounding of each output (act * weights is not rounded
// before the product), dweights summed per row in fp32 (CPU: fp64) in a fixed order and
// overwritten.
// backward's y (optional, the forward's shape) receives the forward output again, the same
// bits: the experts recompute fc2's input this way instead of keeping it.
// InternalError on a shape, dtype or device mismatch.
void weighted_swiglu_forward(const Tensor& x, const Tensor& weights, Tensor& y);
void weighted_swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                              Tensor& dx, Tensor& dweights, Tensor* y = nullptr);
void weighted_gelu_forward(const Tensor& x, const Tensor& weights, Tensor& y);
void weighted_gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                            Tensor& dx, Tensor& dweights, Tensor* y = nullptr);
void weighted_squared_relu_forward(const Tensor& x, const Tensor& weights, Tensor& y);
void weighted_squared_relu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                                    Tensor& dx, Tensor& dweights, Tensor* y = nullptr);
// Sigmoid row gate (Megatron's SharedExpertMLP with --moe-shared-expert-gate, whose
// output is MLP(x) * sigmoid(x gate_weight^T)): y[t, :] = x[t, :] * sigmoid(logits[t]).
// x, y [T, H] one float dtype (fp32 on the CPU); logits fp32 with T elements ([T] or
// [T, 1]). The gate value is computed in fp32 (Megatron's in the compute dtype).
void sigmoid_gate_forward(const Tensor& x, const Tensor& logits, Tensor& y);
// s_t = sigmoid(logits[t]): dx[t, :] = dy[t, :] * s_t (x's dtype) and
// dlogits[t] = s_t (1 - s_t) * sum_h dy[t, h] x[t, h] (fp32, summed in fp32), both
// overwritten. dy, x, dx [T, H]; logits, dlogits fp32 with T elements. dx may be dy.
void sigmoid_gate_backward(const Tensor& dy, const Tensor& x, const Tensor& logits, Tensor& dx,
                           Tensor& dlogits);

// ---- dropout (ops/cpu/dropout.cpp) ----
// y = x * keep / (1 - p), keep[i] = Philox(seed).uniform(stream, i) >= p. The mask is
// never stored: backward regenerates it from (seed, stream). p == 0 copies.
void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t stream);
void dropout_backward(const Tensor& dy, Tensor& dx, float p, uint64_t seed, uint64_t stream);
// Megatron's fused bias-dropout-add (bias_dropout_add_fused_train) at a residual
// connection: out = residual + dropout(x + bias), in one pass. x, residual, out [T, N] of
// one float dtype (F32 on the CPU; F32 or BF16 on the GPU); bias [N] (any float dtype) or
// undefined; out may be x or residual. The mask is dropout_forward's (the same seed,
// stream and element index) and each step is rounded to the dtype as bias_add_,
// dropout_forward and add_(out, residual) round it, so the result equals those three ops
// bit for bit. p == 0 draws no mask. Backward needs no op of its own: residual gets dy,
// x + bias gets dropout_backward(dy) (and the bias its row sum).
void bias_dropout_add(const Tensor& x, const Tensor& bias, const Tensor& residual, Tensor& out,
                      float p, uint64_t seed, uint64_t stream);

// ---- rotary position embedding (ops/cpu/rope.cpp) ----
// RoPE (Su et al. 2021) in the non-interleaved "rotate half" form of Megatron's default
// and HF Llama: for i < R/2, inv_freq_i = base^(-2i/R), angle = (s + position_offset) *
// inv_freq_i, (x_i, x_{i+R/2}) rotated by angle. x, y [B, S, heads, D]; y may alias x.
// rotary_dim R: the channels rotated, the first R of each head (partial RoPE, Megatron's
// --rotary-percent: R = int(D * rotary_percent)); the channels [R, D) are copied
// unchanged. 0: R = D, the whole head. InternalError when R is odd, negative or > D.
void rope_forward(const Tensor& x, Tensor& y, float base, int64_t position_offset = 0,
                  int64_t rotary_dim = 0);
// The inverse rotation applied to dy (the tail [R, D) copied). dx may alias dy.
void rope_backward(const Tensor& dy, Tensor& dx, float base, int64_t position_offset = 0,
                   int64_t rotary_dim = 0);

// ---- fused QKV split + RoPE (ops/cpu/qkv.cpp) ----
// Megatron's fused linear_qkv output is grouped by query group (Megatron-LM
// SelfAttention.get_query_key_value_tensors): each token's row is
// [ng, qpg + 2, d] = for every group g, its qpg = np / ng query heads, then its key head,
// then its value head. Query head h = g * qpg + j belongs to group g.
// np = num_attention_heads (q.dim(2)), ng = num_query_groups, d = kv_channels.
//
// Splits qkv [B*S, ng * (qpg + 2) * d] (token t = b * S + s) into q [B, S, np, d] and
// k, v [B, S, ng, d], then, when apply_rope, rotates q and k exactly as
// rope_forward(q, q, rotary_base) and rope_forward(k, k, rotary_base) would (position s
// within the sequence, position_offset 0; v is never rotated). One pass, one kernel on
// the GPU. q, k, v are overwritten and must not alias qkv. batch = B; S = rows / B.
// Dtypes: F32 on the CPU; F32 or BF16 on the GPU, all four tensors the same dtype.
// rotary_base is read only when apply_rope (then it must be > 0 and the rotary dim even;
// the GPU supports d <= 512 with RoPE, any d without).
// position_ids (optional; packed sequences, Megatron's --reset-position-ids): I32 [B*S] on
// qkv's device, >= 0: token t = b * S + s is rotated by position position_ids[t] instead of
// s (as rope_forward with position_offset position_ids[t] would rotate that token alone).
// Undefined: position s. Read only when apply_rope.
// rotary_dim (partial RoPE, as rope_forward's): only the first R channels of each q and k
// head are rotated (pairs (i, i + R/2), frequencies over R), [R, d) copied; 0: R = d. Read
// only when apply_rope (then R must be even and 0 < R <= d, InternalError otherwise).
// Throws InternalError on a shape, dtype or device mismatch (position_ids included), when
// batch does not match q, or (CPU) on a negative position id; the GPU does not check the
// values (a negative one gives a wrong rotation, never a bad access).
void qkv_split_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups, Tensor& q,
                    Tensor& k, Tensor& v, bool apply_rope, float rotary_base,
                    const Tensor& position_ids = Tensor(), int64_t rotary_dim = 0);
// The gradient of qkv_split_rope: rope_backward on dq and dk (when apply_rope), then packs
// dq [B, S, np, d], dk, dv [B, S, ng, d] into dqkv [B*S, ng * (qpg + 2) * d] in the same
// grouped layout. dqkv is overwritten (every element: the three parts tile each row) and
// must not alias the inputs; dq, dk, dv are not modified. Same dtypes, position_ids,
// rotary_dim and errors as the forward.
void qkv_pack_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            int64_t num_query_groups, bool apply_rope, float rotary_base,
                            Tensor& dqkv, const Tensor& position_ids = Tensor(),
                            int64_t rotary_dim = 0);

// ---- fused QKV split + q/k norm + RoPE (ops/cpu/qkv_norm.cpp) ----
// --qk-layernorm (Megatron-LM SelfAttention's q_layernorm / k_layernorm, Hugging Face
// Qwen3's q_norm / k_norm): between the split and RoPE, every query head and every key
// head (one row of d = kv_channels values) is normalized on its own, the query heads with
// one weight [d] (and bias [d]) shared by all of them, the key heads with another.
// These two ops are the unfused sequence
//   qkv_split_rope(apply_rope = false); rmsnorm_forward / layernorm_forward on q viewed as
//   [B*S*np, d] and on k viewed as [B*S*ng, d]; rope_forward on q and k (when apply_rope)
// and its gradient
//   rope_backward on dq, dk; rmsnorm_backward / layernorm_backward; qkv_pack_rope_backward
// in one pass each way (CUDA: one kernel forward; one kernel plus the weight-gradient
// reduction backward). Layout, batch, positions and RoPE as qkv_split_rope (np, ng, d,
// qpg = np / ng; position s within each sequence). Norm row r of q is query head h of
// token t = b * S + s at r = t * np + h; of k, key head g at r = t * ng + g.
//
// Numbers: the CPU ops give the composed CPU ops' values (the same expressions: norm
// statistics and norm arithmetic in fp64 as rmsnorm_forward / layernorm_forward, RoPE in
// fp32 as rope_forward). On the GPU everything is fp32 and, unlike the unfused bf16 path,
// the normalized head is rotated before its single rounding to the output dtype (the
// unfused path rounds it to bf16 between the norm and RoPE); the backward likewise keeps
// the un-rotated gradient in fp32 between the inverse RoPE and the norm backward.

enum class QkNormType { LayerNorm, RMSNorm };

// The parameters of q_layernorm and k_layernorm.
//   type, eps: the norm (as rmsnorm_forward / layernorm_forward; config.normalization and
//     norm_epsilon).
//   q_weight, k_weight [d]; q_bias, k_bias [d] LayerNorm only, both defined or both
//     undefined (no bias); they must be undefined for RMSNorm. CPU: F32. GPU: F32 or BF16,
//     the four of one dtype, independent of the activations' dtype.
struct QkNorm {
  QkNormType type = QkNormType::RMSNorm;
  float eps = 1e-5f;
  Tensor q_weight, k_weight;
  Tensor q_bias, k_bias;
};

// What the forward writes for the backward (allocated by the caller, overwritten).
//   q_input [B, S, np, d], k_input [B, S, ng, d]: the split query and key heads before
//     the norm, in qkv's dtype (the norms' backward needs x; the caller does not keep qkv,
//     and these two are (np + ng) d of its (np + 2 ng) d values per token).
//   q_rstd F32 [B*S*np], k_rstd F32 [B*S*ng]: 1 / sqrt(mean(x^2) + eps) (RMSNorm) or
//     1 / sqrt(var(x) + eps) (LayerNorm, biased variance) of each row.
//   q_mean F32 [B*S*np], k_mean F32 [B*S*ng]: each row's mean, LayerNorm only (not read or
//     written for RMSNorm: may be undefined then).
struct QkNormSaved {
  Tensor q_input, k_input;
  Tensor q_mean, q_rstd;
  Tensor k_mean, k_rstd;
};

// The parameter gradients the backward accumulates (+=) into: F32 [d] each (fp32 main
// grads). q_bias, k_bias: LayerNorm with bias only, both defined or both undefined
// (undefined: the bias gradients are not computed); undefined when the norm has no bias.
struct QkNormGrads {
  Tensor q_weight, k_weight;
  Tensor q_bias, k_bias;
};

// Splits qkv [B*S, ng * (qpg + 2) * d] into
//   q [B, S, np, d] = rope(norm_q(query head)), k [B, S, ng, d] = rope(norm_k(key head)),
//   v [B, S, ng, d] = the value heads (neither normalized nor rotated),
// rope only when apply_rope (then rotary_base > 0 and the rotary dim even), and fills
// saved (q_input, k_input: the heads as split; statistics: see QkNormSaved). batch = B;
// S = rows / B.
// q, k, v and saved.q_input / k_input: qkv's dtype (F32 on the CPU; F32 or BF16 on the
// GPU); none may share memory with qkv. GPU: d <= 512.
// InternalError on a shape, dtype or device mismatch (any tensor above, or a norm
// parameter), batch not matching q, num_query_groups not dividing np, a bias on RMSNorm,
// a missing mean for LayerNorm, an output overlapping qkv, or the GPU's d limit.
// position_ids (optional): per-token RoPE positions, as qkv_split_rope's (and its errors).
// rotary_dim: partial RoPE, as qkv_split_rope's: the norm covers all d channels of a head,
// RoPE then rotates its first R (0: all) and leaves [R, d) as normalized.
void qkv_split_norm_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups,
                         const QkNorm& norm, bool apply_rope, float rotary_base, Tensor& q,
                         Tensor& k, Tensor& v, QkNormSaved& saved,
                         const Tensor& position_ids = Tensor(), int64_t rotary_dim = 0);
// The gradient of qkv_split_norm_rope. From dq [B, S, np, d], dk, dv [B, S, ng, d] (the
// gradients of its q, k, v) and saved (its QkNormSaved, unchanged since), for every query
// and key head: the inverse RoPE (when apply_rope), then the norm's backward
// (rmsnorm_backward / layernorm_backward of that row); packs the results and dv into dqkv
// [B*S, ng * (qpg + 2) * d] in the grouped layout (overwritten: every element), and
// accumulates the norms' parameter gradients over all B*S*np query rows and B*S*ng key
// rows into grads (+=):
//   weight[j] += sum_rows dy_row[j] * xhat_row[j], bias[j] += sum_rows dy_row[j],
// dy_row the un-rotated gradient of the row, xhat_row = (x_row - mean) * rstd (mean 0 for
// RMSNorm). The sums are deterministic: the CPU adds the rows in order in fp64 (as
// rmsnorm_backward); the GPU writes per-block partial sums (blocks of consecutive tokens,
// a function of the shape only) and a second kernel adds them in block order; no atomics,
// so repeated runs give the same bits.
// dq, dk, dv, dqkv: one dtype, as the forward's q, k, v; dqkv shares memory with no input;
// dq, dk, dv and saved are not modified. norm, num_query_groups, apply_rope and
// rotary_base, position_ids and rotary_dim: the forward's. InternalError as the forward,
// and on a grads tensor that is not F32 [d] or a bias gradient without a bias.
void qkv_pack_norm_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                 const QkNormSaved& saved, int64_t num_query_groups,
                                 const QkNorm& norm, bool apply_rope, float rotary_base,
                                 Tensor& dqkv, QkNormGrads& grads,
                                 const Tensor& position_ids = Tensor(), int64_t rotary_dim = 0);

// ---- causal self-attention with GQA (ops/cpu/attention.cpp) ----
// q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], Hq % Hkv == 0 (query head h reads
// kv head h / (Hq / Hkv)); Dv may differ from D (MLA: 192 and 128). scores = q k^T *
// softmax_scale (<= 0: 1 / sqrt(D)), causal mask, softmax, dropout with probability
// dropout_p on the probabilities (Philox(seed), stream), out = probs v. out [B, S, Hq, Dv];
// lse [B, Hq, S] = logsumexp of the scaled, masked scores (saved for backward).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       Tensor& lse, float dropout_p = 0.0f, uint64_t seed = 0,
                       uint64_t stream = 0, float softmax_scale = 0.0f);
// dq, dk, dv overwritten (dout, out [B, S, Hq, Dv]).
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk,
                        Tensor& dv, float dropout_p = 0.0f, uint64_t seed = 0,
                        uint64_t stream = 0, float softmax_scale = 0.0f);
// Packed sequences (THD, Megatron's --reset-attention-mask): ops/attention_varlen.h.

// ---- attention over a KV cache, inference only (ops/cpu/attention_kv_cache.cpp) ----
// Generation with a key/value cache (Megatron's inference path over its
// key_value_memory_dict): n new queries at absolute positions first_position ..
// first_position + n - 1 attend to the keys and values cached at positions 0 ..
// first_position + n - 1, the new tokens' own included (the caller writes them into the
// cache first). Query i sees cache rows j <= first_position + i, so the attention is causal
// by construction; n = 1 is one decode step, first_position = 0 a prefill.
//   q           [n, Hq, Dqk]: the new tokens' queries, after RoPE (and q_layernorm).
//   key_cache   [max_positions, Hkv, Dqk]: row j = key of position j (after RoPE).
//   value_cache [max_positions, Hkv, Dv]; Dv may differ from Dqk (multi-latent attention:
//               192 and 128). Rows past first_position + n - 1 are never read (they may
//               hold anything, NaN included).
//   out         [n, Hq, Dv], overwritten: softmax_j(q_i . k_j * scale) v_j, scale =
//               softmax_scale, or 1 / sqrt(Dqk) when softmax_scale <= 0 (as
//               attention_forward; MLA passes YaRN's mscale^2 / sqrt(Dqk)).
// Hq % Hkv == 0: query head h reads kv head h / (Hq / Hkv) (GQA). No dropout, no lse.
// Dtypes: q, key_cache, value_cache and out all F32 on the CPU; F32, BF16 or F16 on the GPU
// (all four the same); scores, softmax and the weighted sum in fp32 on both.
// GPU: Dqk, Dv <= 512 (ops/cuda/attention_kv_cache.cu: one warp per key, D / 32 values a
// lane). InternalError on a dtype, device or shape mismatch, first_position < 0, or
// first_position + n > max_positions.
void attention_kv_cache(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                        int64_t first_position, Tensor& out, float softmax_scale = 0.0f);

// ---- softmax cross-entropy (ops/cpu/cross_entropy.cpp) ----
// losses[t] = logsumexp(logits[t, :]) - logits[t, labels[t]]. logits [T, V]; labels [T]
// int32; losses [T]; lse [T] saved for backward.
void cross_entropy_forward(const Tensor& logits, const Tensor& labels, Tensor& losses,
                           Tensor& lse);
// dlogits[t, v] = dlosses[t] * (softmax(logits[t])[v] - [v == labels[t]]), overwritten.
// dlogits may alias logits (in-place backward, as Megatron's fused cross entropy).
void cross_entropy_backward(const Tensor& dlosses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& dlogits);

// ---- vocab-parallel embedding and cross entropy (ops/cpu/vocab_parallel.cpp) ----
// Megatron's VocabParallelEmbedding and vocab_parallel_cross_entropy: a tensor-parallel
// rank holds vocabulary rows [vocab_start, vocab_start + V_local) of the embedding table
// and of the output layer; token ids and labels are global ids in [0, V).
// out[t, :] = table[ids[t] - vocab_start, :] when vocab_start <= ids[t] < vocab_start +
// V_local, else 0 (the TP all-reduce or reduce-scatter of the outputs then yields the
// full lookup). ids [T] int32, ids[t] >= 0; table [V_local, H]; out [T, H]; dtypes as
// embedding_forward.
void embedding_forward_vocab_range(const Tensor& ids, const Tensor& table, int64_t vocab_start,
                                   Tensor& out);
// dtable[ids[t] - vocab_start, :] += dout[t, :] for the ids in this rank's range.
void embedding_backward_vocab_range(const Tensor& dout, const Tensor& ids, int64_t vocab_start,
                                    Tensor& dtable);
// Per-row statistics of this rank's logits shard [T, V_local] (fp32 or bf16), all fp32
// [T]: row_max[t] = max_v logits[t, v]; sum_exp[t] = sum_v exp(logits[t, v] - row_max[t]);
// target_logit[t] = logits[t, labels[t] - vocab_start] when the label is in this rank's
// range, else 0. labels [T] int32 global ids.
void cross_entropy_partial_stats(const Tensor& logits, const Tensor& labels,
                                 int64_t vocab_start, Tensor& row_max, Tensor& sum_exp,
                                 Tensor& target_logit);
// sum_exp[t] *= exp(row_max[t] - global_max[t]), in place (global_max: the TP all-reduce
// MAX of row_max), so that the TP all-reduce SUM of sum_exp is sum_v exp(logit - max).
void cross_entropy_rescale_sum_exp(const Tensor& row_max, const Tensor& global_max,
                                   Tensor& sum_exp);
// lse[t] = global_max[t] + log(sum_exp[t]); losses[t] = lse[t] - target_logit[t] (the
// reduced statistics). All fp32 [T].
void cross_entropy_finish(const Tensor& global_max, const Tensor& sum_exp,
                          const Tensor& target_logit, Tensor& losses, Tensor& lse);
// dlogits[t, v] = dlosses[t] * (exp(logits[t, v] - lse[t]) - [v + vocab_start ==
// labels[t]]) on this rank's shard, lse the global log-sum-exp; overwritten, may alias
// logits. vocab_start 0 with the full vocabulary is cross_entropy_backward.
void cross_entropy_backward_vocab_range(const Tensor& dlosses, const Tensor& logits,
                                        const Tensor& labels, const Tensor& lse,
                                        int64_t vocab_start, Tensor& dlogits);

// ---- MoE router, all of Megatron's options (ops/cpu/moe_router.cpp) ----
// Megatron-LM transformer/moe/moe_utils.py (topk_routing_with_score_function,
// group_limited_topk, compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func,
// z_loss_func, sinkhorn). Router math in fp32 whatever the model dtype (Megatron computes
// softmax/sigmoid scores in fp32 even with --moe-router-dtype fp64).

enum class RouterScoreFunction { Softmax, Sigmoid, SqrtSoftplus };

struct RouterTopK {
  int topk = 2;
  RouterScoreFunction score_function = RouterScoreFunction::Softmax;
  bool pre_softmax = false;     // softmax only: softmax over all E, then top-k
  float scaling_factor = 0.0f;  // --moe-router-topk-scaling-factor; 0: none
  int num_groups = 0;           // --moe-router-num-groups; 0: no group limit
  int group_topk = 0;           // --moe-router-group-topk
  bool sinkhorn = false;        // --moe-router-load-balancing-type sinkhorn (training)
};

// Top-k routing. logits [T, E] fp32; expert_bias [E] fp32, or undefined (no bias; only
// with sigmoid/sqrtsoftplus); probs [T, k] fp32 and indices [T, k] int32 written, each
// row's experts in descending order of the selection score (ties: lower expert first).
// - softmax, !pre_softmax: select the top-k logits, probs = softmax over those k.
// - softmax, pre_softmax: s = softmax over all E, select the top-k s, probs = s there.
// - sigmoid / sqrtsoftplus: s = sigmoid(x) or sqrt(softplus(x)) (softplus(x) = x for
//   x > 20, torch's threshold); select the top-k of s + bias; probs = s there, divided by
//   (their sum + 1e-20) when k > 1.
// - sinkhorn (softmax or sigmoid scores only as the probability): select the top-k of
//   Megatron's sinkhorn(exp(logits)) (below); probs = sigmoid(x) there when k == 1, else
//   softmax over all E there (not renormalised).
// - group limit (num_groups > 0): experts in num_groups equal consecutive groups; group
//   score = sum of the top (k / group_topk) selection scores in the group; experts outside
//   the group_topk best groups cannot be selected.
// Then probs *= scaling_factor when it is set. (Megatron's sinkhorn router applies
// neither the group limit nor the scaling factor, nor a bias: leave them unset with
// sinkhorn to match it.) InternalError on bad shapes or options (k outside [1, E],
// E % num_groups, group_topk outside [1, num_groups] with groups, k / group_topk outside
// [1, E / num_groups], k > group_topk * E / num_groups, bias with softmax or sinkhorn).
void moe_router_topk_forward(const Tensor& logits, const Tensor& expert_bias,
                             const RouterTopK& options, Tensor& probs, Tensor& indices);
// dlogits [T, E] (overwritten) = d(sum(dprobs * probs)) / d(logits) for the forward above
// (same logits, probs, indices, options). The selection has no gradient; with sinkhorn
// the gradient flows through the sigmoid/softmax probability only.
void moe_router_topk_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& probs,
                              const Tensor& indices, const RouterTopK& options, Tensor& dlogits);

// Megatron's sinkhorn(cost = exp(logits)): d0 = 1/T / (sum_e d1 cost + 1e-8), d1 = 1/E /
// (sum_t d0 cost + 1e-8), from d1 = 1, until mean |d1 - d1_previous| <= 1e-4; out
// [T, E] fp32 = d1 * cost * d0 (column scale d1, row scale d0). logits [T, E] fp32.
void moe_sinkhorn(const Tensor& logits, Tensor& out);

// Statistics of the load-balancing losses (compute_routing_scores_for_aux_loss), for
// token rows grouped into sequences. logits [T, E] fp32 are rows first_row ..
// first_row + T - 1 of a token list in which row r belongs to group r / rows_per_group
// (seq_aux_loss: rows_per_group = sequence length; aux/global: one group). Writes
// scores [T, E] fp32: softmax over all E, or sigmoid / sqrtsoftplus divided by their sum
// over E (+ 1e-20); score_sums [G, E] fp32: per group the sum over this call's rows of
// scores; counts [G, E] fp32: per group the rows whose top-k of scores (no bias, no
// group limit; ties: lower expert) includes e. G = score_sums.dim(0) must cover every
// row's group. InternalError otherwise.
void moe_aux_loss_statistics(const Tensor& logits, RouterScoreFunction score_function, int topk,
                             int64_t first_row, int64_t rows_per_group, Tensor& scores,
                             Tensor& score_sums, Tensor& counts);
// dlogits [T, E] += J^T dscores with dscores[t, e] = coeffs[g(t), e] (coeffs [G, E] fp32,
// g(t) = (first_row + t) / rows_per_group) and J the Jacobian of the scores above with
// respect to the logits. The switch load-balancing loss c E / (k T^2) sum_e score_sums[e]
// counts[e] has coeffs[g, e] = c E / (k T^2) counts[g, e] times the gradient scale.
void moe_aux_loss_statistics_backward(const Tensor& coeffs, const Tensor& logits,
                                      const Tensor& scores, RouterScoreFunction score_function,
                                      int64_t first_row, int64_t rows_per_group, Tensor& dlogits);

// Row log-sum-exp: lse [T] fp32 of logits [T, E] fp32 (z_loss_func's torch.logsumexp).
void moe_router_logsumexp(const Tensor& logits, Tensor& lse);
// dlogits [T, E] += scale * lse[t] * softmax(logits[t, :]): the gradient of
// scale / 2 * sum_t lse[t]^2 (the z-loss coeff / (tp cp) * mean(lse^2) has
// scale = 2 coeff / (tp cp T) times the gradient scale).
void moe_z_loss_backward(float scale, const Tensor& logits, const Tensor& lse, Tensor& dlogits);

// counts [num_experts] fp32 += how many rows of indices [T, k] int32 name each expert
// (tokens per expert; an index outside [0, num_experts) is an InternalError).
void moe_tokens_per_expert(const Tensor& indices, int64_t num_experts, Tensor& counts);

// The expert-bias update after an optimizer step (Megatron's get_updated_expert_bias,
// moe_utils.py): bias[e] += rate * sign(mean(counts) - counts[e]), the mean over the
// experts summed in fp32 in expert order. counts [E] fp32 (tokens per expert of the step,
// summed over TP x DP x CP), bias [E] fp32, on one device; on the GPU one kernel, no host
// synchronization. InternalError on other dtypes or shapes.
void moe_expert_bias_update(const Tensor& counts, float rate, Tensor& bias);

// Token dropping with a per-expert capacity (Megatron's apply_router_token_dropping,
// --moe-expert-capacity-factor, --moe-token-drop-policy; ops/cpu/moe_router_capacity.cpp).
// probs [T, k] fp32 (finite; Megatron's are >= 0) and indices [T, k] int32
// (moe_router_topk_forward's outputs). For each expert, of the (row, slot) entries routed
// to it keep `capacity` entries (tokens): policy probs (by_position false): those with the
// largest probability (ties: lower row first, then lower slot; -0 equals +0); policy
// position (true): the first in row order (then slot order). keep [T, k] fp32 is written
// with 1 (kept) or 0 (dropped); kept_counts [num_experts] fp32 += kept entries per expert
// (min(routed, capacity)). The capacity is get_capacity's ceil(T k / E * capacity_factor),
// computed by the caller. Megatron's position policy and its pad_to_capacity take
// torch.topk's order among equal values, which is not specified: this op fixes one.
// InternalError on bad shapes, num_experts < 1, capacity < 0, or (CPU) an index outside
// [0, num_experts); the GPU does not check indices (a host synchronization): it drops
// such entries (keep 0, not counted).
void moe_capacity_drop(const Tensor& probs, const Tensor& indices, int64_t num_experts,
                       int64_t capacity, bool by_position, Tensor& keep, Tensor& kept_counts);
// The routing map after dropping, as the token dispatchers take it: routed [T, k] int32
// = indices[i] where keep[i] != 0, num_experts where keep[i] == 0 (the "dropped" marker:
// an expert index one past the last, so that moe_permute with num_experts + 1 groups sorts
// the dropped copies last). indices [T, k] int32, keep [T, k] fp32 (moe_capacity_drop's);
// routed must not alias indices. InternalError on bad shapes or dtypes, num_experts < 1, or
// (CPU) a kept index outside [0, num_experts); the GPU does not check indices.
void moe_mark_dropped(const Tensor& indices, const Tensor& keep, int64_t num_experts,
                      Tensor& routed);

// Counter-based random fills (core/rng.h Philox, the same values on CPU and GPU): element
// i of t (fp32, contiguous) = Philox(seed).normal(stream, i) (standard normal), or
// lo + (hi - lo) * Philox(seed).uniform(stream, i).
void fill_normal(Tensor& t, uint64_t seed, uint64_t stream);
void fill_uniform(Tensor& t, float lo, float hi, uint64_t seed, uint64_t stream);
// y *= x elementwise (same shape; y any float dtype, x fp32 or y's dtype).
void mul_(Tensor& y, const Tensor& x);

// ---- MoE token permutation (ops/cpu/moe_permute.cpp) ----
// Sort the T*k (token, slot) copies by expert, stable in token order.
// x [T, H]; indices [T, k] int32 in [0, E); permuted [T*k, H];
// row_id_map [T*k] int32: permuted row r holds copy row_id_map[r] = t*k + j;
// tokens_per_expert [E] int64 (rows of permuted per expert, in expert order).
// E = num_experts is any group count (GPU: at most 8192): the token dispatchers pass the
// layer's experts + 1, the last group holding the copies dropped by capacity
// (moe_mark_dropped), which then sort after every expert's.
void moe_permute(const Tensor& x, const Tensor& indices, int num_experts, Tensor& permuted,
                 Tensor& row_id_map, Tensor& tokens_per_expert);
// dx[t, :] = sum over permuted rows r of token t of dpermuted[r, :]; dx [T, H] overwritten.
void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_id_map, int k, Tensor& dx);
// permuted[r, :] = x[row_id_map[r] / k, :]: moe_permute's gather with a map it made
// (the gradient of moe_permute_backward: the MoE combine's backward). With k = 1 and x a
// [T k, 1] view of the probs [T, k], permuted[r] = probs of copy row_id_map[r] (the
// routing probabilities in permuted order; moe_permute_backward with k = 1 is then the
// way back). x [T, H], permuted [T*k, H], one dtype (CPU: F32; GPU: F32, BF16 or F16);
// row_id_map [T*k] int32. InternalError on a shape, dtype or device mismatch or a map
// entry outside [0, T k).
void moe_permute_rows(const Tensor& x, const Tensor& row_id_map, int k, Tensor& permuted);
// out[t, :] = sum_j probs[t, j] * expert_out[r(t, j), :]; expert_out [T*k, H]; out [T, H].
void moe_unpermute(const Tensor& expert_out, const Tensor& row_id_map, const Tensor& probs,
                   Tensor& out);
// dexpert_out [T*k, H] and dprobs [T, k], both overwritten.
void moe_unpermute_backward(const Tensor& dout, const Tensor& expert_out,
                            const Tensor& row_id_map, const Tensor& probs,
                            Tensor& dexpert_out, Tensor& dprobs);

// Expert inputs padded with zero rows, group by group: to a fixed number of rows per expert
// (Megatron's --moe-pad-expert-input-to-capacity) or each expert's rows rounded up to a
// multiple of the FP8 GEMMs' tile (ops/cpu/moe_permute.cpp, CUDA: one launch per 480
// groups, moe_permute.cu). rows [R, H] holds G groups of consecutive rows, group g having
// group_rows[g] rows; padded [P, H] holds the same groups, group g having padded_rows[g]
// rows. Both host counts of length G = group_rows.size(), 0 <= group_rows[g] <=
// padded_rows[g] (empty groups and groups without padding allowed), R = sum(group_rows),
// P = sum(padded_rows). padded is overwritten with group g's rows at [P_g, P_g +
// group_rows[g]) in order, P_g = padded_rows[0] + ... + padded_rows[g - 1], and +0 in the
// rest of its padded_rows[g] rows. rows and padded: the same dtype (CPU: F32; GPU: F32 or
// BF16), on one device, not aliasing. Its gradient is moe_unpad_rows.
// InternalError on a shape, dtype or device mismatch, counts of different lengths, a
// negative count, a group above its padded rows, or (GPU) R or P above INT32_MAX.
void moe_pad_rows(const Tensor& rows, const std::vector<int64_t>& group_rows,
                  const std::vector<int64_t>& padded_rows, Tensor& padded);
// The reverse (and the gradient of the padding): rows [R, H] overwritten with group g's
// first group_rows[g] rows of padded [P, H]; the padding rows are not read.
// Same shapes, dtypes and errors as moe_pad_rows.
void moe_unpad_rows(const Tensor& padded, const std::vector<int64_t>& group_rows,
                    const std::vector<int64_t>& padded_rows, Tensor& rows);

// Chunks of rows put in a new order (Megatron's sort_chunks_by_idxs: the all-to-all
// dispatcher regroups the chunks it received by local expert; ops/cpu/moe_permute.cpp,
// CUDA: ops/cuda/copy_chunks.cu, one launch per 128 chunks). src [R, ...] holds C chunks of
// consecutive rows, chunk c having chunk_rows[c] rows (host counts, R their sum); dst
// (src's shape and dtype, on its device, not overlapping it) is overwritten with chunks
// order[0], order[1], ... one after the other. order is a permutation of 0 .. C - 1. Any
// dtype. InternalError on a shape, dtype or device mismatch, negative counts or counts
// that do not sum to R, or an order that is not a permutation.
void moe_sort_chunks(const Tensor& src, const std::vector<int64_t>& chunk_rows,
                     const std::vector<int64_t>& order, Tensor& dst);

// ---- AdamW (ops/cpu/adam.cpp) ----
// Decoupled weight decay (Loshchilov & Hutter 2019; torch.optim.AdamW, Megatron's
// default optimizer): p -= lr * wd * p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps). step is 1-based.
// param, grad, exp_avg, exp_avg_sq: same numel, fp32.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);

// ---- multi-tensor optimizer ops (ops/cpu/multi_tensor.cpp) ----
// The optimizer's per-parameter ops over a whole list of tensors at once (as Apex/TE
// multi_tensor_apply): on the GPU a few launches for the list instead of one or more per
// tensor, and one host synchronization for the whole sum of squares. The CPU versions
// apply the single-tensor op to each tensor in list order. Each dispatches on the device
// of its first tensor; every listed tensor must be defined and on that device
// (InternalError otherwise). Lists may be empty and may hold 0-element tensors.

// sum over the list of sum_of_squares(tensors[i]), accumulated in fp64 (the global grad
// norm's squared sum). tensors: any shapes; F32 (GPU: F32 or BF16). Empty list: 0.
// Deterministic: the same list (shapes, values) gives the same bits on every call. The
// GPU result differs from adding per-tensor sum_of_squares only in the fp64 summation
// order (rounding far below fp32 resolution).
double multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors);
// The same sum left where the tensors are: out is a 1-element I64 tensor on their device
// holding the fp64 bits of the result (Megaton has no F64 dtype), overwritten; the same
// bits as the host-returning version. On the GPU no host synchronization. An empty list
// needs `out` on the intended device (it writes +0.0).
void multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors, Tensor& out);

// Number of elements exactly equal to 0 (+0.0f or -0.0f) over every tensor of the list:
// the fp32 main grads' zero count behind Megatron's --log-num-zeros-in-grad
// (Megatron-LM `count_zeros_fp32`, numel - torch.count_nonzero). NaN, Inf and denormals
// are not zero; the test is on the bits, so a flush-to-zero mode cannot change the count.
// tensors: any shapes; F32 only (also on the GPU). Empty list or 0-element tensors: 0.
// Exact (integer counts) and deterministic. GPU: one host synchronization for the list.
// A non-F32 tensor throws InternalError.
int64_t multi_tensor_count_zeros(const std::vector<Tensor>& tensors);

// tensors[i] *= scale for every i (gradient clipping), elementwise in fp32; each result
// equals scale_(tensors[i], scale) bitwise. tensors: any shapes; F32 (GPU: F32 or BF16,
// BF16 rounded to nearest even).
void multi_tensor_scale_(std::vector<Tensor>& tensors, float scale);

// adamw_step on every i with weight decay weight_decays[i] and gradient
// grads[i] * grad_scale, followed, where param_copies[i] is defined, by
// cast(params[i], param_copies[i]) (the compute copy of a bf16 run, round-to-nearest-even;
// fused into the update on the GPU). Results are bitwise equal to those single-tensor ops
// on the same device, with scale_(grad, grad_scale) on a copy of each grad first when
// grad_scale != 1.
//   params:        fp32 main params, updated in place.
//   grads:         fp32 main grads, numel of params[i]; read only (not scaled in place).
//   exp_avg, exp_avg_sq: moments, numel of params[i], updated in place: fp32, or bf16
//                  (the precision-aware optimizer: updated in fp32 and stored by
//                  stochastic rounding; ops/adam_precision.h, keyed overloads there).
//   param_copies:  per param either undefined (no copy) or a BF16, F16 or F32 tensor with
//                  the numel of params[i], overwritten with the updated param (rounded to
//                  nearest even).
//   weight_decays: per param (0 for biases and norm weights).
//   lr, beta1, beta2, eps, step: as adamw_step (step 1-based, betas in [0, 1)).
//   grad_scale:    factor applied to every gradient element in fp32 as it is read: the
//                  gradient-clipping coefficient (optim::clip_coefficient), folded into
//                  the update as fused optimizers do instead of a separate
//                  multi_tensor_scale_ pass over the grads. 1 leaves the update exactly
//                  as without it (g * 1.0f == g). Must be finite.
// All six lists have the same length. Everything is checked before any tensor is
// updated: a length, dtype, numel or device mismatch, step < 1, a beta outside [0, 1) or
// a non-finite grad_scale throws InternalError and changes nothing.
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale);

// ---- AdamW steps decided on the device (ops/cpu/adam_control.cpp) ----
// A training step whose clipping coefficient, skip on a non-finite gradient norm and
// Adam step count never leave the device, so the host need not wait for the gradients
// before it queues the update (Apex/TE fused optimizers' noop flag, torch's
// _foreach ops with a found_inf tensor). fp64 scalars are I64 tensors holding the bits.

// What adamw_step_control writes for multi_tensor_adamw (control, F32 [kAdamControlSize]).
constexpr int64_t kAdamControlSize = 6;
constexpr int64_t kAdamStepSize = 0;   // float(lr / (1 - beta1^step))
constexpr int64_t kAdamInvSqrtBc2 = 1; // float(1 / sqrt(1 - beta2^step))
constexpr int64_t kAdamGradScale = 2;  // float(clip coefficient) * grad_scale_factor
constexpr int64_t kAdamSkip = 3;       // 1: no update this step, 0: update
constexpr int64_t kAdamStep = 4;       // the step count (exact below 2^24 steps)
constexpr int64_t kAdamLr = 5;         // the learning rate (lr[0]), written even when skipping
// The scalar prologue of a step, one thread on the GPU:
//   sum_sq_parts  I64 [n]: fp64 squared sums (one per rank), added in index order (the
//                 order of dist::sum_over, so the norm has its bits);
//   grad_norm   = sqrt(sum) * norm_scale (fp64), written to grad_norm_out (I64 [1]);
//   loss          F32 [1] or undefined: a non-finite value stops the run when check_nan;
//   lr            F32 [1]: the step's learning rate, read on the device (so a captured
//                 CUDA graph takes each step's value; copied to control[kAdamLr]);
//   state         I64 [2] = {Adam step count, stopped}: stopped becomes 1 (and stays 1)
//                 when check_nan and the norm or the loss is not finite, the step count
//                 grows by one for every step that updates;
//   skip        = stopped or the norm not finite; otherwise the step updates with
//                 clip = max_norm / (grad_norm + 1e-6) when max_norm > 0 and that is < 1,
//                 else 1 (optim::clip_coefficient), grad_scale = float(clip) *
//                 grad_scale_factor, and the bias corrections of the new step count.
// These are exactly the host path's values (clip_coefficient, then AdamW::step and
// multi_tensor_adamw's fp64 bias corrections), so the two paths update to the same bits.
// Tensors on one device; InternalError on dtypes, shapes or betas outside [0, 1).
void adamw_step_control(const Tensor& sum_sq_parts, double norm_scale, double max_norm,
                        float grad_scale_factor, const Tensor& loss, bool check_nan,
                        const Tensor& lr, float beta1, float beta2, Tensor& state,
                        Tensor& control, Tensor& grad_norm_out);
// multi_tensor_adamw with step, learning rate, step size, bias correction and gradient
// scale read from control (adamw_step_control's, on the params' device): when
// control[kAdamSkip] is nonzero nothing is written; otherwise every tensor gets the update
// multi_tensor_adamw would give with that step, lr and grad_scale (the same bits: on the
// GPU both compute the weight-decay factor 1 - lr * wd in fp64 in the kernel). The other
// arguments and checks as above.
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control);

}  // namespace megaton::ops
