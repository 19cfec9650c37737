// Rotary position embedding (RoPE), non-interleaved "rotate half" form, CPU fp32 reference.
#include <cmath>
#include <vector>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

// Below this many elements the loop runs on the calling thread: waking an OpenMP team
// costs more than the work (and much more on a loaded machine).
constexpr int64_t kParallelMin = int64_t(1) << 15;

void check_rope_args(const Tensor& x, const Tensor& y, const char* x_name, const char* y_name,
                     float base, int64_t position_offset) {
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
  MEGATON_CHECK(x.dim(3) % 2 == 0, "rope: head dim {} must be even", x.dim(3));
  MEGATON_CHECK(base > 0.0f, "rope: base {} must be positive", base);
  MEGATON_CHECK(position_offset >= 0, "rope: position_offset {} must be >= 0", position_offset);
}

// cos and sin of angle(s, i) for s < S, i < D/2, laid out [S, D/2].
// Computed as HF Llama (LlamaRotaryEmbedding) and Megatron (RotaryEmbedding) do in fp32:
// inv_freq = 1 / base^(float(2i) / D), angle = float(pos) * inv_freq, both rounded to
// fp32, so that long positions see the same angle rounding as the references (at
// position 4096 one fp32 ulp of the angle is ~5e-4). cos/sin of that fp32 angle are then
// evaluated in double and rounded once.
void rope_tables(int64_t S, int64_t D, float base, int64_t position_offset,
                 std::vector<float>& cos_table, std::vector<float>& sin_table) {
  const int64_t half = D / 2;
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    float exponent = float(2 * i) / float(D);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
  cos_table.resize(S * half);
  sin_table.resize(S * half);
  for (int64_t s = 0; s < S; ++s) {
    float pos = float(s + position_offset);
    for (int64_t i = 0; i < half; ++i) {
      float angle = pos * inv_freq[i];
      cos_table[s * half + i] = float(std::cos(double(angle)));
      sin_table[s * half + i] = float(std::sin(double(angle)));
    }
  }
}

// y = rotate(x, sign * angle): sign = +1 forward, -1 backward (the transpose of a
// rotation is the rotation by the opposite angle). Safe when y aliases x: each pair is
// read completely before it is written.
void rope_apply(const Tensor& x, Tensor& y, float base, int64_t position_offset, float sign) {
  const int64_t B = x.dim(0), S = x.dim(1), heads = x.dim(2), D = x.dim(3), half = D / 2;
  std::vector<float> cos_table, sin_table;
  rope_tables(S, D, base, position_offset, cos_table, sin_table);
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
      }
    }
  }
}

}  // namespace

void rope_forward(const Tensor& x, Tensor& y, float base, int64_t position_offset) {
  MEGATON_CUDA_DISPATCH(x, cuda::rope_forward(x, y, base, position_offset));
  check_rope_args(x, y, "x", "y", base, position_offset);
  rope_apply(x, y, base, position_offset, 1.0f);
}

void rope_backward(const Tensor& dy, Tensor& dx, float base, int64_t position_offset) {
  MEGATON_CUDA_DISPATCH(dy, cuda::rope_backward(dy, dx, base, position_offset));
  check_rope_args(dy, dx, "dy", "dx", base, position_offset);
  rope_apply(dy, dx, base, position_offset, -1.0f);
}

}  // namespace megaton::ops
