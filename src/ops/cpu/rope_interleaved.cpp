// MLA's interleaved rotary embedding (ops/rope_interleaved.h), CPU fp32 reference.
#include "ops/rope_interleaved.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/cpu/rope_tables.h"
#include "ops/dispatch.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/rope_interleaved.h"
#endif

namespace megaton::ops {
namespace {

void check_args(const Tensor& x, const Tensor& y, const std::vector<float>& inv_freq,
                int64_t position_offset) {
  MEGATON_CHECK(x.defined() && y.defined(), "rope_interleaved: tensors must be allocated");
  MEGATON_CHECK(x.device() == Device::CPU && y.device() == Device::CPU,
                "rope_interleaved: only the CPU backend is built");
  MEGATON_CHECK(x.dtype() == DType::F32 && y.dtype() == DType::F32,
                "rope_interleaved: tensors must be F32, got {} and {}", dtype_name(x.dtype()),
                dtype_name(y.dtype()));
  MEGATON_CHECK(x.ndim() == 4 && y.shape() == x.shape(),
                "rope_interleaved: x {} and y {} must be the same [B, S, heads, D]",
                shape_str(x.shape()), shape_str(y.shape()));
  MEGATON_CHECK(x.dim(3) % 2 == 0 && int64_t(inv_freq.size()) == x.dim(3) / 2,
                "rope_interleaved: head dim {} must be even with {} frequencies", x.dim(3),
                inv_freq.size());
  MEGATON_CHECK(x.raw() != y.raw() || x.numel() == 0, "rope_interleaved: y must not alias x");
  MEGATON_CHECK(position_offset >= 0, "rope_interleaved: position_offset {} must be >= 0",
                position_offset);
}

// forward: y from x; backward (transpose): dx from dy.
void apply(const Tensor& in, Tensor& out, const std::vector<float>& inv_freq, float scale,
           int64_t position_offset, bool forward) {
  const int64_t B = in.dim(0), S = in.dim(1), heads = in.dim(2), D = in.dim(3), half = D / 2;
  std::vector<float> cos_table, sin_table;
  cpu::rope_tables_from_inv_freq(S, inv_freq, position_offset, cos_table, sin_table);
  const float* src = in.f32();
  float* dst = out.f32();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const float* c = cos_table.data() + s * half;
      const float* sn = sin_table.data() + s * half;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t off = ((b * S + s) * heads + h) * D;
        const float* x = src + off;
        float* y = dst + off;
        for (int64_t j = 0; j < half; ++j) {
          if (forward) {
            const float a = x[2 * j], e = x[2 * j + 1];
            y[j] = scale * (a * c[j] - e * sn[j]);
            y[j + half] = scale * (e * c[j] + a * sn[j]);
          } else {
            const float g1 = x[j], g2 = x[j + half];
            y[2 * j] = scale * (g1 * c[j] + g2 * sn[j]);
            y[2 * j + 1] = scale * (g2 * c[j] - g1 * sn[j]);
          }
        }
      }
    }
}

}  // namespace

void rope_interleaved_forward(const Tensor& x, Tensor& y, const std::vector<float>& inv_freq,
                              float scale, int64_t position_offset) {
  MEGATON_CUDA_DISPATCH(x, cuda::rope_interleaved_forward(x, y, inv_freq, scale, position_offset));
  check_args(x, y, inv_freq, position_offset);
  apply(x, y, inv_freq, scale, position_offset, true);
}

void rope_interleaved_backward(const Tensor& dy, Tensor& dx, const std::vector<float>& inv_freq,
                               float scale, int64_t position_offset) {
  MEGATON_CUDA_DISPATCH(dy,
                        cuda::rope_interleaved_backward(dy, dx, inv_freq, scale, position_offset));
  check_args(dy, dx, inv_freq, position_offset);
  apply(dy, dx, inv_freq, scale, position_offset, false);
}

}  // namespace megaton::ops
