// The FP8 part of the op catalogue (ops.h): quantization per Transformer Engine's recipes
// (per-tensor current and delayed scaling, DeepSeek-V3 blockwise scaling) and the FP8 GEMM.
//
// Numerics (every backend):
//   q = fp8(x * scale)    round-to-nearest-even to the FP8 format, saturating to
//                         +-fp8_max (448 for E4M3, 57344 for E5M2) as TE's satfinite cast
//                         does: +-inf saturates too; NaN stays NaN, coded 0x7F / 0xFF by
//                         x's sign in both formats (PyTorch's codes).
//   x ~ q * scale_inv     scale_inv = 1 / scale, the dequantization factor the GEMM reads.
// The product x * scale is one fp32 multiply (x converted to fp32 first, exactly for
// BF16); NaN is coded as above, anything else is clamped to +-fp8_max and then converted
// by core/dtype.h's float_to_fp8e4m3 / float_to_fp8e5m2.
// The CPU implementation (ops/cpu/fp8.cpp) is the reference: quantization on the GPU must
// equal it bit for bit; the GEMM on the GPU is compared to its fp32 GEMM of the
// dequantized values to a tolerance.
//
// Scales live in device memory next to the tensor (F32 tensors on x's device): no op here
// synchronizes with the host.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops {

// Largest finite value of an FP8 dtype: 448 (F8E4M3), 57344 (F8E5M2). InternalError for
// any other dtype.
float fp8_max(DType fp8);

// How a scale is chosen from an amax (Transformer Engine's recipes):
//   scale = fp8_max / max(amax, amax_epsilon) / 2^margin
// then, when power_of_2, rounded down to a power of two (TE force_pow_2_scales; the
// blockwise recipe's default), and an infinite result (amax subnormal) clamped to
// FLT_MAX. Where amax is 0 or not finite the scale is left as it was (TE delayed scaling
// keeps the previous scale; current scaling starts from 1, so an all-zero tensor gets 1).
// Exact order, in fp32 (ops/cpu/fp8.cpp; the GPU matches it bit for bit):
//   s = fp8_max / fmaxf(amax, amax_epsilon);  s = s / exp2f(margin);
//   if (isinf(s)) s = FLT_MAX;  if (power_of_2) s = the largest power of two <= s;
//   scale_inv = 1.0f / s.
// (TE divides fp8_max * 2^-margin by amax: the same value unless the quotient overflows.)
struct Fp8ScaleRule {
  DType fp8 = DType::F8E4M3;  // F8E4M3 or F8E5M2: gives fp8_max
  float margin = 0.0f;        // --fp8-margin (>= 0)
  float amax_epsilon = 0.0f;  // lower bound of the amax used (>= 0)
  bool power_of_2 = false;
};

// amax[0] = max over all elements of |x| (NaN if x holds a NaN). x: F32 or BF16, any
// shape, numel >= 0 (0 gives amax 0). amax: F32 [1] on x's device, overwritten.
void fp8_amax(const Tensor& x, Tensor& amax);

// Per-tensor scale update from amax[0] by `rule` (above): scale[0] and scale_inv[0] are
// overwritten when amax[0] is positive and finite, left unchanged otherwise. amax, scale,
// scale_inv: F32 [1], one device. For current scaling call fp8_amax then this, with scale
// set to 1 beforehand.
void fp8_update_scale(const Tensor& amax, const Fp8ScaleRule& rule, Tensor& scale,
                      Tensor& scale_inv);

// Delayed scaling (TE DelayedScaling, one tensor's state):
//   amax_history [L, 1] F32 (exactly; [L] is refused): row 0 holds the amax of the current step (written by the
//   quantize ops' amax output), rows 1.. the previous steps' amaxes.
// Computes amax = max over the L rows (max_algo true, TE "max") or row 0 ("most_recent"),
// updates scale / scale_inv from it by `rule` (fp8_update_scale), then rolls the history
// as TE's _default_get_amax_and_update_history does (torch.roll(history, -1, 0), then
// row 0 = 0): new row i = old row (i + 1) mod L, and row 0, the next step's slot, is
// zeroed: the window holds the previous L - 1 amaxes and the slot the next quantization
// fills. All three tensors on one device,
// no host synchronization.
void fp8_delayed_scaling_update(Tensor& amax_history, const Fp8ScaleRule& rule, bool max_algo,
                                Tensor& scale, Tensor& scale_inv);

// Per-tensor quantization with a given scale (delayed or current scaling):
//   out   = fp8(x * scale[0])               x [R, C] F32 or BF16; out [R, C] F8E4M3/F8E5M2
//   out_t = fp8(x^T * scale[0])             [C, R], same dtype as out; skipped when undefined
//                                            (the backward's K-major operand)
//   amax  = max |x|                          F32 [1], overwritten; skipped when undefined
//                                            (delayed scaling records it for the next step)
// One read of x writes all three (ops/cuda/fp8.cu). Higher-rank x is viewed as
// [numel / C, C] with C its last dimension. out and out_t are the same as those of the
// same x quantized separately: out_t is exactly the transpose of out.
void fp8_quantize(const Tensor& x, const Tensor& scale, Tensor& out, Tensor& out_t,
                  Tensor& amax);

// Blockwise quantization (DeepSeek-V3; TE Float8BlockScaling). x [R, C] (F32 or BF16) is
// cut into blocks of block_rows x 128 elements (block_rows 1: activations and gradients,
// "1x128"; 128: weights, "128x128"); the last block of a row or column may be partial.
// Each block b gets its own scale from its own amax by `rule` (a block of zeros, or one
// holding a NaN, gets scale 1), and
//   out       [R, C]  = fp8(x * scale_b) elementwise, in x's layout
//   scale_inv [ceil(R / block_rows), ceil(C / 128)] F32 = 1 / scale_b
//   out_t, scale_inv_t (skipped when out_t is undefined): the same quantization of x^T
//     [C, R] with blocks of block_rows x 128 of x^T: for block_rows 128 exactly the
//     transposes of out and scale_inv; for block_rows 1, 1x128 blocks along R of x^T
//     (each column of x in runs of 128 rows): its own scales, shape [C, ceil(R / 128)].
void fp8_quantize_blockwise(const Tensor& x, int64_t block_rows, const Fp8ScaleRule& rule,
                            Tensor& out, Tensor& scale_inv, Tensor& out_t, Tensor& scale_inv_t);

// q_t [C, R] = q^T for q [R, C], both FP8 of one dtype on one device (bytes moved, no
// rounding): the column-wise copy of an FP8 weight kept in FP8 (--fp8-param-gather), with
// the same scale. InternalError on a shape, dtype or device mismatch.
void fp8_transpose(const Tensor& q, Tensor& q_t);

// x = q * scale_inv (dequantization), for tests and the CPU GEMM. q [R, C] FP8, x [R, C]
// F32 or BF16 overwritten; scale_inv F32 [1] (per tensor) or the blockwise shape
// [ceil(R / block_rows), ceil(C / 128)]: block_rows is 1 when scale_inv.dim(0) == R,
// else 128 (scale_inv.dim(0) == ceil(R / 128)).
void fp8_dequantize(const Tensor& q, const Tensor& scale_inv, Tensor& x);

// FP8 GEMM in the one layout Hopper's FP8 tensor cores take ("TN": both operands
// K-major):
//   c [M, N] = alpha * deq(a) [M, K] @ deq(b) [N, K]^T + beta * c
// a, b: FP8 (F8E4M3 or F8E5M2, not both F8E5M2); c: F32 or BF16 (c not read when beta 0).
// Scales (F32, on the device):
//   per tensor: a_scale_inv, b_scale_inv [1];
//   blockwise:  a_scale_inv [M, K / 128] (1x128 blocks) and b_scale_inv
//               [ceil(N / 128), K / 128] (128x128 blocks, the weight) or [N, K / 128]
//               (1x128: the weight gradient, where both operands are 1x128 along the
//               token dimension K). Both operands per tensor or both blockwise; a is
//               always 1x128.
// Accumulation: fp32 on the CPU; on Hopper the FP8 tensor cores add each MMA's products
// with about 14 mantissa bits and cuBLASLt's split accumulator (no fast-accumulation
// mode) promotes the partial sums to fp32 periodically (DeepSeek-V3 report, 3.3.2): the
// GPU result differs from the CPU's by a few 1e-4 relative. M, N, K must be multiples of 16 (cuBLASLt FP8); blockwise: K a multiple of 128.
// InternalError on a dtype, shape or device mismatch. CPU: dequantize, then the fp32
// gemm.
// fast_accumulation (per-tensor scales only; the CPU ignores it): the GPU keeps the
// tensor cores' reduced-precision partial sums for the whole K loop instead of promoting
// them to fp32 (cuBLASLt CUBLASLT_MATMUL_DESC_FAST_ACCUM). Faster, less exact: Transformer
// Engine uses it for the forward GEMM of its per-tensor recipes (recipe.py:
// fp8_gemm_fprop use_split_accumulator=False) and not for the two backward GEMMs.
void fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
              const Tensor& b_scale_inv, Tensor& c, float alpha = 1.0f, float beta = 0.0f,
              bool fast_accumulation = false);

// ---- multi-tensor and grouped FP8 (the MoE experts: one launch for all local experts) ----
//
// Transformer Engine's GroupedLinear quantizes each expert's operand with its own scale.
// These ops do the per-tensor steps above for n tensors at once: entry i gives exactly the
// result of the single-tensor op on entry i (bit for bit, on every backend), in one launch
// per op on the GPU (ops/cuda/fp8_multi.cu) instead of n. The lists have equal lengths;
// all tensors are on one device; an entry's x may have numel 0 (amax 0, nothing written).
// InternalError on any mismatch the single-tensor op would refuse, or unequal lengths.

// amax[i] (F32 [1], overwritten) = max |x[i]|, as fp8_amax.
void fp8_amax_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& amax);
// As fp8_update_scale for each i (scale[i], scale_inv[i] F32 [1]; left unchanged where
// amax[i] is 0 or not finite).
void fp8_update_scale_multi(const std::vector<Tensor>& amax, const Fp8ScaleRule& rule,
                            const std::vector<Tensor>& scale, const std::vector<Tensor>& scale_inv);
// As fp8_delayed_scaling_update for each i (amax_history[i] [L, 1], one L for all).
void fp8_delayed_scaling_update_multi(const std::vector<Tensor>& amax_history,
                                      const Fp8ScaleRule& rule, bool max_algo,
                                      const std::vector<Tensor>& scale,
                                      const std::vector<Tensor>& scale_inv);
// As fp8_quantize(x[i], scale[i], out[i], out_t[i], amax[i]) for each i. out_t[i] and
// amax[i] may be undefined (that output skipped for that entry); x[i] F32 or BF16 (one
// dtype for all), out[i] one FP8 dtype for all.
void fp8_quantize_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& scale,
                        const std::vector<Tensor>& out, const std::vector<Tensor>& out_t,
                        const std::vector<Tensor>& amax);

// FP8 grouped GEMM, per-tensor scales (the experts' forward, input-gradient and
// weight-gradient GEMMs, one launch for all groups): for each group g,
//   c[g] [M_g, N_g] = alpha * deq(a[g]) [M_g, K_g] @ deq(b[g]) [N_g, K_g]^T + beta * c[g]
// with deq(a[g]) = a[g] * a_scale_inv[g][0], deq(b[g]) = b[g] * b_scale_inv[g][0]
// (F32 [1] tensors on the device, each 16-byte aligned). The rules of fp8_gemm per group:
// the "TN" layout (a[g], b[g] row-major, K innermost), every a[g] one FP8 dtype and
// every b[g] one (not both E5M2), every c[g] one dtype (F32 or BF16; not read when beta
// is 0), M_g, N_g, K_g multiples of 16; a group with M_g, N_g or K_g 0 is skipped (c[g]
// untouched, also when K_g is 0). Accumulation and fast_accumulation as fp8_gemm. CPU:
// fp8_gemm per group (the reference). GPU: one CUTLASS Hopper grouped GEMM
// (ops/cuda/grouped_gemm_fp8.cu) with one alpha per group on the device, no host
// synchronization. InternalError on a mismatch.
void fp8_grouped_gemm(const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv,
                      const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv,
                      const std::vector<Tensor>& c, float alpha = 1.0f, float beta = 0.0f,
                      bool fast_accumulation = false);

}  // namespace megaton::ops
