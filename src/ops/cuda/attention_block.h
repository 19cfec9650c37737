// The CUDA side of ops/attention_block.h: the doors' targets (attention_block.cpp: cuDNN per
// block; attention_block.cu: the merge) and the lse layout kernel they share. Kept out of
// cuda_ops.h, which every op includes.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/attention_block.h"

namespace megaton::ops::cuda {

void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t q_offset,
                             int64_t kv_offset, bool causal, Tensor& out, Tensor& lse,
                             float softmax_scale);
void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, int64_t q_offset,
                              int64_t kv_offset, bool causal, Tensor& dq, Tensor& dk, Tensor& dv,
                              float softmax_scale);
void attention_lse_merge(Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b);
// (attention_varlen.cpp: the ragged cuDNN graphs.)
void attention_pieces_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::vector<AttentionPiece>& pieces, bool causal, Tensor& out,
                              Tensor& lse, float softmax_scale);
void attention_pieces_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const std::vector<AttentionPiece>& pieces, bool causal, Tensor& dq,
                               Tensor& dk, Tensor& dv, float softmax_scale);

// The block of one query and one key, which cuDNN refuses (s_q = s_kv = 1; packed
// documents' one-token pieces go through attention_pieces_*, whose ragged graphs take them): q [1,
// Hq, D], k [1, Hkv, D], v [1, Hkv, Dv] -> out [1, Hq, Dv] (q's dtype) = v of each head's kv head,
// lse [1, Hq] F32 = scale q.k (the block's own softmax has the one key). The backward takes
// the query's merged out and lse (ops::attention_block_backward) and adds the block's share
// into dq, dk, dv (one float dtype; the door passes F32 scratch). Shapes are the caller's to check
// (attention_block.cpp).
void attention_single_key_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                  Tensor& lse, float scale);
void attention_single_key_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& out, const Tensor& lse,
                                   Tensor& dq, Tensor& dk, Tensor& dv, float scale);

// out [C, R] = in [R, C] transposed; both F32 on the GPU, contiguous. Between the block op's
// token-major lse [S, H] and cuDNN's packed head-major Stats [H, S]. InternalError on other
// shapes, dtypes or devices.
void lse_transpose(const Tensor& in, Tensor& out);

}  // namespace megaton::ops::cuda
