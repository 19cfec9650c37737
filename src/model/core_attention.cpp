// The core attention, dense or over packed documents (model/core_attention.h).
#include "model/core_attention.h"

#include "core/error.h"
#include "ops/attention_varlen.h"
#include "ops/ops.h"

namespace megaton {

namespace {

bool varlen(const PackedSeqParams* packed) { return packed && packed->reset_attention_mask(); }
bool context_parallel(const PackedSeqParams* packed) {
  return packed && packed->has_context_parallel();
}

// [B, S, H, D] -> [B*S, H, D], the same memory.
Tensor rows_of(const Tensor& x) {
  MEGATON_CHECK(x.ndim() == 4, "core attention: expected [B, S, heads, D], got {}",
                shape_str(x.shape()));
  return x.view({x.dim(0) * x.dim(1), x.dim(2), x.dim(3)});
}

}  // namespace

Shape core_attention_lse_shape(const PackedSeqParams* packed, int64_t batch, int64_t seq,
                               int64_t heads) {
  if (varlen(packed) || context_parallel(packed)) return {batch * seq, heads};
  return {batch, heads, seq};
}

void core_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            Tensor& lse, const PackedSeqParams* packed, float dropout_p,
                            uint64_t seed, uint64_t stream, float softmax_scale) {
  if (context_parallel(packed)) {
    MEGATON_CHECK(dropout_p == 0.0f && !varlen(packed),
                  "core attention: context parallelism without dropout or packed documents");
    cp_attention_forward(q, k, v, out, lse, packed->context_parallel, softmax_scale);
    return;
  }
  if (!varlen(packed)) {
    ops::attention_forward(q, k, v, out, lse, dropout_p, seed, stream, softmax_scale);
    return;
  }
  Tensor out_rows = rows_of(out);
  ops::attention_varlen_forward(rows_of(q), rows_of(k), rows_of(v), out_rows, lse,
                                packed->cu_seqlens, packed->max_seqlen, dropout_p, seed, stream,
                                softmax_scale);
}

void core_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const PackedSeqParams* packed,
                             Tensor& dq, Tensor& dk, Tensor& dv, float dropout_p, uint64_t seed,
                             uint64_t stream, float softmax_scale) {
  if (context_parallel(packed)) {
    cp_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, packed->context_parallel,
                          softmax_scale);
    return;
  }
  if (!varlen(packed)) {
    ops::attention_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, seed, stream,
                            softmax_scale);
    return;
  }
  Tensor dq_rows = rows_of(dq), dk_rows = rows_of(dk), dv_rows = rows_of(dv);
  ops::attention_varlen_backward(rows_of(dout), rows_of(q), rows_of(k), rows_of(v), rows_of(out),
                                 lse, packed->cu_seqlens, packed->max_seqlen, dq_rows, dk_rows,
                                 dv_rows, dropout_p, seed, stream, softmax_scale);
}

}  // namespace megaton
