// Rotary position embedding (RoPE), non-interleaved "rotate half" form, CPU fp32 reference.
#include <cmath>
#include <vector>

#include "ops/dispatch.h"
#include "ops/ops.h"
#include "ops/cpu/rope_tables.h"
#include "ops/rope_dim.h"

namespace megaton::ops {
namespace {

// Below this many elements the loop runs on the calling thread: waking an OpenMP team
// costs more than the work (and much more on a loaded machine).
constexpr int64_t kParallelMin = int64_t(1) << 15;

// Returns the rotary dim (rotary_dim, or the whole head for 0).
int64_t check_rope_args(const Tensor& x, const Tensor& y, const char* x_name, const char* y_name,
                        float base, int64_t position_offset, int64_t rotary_dim) {
  MEGATON_CHECK(x.defined() && y.defined(), "rope: {} and {} must be allocated", x_name, y_name);
  MEGATON_CHECK(x.device() == Device::CPU && y.device() == Device::CPU,
                "rope: only the CPU backend is built");
  MEGATON_CHECK(x.dtype() == DType::F32 && y.dtype() == DType::F32,
                "rope: {} {} and {} {} must be F32", x_name, dtype_name(x.dtype()), y_name,
                dtype_name(y.dtype()));
  MEGATON_CHECK(x.ndim() == 4, "rope: {} must be [B, S, heads, D], got {}", x_name,
                shape_str(x.shape()));
  MEGATON_CHECK(y.shape() == x.shape(), "rope: {} {} must match {} {}", y_name,
                shape_str(y.shape()), x_name, shape_str(x.shape()));
  MEGATON_CHECK(base > 0.0f, "rope: base {} must be positive", base);
  MEGATON_CHECK(position_offset >= 0, "rope: position_offset {} must be >= 0", position_offset);
  return checked_rotary_dim("rope", rotary_dim, x.dim(3));
}

// y = rotate(x, sign * angle) on the first R = rotary_dim channels of each head, the
// channels [R, D) copied: sign = +1 forward, -1 backward (the transpose of a rotation is
// the rotation by the opposite angle). Safe when y aliases x: each pair is read completely
// before it is written.
void rope_apply(const Tensor& x, Tensor& y, float base, int64_t position_offset, float sign,
                int64_t rotary_dim) {
  const int64_t B = x.dim(0), S = x.dim(1), heads = x.dim(2), D = x.dim(3);
  const int64_t half = rotary_dim / 2;
  std::vector<float> cos_table, sin_table;
  cpu::rope_tables(S, rotary_dim, base, position_offset, cos_table, sin_table);
  const float* src = x.f32();
  float* dst = y.f32();
#pragma omp parallel for collapse(2) schedule(static) if (x.numel() >= kParallelMin)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      const float* c = cos_table.data() + s * half;
      const float* sn = sin_table.data() + s * half;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t off = ((b * S + s) * heads + h) * D;
        const float* in = src + off;
        float* out = dst + off;
        for (int64_t i = 0; i < half; ++i) {
          float x1 = in[i], x2 = in[i + half];
          float si = sign * sn[i];
          out[i] = x1 * c[i] - x2 * si;
          out[i + half] = x2 * c[i] + x1 * si;
        }
        if (out != in)
          for (int64_t i = rotary_dim; i < D; ++i) out[i] = in[i];
      }
    }
  }
}

}  // namespace

void rope_forward(const Tensor& x, Tensor& y, float base, int64_t position_offset,
                  int64_t rotary_dim) {
  MEGATON_CUDA_DISPATCH(x, cuda::rope_forward(x, y, base, position_offset, rotary_dim));
  const int64_t r = check_rope_args(x, y, "x", "y", base, position_offset, rotary_dim);
  rope_apply(x, y, base, position_offset, 1.0f, r);
}

void rope_backward(const Tensor& dy, Tensor& dx, float base, int64_t position_offset,
                   int64_t rotary_dim) {
  MEGATON_CUDA_DISPATCH(dy, cuda::rope_backward(dy, dx, base, position_offset, rotary_dim));
  const int64_t r = check_rope_args(dy, dx, "dy", "dx", base, position_offset, rotary_dim);
  rope_apply(dy, dx, base, position_offset, -1.0f, r);
}

}  // namespace megaton::ops
