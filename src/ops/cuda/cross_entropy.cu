// Softmax cross-entropy over the vocabulary on the GPU: one block per token row, fp32 math
// on F32, BF16 or F16 logits, never materialising the fp32 probabilities.
#include <cmath>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cross_entropy_rows.cuh"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {
namespace {

// ---- host: door checks ----

void check_on_gpu(const Tensor& t, DType want, const char* name) {
  MEGATON_CHECK(t.defined(), "cross_entropy: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CUDA, "cross_entropy: {} must be on the GPU", name);
  MEGATON_CHECK(t.dtype() == want, "cross_entropy: {} must be {}, got {}", name, dtype_name(want),
                dtype_name(t.dtype()));
}

void check_logits_labels(const Tensor& logits, const Tensor& labels) {
  MEGATON_CHECK(logits.defined() && logits.device() == Device::CUDA,
                "cross_entropy: logits must be allocated on the GPU");
  MEGATON_CHECK(detail::is_cuda_float(logits.dtype()),
                "cross_entropy: logits must be F32, BF16 or F16, got {}",
                dtype_name(logits.dtype()));
  MEGATON_CHECK(logits.ndim() == 2 && logits.dim(1) > 0,
                "cross_entropy: logits must be [T, V] with V > 0, got {}",
                shape_str(logits.shape()));
  MEGATON_CHECK(logits.dim(0) <= INT32_MAX, "cross_entropy: {} rows exceed the grid limit",
                logits.dim(0));
  check_on_gpu(labels, DType::I32, "labels");
  MEGATON_CHECK(labels.shape() == Shape{logits.dim(0)}, "cross_entropy: labels {} must be [{}]",
                shape_str(labels.shape()), logits.dim(0));
}

void check_vector(const Tensor& t, int64_t T, const char* name) {
  check_on_gpu(t, DType::F32, name);
  MEGATON_CHECK(t.shape() == Shape{T}, "cross_entropy: {} {} must be [{}]", name,
                shape_str(t.shape()), T);
}

// ---- device ----

using detail::block_row_max_sum;
using detail::MaxSum;
using detail::to_float;

// losses[t] = lse[t] - logits[t, labels[t]], lse[t] = logsumexp(logits[t, :]). One block
// per row. A label outside [0, V) gives a NaN loss (the CPU twin throws; here the loss
// shows it).
template <typename T, int kN>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ logits,
                                             const int32_t* __restrict__ labels,
                                             float* __restrict__ losses, float* __restrict__ lse,
                                             int64_t V) {
  const int64_t t = blockIdx.x;
  const T* row = logits + t * V;
  const MaxSum acc = block_row_max_sum<T, kN>(row, V);
  if (threadIdx.x == 0) {
    const float row_lse = acc.max + logf(acc.sum);
    const int32_t label = labels[t];
    lse[t] = row_lse;
    losses[t] = (label >= 0 && label < V) ? row_lse - to_float(row[label]) : NAN;
  }
}

// dlogits[t, v] = dlosses[t] * (exp(logits[t, v] - lse[t]) - [v == labels[t]]); a label
// outside [0, V) turns the row into NaN, as the forward's loss. dlogits may alias logits
// (detail::cross_entropy_backward_row), hence no __restrict__ on them.
template <typename T, int kN>
__global__ void cross_entropy_backward_kernel(const float* __restrict__ dlosses, const T* logits,
                                              const int32_t* __restrict__ labels,
                                              const float* __restrict__ lse, T* dlogits,
                                              int64_t V) {
  const int64_t t = blockIdx.x;
  detail::cross_entropy_backward_row<T, kN>(dlosses[t], logits + t * V, labels[t], lse[t],
                                            dlogits + t * V, V, /*vocab_start=*/0,
                                            /*label_end=*/V);
}

template <typename T, int kN>
void launch_forward(const Tensor& logits, const Tensor& labels, Tensor& losses, Tensor& lse) {
  const int64_t T_rows = logits.dim(0), V = logits.dim(1);
  const int threads = detail::cross_entropy_threads(V / kN);
  cross_entropy_forward_kernel<T, kN><<<unsigned(T_rows), threads, 0, ::megaton::cuda::stream()>>>(
      static_cast<const T*>(logits.raw()), labels.i32(), losses.f32(), lse.f32(), V);
  MEGATON_CUDA_CHECK_LAUNCH();
}

template <typename T, int kN>
void launch_backward(const Tensor& dlosses, const Tensor& logits, const Tensor& labels,
                     const Tensor& lse, Tensor& dlogits) {
  const int64_t T_rows = logits.dim(0), V = logits.dim(1);
  const int threads = detail::cross_entropy_threads(V / kN);
  cross_entropy_backward_kernel<T, kN><<<unsigned(T_rows), threads, 0, ::megaton::cuda::stream()>>>(
      dlosses.f32(), static_cast<const T*>(logits.raw()), labels.i32(), lse.f32(),
      static_cast<T*>(dlogits.raw()), V);
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& labels, Tensor& losses,
                           Tensor& lse) {
  check_logits_labels(logits, labels);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_vector(losses, T, "losses");
  check_vector(lse, T, "lse");
  if (T == 0) return;
  const bool packed = detail::rows_fit_packs(V, dtype_size(logits.dtype()), {logits.raw()});
  detail::dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (packed)
      launch_forward<T, detail::kPackElems<T>>(logits, labels, losses, lse);
    else
      launch_forward<T, 1>(logits, labels, losses, lse);
  });
}

void cross_entropy_backward(const Tensor& dlosses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& dlogits) {
  check_logits_labels(logits, labels);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_vector(dlosses, T, "dlosses");
  check_vector(lse, T, "lse");
  check_on_gpu(dlogits, logits.dtype(), "dlogits");
  MEGATON_CHECK(dlogits.shape() == logits.shape(), "cross_entropy: dlogits {} must match logits {}",
                shape_str(dlogits.shape()), shape_str(logits.shape()));
  // In place (the same elements) is supported; a partial overlap would let one row's
  // writes feed another row's reads.
  const char* in = static_cast<const char*>(logits.raw());
  const char* out = static_cast<const char*>(dlogits.raw());
  const size_t bytes = logits.nbytes();
  MEGATON_CHECK(in == out || in + bytes <= out || out + bytes <= in,
                "cross_entropy: dlogits partially overlaps logits (in place must be exact)");
  if (T == 0) return;
  const bool packed =
      detail::rows_fit_packs(V, dtype_size(logits.dtype()), {logits.raw(), dlogits.raw()});
  detail::dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (packed)
      launch_backward<T, detail::kPackElems<T>>(dlosses, logits, labels, lse, dlogits);
    else
      launch_backward<T, 1>(dlosses, logits, labels, lse, dlogits);
  });
}

}  // namespace megaton::ops::cuda
