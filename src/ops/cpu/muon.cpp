// Muon's math (ops/muon.h): the name tables, the doors, which check the arguments and then
// run the CUDA implementation (ops/cuda/muon.h) for device tensors, and the CPU reference:
// Newton-Schulz in fp64 through OpenBLAS's dgemm, the QKV split as row copies. The
// elementwise ops (momentum, muon_apply, copy_columns) are in muon_update.cpp.
#include "ops/muon.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>

#include "core/error.h"
#include "ops/dispatch.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/muon.h"
#endif

namespace megaton::ops {
namespace {

constexpr const char* kCoefficientNames = "simple, quintic, polar_express, cans, aol, deepseekv4";

const char* device_name(Device d) { return d == Device::CUDA ? "CUDA" : "CPU"; }

// ---- Newton-Schulz, CPU reference ----

// Row-major fp64 GEMM: c = alpha op(a) op(b) + beta c, op(a) [m, k], op(b) [k, n], c [m, n].
void dgemm(const double* a, bool trans_a, const double* b, bool trans_b, double* c, int64_t m,
           int64_t n, int64_t k, double alpha, double beta) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, int(m), int(n), int(k), alpha, a,
              int(trans_a ? m : k), b, int(trans_b ? k : n), beta, c, int(n));
}

// Which matrix the iteration runs on (NsOptions::transpose): g^T when asked to, or
// automatically when rows > cols (EO's `transpose = x.size(-2) > x.size(-1)`), so that the
// Gram matrix X X^T is min(rows, cols) square.
bool iterate_on_transpose(int transpose, int64_t rows, int64_t cols) {
  return transpose == 1 || (transpose == -1 && rows > cols);
}

// Hands `values` (fp64) to the distributed mode's all-reduce as an F32 tensor of `shape`
// and widens the sums back into them.
void all_reduce_f64(const std::function<void(Tensor&)>& all_reduce, std::vector<double>& values,
                    const Shape& shape, const char* what) {
  Tensor t = Tensor::empty(shape);
  for (size_t i = 0; i < values.size(); ++i) t.f32()[i] = float(values[i]);
  all_reduce(t);
  MEGATON_CHECK(
      t.defined() && t.shape() == shape && t.dtype() == DType::F32 && t.device() == Device::CPU,
      "newton_schulz: the all-reduce of the {} left {} {}, expected F32 {} on the CPU", what,
      t.defined() ? shape_str(t.shape()) : "undefined", dtype_name(t.dtype()), shape_str(shape));
  for (size_t i = 0; i < values.size(); ++i) values[i] = double(t.f32()[i]);
}

// The batch g [batch, rows, cols] -> out (may be g). Each matrix iterates on X [m, n]:
// g itself, or g^T when `transpose`. The steps run outermost so that the distributed
// mode's all-reduce sees every matrix's Gram matrix of a step at once; each matrix's
// operations are those of the matrix alone.
void newton_schulz_cpu(const float* g, float* out, int64_t batch, int64_t rows, int64_t cols,
                       const std::vector<NsCoefficientSet>& per_step, double eps, bool transpose,
                       const std::function<void(Tensor&)>& all_reduce) {
  const int64_t m = transpose ? cols : rows, n = transpose ? rows : cols, per = rows * cols;
  std::vector<double> sum_sq(size_t(batch), 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < per; ++i)
      sum_sq[size_t(b)] += double(g[b * per + i]) * double(g[b * per + i]);
  if (all_reduce) all_reduce_f64(all_reduce, sum_sq, {batch}, "sums of squares");
  std::vector<std::vector<double>> x(size_t(batch), std::vector<double>(size_t(m * n)));
  for (int64_t b = 0; b < batch; ++b) {
    // torch's normalize: x / max(|x|, eps)
    const double norm = std::max(std::sqrt(sum_sq[size_t(b)]), eps);
    std::vector<double>& xb = x[size_t(b)];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        xb[size_t(transpose ? c * n + r : r * n + c)] = double(g[b * per + r * cols + c]) / norm;
  }
  std::vector<double> gram(size_t(batch * m * m)), poly(size_t(m * m)), next(size_t(m * n));
  for (const NsCoefficientSet& s : per_step) {
    const double a = s.a, b = s.b, c = s.c;
    for (int64_t k = 0; k < batch; ++k)  // A = X X^T
      dgemm(x[size_t(k)].data(), false, x[size_t(k)].data(), true, gram.data() + k * m * m, m, m, n,
            1.0, 0.0);
    if (all_reduce) all_reduce_f64(all_reduce, gram, {batch, m, m}, "Gram matrices");
    for (int64_t k = 0; k < batch; ++k) {
      const double* a_k = gram.data() + k * m * m;
      std::vector<double>& xk = x[size_t(k)];
      for (int64_t i = 0; i < m * m; ++i) poly[size_t(i)] = b * a_k[i];
      dgemm(a_k, false, a_k, false, poly.data(), m, m, m, c, 1.0);  // B = bA + cA^2
      for (size_t i = 0; i < next.size(); ++i) next[i] = a * xk[i];
      dgemm(poly.data(), false, xk.data(), false, next.data(), m, n, m, 1.0, 1.0);  // aX + B X
      std::swap(xk, next);
    }
  }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out[b * per + r * cols + c] =
            float(x[size_t(b)][size_t(transpose ? c * n + r : r * n + c)]);
}

// ---- QKV split ----

struct QkvLayout {
  int64_t groups, per_group, hidden;  // u is [groups * per_group, hidden]
};

QkvLayout check_qkv(const Tensor& u, const std::vector<int64_t>& split_shapes, const char* op) {
  MEGATON_CHECK(u.defined() && u.ndim() == 2, "{}: u must be an allocated 2-d tensor, got {}", op,
                u.defined() ? shape_str(u.shape()) : "undefined");
  MEGATON_CHECK(!split_shapes.empty(), "{}: no split shapes", op);
  int64_t per_group = 0;
  for (int64_t s : split_shapes) {
    MEGATON_CHECK(s > 0, "{}: split shape {} must be positive", op, s);
    per_group += s;
  }
  MEGATON_CHECK(u.dim(0) % per_group == 0,
                "{}: u {} has {} rows, not a multiple of the {} rows per query group", op,
                shape_str(u.shape()), u.dim(0), per_group);
  return {u.dim(0) / per_group, per_group, u.dim(1)};
}

void check_pieces(const Tensor& u, const std::vector<Tensor>& pieces,
                  const std::vector<int64_t>& split_shapes, const QkvLayout& l, const char* op) {
  MEGATON_CHECK(pieces.size() == split_shapes.size(), "{}: {} pieces for {} split shapes", op,
                pieces.size(), split_shapes.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Tensor& p = pieces[i];
    const Shape want{l.groups * split_shapes[i], l.hidden};
    MEGATON_CHECK(
        p.defined() && p.shape() == want && p.dtype() == u.dtype() && p.device() == u.device(),
        "{}: piece {} is {} {} on {}, expected {} {} on {}", op, i,
        p.defined() ? shape_str(p.shape()) : "undefined", dtype_name(p.dtype()),
        device_name(p.device()), shape_str(want), dtype_name(u.dtype()), device_name(u.device()));
  }
}

// Copies between u's [groups, per_group, hidden] view and the pieces, in either direction.
void copy_qkv_cpu(const Tensor& u, const std::vector<Tensor>& pieces,
                  const std::vector<int64_t>& split_shapes, const QkvLayout& l, bool to_pieces) {
  const size_t row_bytes = size_t(l.hidden) * dtype_size(u.dtype());
  auto* whole = static_cast<char*>(u.raw());
  int64_t at = 0;  // the piece's first row within a group
  for (size_t i = 0; i < pieces.size(); ++i) {
    auto* piece = static_cast<char*>(pieces[i].raw());
    const int64_t s = split_shapes[i];
    for (int64_t grp = 0; grp < l.groups; ++grp) {
      char* in_u = whole + size_t(grp * l.per_group + at) * row_bytes;
      char* in_piece = piece + size_t(grp * s) * row_bytes;
      if (to_pieces)
        std::memcpy(in_piece, in_u, size_t(s) * row_bytes);
      else
        std::memcpy(in_u, in_piece, size_t(s) * row_bytes);
    }
    at += s;
  }
}

// The split's door and dispatch (a void function, as MEGATON_CUDA_DISPATCH needs).
void split_qkv_into(const Tensor& u, const std::vector<int64_t>& split_shapes,
                    std::vector<Tensor>& pieces, const QkvLayout& l) {
  MEGATON_CUDA_DISPATCH(u, cuda::split_qkv_update(u, split_shapes, pieces));
  copy_qkv_cpu(u, pieces, split_shapes, l, true);
}

}  // namespace

// ---- names ----

NsCoefficients parse_ns_coefficients(const std::string& name) {
  if (name == "simple") return NsCoefficients::Simple;
  if (name == "quintic") return NsCoefficients::Quintic;
  if (name == "polar_express") return NsCoefficients::PolarExpress;
  if (name == "cans") return NsCoefficients::Cans;
  if (name == "aol") return NsCoefficients::Aol;
  if (name == "deepseekv4") return NsCoefficients::DeepseekV4;
  if (name == "custom")
    fail(
        "--muon-coefficient-type custom needs coefficient sets that Megatron never passes "
        "(Emerging-Optimizers raises on the first step); use one of {}",
        kCoefficientNames);
  if (name == "cubic5")
    fail(
        "--muon-coefficient-type cubic5 needs Emerging-Optimizers >= 0.4.0, Megatron pins "
        "v0.3.0; use one of {}",
        kCoefficientNames);
  fail("--muon-coefficient-type '{}' is not one of {}", name, kCoefficientNames);
}

const char* ns_coefficients_name(NsCoefficients set) {
  switch (set) {
    case NsCoefficients::Simple:
      return "simple";
    case NsCoefficients::Quintic:
      return "quintic";
    case NsCoefficients::PolarExpress:
      return "polar_express";
    case NsCoefficients::Cans:
      return "cans";
    case NsCoefficients::Aol:
      return "aol";
    case NsCoefficients::DeepseekV4:
      return "deepseekv4";
  }
  MEGATON_CHECK(false, "unknown NsCoefficients {}", int(set));
}

std::span<const NsCoefficientSet> ns_coefficient_table(NsCoefficients set) {
  switch (set) {
    case NsCoefficients::Simple:
      return kNsSimple;
    case NsCoefficients::Quintic:
      return kNsQuintic;
    case NsCoefficients::PolarExpress:
      return kNsPolarExpress;
    case NsCoefficients::Cans:
      return kNsCans;
    case NsCoefficients::Aol:
      return kNsAol;
    case NsCoefficients::DeepseekV4:
      return kNsDeepseekV4;
  }
  MEGATON_CHECK(false, "unknown NsCoefficients {}", int(set));
}

bool ns_coefficients_cycle(NsCoefficients set) {
  return set == NsCoefficients::Simple || set == NsCoefficients::Quintic ||
         set == NsCoefficients::Aol;
}

NsCoefficientSet ns_step_coefficients(NsCoefficients set, int step) {
  MEGATON_CHECK(step >= 0, "ns_step_coefficients: step {} must be >= 0", step);
  const std::span<const NsCoefficientSet> table = ns_coefficient_table(set);
  const size_t k = size_t(step);
  return ns_coefficients_cycle(set) ? table[k % table.size()]
                                    : table[std::min(k, table.size() - 1)];
}

MuonScaleMode parse_muon_scale_mode(const std::string& name) {
  if (name == "spectral") return MuonScaleMode::Spectral;
  if (name == "unit_rms_norm") return MuonScaleMode::UnitRmsNorm;
  if (name == "shape_scaling") return MuonScaleMode::ShapeScaling;
  fail("--muon-scale-mode '{}' is not one of spectral, unit_rms_norm, shape_scaling", name);
}

const char* muon_scale_mode_name(MuonScaleMode mode) {
  switch (mode) {
    case MuonScaleMode::Spectral:
      return "spectral";
    case MuonScaleMode::UnitRmsNorm:
      return "unit_rms_norm";
    case MuonScaleMode::ShapeScaling:
      return "shape_scaling";
  }
  MEGATON_CHECK(false, "unknown MuonScaleMode {}", int(mode));
}

// ---- the ops ----

void newton_schulz(const Tensor& g, Tensor& out, NsCoefficients coefficients, int steps,
                   float eps) {
  newton_schulz(g, out, coefficients, steps, NsOptions{}, eps);
}

void newton_schulz(const Tensor& g, Tensor& out, NsCoefficients coefficients, int steps,
                   const NsOptions& options, float eps) {
  MEGATON_CHECK(g.defined() && (g.ndim() == 2 || g.ndim() == 3),
                "newton_schulz: g must be an allocated [rows, cols] or [batch, rows, cols], got {}",
                g.defined() ? shape_str(g.shape()) : "undefined");
  const bool on_gpu = g.device() == Device::CUDA;
  MEGATON_CHECK(g.dtype() == DType::F32 || (on_gpu && g.dtype() == DType::BF16),
                "newton_schulz: g is {} on {}; the CPU takes F32, the GPU F32 or BF16",
                dtype_name(g.dtype()), device_name(g.device()));
  MEGATON_CHECK(out.defined() && out.shape() == g.shape() && out.dtype() == g.dtype() &&
                    out.device() == g.device(),
                "newton_schulz: out ({} {} on {}) must match g ({} {} on {})",
                out.defined() ? shape_str(out.shape()) : "undefined", dtype_name(out.dtype()),
                device_name(out.device()), shape_str(g.shape()), dtype_name(g.dtype()),
                device_name(g.device()));
  MEGATON_CHECK(steps >= 1, "newton_schulz: steps {} must be >= 1", steps);
  MEGATON_CHECK(eps > 0 && std::isfinite(eps), "newton_schulz: eps {} must be positive", eps);
  MEGATON_CHECK(options.transpose >= -1 && options.transpose <= 1,
                "newton_schulz: transpose {} must be -1 (automatic), 0 or 1", options.transpose);
  const int64_t batch = g.ndim() == 3 ? g.dim(0) : 1, rows = g.dim(-2), cols = g.dim(-1);
  if (batch == 0 || rows == 0 || cols == 0) return;
  MEGATON_CHECK(rows <= INT_MAX && cols <= INT_MAX,
                "newton_schulz: [{}, {}] exceeds the 32-bit BLAS sizes", rows, cols);
  std::vector<NsCoefficientSet> per_step;
  for (int k = 0; k < steps; ++k) per_step.push_back(ns_step_coefficients(coefficients, k));
  const bool transpose = iterate_on_transpose(options.transpose, rows, cols);
  MEGATON_CUDA_DISPATCH(g, cuda::newton_schulz(g, out, batch, rows, cols, per_step, eps, transpose,
                                               options.tf32, options.all_reduce));
  MEGATON_CHECK(g.device() == Device::CPU, "newton_schulz: no CUDA backend in this build");
  newton_schulz_cpu(g.f32(), out.f32(), batch, rows, cols, per_step, double(eps), transpose,
                    options.all_reduce);
}

double muon_scale_factor(int64_t rows, int64_t cols, MuonScaleMode mode) {
  MEGATON_CHECK(rows >= 1 && cols >= 1, "muon_scale_factor: shape [{}, {}] must be positive", rows,
                cols);
  const double ratio = double(rows) / double(cols);
  switch (mode) {
    case MuonScaleMode::Spectral:
      return std::sqrt(double(std::max(rows, cols)));
    case MuonScaleMode::UnitRmsNorm:
      return std::sqrt(ratio);
    case MuonScaleMode::ShapeScaling:
      return std::sqrt(std::max(1.0, ratio));
  }
  MEGATON_CHECK(false, "unknown MuonScaleMode {}", int(mode));
}

std::vector<int64_t> qkv_split_shapes(int64_t num_attention_heads, int64_t num_query_groups,
                                      int64_t kv_channels, bool attention_output_gate) {
  MEGATON_CHECK(num_attention_heads > 0 && num_query_groups > 0 && kv_channels > 0 &&
                    num_attention_heads % num_query_groups == 0,
                "qkv_split_shapes: {} heads in {} query groups of {} channels", num_attention_heads,
                num_query_groups, kv_channels);
  const int64_t q = num_attention_heads / num_query_groups * kv_channels;
  if (attention_output_gate) return {q, q, kv_channels, kv_channels};
  return {q, kv_channels, kv_channels};
}

std::vector<Tensor> split_qkv_update(const Tensor& u, const std::vector<int64_t>& split_shapes) {
  const QkvLayout l = check_qkv(u, split_shapes, "split_qkv_update");
  std::vector<Tensor> pieces;
  for (int64_t s : split_shapes)
    pieces.push_back(Tensor::empty({l.groups * s, l.hidden}, u.dtype(), u.device()));
  if (u.numel() > 0) split_qkv_into(u, split_shapes, pieces, l);
  return pieces;
}

void join_qkv_update(const std::vector<Tensor>& pieces, const std::vector<int64_t>& split_shapes,
                     Tensor& u) {
  const QkvLayout l = check_qkv(u, split_shapes, "join_qkv_update");
  check_pieces(u, pieces, split_shapes, l, "join_qkv_update");
  if (u.numel() == 0) return;
  MEGATON_CUDA_DISPATCH(u, cuda::join_qkv_update(pieces, split_shapes, u));
  copy_qkv_cpu(u, pieces, split_shapes, l, false);
}

}  // namespace megaton::ops
