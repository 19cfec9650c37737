// The FP8 ops of ops/fp8.h on the CPU: door checks, CUDA dispatch, and the reference.
//
// Bit-exact contract with ops/cuda (quantization there must equal this, bit for bit):
//
//   cast      q = to_fp8(x * scale): the product rounded to fp32 (x widened exactly from
//             bf16 first), then
//               NaN      -> 0x7F | (sign of x << 7), both formats (the sign is x's, not the
//                           product's: a GPU multiply returns NaN without its sign);
//               +-inf and |p| > fp8_max -> +-fp8_max (TE's satfinite cast);
//               else     round to nearest even on the FP8 grid, subnormals included
//                        (core/dtype.h's float_to_fp8e4m3 / float_to_fp8e5m2).
//   scale     from amax, in this order, every step an fp32 IEEE operation (round to
//             nearest even; no FMA, no fast-math):
//               if (!(amax > 0) || !isfinite(amax)) keep the previous scale;
//               float s = fp8_max / fmaxf(amax, amax_epsilon);
//               s = s / exp2f(margin);       // exact for an integral margin (Megatron's
//                                            // --fp8-margin is an int); a fractional one
//                                            // may differ by an ulp between libms
//               if (isinf(s)) s = FLT_MAX;
//               if (power_of_2) s = largest power of two <= s (clear the 23 mantissa bits;
//                                   a subnormal s keeps its highest set bit);
//               scale_inv = 1.0f / s.
//   blockwise each block's scale is the rule above with previous scale 1.0f.
//
// The GEMM dequantizes both operands to fp32 (q * scale_inv, one fp32 product) and calls
// ops::gemm (OpenBLAS); the GPU's is compared with it to a tolerance.
#include "ops/fp8.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "ops/cpu/fp8_checks.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

using fp8_checks::check_input;
using fp8_checks::check_rule;
using fp8_checks::is_fp8;

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;
// DeepSeek-V3 / TE Float8BlockScaling: blocks are 128 wide (1x128 or 128x128).
constexpr int64_t kBlockCols = 128;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// [rows, cols] of a tensor of rank >= 1: leading dimensions merged (fp8.h's
// "[numel / C, C] with C its last dimension").
struct Matrix {
  int64_t rows, cols;
  bool operator==(const Matrix&) const = default;
};
Matrix as_matrix(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.ndim() >= 1, "{}: {} must have rank >= 1, got shape {}", op, name,
                shape_str(t.shape()));
  int64_t rows = 1;  // not numel / cols: that loses the rows when cols == 0
  for (int i = 0; i + 1 < t.ndim(); ++i) rows *= t.dim(i);
  return {rows, t.dim(-1)};
}

void check_fp8(const Tensor& q, const char* op, const char* name) {
  MEGATON_CHECK(q.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(is_fp8(q.dtype()), "{}: {} must be F8E4M3 or F8E5M2, got {}", op, name,
                dtype_name(q.dtype()));
}
void check_f32_shape(const Tensor& t, const Shape& shape, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.dtype() == DType::F32 && t.shape() == shape, "{}: {} must be F32 {}, got {} {}",
                op, name, shape_str(shape), dtype_name(t.dtype()), shape_str(t.shape()));
}
// All defined tensors on one device; in a CPU-only build, that device must be the CPU.
void check_devices(const char* op, std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (!first) first = t;
    MEGATON_CHECK(t->device() == first->device(), "{}: tensors on different devices", op);
  }
}
void require_cpu(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    MEGATON_CHECK(t->device() == Device::CPU, "{}: no CUDA backend in this build", op);
}

namespace cpu {

// x as fp32: F32 in place, BF16 widened exactly into `buffer`.
const float* as_f32(const Tensor& x, std::vector<float>& buffer) {
  if (x.dtype() == DType::F32) return x.f32();
  buffer.resize(x.numel());
  const uint16_t* h = x.data<uint16_t>();
  int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) buffer[i] = bf16_to_float(h[i]);
  return buffer.data();
}

// The cast of the header comment. core/dtype.h's conversions already round to nearest
// even and saturate finite values; they keep E5M2's inf (a plain cast, as torch's) and
// drop NaN's sign, which TE's satfinite cast does not, hence the two cases before them.
uint8_t to_fp8(float x, float product, bool e4m3, float max) {
  if (std::isnan(product)) return std::signbit(x) ? 0xFF : 0x7F;
  product = std::clamp(product, -max, max);
  return e4m3 ? float_to_fp8e4m3(product) : float_to_fp8e5m2(product);
}
float from_fp8(uint8_t q, bool e4m3) { return e4m3 ? fp8e4m3_to_float(q) : fp8e5m2_to_float(q); }

// Largest power of two <= s, s > 0 finite: a normal s keeps its exponent bits only (TE's
// force_pow_2_scales); a subnormal one, which TE would turn into 0, its highest set bit.
float round_down_pow2(float s) {
  uint32_t bits = std::bit_cast<uint32_t>(s);
  if (bits & 0x7F800000u) return std::bit_cast<float>(bits & 0xFF800000u);
  if (bits == 0) return s;
  return std::bit_cast<float>(uint32_t(1) << (31 - std::countl_zero(bits)));
}

// The scale rule; `previous` where the amax gives none (fp8.h, Fp8ScaleRule).
float scale_from_amax(float amax, const Fp8ScaleRule& rule, float previous) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return previous;
  float s = fp8_max(rule.fp8) / std::max(amax, rule.amax_epsilon);
  s = s / exp2f(rule.margin);
  if (std::isinf(s)) s = FLT_MAX;
  if (rule.power_of_2) s = round_down_pow2(s);
  return s;
}

// fp8_update_scale's rule on host memory: both left as they were when amax gives none.
void update_scale(float amax, const Fp8ScaleRule& rule, float* scale, float* scale_inv) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return;
  *scale = scale_from_amax(amax, rule, *scale);
  *scale_inv = 1.0f / *scale;
}

// max |x[i]|, NaN when any x[i] is NaN. A max is exact, so the split over threads does
// not change the result.
float amax(const float* x, int64_t n) {
  float m = 0.0f;
  bool nan = false;
  // clang-format off
#pragma omp parallel for schedule(static) reduction(max : m) reduction(|| : nan) \
    if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (std::isnan(a)) nan = true;
    else m = std::max(m, a);
  }
  // clang-format on
  return nan ? NAN : m;
}

// dst [cols, rows] = src [rows, cols]^T, for the fp8 bytes and the fp32 scales.
template <typename T>
void transpose(const T* src, T* dst, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 64;
#pragma omp parallel for schedule(static) collapse(2) if (rows * cols >= kParallelMin)
  for (int64_t i0 = 0; i0 < rows; i0 += kTile)
    for (int64_t j0 = 0; j0 < cols; j0 += kTile)
      for (int64_t i = i0; i < std::min(rows, i0 + kTile); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + kTile); ++j)
          dst[j * rows + i] = src[i * cols + j];
}

// Per-tensor: out = fp8(x * scale), n elements.
void quantize(const float* x, float scale, uint8_t* out, int64_t n, bool e4m3) {
  const float max = e4m3 ? 448.0f : 57344.0f;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = to_fp8(x[i], x[i] * scale, e4m3, max);
}

// Blockwise quantization of x [rows, cols] in blocks of block_rows x 128:
// scale_inv [ceil(rows / block_rows), ceil(cols / 128)].
void quantize_blocks(const float* x, int64_t rows, int64_t cols, int64_t block_rows,
                     const Fp8ScaleRule& rule, uint8_t* out, float* scale_inv) {
  const bool e4m3 = rule.fp8 == DType::F8E4M3;
  const float max = fp8_max(rule.fp8);
  const int64_t grid_rows = ceil_div(rows, block_rows), grid_cols = ceil_div(cols, kBlockCols);
#pragma omp parallel for schedule(static) collapse(2) if (rows * cols >= kParallelMin)
  for (int64_t br = 0; br < grid_rows; ++br) {
    for (int64_t bc = 0; bc < grid_cols; ++bc) {
      const int64_t r0 = br * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = bc * kBlockCols, c1 = std::min(cols, c0 + kBlockCols);
      float m = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        float row_max = amax(x + r * cols + c0, c1 - c0);
        m = std::isnan(row_max) || std::isnan(m) ? NAN : std::max(m, row_max);
      }
      const float scale = scale_from_amax(m, rule, 1.0f);
      scale_inv[br * grid_cols + bc] = 1.0f / scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const float v = x[r * cols + c];
          out[r * cols + c] = to_fp8(v, v * scale, e4m3, max);
        }
    }
  }
}

// x = q * scale_inv of the block (block_rows x 128) holding each element; block_rows 0:
// one scale for the whole tensor. Writes fp32 or, when bf16 is set, bf16 bits.
void dequantize(const uint8_t* q, bool e4m3, const float* scale_inv, int64_t block_rows,
                int64_t rows, int64_t cols, float* out_f32, uint16_t* out_bf16) {
  const int64_t grid_cols = ceil_div(cols, kBlockCols);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float s =
          block_rows == 0 ? scale_inv[0] : scale_inv[(r / block_rows) * grid_cols + c / kBlockCols];
      const float v = from_fp8(q[r * cols + c], e4m3) * s;
      if (out_bf16)
        out_bf16[r * cols + c] = float_to_bf16(v);
      else
        out_f32[r * cols + c] = v;
    }
}

}  // namespace cpu

// Block rows (0: per tensor, 1 or 128) of a scale_inv tensor for q [rows, cols]; throws
// when its shape is neither [1] nor a blockwise grid of q.
int64_t scale_layout(const Tensor& scale_inv, Matrix q, const char* op, const char* name) {
  MEGATON_CHECK(scale_inv.defined() && scale_inv.dtype() == DType::F32, "{}: {} must be F32", op,
                name);
  if (scale_inv.ndim() == 1 && scale_inv.dim(0) == 1) return 0;
  const int64_t grid_cols = ceil_div(q.cols, kBlockCols);
  if (scale_inv.ndim() == 2 && scale_inv.dim(1) == grid_cols) {
    if (scale_inv.dim(0) == q.rows) return 1;
    if (scale_inv.dim(0) == ceil_div(q.rows, 128)) return 128;
  }
  MEGATON_CHECK(false,
                "{}: {} {} is neither [1] nor a blockwise grid [{}, {}] (1x128) or [{}, {}] "
                "(128x128) of a [{}, {}] operand",
                op, name, shape_str(scale_inv.shape()), q.rows, grid_cols, ceil_div(q.rows, 128),
                grid_cols, q.rows, q.cols);
  return 0;
}

}  // namespace

float fp8_max(DType fp8) {
  MEGATON_CHECK(is_fp8(fp8), "fp8_max: {} is not an FP8 dtype", dtype_name(fp8));
  return fp8 == DType::F8E4M3 ? 448.0f : 57344.0f;
}

void fp8_amax(const Tensor& x, Tensor& amax) {
  check_input(x, "fp8_amax", "x");
  check_f32_shape(amax, {1}, "fp8_amax", "amax");
  check_devices("fp8_amax", {&x, &amax});
  MEGATON_CUDA_DISPATCH(x, cuda::fp8_amax(x, amax));
  require_cpu("fp8_amax", {&x});
  std::vector<float> buffer;
  amax.f32()[0] = cpu::amax(cpu::as_f32(x, buffer), x.numel());
}

void fp8_update_scale(const Tensor& amax, const Fp8ScaleRule& rule, Tensor& scale,
                      Tensor& scale_inv) {
  check_rule(rule, "fp8_update_scale");
  check_f32_shape(amax, {1}, "fp8_update_scale", "amax");
  check_f32_shape(scale, {1}, "fp8_update_scale", "scale");
  check_f32_shape(scale_inv, {1}, "fp8_update_scale", "scale_inv");
  check_devices("fp8_update_scale", {&amax, &scale, &scale_inv});
  MEGATON_CUDA_DISPATCH(amax, cuda::fp8_update_scale(amax, rule, scale, scale_inv));
  require_cpu("fp8_update_scale", {&amax});
  cpu::update_scale(amax.f32()[0], rule, scale.f32(), scale_inv.f32());
}

void fp8_delayed_scaling_update(Tensor& amax_history, const Fp8ScaleRule& rule, bool max_algo,
                                Tensor& scale, Tensor& scale_inv) {
  const char* op = "fp8_delayed_scaling_update";
  check_rule(rule, op);
  MEGATON_CHECK(amax_history.defined() && amax_history.dtype() == DType::F32 &&
                    amax_history.ndim() == 2 && amax_history.dim(0) >= 1 &&
                    amax_history.dim(1) == 1,
                "{}: amax_history must be F32 [L, 1] with L >= 1, got {} {}", op,
                dtype_name(amax_history.dtype()), shape_str(amax_history.shape()));
  check_f32_shape(scale, {1}, op, "scale");
  check_f32_shape(scale_inv, {1}, op, "scale_inv");
  check_devices(op, {&amax_history, &scale, &scale_inv});
  MEGATON_CUDA_DISPATCH(amax_history, cuda::fp8_delayed_scaling_update(amax_history, rule, max_algo,
                                                                       scale, scale_inv));
  require_cpu(op, {&amax_history});
  float* history = amax_history.f32();
  const int64_t length = amax_history.dim(0);
  // TE's torch.max(amax_history, dim=0) propagates a NaN, which then keeps the scale.
  const float a = max_algo ? cpu::amax(history, length) : history[0];
  cpu::update_scale(a, rule, scale.f32(), scale_inv.f32());
  // torch.roll(history, -1, 0), then row 0 = 0 (TE _default_get_amax_and_update_history).
  std::rotate(history, history + 1, history + length);
  history[0] = 0.0f;
}

void fp8_quantize(const Tensor& x, const Tensor& scale, Tensor& out, Tensor& out_t, Tensor& amax) {
  const char* op = "fp8_quantize";
  check_input(x, op, "x");
  check_f32_shape(scale, {1}, op, "scale");
  check_fp8(out, op, "out");
  const Matrix mx = as_matrix(x, op, "x");
  MEGATON_CHECK(as_matrix(out, op, "out") == mx, "{}: out {} must be [{}, {}] like x {}", op,
                shape_str(out.shape()), mx.rows, mx.cols, shape_str(x.shape()));
  if (out_t.defined())
    MEGATON_CHECK(out_t.dtype() == out.dtype() && out_t.shape() == Shape({mx.cols, mx.rows}),
                  "{}: out_t must be {} [{}, {}], got {} {}", op, dtype_name(out.dtype()), mx.cols,
                  mx.rows, dtype_name(out_t.dtype()), shape_str(out_t.shape()));
  if (amax.defined()) check_f32_shape(amax, {1}, op, "amax");
  check_devices(op, {&x, &scale, &out, &out_t, &amax});
  MEGATON_CUDA_DISPATCH(x, cuda::fp8_quantize(x, scale, out, out_t, amax));
  require_cpu(op, {&x});
  std::vector<float> buffer;
  const float* xf = cpu::as_f32(x, buffer);
  uint8_t* q = out.data<uint8_t>();
  cpu::quantize(xf, scale.f32()[0], q, x.numel(), out.dtype() == DType::F8E4M3);
  if (out_t.defined()) cpu::transpose(q, out_t.data<uint8_t>(), mx.rows, mx.cols);
  if (amax.defined()) amax.f32()[0] = cpu::amax(xf, x.numel());
}

void fp8_quantize_blockwise(const Tensor& x, int64_t block_rows, const Fp8ScaleRule& rule,
                            Tensor& out, Tensor& scale_inv, Tensor& out_t, Tensor& scale_inv_t) {
  const char* op = "fp8_quantize_blockwise";
  check_input(x, op, "x");
  check_rule(rule, op);
  MEGATON_CHECK(block_rows == 1 || block_rows == 128, "{}: block_rows must be 1 or 128, got {}", op,
                block_rows);
  MEGATON_CHECK(x.ndim() == 2, "{}: x must be [R, C], got {}", op, shape_str(x.shape()));
  const int64_t rows = x.dim(0), cols = x.dim(1);
  check_fp8(out, op, "out");
  MEGATON_CHECK(out.dtype() == rule.fp8 && out.shape() == x.shape(),
                "{}: out must be {} {} (rule.fp8, x's shape), got {} {}", op, dtype_name(rule.fp8),
                shape_str(x.shape()), dtype_name(out.dtype()), shape_str(out.shape()));
  check_f32_shape(scale_inv, {ceil_div(rows, block_rows), ceil_div(cols, kBlockCols)}, op,
                  "scale_inv");
  if (out_t.defined()) {
    MEGATON_CHECK(out_t.dtype() == rule.fp8 && out_t.shape() == Shape({cols, rows}),
                  "{}: out_t must be {} [{}, {}], got {} {}", op, dtype_name(rule.fp8), cols, rows,
                  dtype_name(out_t.dtype()), shape_str(out_t.shape()));
    check_f32_shape(scale_inv_t, {ceil_div(cols, block_rows), ceil_div(rows, kBlockCols)}, op,
                    "scale_inv_t");
  }
  check_devices(op, {&x, &out, &scale_inv, &out_t});
  if (out_t.defined()) check_devices(op, {&x, &scale_inv_t});
  MEGATON_CUDA_DISPATCH(
      x, cuda::fp8_quantize_blockwise(x, block_rows, rule, out, scale_inv, out_t, scale_inv_t));
  require_cpu(op, {&x});
  std::vector<float> buffer;
  const float* xf = cpu::as_f32(x, buffer);
  cpu::quantize_blocks(xf, rows, cols, block_rows, rule, out.data<uint8_t>(), scale_inv.f32());
  if (!out_t.defined()) return;
  // x^T quantized with the same code: its 128x128 blocks are the transposes of x's (same
  // elements, same amax, same scale), its 1x128 blocks run down x's columns.
  std::vector<float> xt(rows * cols);
  cpu::transpose(xf, xt.data(), rows, cols);
  cpu::quantize_blocks(xt.data(), cols, rows, block_rows, rule, out_t.data<uint8_t>(),
                       scale_inv_t.f32());
}

void fp8_transpose(const Tensor& q, Tensor& q_t) {
  const char* op = "fp8_transpose";
  check_fp8(q, op, "q");
  check_fp8(q_t, op, "q_t");
  const Matrix mq = as_matrix(q, op, "q");
  MEGATON_CHECK(q_t.dtype() == q.dtype() && q_t.ndim() == 2 && q_t.dim(0) == mq.cols &&
                    q_t.dim(1) == mq.rows,
                "{}: q_t {} {} must be [{}, {}] {} (q transposed)", op, dtype_name(q_t.dtype()),
                shape_str(q_t.shape()), mq.cols, mq.rows, dtype_name(q.dtype()));
  check_devices(op, {&q, &q_t});
  if (q.numel() == 0) return;
  MEGATON_CUDA_DISPATCH(q, cuda::fp8_transpose(q, q_t));
  cpu::transpose(q.data<uint8_t>(), q_t.data<uint8_t>(), mq.rows, mq.cols);
}

void fp8_dequantize(const Tensor& q, const Tensor& scale_inv, Tensor& x) {
  const char* op = "fp8_dequantize";
  check_fp8(q, op, "q");
  check_input(x, op, "x");
  const Matrix mq = as_matrix(q, op, "q");
  MEGATON_CHECK(as_matrix(x, op, "x") == mq, "{}: x {} must be [{}, {}] like q {}", op,
                shape_str(x.shape()), mq.rows, mq.cols, shape_str(q.shape()));
  const int64_t block_rows = scale_layout(scale_inv, mq, op, "scale_inv");
  check_devices(op, {&q, &scale_inv, &x});
  MEGATON_CUDA_DISPATCH(q, cuda::fp8_dequantize(q, scale_inv, x));
  require_cpu(op, {&q});
  const bool bf16 = x.dtype() == DType::BF16;
  cpu::dequantize(q.data<uint8_t>(), q.dtype() == DType::F8E4M3, scale_inv.f32(), block_rows,
                  mq.rows, mq.cols, bf16 ? nullptr : x.f32(), bf16 ? x.data<uint16_t>() : nullptr);
}

void fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
              const Tensor& b_scale_inv, Tensor& c, float alpha, float beta,
              bool fast_accumulation) {
  const char* op = "fp8_gemm";
  check_fp8(a, op, "a");
  check_fp8(b, op, "b");
  MEGATON_CHECK(!(a.dtype() == DType::F8E5M2 && b.dtype() == DType::F8E5M2),
                "{}: a and b cannot both be F8E5M2 (no E5M2 x E5M2 FP8 GEMM)", op);
  check_input(c, op, "c");
  MEGATON_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2 && a.dim(1) == b.dim(1) &&
                    c.dim(0) == a.dim(0) && c.dim(1) == b.dim(0),
                "{}: a {} [M, K], b {} [N, K], c {} [M, N] do not match", op, shape_str(a.shape()),
                shape_str(b.shape()), shape_str(c.shape()));
  const int64_t m = a.dim(0), n = b.dim(0), k = a.dim(1);
  MEGATON_CHECK(m % 16 == 0 && n % 16 == 0 && k % 16 == 0,
                "{}: M={} N={} K={} must be multiples of 16 (cuBLASLt FP8)", op, m, n, k);
  const int64_t a_layout = scale_layout(a_scale_inv, {m, k}, op, "a_scale_inv");
  const int64_t b_layout = scale_layout(b_scale_inv, {n, k}, op, "b_scale_inv");
  if (a_layout == 0 || b_layout == 0) {
    MEGATON_CHECK(a_layout == 0 && b_layout == 0,
                  "{}: a_scale_inv {} and b_scale_inv {} mix per-tensor and blockwise scales", op,
                  shape_str(a_scale_inv.shape()), shape_str(b_scale_inv.shape()));
  } else {
    MEGATON_CHECK(a_layout == 1 && k % kBlockCols == 0,
                  "{}: blockwise needs a in 1x128 blocks (a_scale_inv [{}, {}]) and K={} a "
                  "multiple of 128, got a_scale_inv {}",
                  op, m, k / kBlockCols, k, shape_str(a_scale_inv.shape()));
  }
  check_devices(op, {&a, &a_scale_inv, &b, &b_scale_inv, &c});
  MEGATON_CHECK(!fast_accumulation || a_layout == 0,
                "{}: fast accumulation is for per-tensor scales (cuBLASLt refuses it with block "
                "scaling)", op);
  MEGATON_CUDA_DISPATCH(
      a, cuda::fp8_gemm(a, a_scale_inv, b, b_scale_inv, c, alpha, beta, fast_accumulation));
  require_cpu(op, {&a});
  Tensor a32 = Tensor::empty({m, k}), b32 = Tensor::empty({n, k});
  cpu::dequantize(a.data<uint8_t>(), a.dtype() == DType::F8E4M3, a_scale_inv.f32(), a_layout, m, k,
                  a32.f32(), nullptr);
  cpu::dequantize(b.data<uint8_t>(), b.dtype() == DType::F8E4M3, b_scale_inv.f32(), b_layout, n, k,
                  b32.f32(), nullptr);
  if (c.dtype() == DType::F32) {
    gemm(a32, false, b32, true, c, alpha, beta);
    return;
  }
  // BF16 c: accumulate in fp32, round once; c is read only when beta != 0.
  Tensor c32 = beta == 0.0f ? Tensor::empty({m, n}) : c.to(DType::F32);
  gemm(a32, false, b32, true, c32, alpha, beta);
  cast(c32, c);
}

}  // namespace megaton::ops
