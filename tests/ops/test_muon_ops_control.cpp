// Muon's ops for the optimizer step (ops/muon.h) on the CPU: the momentum with a control
// tensor against the plain op, muon_apply against its closed form, Newton-Schulz's options
// (the forced transpose, the distributed mode split over two threads that sum their Gram
// matrices through the callback) against the plain iteration, and copy_columns.
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/muon.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using ops::NsCoefficients;
using ops::NsOptions;
using testing::allclose;
using testing::poison;
using testing::randn;

constexpr double kAtol = 1e-6, kRtol = 5e-6;

Tensor transposed(const Tensor& t) {
  const int64_t r = t.dim(0), c = t.dim(1);
  Tensor out = Tensor::empty({c, r});
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) out.f32()[j * r + i] = t.f32()[i * c + j];
  return out;
}

Tensor run_ns(const Tensor& g, NsCoefficients set, int steps, const NsOptions& options) {
  Tensor out = Tensor::empty(g.shape());
  poison(out);
  ops::newton_schulz(g, out, set, steps, options);
  return out;
}

// ---- momentum with a control tensor ----

TEST(MuonOpsControl, MomentumWithUnitControlIsThePlainOp) {
  const uint64_t seed = testing::test_seed() + 10;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (bool nesterov : {false, true}) {
    const Tensor m0 = randn({6, 11}, seed), g = randn({6, 11}, seed + 1);
    Tensor m_plain = m0.clone(), u_plain = Tensor::empty({6, 11});
    ops::muon_momentum_update(m_plain, g, 0.9f, nesterov, u_plain);
    Tensor m = m0.clone(), u = Tensor::empty({6, 11});
    poison(u);
    ops::muon_momentum_update(m, g, 0.9f, nesterov, u, testing::step_control(0.1f, 1.0f, false));
    EXPECT_TRUE(testing::bytes_equal(m, m_plain));
    EXPECT_TRUE(testing::bytes_equal(u, u_plain));
    // The momentum moved: the comparison above is not between two untouched tensors.
    EXPECT_FALSE(testing::bytes_equal(m, m0));
  }
}

TEST(MuonOpsControl, MomentumScalesTheGradAndTakesBf16) {
  const uint64_t seed = testing::test_seed() + 11;
  SCOPED_TRACE(testing::seed_trace(seed));
  const float scale = 0.37f, beta = 0.95f;
  for (bool nesterov : {false, true})
    for (DType grad_dtype : {DType::F32, DType::BF16})
      for (DType update_dtype : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(std::string(dtype_name(grad_dtype)) + " grad, " +
                     std::string(dtype_name(update_dtype)) + " update" +
                     (nesterov ? ", nesterov" : ""));
        const Tensor m0 = randn({5, 8}, seed);
        // A flat grad of the same numel (a piece of the grad buffer) and a 2-d update.
        const Tensor g = randn({40}, seed + 1).to(grad_dtype);
        Tensor m = m0.clone(), u = Tensor::empty({5, 8}, update_dtype);
        poison(u);
        ops::muon_momentum_update(m, g, beta, nesterov, u,
                                  testing::step_control(0.1f, scale, false));
        // Closed form (docs/research/muon.md 2.2) in fp64 on the fp32 product grad * scale.
        Tensor want_m = Tensor::empty({5, 8}), want_u = Tensor::empty({5, 8});
        for (int64_t i = 0; i < 40; ++i) {
          const double gi = double(float(g.item(i) * scale)), b = beta;
          const double mi = b * m0.f32()[i] + (1 - b) * gi;
          want_m.f32()[i] = float(mi);
          want_u.f32()[i] = float(nesterov ? (1 - b) * gi + b * mi : mi);
        }
        EXPECT_TRUE(allclose(m, want_m, kAtol, kRtol));
        if (update_dtype == DType::F32) {
          EXPECT_TRUE(allclose(u, want_u, kAtol, kRtol));
        } else {
          EXPECT_TRUE(allclose(u, want_u, 1e-5, 1e-2));
          // The BF16 update is the F32 one rounded to nearest even.
          Tensor m_f32 = m0.clone(), u_f32 = Tensor::empty({5, 8});
          ops::muon_momentum_update(m_f32, g, beta, nesterov, u_f32,
                                    testing::step_control(0.1f, scale, false));
          EXPECT_TRUE(testing::bytes_equal(u, u_f32.to(DType::BF16)));
        }
      }
}

TEST(MuonOpsControl, MomentumSkipKeepsTheMomentumAndZerosTheUpdate) {
  const uint64_t seed = testing::test_seed() + 12;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (DType update_dtype : {DType::F32, DType::BF16}) {
    const Tensor m0 = randn({4, 9}, seed), g = randn({4, 9}, seed + 1);
    Tensor m = m0.clone(), u = Tensor::empty({4, 9}, update_dtype);
    poison(u);
    ops::muon_momentum_update(m, g, 0.9f, true, u, testing::step_control(0.1f, 0.5f, true));
    EXPECT_TRUE(testing::bytes_equal(m, m0));
    EXPECT_TRUE(testing::bytes_equal(u, Tensor::zeros({4, 9}, update_dtype)));
  }
}

TEST(MuonOpsControl, MomentumInPlaceAndErrors) {
  const uint64_t seed = testing::test_seed() + 13;
  const Tensor m0 = randn({3, 7}, seed), g0 = randn({3, 7}, seed + 1).to(DType::BF16);
  const Tensor control = testing::step_control(0.1f, 0.25f, false);
  Tensor m = m0.clone(), u = Tensor::empty({3, 7}, DType::BF16);
  ops::muon_momentum_update(m, g0, 0.9f, true, u, control);
  // The update written over the BF16 grad itself.
  Tensor m2 = m0.clone(), g2 = g0.clone();
  ops::muon_momentum_update(m2, g2, 0.9f, true, g2, control);
  EXPECT_TRUE(testing::bytes_equal(m2, m));
  EXPECT_TRUE(testing::bytes_equal(g2, u));
  using ops::muon_momentum_update;
  Tensor short_u = Tensor::empty({20});
  EXPECT_THROW(muon_momentum_update(m, g0, 0.9f, false, short_u, control), InternalError);
  EXPECT_THROW(muon_momentum_update(m, g0, 0.9f, false, m, control), InternalError);
  Tensor f16_u = Tensor::empty({3, 7}, DType::F16);
  EXPECT_THROW(muon_momentum_update(m, g0, 0.9f, false, f16_u, control), InternalError);
  // A BF16 update over an F32 grad's memory.
  Tensor f32_g = randn({3, 7}, 1);
  Tensor bf16_over_f32 = Tensor::borrow(f32_g.raw(), {3, 7}, DType::BF16, Device::CPU);
  EXPECT_THROW(muon_momentum_update(m, f32_g, 0.9f, false, bf16_over_f32, control), InternalError);
  const Tensor short_control = Tensor::zeros({ops::kAdamControlSize - 1});
  EXPECT_THROW(muon_momentum_update(m, g0, 0.9f, false, u, short_control), InternalError);
  EXPECT_THROW(muon_momentum_update(m, g0, 1.5f, false, u, control), InternalError);
}

// ---- muon_apply ----

TEST(MuonOpsControl, ApplyIsDecayThenTheScaledUpdate) {
  const uint64_t seed = testing::test_seed() + 14;
  SCOPED_TRACE(testing::seed_trace(seed));
  const float lr = 0.02f;
  const std::vector<Shape> shapes = {{6, 10}, {12, 5}, {7, 7}, {3, 4}};
  const std::vector<float> wds = {0.1f, 0.0f, 0.05f, 0.1f}, scales = {3.1f, 0.2f, 1.0f, 2.5f};
  const std::vector<DType> update_dtypes = {DType::F32, DType::BF16, DType::F32, DType::BF16};
  const std::vector<DType> copy_dtypes = {DType::BF16, DType::F16, DType::F32, DType::BF16};
  std::vector<Tensor> mains, mains0, updates, copies;
  for (size_t i = 0; i < shapes.size(); ++i) {
    mains.push_back(randn(shapes[i], seed + i));
    mains0.push_back(mains.back().clone());
    // A flat update of the same numel: only the numel has to agree.
    updates.push_back(randn({mains.back().numel()}, seed + 100 + i).to(update_dtypes[i]));
    if (i == 2) {
      copies.emplace_back();  // no copy
    } else {
      copies.push_back(Tensor::empty(shapes[i], copy_dtypes[i]));
      poison(copies.back());
    }
  }
  // A skipped step writes nothing.
  ops::muon_apply(mains, updates, copies, wds, scales, testing::step_control(lr, 1.0f, true));
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_TRUE(testing::bytes_equal(mains[i], mains0[i]));
    if (copies[i].defined()) {
      for (int64_t j = 0; j < copies[i].numel(); ++j) ASSERT_TRUE(std::isnan(copies[i].item(j)));
    }
  }
  // grad_scale is not the update's: 7 there changes nothing.
  ops::muon_apply(mains, updates, copies, wds, scales, testing::step_control(lr, 7.0f, false));
  for (size_t i = 0; i < shapes.size(); ++i) {
    SCOPED_TRACE("entry " + std::to_string(i));
    Tensor want = Tensor::empty(shapes[i]);
    for (int64_t j = 0; j < want.numel(); ++j)
      want.f32()[j] = float(double(mains0[i].f32()[j]) * (1.0 - double(lr) * wds[i]) -
                            double(lr) * scales[i] * double(updates[i].item(j)));
    EXPECT_TRUE(allclose(mains[i], want, kAtol, kRtol));
    if (copies[i].defined()) {
      EXPECT_TRUE(testing::bytes_equal(copies[i], mains[i].to(copy_dtypes[i])));
    }
  }
}

TEST(MuonOpsControl, ApplyChecksEverythingFirst) {
  const uint64_t seed = testing::test_seed() + 15;
  std::vector<Tensor> mains{randn({4, 4}, seed), randn({2, 3}, seed + 1)};
  const std::vector<Tensor> before{mains[0].clone(), mains[1].clone()};
  std::vector<Tensor> updates{randn({4, 4}, seed + 2), randn({2, 3}, seed + 3)};
  std::vector<Tensor> copies(2);
  const Tensor control = testing::step_control(0.1f, 1.0f, false);
  using ops::muon_apply;
  EXPECT_THROW(muon_apply(mains, updates, copies, {0.1f}, {1.0f, 1.0f}, control), InternalError);
  std::vector<Tensor> bad_updates{updates[0], randn({7}, 1)};  // the second entry is wrong
  EXPECT_THROW(muon_apply(mains, bad_updates, copies, {0.1f, 0.1f}, {1.0f, 1.0f}, control),
               InternalError);
  std::vector<Tensor> bad_copies{Tensor(), Tensor::empty({2, 3}, DType::I32)};
  EXPECT_THROW(muon_apply(mains, updates, bad_copies, {0.1f, 0.1f}, {1.0f, 1.0f}, control),
               InternalError);
  const Tensor bad_control = Tensor::zeros({ops::kAdamControlSize}, DType::BF16);
  EXPECT_THROW(muon_apply(mains, updates, copies, {0.1f, 0.1f}, {1.0f, 1.0f}, bad_control),
               InternalError);
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(testing::bytes_equal(mains[i], before[i]));
}

// ---- Newton-Schulz options ----

// transpose = 1 on a wide matrix runs on g^T: the same iteration as NS(g^T) without a
// transpose, transposed back, and NS(g) in exact arithmetic. transpose = 0 on a tall one
// likewise.
TEST(MuonOpsControl, ForcedTransposeIsTheIterationOnTheTranspose) {
  const uint64_t seed = testing::test_seed() + 16;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{20, 36}, {36, 20}})
    for (int transpose : {0, 1}) {
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " transpose " +
                   std::to_string(transpose));
      const Tensor g = randn({rows, cols}, seed + uint64_t(rows));
      NsOptions forced;
      forced.transpose = transpose;
      const Tensor out = run_ns(g, NsCoefficients::Quintic, 5, forced);
      NsOptions other;
      other.transpose = 1 - transpose;
      const Tensor via_t = transposed(run_ns(transposed(g), NsCoefficients::Quintic, 5, other));
      EXPECT_TRUE(testing::bytes_equal(out, via_t));
      const Tensor plain = run_ns(g, NsCoefficients::Quintic, 5, NsOptions{});
      EXPECT_LE(testing::rel_error(out, plain), 1e-5);
    }
  NsOptions bad;
  bad.transpose = 2;
  const Tensor g = randn({4, 6}, seed);
  Tensor out = Tensor::empty({4, 6});
  EXPECT_THROW(ops::newton_schulz(g, out, NsCoefficients::Quintic, 5, bad), InternalError);
}

// Two "ranks" in two threads, each with a column block of the iterated X; the callback
// sums their tensors through a barrier (rank 0's plus rank 1's, the same on both).
class TwoRanks {
 public:
  std::function<void(Tensor&)> all_reduce(int rank) {
    return [this, rank](Tensor& t) {
      ++calls_[rank];
      slots_[rank].assign(t.f32(), t.f32() + t.numel());  // copies: no pointer outlives a call
      barrier_.arrive_and_wait();
      std::vector<float> sum(slots_[0].size());
      const bool same_size = slots_[0].size() == slots_[1].size();
      for (size_t i = 0; same_size && i < sum.size(); ++i) sum[i] = slots_[0][i] + slots_[1][i];
      barrier_.arrive_and_wait();  // both have read both slots
      if (!same_size) throw std::runtime_error("the ranks' tensors differ in size");
      std::copy(sum.begin(), sum.end(), t.f32());
    };
  }
  // Runs f(rank) on two threads; rethrows the first failure.
  void run(const std::function<void(int)>& f) {
    std::exception_ptr errors[2];
    auto body = [&](int rank) {
      try {
        f(rank);
      } catch (...) {
        errors[rank] = std::current_exception();
        barrier_.arrive_and_drop();  // the other rank is not left waiting
      }
    };
    std::thread t0(body, 0), t1(body, 1);
    t0.join();
    t1.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  int calls(int rank) const { return calls_[rank]; }

 private:
  std::barrier<> barrier_{2};
  std::vector<float> slots_[2];
  int calls_[2] = {0, 0};
};

// Columns [c0, c0 + n) of every matrix of g [batch, rows, cols] (or rows when by_rows).
Tensor block(const Tensor& g, int64_t start, int64_t count, bool by_rows) {
  const int64_t batch = g.dim(0), rows = g.dim(1), cols = g.dim(2);
  Tensor out = Tensor::empty({batch, by_rows ? count : rows, by_rows ? cols : count});
  int64_t at = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        if (by_rows ? (r >= start && r < start + count) : (c >= start && c < start + count))
          out.f32()[at++] = g.f32()[(b * rows + r) * cols + c];
  return out;
}

// EO's distributed mode: the two ranks' results, side by side, are the whole NS. Unequal
// blocks; transpose 0 splits g's columns (a column-parallel weight's X), transpose 1 its
// rows (X = g^T); two matrices per rank check the per-matrix sums.
TEST(MuonOpsControl, DistributedNewtonSchulzOverTwoRanksIsTheWholeNs) {
  const uint64_t seed = testing::test_seed() + 17;
  SCOPED_TRACE(testing::seed_trace(seed));
  const int steps = 5;
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{18, 40}, {40, 18}})
    for (int transpose : {0, 1}) {
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " transpose " +
                   std::to_string(transpose));
      const Tensor g = randn({2, rows, cols}, seed + uint64_t(rows + transpose));
      NsOptions whole_options;
      whole_options.transpose = transpose;
      const Tensor whole = run_ns(g, NsCoefficients::Quintic, steps, whole_options);
      const bool by_rows = transpose == 1;
      const int64_t split = (by_rows ? rows : cols) * 2 / 5;  // unequal blocks
      const int64_t starts[2] = {0, split};
      const int64_t counts[2] = {split, (by_rows ? rows : cols) - split};
      TwoRanks ranks;
      Tensor outs[2];
      ranks.run([&](int rank) {
        NsOptions options;
        options.transpose = transpose;
        options.all_reduce = ranks.all_reduce(rank);
        outs[rank] = run_ns(block(g, starts[rank], counts[rank], by_rows), NsCoefficients::Quintic,
                            steps, options);
      });
      EXPECT_EQ(ranks.calls(0), 1 + steps);
      EXPECT_EQ(ranks.calls(1), 1 + steps);
      for (int rank = 0; rank < 2; ++rank) {
        const Tensor want = block(whole, starts[rank], counts[rank], by_rows);
        // The Gram matrices pass through fp32 (each rank's part rounded, then summed), the
        // whole NS keeps fp64: measured 2e-7 relative on these shapes.
        const double rel = testing::rel_error(outs[rank], want);
        std::printf("  %dx%d transpose %d rank %d: ||split - whole|| / ||whole|| = %.2e\n",
                    int(rows), int(cols), transpose, rank, rel);
        EXPECT_LE(rel, 1e-5) << "rank " << rank;
      }
    }
}

TEST(MuonOpsControl, DistributedNewtonSchulzOneRankAndErrors) {
  const uint64_t seed = testing::test_seed() + 18;
  const Tensor g = randn({3, 12, 20}, seed);
  std::vector<Shape> seen;
  NsOptions identity;
  identity.all_reduce = [&seen](Tensor& t) { seen.push_back(t.shape()); };
  const Tensor out = run_ns(g, NsCoefficients::PolarExpress, 4, identity);
  ASSERT_EQ(seen.size(), 5u);
  EXPECT_EQ(seen[0], (Shape{3}));
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_EQ(seen[i], (Shape{3, 12, 12}));
  EXPECT_LE(testing::rel_error(out, run_ns(g, NsCoefficients::PolarExpress, 4, NsOptions{})), 1e-5);
  // A tall matrix iterates on g^T: its Gram matrices are cols x cols.
  seen.clear();
  run_ns(randn({20, 12}, seed), NsCoefficients::Quintic, 1, identity);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], (Shape{1, 12, 12}));
  NsOptions reshaping;
  reshaping.all_reduce = [](Tensor& t) { t = Tensor::zeros({t.numel() + 1}); };
  Tensor out2 = Tensor::empty(g.shape());
  EXPECT_THROW(ops::newton_schulz(g, out2, NsCoefficients::Quintic, 5, reshaping), InternalError);
}

// ---- copy_columns ----

TEST(MuonOpsControl, CopyColumnsGathersColumnSlices) {
  const uint64_t seed = testing::test_seed() + 19;
  SCOPED_TRACE(testing::seed_trace(seed));
  // A row-parallel weight [5, 12] in three slices [5, 4], gathered as [3, 5, 4].
  const Tensor whole = randn({5, 12}, seed);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor src = whole.to(dtype);
    std::vector<Tensor> slices;
    for (int64_t s = 0; s < 3; ++s) {
      slices.push_back(Tensor::empty({5, 4}, dtype));
      ops::copy_columns(src, 4 * s, slices.back(), 0, 4);
    }
    Tensor back = Tensor::empty({5, 12}, dtype);
    poison(back);
    for (int64_t s = 0; s < 3; ++s) ops::copy_columns(slices[size_t(s)], 0, back, 4 * s, 4);
    EXPECT_TRUE(testing::bytes_equal(back, src));
    // A block in the middle leaves the rest as it was.
    Tensor partial = Tensor::empty({5, 7}, dtype);
    poison(partial);
    ops::copy_columns(src, 3, partial, 2, 4);
    for (int64_t r = 0; r < 5; ++r)
      for (int64_t c = 0; c < 7; ++c) {
        const float got = partial.item(r * 7 + c);
        if (c >= 2 && c < 6)
          EXPECT_EQ(got, src.item(r * 12 + c + 1)) << r << ", " << c;
        else
          EXPECT_TRUE(std::isnan(got)) << r << ", " << c;
      }
  }
  // Disjoint ranges of one tensor.
  Tensor t = randn({3, 8}, seed + 1);
  const Tensor t0 = t.clone();
  ops::copy_columns(t, 0, t, 5, 3);
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < 8; ++c)
      EXPECT_EQ(t.f32()[r * 8 + c], t0.f32()[r * 8 + (c >= 5 ? c - 5 : c)]);
  using ops::copy_columns;
  Tensor dst = Tensor::empty({5, 4});
  EXPECT_THROW(copy_columns(whole, 10, dst, 0, 4), InternalError);
  EXPECT_THROW(copy_columns(whole, -1, dst, 0, 2), InternalError);
  EXPECT_THROW(copy_columns(whole, 0, dst, 1, 4), InternalError);
  Tensor wrong_rows = Tensor::empty({4, 4});
  EXPECT_THROW(copy_columns(whole, 0, wrong_rows, 0, 4), InternalError);
  Tensor wrong_dtype = Tensor::empty({5, 4}, DType::BF16);
  EXPECT_THROW(copy_columns(whole, 0, wrong_dtype, 0, 4), InternalError);
  EXPECT_THROW(copy_columns(t, 0, t, 2, 3), InternalError);  // overlapping ranges
  copy_columns(whole, 12, dst, 4, 0);                        // nothing, at the ends
}

}  // namespace
}  // namespace megaton
