// Muon's math (ops/muon.h) on the CPU. Newton-Schulz is checked against LAPACK's SVD
// (LAPACKE_dgesvd in fp64): g = U S V^T must become U p(S / ||g||_F) V^T, p the composition
// of the steps' scalar quintics, computed here from the coefficient tables as
// docs/research/muon.md 2.4 quotes them (typed again below, not read from the op).
// The momentum, the scale factors and the QKV split are checked against their formulas.
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/muon.h"

namespace megaton {
namespace {

using ops::NsCoefficients;
using testing::allclose;
using testing::poison;
using testing::randn;
using testing::rel_error;

// CPU vs CPU fp32 (../shared/CONVENTIONS.md). The op computes in fp64 and rounds once, the
// references here are fp64, so fp32 outputs differ from them by their last rounding.
constexpr double kAtol = 1e-6, kRtol = 5e-6, kRelFp32 = 1e-5;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

// ---- the coefficient sets, as docs/research/muon.md 2.4 quotes EO v0.3.0 ----

struct Coef {
  float a, b, c;
};
struct SetSpec {
  NsCoefficients set;
  const char* name;
  bool cycle;
  std::vector<Coef> table;
};
const std::vector<SetSpec>& specs() {
  static const std::vector<SetSpec> s = {
      {NsCoefficients::Simple, "simple", true, {{3.4445f, -4.7750f, 2.0315f}}},
      {NsCoefficients::Quintic,
       "quintic",
       true,
       {{4.0848f, -6.8946f, 2.9270f},
        {3.9505f, -6.3029f, 2.6377f},
        {3.7418f, -5.5913f, 2.3037f},
        {2.8769f, -3.1427f, 1.2046f},
        {2.8366f, -3.0525f, 1.2012f}}},
      {NsCoefficients::PolarExpress,
       "polar_express",
       false,
       {{8.2051f, -22.9019f, 16.4607f},
        {4.0664f, -2.8612f, 0.5184f},
        {3.9096f, -2.8234f, 0.5250f},
        {3.2856f, -2.4153f, 0.4853f},
        {2.2779f, -1.6198f, 0.3985f},
        {1.8726f, -1.2307f, 0.3585f},
        {1.8564f, -1.2132f, 0.3568f},
        {1.8750f, -1.2500f, 0.3750f}}},
      {NsCoefficients::Cans,
       "cans",
       false,
       {{8.4703f, -25.1081f, 18.6293f},
        {4.1828f, -3.1087f, 0.5806f},
        {3.9619f, -2.9541f, 0.5630f},
        {3.2866f, -2.4647f, 0.5074f},
        {2.2737f, -1.6447f, 0.4162f}}},
      {NsCoefficients::Aol,
       "aol",
       true,
       {{4.0098f, -7.0585f, 2.4635f},
        {3.4585f, -5.5479f, 2.5959f},
        {2.7573f, -3.2939f, 1.4254f},
        {2.7215f, -3.0494f, 1.3169f}}},
      // 8 x Keller Jordan's set, then 2 x (2, -1.5, 0.5).
      {NsCoefficients::DeepseekV4, "deepseekv4", false,
       [] {
         std::vector<Coef> t(8, Coef{3.4445f, -4.7750f, 2.0315f});
         t.insert(t.end(), 2, Coef{2.0f, -1.5f, 0.5f});
         return t;
       }()},
  };
  return s;
}
const SetSpec& spec(NsCoefficients set) {
  for (const SetSpec& s : specs())
    if (s.set == set) return s;
  throw std::runtime_error("no spec");
}

// EO's get_coefficient_iterator: "cycle" wraps to the first set, "repeat_last" keeps the last.
std::vector<Coef> schedule(NsCoefficients set, int steps, bool cycle) {
  const std::vector<Coef>& t = spec(set).table;
  std::vector<Coef> out;
  for (int k = 0; k < steps; ++k)
    out.push_back(cycle ? t[k % t.size()] : t[std::min<size_t>(k, t.size() - 1)]);
  return out;
}
std::vector<Coef> schedule(NsCoefficients set, int steps) {
  return schedule(set, steps, spec(set).cycle);
}

// What the iteration does to one normalised singular value x.
double scalar_map(const std::vector<Coef>& steps, double x) {
  for (const Coef& s : steps) x = s.a * x + s.b * x * x * x + s.c * x * x * x * x * x;
  return x;
}

// ---- fp64 linear algebra ----

struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;  // row-major
  double& at(int64_t r, int64_t c) { return v[size_t(r * cols + c)]; }
  double at(int64_t r, int64_t c) const { return v[size_t(r * cols + c)]; }
};

Matrix from_tensor(const Tensor& t, int64_t offset, int64_t rows, int64_t cols) {
  Matrix m{rows, cols, std::vector<double>(size_t(rows * cols))};
  for (int64_t i = 0; i < rows * cols; ++i) m.v[size_t(i)] = t.f32()[offset + i];
  return m;
}
Matrix from_tensor(const Tensor& t) { return from_tensor(t, 0, t.dim(0), t.dim(1)); }

double frobenius(const Matrix& m) {
  double s = 0;
  for (double x : m.v) s += x * x;
  return std::sqrt(s);
}
double rel_diff(const Matrix& a, const Matrix& b) {
  double num = 0;
  for (size_t i = 0; i < a.v.size(); ++i) num += (a.v[i] - b.v[i]) * (a.v[i] - b.v[i]);
  return std::sqrt(num) / frobenius(b);
}

// g = U diag(s) V^T, thin: U [m, r], V [n, r] (stored as Vt [r, n]), r = min(m, n).
struct Svd {
  Matrix u, vt;
  std::vector<double> s;
};
Svd svd(Matrix a) {
  const int64_t m = a.rows, n = a.cols, r = std::min(m, n);
  Svd out{{m, r, std::vector<double>(size_t(m * r))},
          {r, n, std::vector<double>(size_t(r * n))},
          std::vector<double>(size_t(r))};
  std::vector<double> superb(size_t(std::max<int64_t>(r, 2)));
  const lapack_int info = LAPACKE_dgesvd(
      LAPACK_ROW_MAJOR, 'S', 'S', lapack_int(m), lapack_int(n), a.v.data(), lapack_int(n),
      out.s.data(), out.u.v.data(), lapack_int(r), out.vt.v.data(), lapack_int(n), superb.data());
  if (info != 0) throw std::runtime_error("LAPACKE_dgesvd failed: " + std::to_string(info));
  return out;
}
// U diag(d) V^T.
Matrix compose(const Svd& f, const std::vector<double>& d) {
  Matrix out{f.u.rows, f.vt.cols, std::vector<double>(size_t(f.u.rows * f.vt.cols), 0.0)};
  for (int64_t i = 0; i < out.rows; ++i)
    for (size_t k = 0; k < d.size(); ++k) {
      const double w = f.u.at(i, int64_t(k)) * d[k];
      for (int64_t j = 0; j < out.cols; ++j) out.at(i, j) += w * f.vt.at(int64_t(k), j);
    }
  return out;
}
// u_k^T a v_k: a's singular values in the basis of f (exact when a = U diag V^T).
std::vector<double> project(const Svd& f, const Matrix& a) {
  std::vector<double> d(f.s.size(), 0.0);
  for (size_t k = 0; k < d.size(); ++k)
    for (int64_t i = 0; i < a.rows; ++i)
      for (int64_t j = 0; j < a.cols; ++j)
        d[k] += f.u.at(i, int64_t(k)) * a.at(i, j) * f.vt.at(int64_t(k), j);
  return d;
}

// A random [rows, cols] fp32 matrix with singular values `s` (r = min(rows, cols) of them):
// U, V from the SVD of a Gaussian matrix.
Tensor with_singular_values(int64_t rows, int64_t cols, const std::vector<double>& s,
                            uint64_t seed) {
  const Svd basis = svd(from_tensor(randn({rows, cols}, seed)));
  const Matrix m = compose(basis, s);
  Tensor t = Tensor::empty({rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i) t.f32()[i] = float(m.v[size_t(i)]);
  return t;
}
// r singular values evenly spaced over [lo, hi] (well-conditioned) or log-spaced
// (ill-conditioned: 1e-3 .. 1 is a condition number of 1e3).
std::vector<double> uniform_values(int64_t r, double lo, double hi) {
  std::vector<double> s;
  for (int64_t k = 0; k < r; ++k) s.push_back(lo + (hi - lo) * double(k) / double(r - 1));
  return s;
}
std::vector<double> log_values(int64_t r, double lo, double hi) {
  std::vector<double> s;
  for (int64_t k = 0; k < r; ++k)
    s.push_back(std::exp(std::log(lo) + (std::log(hi) - std::log(lo)) * double(k) / double(r - 1)));
  return s;
}

Tensor run_ns(const Tensor& g, NsCoefficients set, int steps) {
  Tensor out = Tensor::empty(g.shape());
  poison(out);
  ops::newton_schulz(g, out, set, steps);
  for (int64_t i = 0; i < out.numel(); ++i)
    if (!std::isfinite(out.f32()[i])) throw std::runtime_error("element not written or not finite");
  return out;
}

// The expected result: U p(s / ||g||_F) V^T from the SVD of g itself (fp32 values in fp64).
Matrix expected_ns(const Tensor& g, const std::vector<Coef>& steps) {
  const Matrix a = from_tensor(g);
  const double norm = frobenius(a);
  const Svd f = svd(a);
  std::vector<double> d;
  for (double s : f.s) d.push_back(scalar_map(steps, s / norm));
  return compose(f, d);
}

struct Shape2 {
  int64_t rows, cols;
};
const Shape2 kShapes[] = {{72, 40}, {40, 72}, {48, 48}};

// ---- Newton-Schulz ----

TEST(MuonOps, CoefficientTablesAndNames) {
  for (const SetSpec& s : specs()) {
    SCOPED_TRACE(s.name);
    const auto table = ops::ns_coefficient_table(s.set);
    ASSERT_EQ(table.size(), s.table.size());
    for (size_t k = 0; k < table.size(); ++k) {
      EXPECT_EQ(table[k].a, s.table[k].a);
      EXPECT_EQ(table[k].b, s.table[k].b);
      EXPECT_EQ(table[k].c, s.table[k].c);
    }
    EXPECT_EQ(ops::ns_coefficients_cycle(s.set), s.cycle);
    EXPECT_EQ(ops::parse_ns_coefficients(s.name), s.set);
    EXPECT_EQ(std::string(ops::ns_coefficients_name(s.set)), s.name);
    const std::vector<Coef> want = schedule(s.set, 23);
    for (int k = 0; k < 23; ++k) {
      const ops::NsCoefficientSet got = ops::ns_step_coefficients(s.set, k);
      EXPECT_TRUE(got.a == want[k].a && got.b == want[k].b && got.c == want[k].c) << "step " << k;
    }
  }
  for (const char* bad : {"custom", "cubic5", "Quintic", ""}) {
    try {
      ops::parse_ns_coefficients(bad);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--muon-coefficient-type"), std::string::npos);
    }
  }
  EXPECT_THROW(ops::ns_step_coefficients(NsCoefficients::Quintic, -1), InternalError);
}

// Every set on tall, wide and square matrices, well- and ill-conditioned: NS acts on the
// singular values alone, by the scalar map of its steps.
TEST(MuonOps, NewtonSchulzIsTheScalarMapOfTheSingularValues) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(seed_trace(seed));
  for (const SetSpec& s : specs())
    for (int steps : {1, 5, 8})
      for (const Shape2& sh : kShapes)
        for (bool ill : {false, true}) {
          SCOPED_TRACE(std::string(s.name) + " steps " + std::to_string(steps) + " " +
                       std::to_string(sh.rows) + "x" + std::to_string(sh.cols) +
                       (ill ? " ill-conditioned" : ""));
          const int64_t r = std::min(sh.rows, sh.cols);
          const Tensor g = with_singular_values(
              sh.rows, sh.cols, ill ? log_values(r, 1e-3, 1.0) : uniform_values(r, 0.05, 1.0),
              seed + uint64_t(sh.rows));
          const Tensor out = run_ns(g, s.set, steps);
          EXPECT_LE(rel_diff(from_tensor(out), expected_ns(g, schedule(s.set, steps))), kRelFp32);
        }
}

// The band the output's singular values lie in, for inputs whose normalised singular
// values x = s / ||g||_F lie in [0.01, 0.8] (a rank-1 matrix has x = 1; these have r = 40).
// The bounds are the scalar map's range over that interval (20001 log-spaced points in
// fp64, scripted from the tables above), widened by 1e-3: each set's guarantee at its
// usual step count. aol runs 4 steps: its tables are the 4 of flash-newton-schulz, and a
// fifth step (cycled to the first set, whose p(1) = -0.585) maps [0.01, 0.8] to
// [-0.959, 0.089]. Quintic at 6 steps does the same to [0.064, 0.165] (p_0(1) = 0.117).
TEST(MuonOps, NewtonSchulzSingularValueBands) {
  struct Band {
    NsCoefficients set;
    int steps;
    double lo, hi;
  };
  const Band bands[] = {
      {NsCoefficients::Simple, 5, 0.6808, 1.1354},
      {NsCoefficients::Quintic, 5, 0.9767, 1.0328},
      {NsCoefficients::Quintic, 10, 0.9767, 1.0268},
      {NsCoefficients::PolarExpress, 5, 0.8694, 1.1246},
      {NsCoefficients::PolarExpress, 8, 0.9990, 1.0010},
      {NsCoefficients::Cans, 5, 0.8833, 1.1209},
      {NsCoefficients::Aol, 4, 0.8648, 1.0855},
      {NsCoefficients::DeepseekV4, 5, 0.6808, 1.1354},
      {NsCoefficients::DeepseekV4, 10, 0.9990, 1.0016},
  };
  const uint64_t seed = testing::test_seed() + 1;
  SCOPED_TRACE(seed_trace(seed));
  for (const Band& b : bands) {
    double lo = INFINITY, hi = -INFINITY, worst_vectors = 0;
    for (const Shape2& sh : kShapes) {
      const int64_t r = std::min(sh.rows, sh.cols);
      const Tensor g = with_singular_values(sh.rows, sh.cols, uniform_values(r, 0.05, 1.0),
                                            seed + uint64_t(sh.cols));
      const Svd in = svd(from_tensor(g));
      const double norm =
          std::sqrt(std::inner_product(in.s.begin(), in.s.end(), in.s.begin(), 0.0));
      ASSERT_GE(in.s.back() / norm, 0.01);
      ASSERT_LE(in.s.front() / norm, 0.8);
      const Matrix out = from_tensor(run_ns(g, b.set, b.steps));
      // Its singular vectors are g's: out = U diag(s') V^T with s' read in g's basis.
      const std::vector<double> in_basis = project(in, out);
      worst_vectors = std::max(worst_vectors, rel_diff(compose(in, in_basis), out));
      for (double s : svd(out).s) {
        lo = std::min(lo, s);
        hi = std::max(hi, s);
      }
    }
    std::printf("%-14s %2d steps: singular values of NS(g) in [%.4f, %.4f], vectors %.1e\n",
                ops::ns_coefficients_name(b.set), b.steps, lo, hi, worst_vectors);
    EXPECT_LE(worst_vectors, kRelFp32) << ops::ns_coefficients_name(b.set);
    EXPECT_GE(lo, b.lo) << ops::ns_coefficients_name(b.set) << " " << b.steps;
    EXPECT_LE(hi, b.hi) << ops::ns_coefficients_name(b.set) << " " << b.steps;
  }
}

// Polar Express's last set (1.875, -1.25, 0.375) fixes 1 with p' = p'' = 0 there: 8 steps
// give U V^T for x >= 1e-3, and 10 steps for x >= 3e-4 (the ill-conditioned matrices reach
// x = 6e-4), to the fp32 rounding of the output.
TEST(MuonOps, PolarExpressReachesThePolarFactor) {
  const uint64_t seed = testing::test_seed() + 2;
  SCOPED_TRACE(seed_trace(seed));
  for (const Shape2& sh : kShapes)
    for (bool ill : {false, true}) {
      const int64_t r = std::min(sh.rows, sh.cols);
      const Tensor g = with_singular_values(
          sh.rows, sh.cols, ill ? log_values(r, 1e-3, 1.0) : uniform_values(r, 0.05, 1.0), seed);
      const Svd f = svd(from_tensor(g));
      const Matrix polar = compose(f, std::vector<double>(f.s.size(), 1.0));
      const double err =
          rel_diff(from_tensor(run_ns(g, NsCoefficients::PolarExpress, ill ? 10 : 8)), polar);
      std::printf("polar_express %dx%d%s: ||NS(g) - U V^T|| / ||U V^T|| = %.2e\n", int(sh.rows),
                  int(sh.cols), ill ? " ill-conditioned" : "", err);
      EXPECT_LE(err, kRelFp32);
    }
}

// NS(g^T) = NS(g)^T, NS(c g) = NS(g), and the batched form is the matrices one by one.
TEST(MuonOps, NewtonSchulzSymmetries) {
  const uint64_t seed = testing::test_seed() + 3;
  SCOPED_TRACE(seed_trace(seed));
  const Tensor g = randn({30, 18}, seed);
  Tensor gt = Tensor::empty({18, 30});
  for (int64_t i = 0; i < 30; ++i)
    for (int64_t j = 0; j < 18; ++j) gt.f32()[j * 30 + i] = g.f32()[i * 18 + j];
  const Tensor out = run_ns(g, NsCoefficients::Quintic, 5),
               out_t = run_ns(gt, NsCoefficients::Quintic, 5);
  Tensor back = Tensor::empty({30, 18});
  for (int64_t i = 0; i < 30; ++i)
    for (int64_t j = 0; j < 18; ++j) back.f32()[i * 18 + j] = out_t.f32()[j * 30 + i];
  EXPECT_TRUE(allclose(back, out, kAtol, kRtol));
  for (float c : {1e-3f, 37.5f}) {
    Tensor scaled = g.clone();
    for (int64_t i = 0; i < scaled.numel(); ++i) scaled.f32()[i] *= c;
    EXPECT_TRUE(allclose(run_ns(scaled, NsCoefficients::Quintic, 5), out, kAtol, kRtol)) << c;
  }
  // Batched: [3, 12, 20] against each matrix alone; in place (out = g) too.
  const Tensor batch = randn({3, 12, 20}, seed + 1);
  const Tensor out_b = run_ns(batch, NsCoefficients::PolarExpress, 6);
  for (int64_t b = 0; b < 3; ++b) {
    Tensor one = Tensor::empty({12, 20});
    std::copy(batch.f32() + b * 240, batch.f32() + (b + 1) * 240, one.f32());
    const Tensor alone = run_ns(one, NsCoefficients::PolarExpress, 6);
    for (int64_t i = 0; i < 240; ++i) EXPECT_EQ(out_b.f32()[b * 240 + i], alone.f32()[i]);
  }
  Tensor in_place = batch.clone();
  ops::newton_schulz(in_place, in_place, NsCoefficients::PolarExpress, 6);
  EXPECT_TRUE(allclose(in_place, out_b, 0, 0));
}

// The fp64 iteration written out, with the transpose of a tall matrix done explicitly.
Matrix direct_ns(Matrix g, const std::vector<Coef>& steps) {
  const bool tall = g.rows > g.cols;
  Matrix x{tall ? g.cols : g.rows, tall ? g.rows : g.cols, {}};
  x.v.resize(g.v.size());
  for (int64_t i = 0; i < g.rows; ++i)
    for (int64_t j = 0; j < g.cols; ++j) (tall ? x.at(j, i) : x.at(i, j)) = g.at(i, j);
  const double norm = frobenius(x);
  for (double& v : x.v) v /= norm;
  const int64_t m = x.rows, n = x.cols;
  for (const Coef& s : steps) {
    Matrix a{m, m, std::vector<double>(size_t(m * m), 0.0)}, b = a, next = x;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j)
        for (int64_t k = 0; k < n; ++k) a.at(i, j) += x.at(i, k) * x.at(j, k);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        b.at(i, j) = s.b * a.at(i, j);
        for (int64_t k = 0; k < m; ++k) b.at(i, j) += s.c * a.at(i, k) * a.at(k, j);
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        next.at(i, j) = s.a * x.at(i, j);
        for (int64_t k = 0; k < m; ++k) next.at(i, j) += b.at(i, k) * x.at(k, j);
      }
    x = next;
  }
  Matrix out{g.rows, g.cols, std::vector<double>(g.v.size())};
  for (int64_t i = 0; i < g.rows; ++i)
    for (int64_t j = 0; j < g.cols; ++j) out.at(i, j) = tall ? x.at(j, i) : x.at(i, j);
  return out;
}

// Past the table: quintic and aol start it again (quintic's 6th step is set 0), polar_express
// and deepseekv4 repeat the last row. Each is checked against the loop above with the rule
// written out, and told apart from the other rule.
TEST(MuonOps, CoefficientCyclingMatchesADirectLoop) {
  const uint64_t seed = testing::test_seed() + 4;
  SCOPED_TRACE(seed_trace(seed));
  struct Case {
    NsCoefficients set;
    int steps;
  };
  for (const Case c : {Case{NsCoefficients::Quintic, 6}, Case{NsCoefficients::Quintic, 7},
                       Case{NsCoefficients::Aol, 5}, Case{NsCoefficients::PolarExpress, 10},
                       Case{NsCoefficients::Cans, 7}}) {
    for (const Shape2& sh : {Shape2{14, 22}, Shape2{22, 14}}) {
      SCOPED_TRACE(std::string(ops::ns_coefficients_name(c.set)) + " " + std::to_string(c.steps) +
                   " steps, " + std::to_string(sh.rows) + "x" + std::to_string(sh.cols));
      const Tensor g = randn({sh.rows, sh.cols}, seed + uint64_t(c.steps));
      const Matrix out = from_tensor(run_ns(g, c.set, c.steps));
      const bool cycle = spec(c.set).cycle;
      EXPECT_LE(rel_diff(out, direct_ns(from_tensor(g), schedule(c.set, c.steps, cycle))),
                kRelFp32);
      EXPECT_GE(rel_diff(out, direct_ns(from_tensor(g), schedule(c.set, c.steps, !cycle))), 1e-2);
    }
  }
}

TEST(MuonOps, NewtonSchulzEdgeCasesAndErrors) {
  // A zero matrix stays zero (g / max(0, eps) = 0), with no NaN.
  Tensor zero = Tensor::zeros({4, 6});
  EXPECT_TRUE(allclose(run_ns(zero, NsCoefficients::Quintic, 5), zero, 0, 0));
  Tensor empty = Tensor::empty({0, 5}), empty_out = Tensor::empty({0, 5});
  ops::newton_schulz(empty, empty_out, NsCoefficients::Quintic, 5);
  const Tensor g = randn({4, 6}, testing::test_seed());
  Tensor out = Tensor::empty({4, 6});
  using ops::newton_schulz;
  EXPECT_THROW(newton_schulz(g, out, NsCoefficients::Quintic, 0), InternalError);
  EXPECT_THROW(newton_schulz(g, out, NsCoefficients::Quintic, 5, 0.0f), InternalError);
  Tensor wrong = Tensor::empty({6, 4});
  EXPECT_THROW(newton_schulz(g, wrong, NsCoefficients::Quintic, 5), InternalError);
  Tensor flat = randn({24}, 1), flat_out = Tensor::empty({24});
  EXPECT_THROW(newton_schulz(flat, flat_out, NsCoefficients::Quintic, 5), InternalError);
  Tensor four = randn({1, 2, 3, 4}, 1), four_out = Tensor::empty({1, 2, 3, 4});
  EXPECT_THROW(newton_schulz(four, four_out, NsCoefficients::Quintic, 5), InternalError);
  Tensor bf16 = g.to(DType::BF16), bf16_out = Tensor::empty({4, 6}, DType::BF16);
  EXPECT_THROW(newton_schulz(bf16, bf16_out, NsCoefficients::Quintic, 5), InternalError);
  Tensor undefined;
  EXPECT_THROW(newton_schulz(g, undefined, NsCoefficients::Quintic, 5), InternalError);
}

// ---- scale factors, momentum, QKV split ----

TEST(MuonOps, ScaleFactors) {
  using ops::MuonScaleMode;
  // [out, in] = [1024, 4096] and its transpose, and a square matrix.
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(1024, 4096, MuonScaleMode::Spectral), 64.0);
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(4096, 1024, MuonScaleMode::Spectral), 64.0);
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(1024, 4096, MuonScaleMode::UnitRmsNorm), 0.5);
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(4096, 1024, MuonScaleMode::UnitRmsNorm), 2.0);
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(1024, 4096, MuonScaleMode::ShapeScaling), 1.0);
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(4096, 1024, MuonScaleMode::ShapeScaling), 2.0);
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(3, 3, MuonScaleMode::Spectral), std::sqrt(3.0));
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(6, 4, MuonScaleMode::UnitRmsNorm), std::sqrt(1.5));
  EXPECT_DOUBLE_EQ(ops::muon_scale_factor(6, 4, MuonScaleMode::ShapeScaling), std::sqrt(1.5));
  EXPECT_THROW(ops::muon_scale_factor(0, 4, MuonScaleMode::Spectral), InternalError);
  for (auto [name, mode] : {std::pair{"spectral", MuonScaleMode::Spectral},
                            {"unit_rms_norm", MuonScaleMode::UnitRmsNorm},
                            {"shape_scaling", MuonScaleMode::ShapeScaling}}) {
    EXPECT_EQ(ops::parse_muon_scale_mode(name), mode);
    EXPECT_EQ(std::string(ops::muon_scale_mode_name(mode)), name);
  }
  try {
    ops::parse_muon_scale_mode("rms");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--muon-scale-mode"), std::string::npos);
  }
}

TEST(MuonOps, MomentumIsAnEmaAndNesterovLooksAhead) {
  const uint64_t seed = testing::test_seed() + 5;
  SCOPED_TRACE(seed_trace(seed));
  for (bool nesterov : {false, true})
    for (float beta : {0.9f, 0.95f}) {
      Tensor m = randn({7, 9}, seed), m0 = m.clone();
      const Tensor g = randn({7, 9}, seed + 1);
      Tensor update = Tensor::empty({7, 9});
      poison(update);
      ops::muon_momentum_update(m, g, beta, nesterov, update);
      Tensor want_m = Tensor::empty({7, 9}), want_u = Tensor::empty({7, 9});
      for (int64_t i = 0; i < g.numel(); ++i) {
        const double b = beta, mi = b * m0.f32()[i] + (1 - b) * g.f32()[i];
        want_m.f32()[i] = float(mi);
        want_u.f32()[i] = float(nesterov ? (1 - b) * g.f32()[i] + b * mi : mi);
      }
      EXPECT_TRUE(allclose(m, want_m, kAtol, kRtol));
      EXPECT_TRUE(allclose(update, want_u, kAtol, kRtol));
      // In place over the gradient.
      Tensor m2 = m0.clone(), g2 = g.clone();
      ops::muon_momentum_update(m2, g2, beta, nesterov, g2);
      EXPECT_TRUE(allclose(m2, m, 0, 0));
      EXPECT_TRUE(allclose(g2, update, 0, 0));
    }
  Tensor m = randn({3}, 1), g = randn({3}, 2), u = Tensor::empty({3});
  EXPECT_THROW(ops::muon_momentum_update(m, g, 1.5f, false, u), InternalError);
  EXPECT_THROW(ops::muon_momentum_update(m, g, 0.9f, true, m), InternalError);
  Tensor short_u = Tensor::empty({2});
  EXPECT_THROW(ops::muon_momentum_update(m, g, 0.9f, false, short_u), InternalError);
}

TEST(MuonOps, QkvSplitAndJoin) {
  EXPECT_EQ(ops::qkv_split_shapes(8, 2, 4), (std::vector<int64_t>{16, 4, 4}));
  EXPECT_EQ(ops::qkv_split_shapes(8, 2, 4, true), (std::vector<int64_t>{16, 16, 4, 4}));
  EXPECT_THROW(ops::qkv_split_shapes(8, 3, 4), InternalError);
  const uint64_t seed = testing::test_seed() + 6;
  SCOPED_TRACE(seed_trace(seed));
  for (bool gate : {false, true}) {
    const std::vector<int64_t> shapes = ops::qkv_split_shapes(8, 2, 4, gate);
    const int64_t per_group = gate ? 40 : 24, groups = 2, h = 6;
    const Tensor u = randn({groups * per_group, h}, seed);
    const std::vector<Tensor> pieces = ops::split_qkv_update(u, shapes);
    ASSERT_EQ(pieces.size(), shapes.size());
    int64_t at = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      ASSERT_EQ(pieces[i].shape(), (Shape{groups * shapes[i], h}));
      for (int64_t grp = 0; grp < groups; ++grp)
        for (int64_t r = 0; r < shapes[i]; ++r)
          for (int64_t c = 0; c < h; ++c)
            EXPECT_EQ(pieces[i].f32()[(grp * shapes[i] + r) * h + c],
                      u.f32()[(grp * per_group + at + r) * h + c]);
      at += shapes[i];
    }
    Tensor joined = Tensor::empty(u.shape());
    poison(joined);
    ops::join_qkv_update(pieces, shapes, joined);
    EXPECT_TRUE(allclose(joined, u, 0, 0));
  }
  const std::vector<int64_t> shapes{16, 4, 4};
  EXPECT_THROW(ops::split_qkv_update(randn({47, 6}, 1), shapes), InternalError);
  Tensor u = randn({48, 6}, 1);
  std::vector<Tensor> pieces = ops::split_qkv_update(u, shapes);
  pieces[1] = Tensor::empty({8, 5});
  EXPECT_THROW(ops::join_qkv_update(pieces, shapes, u), InternalError);
}

}  // namespace
}  // namespace megaton
