// Token embedding lookup and its gradient on the CPU.
#include <algorithm>
#include <cstring>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

void check_dtype(const Tensor& t, DType want, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.dtype() == want, "{}: {} must be {}, got {}", op, name, dtype_name(want),
                dtype_name(t.dtype()));
}

// ids may be [T] or [B, S] (any rank, T = numel); rows is [T, H] or ids.shape + [H].
void check_shapes(const char* op, const Tensor& ids, const Tensor& table, const char* table_name,
                  const Tensor& rows, const char* rows_name) {
  check_dtype(ids, DType::I32, op, "ids");
  check_dtype(table, DType::F32, op, table_name);
  check_dtype(rows, DType::F32, op, rows_name);
  MEGATON_CHECK(table.ndim() == 2, "{}: {} must be [V, H], got {}", op, table_name,
                shape_str(table.shape()));
  int64_t hidden = table.dim(1);
  MEGATON_CHECK(rows.ndim() >= 1 && rows.dim(-1) == hidden && rows.numel() == ids.numel() * hidden,
                "{}: {} {} does not match ids {} and {} {} (expected [T, H])", op, rows_name,
                shape_str(rows.shape()), shape_str(ids.shape()), table_name,
                shape_str(table.shape()));
  for (const Tensor* t : {&ids, &table, &rows})
    MEGATON_CHECK(t->device() == Device::CPU, "{}: no CUDA backend in this build", op);
}

// An id outside the vocabulary is a bug upstream (tokenizer/vocab padding mismatch); name
// the first one so it can be traced to the data.
void check_ids(const char* op, const int32_t* ids, int64_t tokens, int64_t vocab) {
  for (int64_t t = 0; t < tokens; ++t)
    MEGATON_CHECK(ids[t] >= 0 && ids[t] < vocab,
                  "{}: token id {} at position {} is outside the vocabulary [0, {})", op, ids[t], t,
                  vocab);
}

namespace cpu {

void embedding_forward(const int32_t* ids, const float* table, float* out, int64_t tokens,
                       int64_t hidden) {
#pragma omp parallel for schedule(static) if (tokens * hidden >= (1 << 15))
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(out + t * hidden, table + int64_t(ids[t]) * hidden, hidden * sizeof(float));
}

// Threads split the hidden dimension, each adding every token in order: repeated ids do
// not race and the sum order (token order) does not depend on the thread count.
void embedding_backward(const float* dout, const int32_t* ids, float* dtable, int64_t tokens,
                        int64_t hidden) {
  constexpr int64_t kBlock = 32;
  int64_t blocks = (hidden + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (tokens * hidden >= (1 << 15))
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int64_t j0 = blk * kBlock, j1 = std::min(hidden, j0 + kBlock);
    for (int64_t t = 0; t < tokens; ++t) {
      float* row = dtable + int64_t(ids[t]) * hidden;
      const float* d = dout + t * hidden;
      for (int64_t j = j0; j < j1; ++j) row[j] += d[j];
    }
  }
}

}  // namespace cpu
}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  MEGATON_CUDA_DISPATCH(ids, cuda::embedding_forward(ids, table, out));
  check_shapes("embedding_forward", ids, table, "table", out, "out");
  check_ids("embedding_forward", ids.i32(), ids.numel(), table.dim(0));
  cpu::embedding_forward(ids.i32(), table.f32(), out.f32(), ids.numel(), table.dim(1));
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  MEGATON_CUDA_DISPATCH(dout, cuda::embedding_backward(dout, ids, dtable));
  check_shapes("embedding_backward", ids, dtable, "dtable", dout, "dout");
  check_ids("embedding_backward", ids.i32(), ids.numel(), dtable.dim(0));
  cpu::embedding_backward(dout.f32(), ids.i32(), dtable.f32(), ids.numel(), dtable.dim(1));
}

}  // namespace megaton::ops
