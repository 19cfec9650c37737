// Mamba-2's ops (Dao & Gu, "Transformers are SSMs", 2024, arXiv:2405.21060; Megatron-LM's
// MambaMixer in megatron/core/ssm/mamba_mixer.py, which calls the mamba_ssm kernels
// causal_conv1d_fn, mamba_chunk_scan_combined and RMSNormGated): the causal depthwise
// convolution, the selective state-space scan in its chunked SSD form, and the gated
// RMSNorm; each with its backward, and the one-token steps of generation.
//
// Rows are tokens, b-major: row b * S + s is token s of sample b (the model's [T, ...]
// activations). Packed documents: `position_ids` (optional, I32 [B*S] on the tensors'
// device) gives each row's position within its document (MambaMixer derives them from
// --reset-attention-mask's document boundaries, as Megatron resets Mamba at THD ones); a row at
// position p sees only the p rows before it (the convolution reads no earlier tap, the
// scan's state restarts at p = 0), as mamba_ssm's seq_idx does. Without it, p = s.
//
// Dtypes: activations one float dtype (CPU F32; GPU F32, BF16, F16), contiguous; the
// per-head vectors A_log, D, dt_bias any float dtype, read as fp32; gradient accumulators
// (`*_acc`) F32 and added to, never overwritten. Every sum is accumulated in fp32.
// InternalError on a shape, dtype or device mismatch.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace megaton::ops {

// ---- causal depthwise conv1d (mamba_ssm's causal_conv1d_fn) ----
//
// x [B*S, C], weight [C, K] (Megatron's conv1d.weight [C, 1, K]), bias [C] ->
//   y[b, s, c] = act(bias[c] + sum_{k=0}^{K-1} weight[c, k] * x[b, s - (K-1) + k, c])
// where taps before the document's first row (s - (K-1) + k < s - p) read 0, and act is
// SiLU (x sigmoid(x)) when silu, else the identity.
void causal_conv1d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t batch,
                           bool silu, Tensor& y, const Tensor& position_ids = Tensor());
// dy [B*S, C] -> dx [B*S, C] (overwritten); dweight_acc [C, K] and dbias_acc [C] (F32)
// accumulate the weight and bias gradients.
void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                            const Tensor& bias, int64_t batch, bool silu, Tensor& dx,
                            Tensor& dweight_acc, Tensor& dbias_acc,
                            const Tensor& position_ids = Tensor());
// One new token per sample (generation): x [B, C]; conv_state [B, K-1, C] holds each
// sample's last K-1 inputs, oldest first (zeros before the sequence's first token). Writes
// y [B, C] = the forward's output for the token after them, then shifts x into conv_state.
void causal_conv1d_step(const Tensor& x, const Tensor& weight, const Tensor& bias, bool silu,
                        Tensor& conv_state, Tensor& y);
// conv_state [B, K-1, C] after a forward over x [B*S, C]: each sample's last K-1 rows,
// zero-filled in front when S < K-1 (the state causal_conv1d_step continues from).
void causal_conv1d_final_state(const Tensor& x, int64_t batch, Tensor& conv_state);

// ---- the selective scan (SSD) ----

// Sizes of one rank's scan: nheads heads of head_dim channels in ngroups groups (head h
// reads group h / (nheads / ngroups)'s B and C), state_dim N. chunk_size: the SSD chunk
// (Megatron's chunk_size, 128); the result does not depend on it beyond rounding.
struct SsdDims {
  int64_t batch = 0, seq = 0;
  int64_t nheads = 0, head_dim = 0, ngroups = 0, state_dim = 0;
  int64_t chunk_size = 128;
};

// x [B*S, nheads * head_dim], dt [B*S, nheads] (in_proj's raw dt), B, C [B*S, ngroups *
// state_dim]; A_log, D, dt_bias [nheads] ->  y [B*S, nheads * head_dim]:
//   delta_t = softplus(dt_t + dt_bias)            (per head; mamba_ssm's dt_softplus)
//   A       = -exp(A_log)
//   h_t     = exp(delta_t A) h_{t-1} + delta_t x_t B_t^T    ([head_dim, N] per head,
//                                                           h = 0 before a document)
//   y_t     = h_t C_t + D x_t
// computed in the chunked form (within a chunk as masked matrix products with the decay
// matrix L = exp(segsum(delta A)), across chunks by passing states; the paper's Listing 1).
// final_state (optional, F32 [B, nheads, head_dim, N]): h after each sample's last token.
void ssd_forward(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
                 const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
                 Tensor& y, const Tensor& position_ids = Tensor(), Tensor* final_state = nullptr);
// dy [B*S, nheads * head_dim] -> dx, ddt (the gradient of the raw dt), dB, dC
// (overwritten, shaped as their inputs); dA_log_acc, dD_acc, ddt_bias_acc [nheads] F32
// accumulate. Recomputes the forward's chunk states (nothing but the inputs is saved).
void ssd_backward(const Tensor& dy, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                  const Tensor& B, const Tensor& C, const Tensor& D, const Tensor& dt_bias,
                  const SsdDims& dims, Tensor& dx, Tensor& ddt, Tensor& dB, Tensor& dC,
                  Tensor& dA_log_acc, Tensor& dD_acc, Tensor& ddt_bias_acc,
                  const Tensor& position_ids = Tensor());
// The same forward as the plain recurrence, token by token (the CPU reference the chunked
// form is tested against; CPU only, F32 activations, computed in fp64; dims.chunk_size is
// ignored).
void ssd_forward_recurrent(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
                           const Tensor& C, const Tensor& D, const Tensor& dt_bias,
                           const SsdDims& dims, Tensor& y, const Tensor& position_ids = Tensor(),
                           Tensor* final_state = nullptr);
// ssd_backward by reverse mode through the recurrence, every state kept (the second CPU
// reference the chunked backward is tested against; CPU only, F32 activations, computed in
// fp64; dims.chunk_size is ignored). Arguments and results as ssd_backward's.
void ssd_backward_recurrent(const Tensor& dy, const Tensor& x, const Tensor& dt,
                            const Tensor& A_log, const Tensor& B, const Tensor& C, const Tensor& D,
                            const Tensor& dt_bias, const SsdDims& dims, Tensor& dx, Tensor& ddt,
                            Tensor& dB, Tensor& dC, Tensor& dA_log_acc, Tensor& dD_acc,
                            Tensor& ddt_bias_acc, const Tensor& position_ids = Tensor());
// One new token per sample (generation; dims.seq is ignored): x [B, nheads * head_dim],
// dt [B, nheads], B, C [B, ngroups * N]; state F32 [B, nheads, head_dim, N] is h_{t-1} on
// entry and h_t on return; y [B, nheads * head_dim] as the forward's.
void ssd_step(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
              const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
              Tensor& state, Tensor& y);

// ---- gated RMSNorm (mamba_ssm's RMSNormGated, norm_before_gate = False) ----
//
// y, z [T, D], weight [D] (compute dtype) -> out [T, D]:
//   g = y * silu(z);  out = g / sqrt(mean(g^2 over the row's group) + eps) * weight
// with groups of group_size consecutive columns (D divisible by group_size; Megatron:
// d_inner / ngroups). rstd (F32 [T * D / group_size]) receives 1 / sqrt(mean + eps) per
// row and group, for the backward.
void gated_rmsnorm_forward(const Tensor& y, const Tensor& z, const Tensor& weight,
                           int64_t group_size, float eps, Tensor& out, Tensor& rstd);
// dout [T, D] -> dy, dz [T, D] (overwritten); dweight_acc [D] F32 accumulates.
void gated_rmsnorm_backward(const Tensor& dout, const Tensor& y, const Tensor& z,
                            const Tensor& weight, const Tensor& rstd, int64_t group_size,
                            Tensor& dy, Tensor& dz, Tensor& dweight_acc);

}  // namespace megaton::ops
