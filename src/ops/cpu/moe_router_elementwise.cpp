// The MoE router's elementwise helpers on the CPU: counter-based (Philox) random fills,
// the same values as the GPU's (forced load balancing's normal logits, the input jitter's
// uniform factors), and mul_ (applying the jitter).
#include <cstdint>

#include "core/rng.h"
#include "ops/cpu/moe_router_math.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

using router_math::check_tensor;

// Philox costs ~10 multiplies an element: worth a thread team sooner than a plain loop.
constexpr int64_t kParallelMinRandom = int64_t(1) << 13;
constexpr int64_t kParallelMin = router_math::kParallelMin;

// The float dtypes mul_ takes, read and written through fp32.
float load(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::F32:
      return static_cast<const float*>(p)[i];
    case DType::BF16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::F16:
      return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::F8E4M3:
      return fp8e4m3_to_float(static_cast<const uint8_t*>(p)[i]);
    case DType::F8E5M2:
      return fp8e5m2_to_float(static_cast<const uint8_t*>(p)[i]);
    default:
      return 0.0f;  // unreachable: callers check is_floating
  }
}

void store(void* p, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::F32:
      static_cast<float*>(p)[i] = v;
      return;
    case DType::BF16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
      return;
    case DType::F16:
      static_cast<uint16_t*>(p)[i] = float_to_fp16(v);
      return;
    case DType::F8E4M3:
      static_cast<uint8_t*>(p)[i] = float_to_fp8e4m3(v);
      return;
    case DType::F8E5M2:
      static_cast<uint8_t*>(p)[i] = float_to_fp8e5m2(v);
      return;
    default:
      return;  // unreachable: callers check is_floating
  }
}

}  // namespace

void fill_normal(Tensor& t, uint64_t seed, uint64_t stream) {
  MEGATON_CUDA_DISPATCH(t, cuda::fill_normal(t, seed, stream));
  check_tensor(t, DType::F32, "fill_normal", "t");
  const Philox rng(seed);
  float* y = t.f32();
  const int64_t n = t.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMinRandom)
  for (int64_t i = 0; i < n; ++i) y[i] = rng.normal(stream, uint64_t(i));
}

void fill_uniform(Tensor& t, float lo, float hi, uint64_t seed, uint64_t stream) {
  MEGATON_CUDA_DISPATCH(t, cuda::fill_uniform(t, lo, hi, seed, stream));
  check_tensor(t, DType::F32, "fill_uniform", "t");
  const Philox rng(seed);
  float* y = t.f32();
  const int64_t n = t.numel();
  const float width = hi - lo;
#pragma omp parallel for schedule(static) if (n >= kParallelMinRandom)
  for (int64_t i = 0; i < n; ++i) y[i] = lo + width * rng.uniform(stream, uint64_t(i));
}

void mul_(Tensor& y, const Tensor& x) {
  MEGATON_CUDA_DISPATCH(y, cuda::mul_(y, x));
  constexpr const char* op = "mul_";
  MEGATON_CHECK(y.defined() && x.defined(), "{}: y and x must be allocated", op);
  MEGATON_CHECK(y.device() == Device::CPU && x.device() == Device::CPU,
                "{}: y and x must both be on the CPU", op);
  MEGATON_CHECK(is_floating(y.dtype()), "{}: y must be a float tensor, got {}", op,
                dtype_name(y.dtype()));
  MEGATON_CHECK(x.dtype() == DType::F32 || x.dtype() == y.dtype(),
                "{}: x must be F32 or y's dtype {}, got {}", op, dtype_name(y.dtype()),
                dtype_name(x.dtype()));
  MEGATON_CHECK(x.shape() == y.shape(), "{}: y {} and x {} differ in shape", op,
                shape_str(y.shape()), shape_str(x.shape()));
  const int64_t n = y.numel();
  if (n == 0) return;
  const DType ydt = y.dtype(), xdt = x.dtype();
  void* yp = y.raw();
  const void* xp = x.raw();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) store(yp, ydt, i, load(yp, ydt, i) * load(xp, xdt, i));
}

}  // namespace megaton::ops
