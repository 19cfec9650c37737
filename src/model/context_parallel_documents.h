// Context parallelism over packed documents (model/context_parallel.h, CpAttention::
// document_starts): a block of queries against a block of keys cut at the documents'
// boundaries, one ops::attention_pieces call per block. Internal to model/context_parallel*.cpp.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace megaton::cp_detail {

// Queries q [nq, Hq, D] at global positions [q_pos, ...) against keys k, v [nkv, ...] at
// [kv_pos, ...) under the causal and document masks (starts: the sample's document start of
// each global position): out [nq, Hq, Dv] and lse [nq, Hq] overwritten (a query that sees
// no key: 0 and -inf). The block's keys either lie wholly before the queries or reach their
// end (the chunk pairs and gathered prefixes the CP attention makes; InternalError else).
void document_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t q_pos,
                            int64_t kv_pos, const int32_t* starts, Tensor& out, Tensor& lse,
                            float scale);
// Its gradients, added into dq [nq, ...], dk, dv [nkv, ...]; out and lse: the queries'
// merged results (ops::attention_pieces_backward).
void document_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, int64_t q_pos, int64_t kv_pos,
                             const int32_t* starts, Tensor& dq, Tensor& dk, Tensor& dv,
                             float scale);

}  // namespace megaton::cp_detail
