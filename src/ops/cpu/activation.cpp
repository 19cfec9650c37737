// SwiGLU, exact (erf) GeLU and squared ReLU, plain and row-weighted (MoE experts), and the
// sigmoid row gate, forward and backward, on the CPU.
#include <cmath>
#include <utility>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

constexpr int64_t kParallelMin = 1 << 14;  // elements

void check_f32(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.dtype() == DType::F32, "{}: {} must be F32, got {}", op, name,
                dtype_name(t.dtype()));
  // A CUDA backend dispatches on the device after the checks; this binary has only CPU.
  MEGATON_CHECK(t.device() == Device::CPU, "{}: no CUDA backend in this build ({})", op, name);
}

void check_same_shape(const Tensor& t, const Tensor& ref, const char* op, const char* name,
                      const char* ref_name) {
  MEGATON_CHECK(t.shape() == ref.shape(), "{}: {} {} must have the shape of {} {}", op, name,
                shape_str(t.shape()), ref_name, shape_str(ref.shape()));
}

// x [T, 2F] and y [T, F] (any leading dimensions, equal in both). Returns {T, F}.
std::pair<int64_t, int64_t> swiglu_shape(const Tensor& x, const Tensor& y, const char* op,
                                         const char* y_name) {
  MEGATON_CHECK(x.ndim() >= 1 && x.dim(-1) % 2 == 0,
                "{}: x must be [T, 2F] with an even last dim, got {}", op, shape_str(x.shape()));
  Shape want = x.shape();
  want.back() /= 2;
  MEGATON_CHECK(y.shape() == want, "{}: {} {} must be {} for x {}", op, y_name,
                shape_str(y.shape()), shape_str(want), shape_str(x.shape()));
  int64_t ffn = want.back();
  return {ffn ? y.numel() / ffn : 0, ffn};
}

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

namespace cpu {

// y = silu(gate) * up, gate = x[t, :F], up = x[t, F:] (Megatron's packed fc1 output).
void swiglu_forward(const float* x, float* y, int64_t rows, int64_t ffn) {
#pragma omp parallel for schedule(static) if (rows * ffn >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = x + t * 2 * ffn;
    const float* up = gate + ffn;
    float* yr = y + t * ffn;
    for (int64_t j = 0; j < ffn; ++j) yr[j] = gate[j] * sigmoid(gate[j]) * up[j];
  }
}

// d silu(g)/dg = s (1 + g (1 - s)), s = sigmoid(g).
void swiglu_backward(const float* dy, const float* x, float* dx, int64_t rows, int64_t ffn) {
#pragma omp parallel for schedule(static) if (rows * ffn >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = x + t * 2 * ffn;
    const float* up = gate + ffn;
    const float* dyr = dy + t * ffn;
    float* dgate = dx + t * 2 * ffn;
    float* dup = dgate + ffn;
    for (int64_t j = 0; j < ffn; ++j) {
      float g = gate[j], u = up[j], s = sigmoid(g);
      dgate[j] = dyr[j] * u * s * (1.0f + g * (1.0f - s));
      dup[j] = dyr[j] * g * s;
    }
  }
}

// gelu(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)).
void gelu_forward(const float* x, float* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kInvSqrt2));
}

// gelu'(x) = Phi(x) + x phi(x), phi the standard normal density.
void gelu_backward(const float* dy, const float* x, float* dx, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    float cdf = 0.5f * (1.0f + std::erf(v * kInvSqrt2));
    float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}

// squared_relu(x) = relu(x)^2 (Megatron's activations.squared_relu).
inline float squared_relu(float v) {
  const float r = v > 0.0f ? v : 0.0f;
  return r * r;
}
// d relu(x)^2 / dx = 2 relu(x) (Megatron's _squared_relu_back).
inline float squared_relu_grad(float v) { return v > 0.0f ? 2.0f * v : 0.0f; }

void squared_relu_forward(const float* x, float* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = squared_relu(x[i]);
}

void squared_relu_backward(const float* dy, const float* x, float* dx, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * squared_relu_grad(x[i]);
}

// The row-weighted activations (ops.h): y = act(x) w_t, dx = act'(x) (dy w_t),
// dw_t = sum_f dy act(x) (fp64 sum). act(x) is computed as the unweighted forward does.
void weighted_swiglu_forward(const float* x, const float* w, float* y, int64_t rows,
                             int64_t ffn) {
#pragma omp parallel for schedule(static) if (rows * ffn >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = x + t * 2 * ffn;
    const float* up = gate + ffn;
    float* yr = y + t * ffn;
    for (int64_t j = 0; j < ffn; ++j) yr[j] = gate[j] * sigmoid(gate[j]) * up[j] * w[t];
  }
}

void weighted_swiglu_backward(const float* dy, const float* x, const float* w, float* dx,
                              float* dw, int64_t rows, int64_t ffn) {
#pragma omp parallel for schedule(static) if (rows * ffn >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = x + t * 2 * ffn;
    const float* up = gate + ffn;
    const float* dyr = dy + t * ffn;
    float* dgate = dx + t * 2 * ffn;
    float* dup = dgate + ffn;
    double dot = 0.0;
    for (int64_t j = 0; j < ffn; ++j) {
      const float g = gate[j], u = up[j], s = sigmoid(g), d = dyr[j] * w[t];
      dot += double(dyr[j]) * (g * s * u);
      dgate[j] = d * u * s * (1.0f + g * (1.0f - s));
      dup[j] = d * g * s;
    }
    dw[t] = float(dot);
  }
}

void weighted_gelu_forward(const float* x, const float* w, float* y, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = x[t * cols + j];
      y[t * cols + j] = 0.5f * v * (1.0f + std::erf(v * kInvSqrt2)) * w[t];
    }
}

void weighted_gelu_backward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                            int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    double dot = 0.0;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t i = t * cols + j;
      const float v = x[i];
      const float cdf = 0.5f * (1.0f + std::erf(v * kInvSqrt2));
      const float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
      dot += double(dy[i]) * (0.5f * v * (1.0f + std::erf(v * kInvSqrt2)));
      dx[i] = dy[i] * w[t] * (cdf + v * pdf);
    }
    dw[t] = float(dot);
  }
}

void weighted_squared_relu_forward(const float* x, const float* w, float* y, int64_t rows,
                                   int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < cols; ++j) y[t * cols + j] = squared_relu(x[t * cols + j]) * w[t];
}

void weighted_squared_relu_backward(const float* dy, const float* x, const float* w, float* dx,
                                    float* dw, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    double dot = 0.0;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t i = t * cols + j;
      dot += double(dy[i]) * squared_relu(x[i]);
      dx[i] = dy[i] * w[t] * squared_relu_grad(x[i]);
    }
    dw[t] = float(dot);
  }
}

// y[t, :] = x[t, :] * sigmoid(logits[t]).
void sigmoid_gate_forward(const float* x, const float* logits, float* y, int64_t rows,
                          int64_t hidden) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float s = sigmoid(logits[t]);
    for (int64_t h = 0; h < hidden; ++h) y[t * hidden + h] = x[t * hidden + h] * s;
  }
}

// dlogits[t] = s (1 - s) <dy[t], x[t]> (d sigmoid / d logit = s (1 - s)); dx = dy s.
void sigmoid_gate_backward(const float* dy, const float* x, const float* logits, float* dx,
                           float* dlogits, int64_t rows, int64_t hidden) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float s = sigmoid(logits[t]);
    float dot = 0.0f;
    for (int64_t h = 0; h < hidden; ++h) {
      const float d = dy[t * hidden + h];
      dot += d * x[t * hidden + h];
      dx[t * hidden + h] = d * s;
    }
    dlogits[t] = s * (1.0f - s) * dot;
  }
}

}  // namespace cpu

// x, y (or dy, dx) [T, H] with logits of T elements. Returns {T, H}.
std::pair<int64_t, int64_t> gate_shape(const Tensor& x, const Tensor& logits, const char* op) {
  MEGATON_CHECK(x.ndim() == 2, "{}: x must be [T, H], got {}", op, shape_str(x.shape()));
  MEGATON_CHECK(logits.numel() == x.dim(0), "{}: logits {} must have {} elements (x {})", op,
                shape_str(logits.shape()), x.dim(0), shape_str(x.shape()));
  return {x.dim(0), x.dim(1)};
}

}  // namespace

void swiglu_forward(const Tensor& x, Tensor& y) {
  MEGATON_CUDA_DISPATCH(x, cuda::swiglu_forward(x, y));
  const char* op = "swiglu_forward";
  check_f32(x, op, "x");
  check_f32(y, op, "y");
  auto [rows, ffn] = swiglu_shape(x, y, op, "y");
  cpu::swiglu_forward(x.f32(), y.f32(), rows, ffn);
}

// The CPU twin of the fused recompute is the unfused pair: forward, then backward.
void swiglu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y) {
  MEGATON_CUDA_DISPATCH(dy, cuda::swiglu_backward(dy, x, dx, y));
  const char* op = "swiglu_backward";
  check_f32(dy, op, "dy");
  check_f32(x, op, "x");
  check_f32(dx, op, "dx");
  auto [rows, ffn] = swiglu_shape(x, dy, op, "dy");
  check_same_shape(dx, x, op, "dx", "x");
  if (y) {
    check_f32(*y, op, "y");
    check_same_shape(*y, dy, op, "y", "dy");
    cpu::swiglu_forward(x.f32(), y->f32(), rows, ffn);
  }
  cpu::swiglu_backward(dy.f32(), x.f32(), dx.f32(), rows, ffn);
}

void gelu_forward(const Tensor& x, Tensor& y) {
  MEGATON_CUDA_DISPATCH(x, cuda::gelu_forward(x, y));
  const char* op = "gelu_forward";
  check_f32(x, op, "x");
  check_f32(y, op, "y");
  check_same_shape(y, x, op, "y", "x");
  cpu::gelu_forward(x.f32(), y.f32(), x.numel());
}

void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y) {
  MEGATON_CUDA_DISPATCH(dy, cuda::gelu_backward(dy, x, dx, y));
  const char* op = "gelu_backward";
  check_f32(dy, op, "dy");
  check_f32(x, op, "x");
  check_f32(dx, op, "dx");
  check_same_shape(dy, x, op, "dy", "x");
  check_same_shape(dx, x, op, "dx", "x");
  if (y) {
    check_f32(*y, op, "y");
    check_same_shape(*y, x, op, "y", "x");
    cpu::gelu_forward(x.f32(), y->f32(), x.numel());
  }
  cpu::gelu_backward(dy.f32(), x.f32(), dx.f32(), x.numel());
}

void squared_relu_forward(const Tensor& x, Tensor& y) {
  MEGATON_CUDA_DISPATCH(x, cuda::squared_relu_forward(x, y));
  const char* op = "squared_relu_forward";
  check_f32(x, op, "x");
  check_f32(y, op, "y");
  check_same_shape(y, x, op, "y", "x");
  cpu::squared_relu_forward(x.f32(), y.f32(), x.numel());
}

void squared_relu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y) {
  MEGATON_CUDA_DISPATCH(dy, cuda::squared_relu_backward(dy, x, dx, y));
  const char* op = "squared_relu_backward";
  check_f32(dy, op, "dy");
  check_f32(x, op, "x");
  check_f32(dx, op, "dx");
  check_same_shape(dy, x, op, "dy", "x");
  check_same_shape(dx, x, op, "dx", "x");
  if (y) {
    check_f32(*y, op, "y");
    check_same_shape(*y, x, op, "y", "x");
    cpu::squared_relu_forward(x.f32(), y->f32(), x.numel());
  }
  cpu::squared_relu_backward(dy.f32(), x.f32(), dx.f32(), x.numel());
}

namespace {
// weights, dweights: F32 [rows] (any shape of that many elements).
void check_row_weights(const Tensor& w, int64_t rows, const char* op, const char* name) {
  check_f32(w, op, name);
  MEGATON_CHECK(w.numel() == rows, "{}: {} {} must have {} elements, one per row", op, name,
                shape_str(w.shape()), rows);
}
}  // namespace

void weighted_swiglu_forward(const Tensor& x, const Tensor& weights, Tensor& y) {
  MEGATON_CUDA_DISPATCH(x, cuda::weighted_swiglu_forward(x, weights, y));
  const char* op = "weighted_swiglu_forward";
  check_f32(x, op, "x");
  check_f32(y, op, "y");
  auto [rows, ffn] = swiglu_shape(x, y, op, "y");
  check_row_weights(weights, rows, op, "weights");
  cpu::weighted_swiglu_forward(x.f32(), weights.f32(), y.f32(), rows, ffn);
}

void weighted_swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                              Tensor& dx, Tensor& dweights, Tensor* y) {
  MEGATON_CUDA_DISPATCH(dy, cuda::weighted_swiglu_backward(dy, x, weights, dx, dweights, y));
  const char* op = "weighted_swiglu_backward";
  check_f32(dy, op, "dy");
  check_f32(x, op, "x");
  check_f32(dx, op, "dx");
  auto [rows, ffn] = swiglu_shape(x, dy, op, "dy");
  check_same_shape(dx, x, op, "dx", "x");
  check_row_weights(weights, rows, op, "weights");
  check_row_weights(dweights, rows, op, "dweights");
  if (y) {
    check_f32(*y, op, "y");
    check_same_shape(*y, dy, op, "y", "dy");
    cpu::weighted_swiglu_forward(x.f32(), weights.f32(), y->f32(), rows, ffn);
  }
  cpu::weighted_swiglu_backward(dy.f32(), x.f32(), weights.f32(), dx.f32(), dweights.f32(), rows,
                                ffn);
}

void weighted_gelu_forward(const Tensor& x, const Tensor& weights, Tensor& y) {
  MEGATON_CUDA_DISPATCH(x, cuda::weighted_gelu_forward(x, weights, y));
  const char* op = "weighted_gelu_forward";
  check_f32(x, op, "x");
  check_f32(y, op, "y");
  check_same_shape(y, x, op, "y", "x");
  MEGATON_CHECK(x.ndim() >= 1, "{}: x must be [R, F]", op);
  const int64_t cols = x.dim(-1), rows = cols ? x.numel() / cols : 0;
  check_row_weights(weights, rows, op, "weights");
  cpu::weighted_gelu_forward(x.f32(), weights.f32(), y.f32(), rows, cols);
}

void weighted_gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights, Tensor& dx,
                            Tensor& dweights, Tensor* y) {
  MEGATON_CUDA_DISPATCH(dy, cuda::weighted_gelu_backward(dy, x, weights, dx, dweights, y));
  const char* op = "weighted_gelu_backward";
  check_f32(dy, op, "dy");
  check_f32(x, op, "x");
  check_f32(dx, op, "dx");
  check_same_shape(dy, x, op, "dy", "x");
  check_same_shape(dx, x, op, "dx", "x");
  MEGATON_CHECK(x.ndim() >= 1, "{}: x must be [R, F]", op);
  const int64_t cols = x.dim(-1), rows = cols ? x.numel() / cols : 0;
  check_row_weights(weights, rows, op, "weights");
  check_row_weights(dweights, rows, op, "dweights");
  if (y) {
    check_f32(*y, op, "y");
    check_same_shape(*y, x, op, "y", "x");
    cpu::weighted_gelu_forward(x.f32(), weights.f32(), y->f32(), rows, cols);
  }
  cpu::weighted_gelu_backward(dy.f32(), x.f32(), weights.f32(), dx.f32(), dweights.f32(), rows,
                              cols);
}

void weighted_squared_relu_forward(const Tensor& x, const Tensor& weights, Tensor& y) {
  MEGATON_CUDA_DISPATCH(x, cuda::weighted_squared_relu_forward(x, weights, y));
  const char* op = "weighted_squared_relu_forward";
  check_f32(x, op, "x");
  check_f32(y, op, "y");
  check_same_shape(y, x, op, "y", "x");
  MEGATON_CHECK(x.ndim() >= 1, "{}: x must be [R, F]", op);
  const int64_t cols = x.dim(-1), rows = cols ? x.numel() / cols : 0;
  check_row_weights(weights, rows, op, "weights");
  cpu::weighted_squared_relu_forward(x.f32(), weights.f32(), y.f32(), rows, cols);
}

void weighted_squared_relu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                                    Tensor& dx, Tensor& dweights, Tensor* y) {
  MEGATON_CUDA_DISPATCH(dy, cuda::weighted_squared_relu_backward(dy, x, weights, dx, dweights, y));
  const char* op = "weighted_squared_relu_backward";
  check_f32(dy, op, "dy");
  check_f32(x, op, "x");
  check_f32(dx, op, "dx");
  check_same_shape(dy, x, op, "dy", "x");
  check_same_shape(dx, x, op, "dx", "x");
  MEGATON_CHECK(x.ndim() >= 1, "{}: x must be [R, F]", op);
  const int64_t cols = x.dim(-1), rows = cols ? x.numel() / cols : 0;
  check_row_weights(weights, rows, op, "weights");
  check_row_weights(dweights, rows, op, "dweights");
  if (y) {
    check_f32(*y, op, "y");
    check_same_shape(*y, x, op, "y", "x");
    cpu::weighted_squared_relu_forward(x.f32(), weights.f32(), y->f32(), rows, cols);
  }
  cpu::weighted_squared_relu_backward(dy.f32(), x.f32(), weights.f32(), dx.f32(), dweights.f32(),
                                      rows, cols);
}

void sigmoid_gate_forward(const Tensor& x, const Tensor& logits, Tensor& y) {
  MEGATON_CUDA_DISPATCH(x, cuda::sigmoid_gate_forward(x, logits, y));
  const char* op = "sigmoid_gate_forward";
  check_f32(x, op, "x");
  check_f32(logits, op, "logits");
  check_f32(y, op, "y");
  check_same_shape(y, x, op, "y", "x");
  auto [rows, hidden] = gate_shape(x, logits, op);
  cpu::sigmoid_gate_forward(x.f32(), logits.f32(), y.f32(), rows, hidden);
}

void sigmoid_gate_backward(const Tensor& dy, const Tensor& x, const Tensor& logits, Tensor& dx,
                           Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(dy, cuda::sigmoid_gate_backward(dy, x, logits, dx, dlogits));
  const char* op = "sigmoid_gate_backward";
  check_f32(dy, op, "dy");
  check_f32(x, op, "x");
  check_f32(logits, op, "logits");
  check_f32(dx, op, "dx");
  check_f32(dlogits, op, "dlogits");
  check_same_shape(dy, x, op, "dy", "x");
  check_same_shape(dx, x, op, "dx", "x");
  auto [rows, hidden] = gate_shape(x, logits, op);
  MEGATON_CHECK(dlogits.numel() == rows, "{}: dlogits {} must have {} elements", op,
                shape_str(dlogits.shape()), rows);
  cpu::sigmoid_gate_backward(dy.f32(), x.f32(), logits.f32(), dx.f32(), dlogits.f32(), rows,
                             hidden);
}

}  // namespace megaton::ops
