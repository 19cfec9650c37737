// Softmax cross-entropy over the vocabulary, CPU fp32 reference (fp64 row sums).
#include <algorithm>
#include <cmath>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

// Below this many elements a loop runs on the calling thread: waking an OpenMP team
// costs more than the work (and much more on a loaded machine).
constexpr int64_t kParallelMin = int64_t(1) << 15;

void check_f32_cpu(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "cross_entropy: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CPU, "cross_entropy: {}: only the CPU backend is built",
                name);
  MEGATON_CHECK(t.dtype() == DType::F32, "cross_entropy: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
}

// Shapes of logits [T, V] and labels [T] int32 with every label in [0, V). Labels are
// checked here, before any parallel loop, so a bad one throws instead of terminating
// inside an OpenMP region.
void check_logits_labels(const Tensor& logits, const Tensor& labels) {
  check_f32_cpu(logits, "logits");
  MEGATON_CHECK(logits.ndim() == 2 && logits.dim(1) > 0,
                "cross_entropy: logits must be [T, V] with V > 0, got {}",
                shape_str(logits.shape()));
  MEGATON_CHECK(labels.defined() && labels.device() == Device::CPU && labels.dtype() == DType::I32,
                "cross_entropy: labels must be an allocated CPU I32 tensor");
  const int64_t T = logits.dim(0), V = logits.dim(1);
  MEGATON_CHECK(labels.shape() == Shape{T}, "cross_entropy: labels {} must be [{}]",
                shape_str(labels.shape()), T);
  const int32_t* lab = labels.i32();
  for (int64_t t = 0; t < T; ++t)
    MEGATON_CHECK(lab[t] >= 0 && lab[t] < V, "cross_entropy: label {} of token {} not in [0, {})",
                  lab[t], t, V);
}

void check_vector(const Tensor& t, int64_t T, const char* name) {
  check_f32_cpu(t, name);
  MEGATON_CHECK(t.shape() == Shape{T}, "cross_entropy: {} {} must be [{}]", name,
                shape_str(t.shape()), T);
}

}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& labels, Tensor& losses,
                           Tensor& lse) {
  MEGATON_CUDA_DISPATCH(logits, cuda::cross_entropy_forward(logits, labels, losses, lse));
  check_logits_labels(logits, labels);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_vector(losses, T, "losses");
  check_vector(lse, T, "lse");
  const float* x = logits.f32();
  const int32_t* lab = labels.i32();
  float *loss_p = losses.f32(), *lse_p = lse.f32();
#pragma omp parallel for schedule(static) if (T * V >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * V;
    const float row_max = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - row_max);
    const double row_lse = double(row_max) + std::log(sum);
    lse_p[t] = float(row_lse);
    loss_p[t] = float(row_lse - double(row[lab[t]]));
  }
}

void cross_entropy_backward(const Tensor& dlosses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(dlosses,
                        cuda::cross_entropy_backward(dlosses, logits, labels, lse, dlogits));
  check_logits_labels(logits, labels);
  const int64_t T = logits.dim(0);
  check_vector(dlosses, T, "dlosses");
  check_vector(lse, T, "lse");
  check_f32_cpu(dlogits, "dlogits");
  MEGATON_CHECK(dlogits.shape() == logits.shape(), "cross_entropy: dlogits {} must match logits {}",
                shape_str(dlogits.shape()), shape_str(logits.shape()));
  // The same formula on a "shard" that is the whole vocabulary; the checks above also
  // bound the labels by V, which a shard cannot.
  cross_entropy_backward_vocab_range(dlosses, logits, labels, lse, /*vocab_start=*/0, dlogits);
}

}  // namespace megaton::ops
