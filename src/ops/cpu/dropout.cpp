// Dropout on the CPU with a counter-based (Philox) mask that backward regenerates.
#include <cstring>
#include <utility>

#include "core/rng.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

constexpr int64_t kParallelMin = 1 << 13;  // elements; Philox is ~10 multiplies each

void check_args(const Tensor& in, const char* in_name, const Tensor& out, const char* out_name,
                float p, const char* op) {
  for (auto [t, name] : {std::pair{&in, in_name}, std::pair{&out, out_name}}) {
    MEGATON_CHECK(t->defined(), "{}: {} is undefined", op, name);
    MEGATON_CHECK(t->dtype() == DType::F32, "{}: {} must be F32, got {}", op, name,
                  dtype_name(t->dtype()));
  }
  MEGATON_CHECK(in.shape() == out.shape(), "{}: {} {} and {} {} differ in shape", op, in_name,
                shape_str(in.shape()), out_name, shape_str(out.shape()));
  MEGATON_CHECK(p >= 0.0f && p < 1.0f, "{}: dropout probability {} is not in [0, 1)", op, p);
  // A CUDA backend dispatches on the device after the checks; this binary has only CPU.
  MEGATON_CHECK(in.device() == Device::CPU && out.device() == Device::CPU,
                "{}: no CUDA backend in this build", op);
}

namespace cpu {

// out[i] = in[i] * keep[i] * (1 / (1 - p)), keep[i] = Philox(seed).uniform(stream, i) >= p.
// Forward and backward are the same map (the mask is regenerated, never stored). The
// scale is applied as a multiply by the fp32 reciprocal, as torch's dropout does.
void apply_mask(const float* in, float* out, int64_t n, float p, uint64_t seed, uint64_t stream) {
  if (p == 0.0f) {
    if (out != in) std::memcpy(out, in, n * sizeof(float));
    return;
  }
  const Philox rng(seed);
  const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i)
    out[i] = rng.uniform(stream, uint64_t(i)) >= p ? in[i] * scale : 0.0f;
}

// out[i] = residual[i] + mask(x[i] + bias[i % cols]), each step rounded to fp32 as the
// unfused ops round it (bias null: no bias; p 0: no mask).
void bias_dropout_add(const float* x, const float* bias, int64_t cols, const float* residual,
                      float* out, int64_t n, float p, uint64_t seed, uint64_t stream) {
  const Philox rng(seed);
  const float scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    if (bias) v += bias[i % cols];
    if (p > 0.0f) v = rng.uniform(stream, uint64_t(i)) >= p ? v * scale : 0.0f;
    out[i] = v + residual[i];
  }
}

}  // namespace cpu
}  // namespace

void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t stream) {
  MEGATON_CUDA_DISPATCH(x, cuda::dropout_forward(x, y, p, seed, stream));
  check_args(x, "x", y, "y", p, "dropout_forward");
  cpu::apply_mask(x.f32(), y.f32(), x.numel(), p, seed, stream);
}

void dropout_backward(const Tensor& dy, Tensor& dx, float p, uint64_t seed, uint64_t stream) {
  MEGATON_CUDA_DISPATCH(dy, cuda::dropout_backward(dy, dx, p, seed, stream));
  check_args(dy, "dy", dx, "dx", p, "dropout_backward");
  cpu::apply_mask(dy.f32(), dx.f32(), dy.numel(), p, seed, stream);
}

void bias_dropout_add(const Tensor& x, const Tensor& bias, const Tensor& residual, Tensor& out,
                      float p, uint64_t seed, uint64_t stream) {
  MEGATON_CUDA_DISPATCH(x, cuda::bias_dropout_add(x, bias, residual, out, p, seed, stream));
  check_args(x, "x", out, "out", p, "bias_dropout_add");
  check_args(residual, "residual", out, "out", p, "bias_dropout_add");
  MEGATON_CHECK(x.ndim() >= 1, "bias_dropout_add: x must have a last dimension");
  if (bias.defined()) {
    MEGATON_CHECK(bias.dtype() == DType::F32 && bias.device() == Device::CPU && bias.ndim() == 1 &&
                      bias.dim(0) == x.dim(-1),
                  "bias_dropout_add: bias {} {} must be F32 [{}] on the CPU", dtype_name(bias.dtype()),
                  shape_str(bias.shape()), x.dim(-1));
  }
  cpu::bias_dropout_add(x.f32(), bias.defined() ? bias.f32() : nullptr, x.dim(-1), residual.f32(),
                        out.f32(), x.numel(), p, seed, stream);
}

}  // namespace megaton::ops
