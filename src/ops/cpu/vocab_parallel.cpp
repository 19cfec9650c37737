// Vocab-parallel embedding and softmax cross entropy on the CPU (fp32 reference, fp64
// row sums): the per-rank pieces of Megatron's VocabParallelEmbedding and
// vocab_parallel_cross_entropy, whose TP reductions the caller makes.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

// Below this many elements a loop runs on the calling thread: waking an OpenMP team
// costs more than the work.
constexpr int64_t kParallelMin = int64_t(1) << 15;

void check_cpu(const Tensor& t, DType want, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.device() == Device::CPU,
                "{}: {} must be on the CPU (the op dispatches on another tensor's device)", op,
                name);
  MEGATON_CHECK(t.dtype() == want, "{}: {} must be {}, got {}", op, name, dtype_name(want),
                dtype_name(t.dtype()));
}

void check_vocab_start(const char* op, int64_t vocab_start) {
  MEGATON_CHECK(vocab_start >= 0, "{}: vocab_start {} is negative", op, vocab_start);
}

// Global ids (token ids or labels) are non-negative; the upper end of the vocabulary is
// not known to a shard. Checked before any parallel loop, so a bad one throws instead of
// terminating inside an OpenMP region.
void check_global_ids(const char* op, const char* what, const int32_t* ids, int64_t n) {
  for (int64_t t = 0; t < n; ++t)
    MEGATON_CHECK(ids[t] >= 0, "{}: {} {} at position {} is negative", op, what, ids[t], t);
}

// ids [T] or any rank (T = numel) I32; table [V_local, H] F32; rows [T, H] or
// ids.shape + [H] F32.
void check_embedding(const char* op, const Tensor& ids, const Tensor& table, const char* table_name,
                     const Tensor& rows, const char* rows_name, int64_t vocab_start) {
  check_cpu(ids, DType::I32, op, "ids");
  check_cpu(table, DType::F32, op, table_name);
  check_cpu(rows, DType::F32, op, rows_name);
  MEGATON_CHECK(table.ndim() == 2, "{}: {} must be [V_local, H], got {}", op, table_name,
                shape_str(table.shape()));
  const int64_t hidden = table.dim(1);
  MEGATON_CHECK(rows.ndim() >= 1 && rows.dim(-1) == hidden && rows.numel() == ids.numel() * hidden,
                "{}: {} {} does not match ids {} and {} {} (expected [T, H])", op, rows_name,
                shape_str(rows.shape()), shape_str(ids.shape()), table_name,
                shape_str(table.shape()));
  check_vocab_start(op, vocab_start);
  check_global_ids(op, "token id", ids.i32(), ids.numel());
}

// logits [T, V_local] F32 with V_local > 0; labels [T] I32, non-negative.
void check_logits_labels(const char* op, const Tensor& logits, const Tensor& labels,
                         int64_t vocab_start) {
  check_cpu(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2 && logits.dim(1) > 0,
                "{}: logits must be [T, V_local] with V_local > 0, got {}", op,
                shape_str(logits.shape()));
  check_cpu(labels, DType::I32, op, "labels");
  MEGATON_CHECK(labels.shape() == Shape{logits.dim(0)}, "{}: labels {} must be [{}]", op,
                shape_str(labels.shape()), logits.dim(0));
  check_vocab_start(op, vocab_start);
  check_global_ids(op, "label", labels.i32(), labels.numel());
}

// An fp32 per-token statistic [T].
void check_stat(const char* op, const Tensor& t, int64_t T, const char* name) {
  check_cpu(t, DType::F32, op, name);
  MEGATON_CHECK(t.shape() == Shape{T}, "{}: {} {} must be [{}]", op, name, shape_str(t.shape()), T);
}

// The row of the shard [vocab_start, vocab_start + V_local) that holds global id `id`, or
// -1 when another rank holds it.
int64_t local_row(int32_t id, int64_t vocab_start, int64_t vocab_local) {
  const int64_t row = int64_t(id) - vocab_start;
  return row >= 0 && row < vocab_local ? row : -1;
}

}  // namespace

void embedding_forward_vocab_range(const Tensor& ids, const Tensor& table, int64_t vocab_start,
                                   Tensor& out) {
  MEGATON_CUDA_DISPATCH(ids, cuda::embedding_forward_vocab_range(ids, table, vocab_start, out));
  const char* op = "embedding_forward_vocab_range";
  check_embedding(op, ids, table, "table", out, "out", vocab_start);
  const int64_t tokens = ids.numel(), vocab_local = table.dim(0), hidden = table.dim(1);
  const int32_t* id = ids.i32();
  const float* tab = table.f32();
  float* o = out.f32();
#pragma omp parallel for schedule(static) if (tokens * hidden >= kParallelMin)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = local_row(id[t], vocab_start, vocab_local);
    if (row >= 0)
      std::memcpy(o + t * hidden, tab + row * hidden, hidden * sizeof(float));
    else
      std::fill(o + t * hidden, o + (t + 1) * hidden, 0.0f);
  }
}

// As embedding_backward: threads split the hidden dimension, each adding every token in
// order, so repeated ids do not race and the sum order does not depend on the threads.
void embedding_backward_vocab_range(const Tensor& dout, const Tensor& ids, int64_t vocab_start,
                                    Tensor& dtable) {
  MEGATON_CUDA_DISPATCH(dout, cuda::embedding_backward_vocab_range(dout, ids, vocab_start, dtable));
  const char* op = "embedding_backward_vocab_range";
  check_embedding(op, ids, dtable, "dtable", dout, "dout", vocab_start);
  const int64_t tokens = ids.numel(), vocab_local = dtable.dim(0), hidden = dtable.dim(1);
  const int32_t* id = ids.i32();
  const float* d = dout.f32();
  float* dtab = dtable.f32();
  constexpr int64_t kBlock = 32;
  const int64_t blocks = (hidden + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (tokens * hidden >= kParallelMin)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t j0 = blk * kBlock, j1 = std::min(hidden, j0 + kBlock);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t row = local_row(id[t], vocab_start, vocab_local);
      if (row < 0) continue;
      float* dst = dtab + row * hidden;
      const float* src = d + t * hidden;
      for (int64_t j = j0; j < j1; ++j) dst[j] += src[j];
    }
  }
}

void cross_entropy_partial_stats(const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                                 Tensor& row_max, Tensor& sum_exp, Tensor& target_logit) {
  MEGATON_CUDA_DISPATCH(logits, cuda::cross_entropy_partial_stats(logits, labels, vocab_start,
                                                                  row_max, sum_exp, target_logit));
  const char* op = "cross_entropy_partial_stats";
  check_logits_labels(op, logits, labels, vocab_start);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_stat(op, row_max, T, "row_max");
  check_stat(op, sum_exp, T, "sum_exp");
  check_stat(op, target_logit, T, "target_logit");
  const float* x = logits.f32();
  const int32_t* lab = labels.i32();
  float *max_p = row_max.f32(), *sum_p = sum_exp.f32(), *target_p = target_logit.f32();
#pragma omp parallel for schedule(static) if (T * V >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * V;
    const float m = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - m);
    max_p[t] = m;
    sum_p[t] = float(sum);
    const int64_t target = local_row(lab[t], vocab_start, V);
    target_p[t] = target >= 0 ? row[target] : 0.0f;
  }
}

void cross_entropy_rescale_sum_exp(const Tensor& row_max, const Tensor& global_max,
                                   Tensor& sum_exp) {
  MEGATON_CUDA_DISPATCH(sum_exp, cuda::cross_entropy_rescale_sum_exp(row_max, global_max, sum_exp));
  const char* op = "cross_entropy_rescale_sum_exp";
  check_cpu(sum_exp, DType::F32, op, "sum_exp");
  MEGATON_CHECK(sum_exp.ndim() == 1, "{}: sum_exp must be [T], got {}", op,
                shape_str(sum_exp.shape()));
  const int64_t T = sum_exp.dim(0);
  check_stat(op, row_max, T, "row_max");
  check_stat(op, global_max, T, "global_max");
  const float *max_p = row_max.f32(), *global_p = global_max.f32();
  float* sum_p = sum_exp.f32();
#pragma omp parallel for schedule(static) if (T >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    // The rank that holds the maximum keeps its sum as is (also when both are -inf, where
    // exp(-inf - -inf) would be NaN).
    if (max_p[t] == global_p[t]) continue;
    sum_p[t] = float(double(sum_p[t]) * std::exp(double(max_p[t]) - double(global_p[t])));
  }
}

void cross_entropy_finish(const Tensor& global_max, const Tensor& sum_exp,
                          const Tensor& target_logit, Tensor& losses, Tensor& lse) {
  MEGATON_CUDA_DISPATCH(sum_exp,
                        cuda::cross_entropy_finish(global_max, sum_exp, target_logit, losses, lse));
  const char* op = "cross_entropy_finish";
  check_cpu(sum_exp, DType::F32, op, "sum_exp");
  MEGATON_CHECK(sum_exp.ndim() == 1, "{}: sum_exp must be [T], got {}", op,
                shape_str(sum_exp.shape()));
  const int64_t T = sum_exp.dim(0);
  check_stat(op, global_max, T, "global_max");
  check_stat(op, target_logit, T, "target_logit");
  check_stat(op, losses, T, "losses");
  check_stat(op, lse, T, "lse");
  const float *max_p = global_max.f32(), *sum_p = sum_exp.f32(), *target_p = target_logit.f32();
  float *loss_p = losses.f32(), *lse_p = lse.f32();
#pragma omp parallel for schedule(static) if (T >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    // fp64 as cross_entropy_forward, so one shard reproduces it.
    const double row_lse = double(max_p[t]) + std::log(double(sum_p[t]));
    lse_p[t] = float(row_lse);
    loss_p[t] = float(row_lse - double(target_p[t]));
  }
}

void cross_entropy_backward_vocab_range(const Tensor& dlosses, const Tensor& logits,
                                        const Tensor& labels, const Tensor& lse,
                                        int64_t vocab_start, Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(dlosses, cuda::cross_entropy_backward_vocab_range(
                                     dlosses, logits, labels, lse, vocab_start, dlogits));
  const char* op = "cross_entropy_backward_vocab_range";
  check_logits_labels(op, logits, labels, vocab_start);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_stat(op, dlosses, T, "dlosses");
  check_stat(op, lse, T, "lse");
  check_cpu(dlogits, DType::F32, op, "dlogits");
  MEGATON_CHECK(dlogits.shape() == logits.shape(), "{}: dlogits {} must match logits {}", op,
                shape_str(dlogits.shape()), shape_str(logits.shape()));
  const float *x = logits.f32(), *dl = dlosses.f32(), *lse_p = lse.f32();
  const int32_t* lab = labels.i32();
  float* dx = dlogits.f32();  // may be x: each element is read before it is written
#pragma omp parallel for schedule(static) if (T * V >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * V;
    float* drow = dx + t * V;
    const float g = dl[t], row_lse = lse_p[t];
    for (int64_t v = 0; v < V; ++v) drow[v] = g * std::exp(row[v] - row_lse);
    const int64_t target = local_row(lab[t], vocab_start, V);
    if (target >= 0) drow[target] -= g;
  }
}

}  // namespace megaton::ops
