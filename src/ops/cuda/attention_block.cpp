// Block attention on the GPU (ops/attention_block.h): one cuDNN fused-attention call per
// block of queries against a block of keys (the graphs of ops/cuda/attention.cpp with
// Sq != Skv and the block's mask), the layout changes and merge of attention_block.cu.
//
// Masks. A block's causal mask, "key position <= query position" with the block's row
// offsets, is one cuDNN can run when it is one of:
//   - every query sees every key (kv_offset + Skv - 1 <= q_offset): no mask;
//   - no query sees any key (kv_offset > q_offset + Sq - 1): nothing to run (out 0,
//     lse -inf; backward adds nothing);
//   - the diagonal aligned with the top left (Sq = Skv, q_offset = kv_offset) or bottom
//     right (q_offset - kv_offset = Skv - Sq >= 0: cuDNN's causal_mask_bottom_right).
// Context parallelism's tiles (model/context_parallel.cpp) are all of these; any other is
// an InternalError naming the offsets. A block of one query and one key, which cuDNN
// refuses (all_gather's first chunk when seq-length is 2 x cp), runs a small kernel.
//
// Layouts. The op's lse is token-major [Sq, Hq] (the CPU op's); cuDNN reads and writes its
// Stats packed head-major [Hq, Sq], so the lse is transposed on the way in and out (Sq * Hq
// floats). cuDNN overwrites dq, dk, dv; the op's backward adds, so the block's gradients go
// through scratch tensors of q's dtype and are added (ops::add_, into dq, dk, dv of any
// float dtype: context parallelism accumulates in F32).
#include "ops/cuda/attention_block.h"

#include <cmath>
#include <limits>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/cudnn_sdpa.h"

namespace megaton::ops::cuda {
namespace {

constexpr const char* kOp = "attention_block (cuda)";

// What runs for a block: cuDNN with a mask, or nothing (no query sees a key).
struct BlockPlan {
  sdpa::Problem problem;
  bool empty;
};

BlockPlan plan_block(const Tensor& q, const Tensor& k, const Tensor& v, int64_t q_offset,
                     int64_t kv_offset, bool causal, float softmax_scale) {
  sdpa::check_device_tensor(q, kOp, "q");
  sdpa::check_device_tensor(k, kOp, "k");
  sdpa::check_device_tensor(v, kOp, "v");
  MEGATON_CHECK(q.dtype() == DType::BF16 || q.dtype() == DType::F16,
                "{}: q must be BF16 or F16 (cuDNN fused attention), got {}", kOp,
                dtype_name(q.dtype()));
  MEGATON_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype(),
                "{}: k ({}) and v ({}) must have q's dtype ({})", kOp, dtype_name(k.dtype()),
                dtype_name(v.dtype()), dtype_name(q.dtype()));
  MEGATON_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3,
                "{}: q, k, v must be [S, heads, D], got {}, {}, {}", kOp, shape_str(q.shape()),
                shape_str(k.shape()), shape_str(v.shape()));
  const int64_t Sq = q.dim(0), Skv = k.dim(0), Hq = q.dim(1), Hkv = k.dim(1), D = q.dim(2),
                Dv = v.dim(2);
  MEGATON_CHECK(Hkv > 0 && Hq % Hkv == 0 && D > 0 && Dv > 0 && k.shape() == (Shape{Skv, Hkv, D}) &&
                    v.shape() == (Shape{Skv, Hkv, Dv}),
                "{}: q {}, k {}, v {} do not fit (GQA: query heads a multiple of kv heads)", kOp,
                shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(D));
  BlockPlan plan{{1, Sq, Skv, Hq, Hkv, D, Dv, scale, sdpa::Mask::None}, false};
  sdpa::check_head_dims(plan.problem, kOp);
  MEGATON_CHECK(Skv > 0, "{}: a block of no keys", kOp);
  if (!causal || kv_offset + Skv - 1 <= q_offset) return plan;
  if (kv_offset > q_offset + Sq - 1) {
    plan.empty = true;
    return plan;
  }
  if (Sq == Skv && q_offset == kv_offset) {
    plan.problem.mask = sdpa::Mask::CausalTopLeft;
    return plan;
  }
  MEGATON_CHECK(q_offset - kv_offset == Skv - Sq && Skv > Sq,
                "{}: a causal block of {} queries at offset {} against {} keys at offset {} is "
                "not a cuDNN diagonal (top-left or bottom-right)",
                kOp, Sq, q_offset, Skv, kv_offset);
  plan.problem.mask = sdpa::Mask::CausalBottomRight;
  return plan;
}

// (Not cuDNN's: the op transposes it to and from packed stats, so any row offset will do.)
void check_lse(const Tensor& lse, const sdpa::Problem& d) {
  MEGATON_CHECK(lse.defined() && lse.device() == Device::CUDA, "{}: lse must be a CUDA tensor",
                kOp);
  MEGATON_CHECK(lse.dtype() == DType::F32 && lse.shape() == (Shape{d.Sq, d.Hq}),
                "{}: lse must be F32 [{}, {}], got {} {}", kOp, d.Sq, d.Hq, dtype_name(lse.dtype()),
                shape_str(lse.shape()));
}

void check_like(const Tensor& t, const Tensor& ref, const Shape& shape, const char* name) {
  sdpa::check_device_tensor(t, kOp, name);
  MEGATON_CHECK(t.dtype() == ref.dtype() && t.shape() == shape, "{}: {} must be {} {}, got {} {}",
                kOp, name, dtype_name(ref.dtype()), shape_str(shape), dtype_name(t.dtype()),
                shape_str(t.shape()));
}

void check_accumulator(const Tensor& t, const Tensor& like, const char* name) {
  MEGATON_CHECK(
      t.defined() && t.device() == Device::CUDA && t.shape() == like.shape() &&
          (t.dtype() == DType::F32 || t.dtype() == DType::BF16 || t.dtype() == DType::F16),
      "{}: {} must be a float GPU tensor of shape {}, got {}", kOp, name, shape_str(like.shape()),
      t.defined() ? shape_str(t.shape()) : "none");
}

}  // namespace

void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t q_offset,
                             int64_t kv_offset, bool causal, Tensor& out, Tensor& lse,
                             float softmax_scale) {
  const BlockPlan plan = plan_block(q, k, v, q_offset, kv_offset, causal, softmax_scale);
  const sdpa::Problem& d = plan.problem;
  check_like(out, q, {d.Sq, d.Hq, d.Dv}, "out");
  check_lse(lse, d);
  if (plan.empty) {
    out.zero();
    lse.fill(-std::numeric_limits<float>::infinity());
    return;
  }
  if (d.Sq == 1 && d.Skv == 1) {  // (a one-token document's piece)
    attention_single_key_forward(q, k, v, out, lse, d.scale);
    return;
  }
  Tensor stats = Tensor::empty({d.Hq, d.Sq}, DType::F32, Device::CUDA);
  sdpa::forward(d, q, k, v, out, stats, 0.0f, 0, 0);
  lse_transpose(stats, lse);
}

void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, int64_t q_offset,
                              int64_t kv_offset, bool causal, Tensor& dq, Tensor& dk, Tensor& dv,
                              float softmax_scale) {
  const BlockPlan plan = plan_block(q, k, v, q_offset, kv_offset, causal, softmax_scale);
  const sdpa::Problem& d = plan.problem;
  check_like(dout, q, {d.Sq, d.Hq, d.Dv}, "dout");
  check_like(out, q, {d.Sq, d.Hq, d.Dv}, "out");
  check_lse(lse, d);
  check_accumulator(dq, q, "dq");
  check_accumulator(dk, k, "dk");
  check_accumulator(dv, v, "dv");
  if (plan.empty || d.Sq == 0 || d.Skv == 0) return;
  if (d.Sq == 1 && d.Skv == 1) {
    // F32 scratch (a few hundred elements), added into the accumulators of any dtypes.
    Tensor sq = Tensor::zeros(q.shape(), DType::F32, Device::CUDA),
           sk = Tensor::zeros(k.shape(), DType::F32, Device::CUDA),
           sv = Tensor::zeros(v.shape(), DType::F32, Device::CUDA);
    attention_single_key_backward(dout, q, k, v, out, lse, sq, sk, sv, d.scale);
    add_(dq, sq, 1.0f);
    add_(dk, sk, 1.0f);
    add_(dv, sv, 1.0f);
    return;
  }
  Tensor stats = Tensor::empty({d.Hq, d.Sq}, DType::F32, Device::CUDA);
  lse_transpose(lse, stats);
  Tensor bq = Tensor::empty(q.shape(), q.dtype(), Device::CUDA),
         bk = Tensor::empty(k.shape(), q.dtype(), Device::CUDA),
         bv = Tensor::empty(v.shape(), q.dtype(), Device::CUDA);
  sdpa::backward(d, dout, q, k, v, out, stats, bq, bk, bv, 0.0f, 0, 0);
  add_(dq, bq, 1.0f);
  add_(dk, bk, 1.0f);
  add_(dv, bv, 1.0f);
}

}  // namespace megaton::ops::cuda
