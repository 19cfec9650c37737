// Mamba-2's selective scan (ops/ssm.h) on the CPU: the chunked SSD form against the plain
// recurrence for every chunk size (partial last chunks, one-token sequences, packed
// documents), packed documents against separate runs, the generation step against the
// forward, and the backward against finite differences and against the recurrence's
// reverse mode. The convolution and the gated RMSNorm: test_ssm_conv_norm.cpp.
#include <cmath>
#include <functional>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/ssm.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;

struct SsdInputs {
  Tensor x, dt, A_log, B, C, D, dt_bias;
};

// Random inputs with decays exp(delta A) around 0.8 per token, so that states carry across
// many chunks; delta = softplus(dt + dt_bias) around 0.7.
SsdInputs make_inputs(const ops::SsdDims& d, uint64_t seed) {
  const int64_t rows = d.batch * d.seq;
  SsdInputs in{randn({rows, d.nheads * d.head_dim}, seed),
               randn({rows, d.nheads}, seed + 1, 0.5f),
               randn({d.nheads}, seed + 2, 0.3f),
               randn({rows, d.ngroups * d.state_dim}, seed + 3),
               randn({rows, d.ngroups * d.state_dim}, seed + 4),
               randn({d.nheads}, seed + 5),
               randn({d.nheads}, seed + 6, 0.3f)};
  for (int64_t h = 0; h < d.nheads; ++h) in.A_log.f32()[h] += std::log(0.3f);
  return in;
}

ops::SsdDims dims_of(int64_t batch, int64_t seq, int64_t nheads, int64_t ngroups,
                     int64_t chunk_size, int64_t head_dim = 3, int64_t state_dim = 5) {
  ops::SsdDims d;
  d.batch = batch;
  d.seq = seq;
  d.nheads = nheads;
  d.head_dim = head_dim;
  d.ngroups = ngroups;
  d.state_dim = state_dim;
  d.chunk_size = chunk_size;
  return d;
}

// position_ids of documents with the given lengths per sample; a sample's first document
// may start at `first_position` (a document continued from before the sample).
Tensor positions(const std::vector<std::vector<int>>& lengths, int first_position = 0) {
  std::vector<int32_t> p;
  for (const auto& sample : lengths)
    for (size_t i = 0; i < sample.size(); ++i)
      for (int k = 0; k < sample[i]; ++k) p.push_back((i == 0 ? first_position : 0) + k);
  return Tensor::from_i32({int64_t(p.size())}, p);
}

// Rows [start, start + count) of a [R, C] tensor, copied.
Tensor rows_of(const Tensor& t, int64_t start, int64_t count) {
  return t.rows(start, count).clone();
}

// The `row`th row of sample b at step s, for each sample: [batch, C].
Tensor step_rows(const Tensor& t, int64_t batch, int64_t seq, int64_t s) {
  Tensor out = Tensor::empty({batch, t.dim(1)});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < t.dim(1); ++c)
      out.f32()[b * t.dim(1) + c] = t.f32()[(b * seq + s) * t.dim(1) + c];
  return out;
}

struct Forward {
  Tensor y, state;
};

Forward run_forward(const SsdInputs& in, const ops::SsdDims& d, const Tensor& pos, bool recurrent) {
  Forward f{Tensor::empty(in.x.shape()),
            Tensor::empty({d.batch, d.nheads, d.head_dim, d.state_dim})};
  testing::poison(f.y);
  testing::poison(f.state);
  if (recurrent)
    ops::ssd_forward_recurrent(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, f.y, pos,
                               &f.state);
  else
    ops::ssd_forward(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, f.y, pos, &f.state);
  return f;
}

TEST(Ssd, ChunkedEqualsRecurrence) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Sample 1's first document continues from before the sample; one-token documents, and
  // boundaries on and off the chunk boundaries.
  const Tensor pos = positions({{5, 1, 4, 9}, {6, 1, 8, 4}});
  const Tensor pos_continued = positions({{7, 12}, {1, 1, 17}}, 3);
  for (auto [nheads, ngroups] : {std::pair<int64_t, int64_t>{4, 1}, {6, 2}})
    for (int64_t chunk : {1, 3, 4, 8, 16}) {
      const ops::SsdDims d = dims_of(2, 19, nheads, ngroups, chunk);
      const SsdInputs in = make_inputs(d, seed + uint64_t(chunk));
      for (const Tensor* p : {static_cast<const Tensor*>(nullptr), &pos, &pos_continued}) {
        SCOPED_TRACE("nheads " + std::to_string(nheads) + ", ngroups " + std::to_string(ngroups) +
                     ", chunk " + std::to_string(chunk) + (p ? ", position_ids" : ""));
        const Tensor ids = p ? *p : Tensor();
        const Forward chunked = run_forward(in, d, ids, false);
        const Forward recurrent = run_forward(in, d, ids, true);
        EXPECT_TRUE(allclose(chunked.y, recurrent.y, 1e-6, 5e-6));
        EXPECT_TRUE(allclose(chunked.state, recurrent.state, 1e-6, 5e-6));
      }
    }
}

TEST(Ssd, OneTokenSequences) {
  const uint64_t seed = testing::test_seed() + 100;
  const ops::SsdDims d = dims_of(3, 1, 4, 2, 4);
  const SsdInputs in = make_inputs(d, seed);
  const Forward chunked = run_forward(in, d, Tensor(), false);
  const Forward recurrent = run_forward(in, d, Tensor(), true);
  EXPECT_TRUE(allclose(chunked.y, recurrent.y, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(chunked.state, recurrent.state, 1e-6, 5e-6));
  // One token: y = delta (C . B) x + D x, state = delta x B^T.
  const int64_t P = d.head_dim, N = d.state_dim;
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.nheads; ++h) {
      const int64_t g = h / 2;
      const double u = double(in.dt.f32()[b * d.nheads + h]) + in.dt_bias.f32()[h];
      const double delta = std::log1p(std::exp(u));
      double cb = 0;
      for (int64_t n = 0; n < N; ++n)
        cb += double(in.C.f32()[(b * d.ngroups + g) * N + n]) *
              in.B.f32()[(b * d.ngroups + g) * N + n];
      for (int64_t p = 0; p < P; ++p) {
        const double x = in.x.f32()[(b * d.nheads + h) * P + p];
        EXPECT_NEAR(chunked.y.f32()[(b * d.nheads + h) * P + p], delta * cb * x + in.D.f32()[h] * x,
                    1e-5);
      }
    }
}

// Packed documents give each document's result as if it were alone.
TEST(Ssd, PackedDocumentsEqualSeparateRuns) {
  const uint64_t seed = testing::test_seed() + 200;
  const std::vector<std::vector<int>> lengths{{5, 1, 4, 9}, {6, 1, 8, 4}};
  const ops::SsdDims d = dims_of(2, 19, 6, 2, 4);
  const SsdInputs in = make_inputs(d, seed);
  const Forward packed = run_forward(in, d, positions(lengths), false);
  for (int64_t b = 0; b < d.batch; ++b) {
    int64_t start = b * d.seq;
    for (int len : lengths[size_t(b)]) {
      ops::SsdDims one = d;
      one.batch = 1;
      one.seq = len;
      const SsdInputs doc{rows_of(in.x, start, len),
                          rows_of(in.dt, start, len),
                          in.A_log,
                          rows_of(in.B, start, len),
                          rows_of(in.C, start, len),
                          in.D,
                          in.dt_bias};
      const Forward alone = run_forward(doc, one, Tensor(), false);
      EXPECT_TRUE(allclose(rows_of(packed.y, start, len), alone.y, 1e-6, 5e-6))
          << "sample " << b << ", document at row " << start;
      start += len;
      if (start == (b + 1) * d.seq) {  // the sample's final state is its last document's
        const int64_t per_sample = d.nheads * d.head_dim * d.state_dim;
        EXPECT_TRUE(allclose(packed.state.view({d.batch, per_sample}).rows(b, 1).clone(),
                             alone.state.view({1, per_sample}), 1e-6, 5e-6));
      }
    }
  }
}

// Steps token by token from a zero state, and from the forward's final state over a
// prefix, give the forward's outputs and final state.
TEST(Ssd, StepEqualsForward) {
  const uint64_t seed = testing::test_seed() + 300;
  const ops::SsdDims d = dims_of(2, 11, 6, 2, 4);
  const SsdInputs in = make_inputs(d, seed);
  const Forward full = run_forward(in, d, Tensor(), false);
  for (int64_t prefix : {0, 5}) {
    SCOPED_TRACE("prefix " + std::to_string(prefix));
    Tensor state = Tensor::zeros({d.batch, d.nheads, d.head_dim, d.state_dim});
    if (prefix > 0) {  // the forward over each sample's first `prefix` rows
      ops::SsdDims head = d;
      head.seq = prefix;
      SsdInputs first = in;
      for (auto [t, dst] : {std::pair{&in.x, &first.x},
                            {&in.dt, &first.dt},
                            {&in.B, &first.B},
                            {&in.C, &first.C}}) {
        *dst = Tensor::empty({d.batch * prefix, t->dim(1)});
        for (int64_t b = 0; b < d.batch; ++b)
          dst->rows(b * prefix, prefix).copy_from(t->rows(b * d.seq, prefix));
      }
      state = run_forward(first, head, Tensor(), false).state;
    }
    for (int64_t s = prefix; s < d.seq; ++s) {
      Tensor y = Tensor::empty({d.batch, d.nheads * d.head_dim});
      testing::poison(y);
      ops::ssd_step(step_rows(in.x, d.batch, d.seq, s), step_rows(in.dt, d.batch, d.seq, s),
                    in.A_log, step_rows(in.B, d.batch, d.seq, s),
                    step_rows(in.C, d.batch, d.seq, s), in.D, in.dt_bias, d, state, y);
      EXPECT_TRUE(allclose(y, step_rows(full.y, d.batch, d.seq, s), 1e-5, 1e-5)) << "step " << s;
    }
    EXPECT_TRUE(allclose(state, full.state, 1e-5, 1e-5));
  }
}

struct Grads {
  Tensor dx, ddt, dB, dC, dA_log, dD, ddt_bias;
};

// The backward's outputs, the accumulators starting at `acc0` (they must be added to).
Grads run_backward(const SsdInputs& in, const ops::SsdDims& d, const Tensor& dy, const Tensor& pos,
                   bool recurrent, float acc0) {
  Grads g{Tensor::empty(in.x.shape()), Tensor::empty(in.dt.shape()), Tensor::empty(in.B.shape()),
          Tensor::empty(in.C.shape()), Tensor::empty({d.nheads}),    Tensor::empty({d.nheads}),
          Tensor::empty({d.nheads})};
  for (Tensor* t : {&g.dx, &g.ddt, &g.dB, &g.dC}) testing::poison(*t);
  for (Tensor* t : {&g.dA_log, &g.dD, &g.ddt_bias}) t->fill(acc0);
  auto backward = recurrent ? ops::ssd_backward_recurrent : ops::ssd_backward;
  backward(dy, in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, g.dx, g.ddt, g.dB, g.dC,
           g.dA_log, g.dD, g.ddt_bias, pos);
  for (Tensor* t : {&g.dA_log, &g.dD, &g.ddt_bias})
    for (int64_t h = 0; h < d.nheads; ++h) t->f32()[h] -= acc0;
  return g;
}

// d loss / d x by central differences with the steps actually taken in fp32, at eps and
// eps / 2 combined by Richardson extrapolation (error O(eps^4) instead of O(eps^2)).
Tensor central_difference(Tensor& x, const std::function<double()>& loss, float eps) {
  Tensor grad = Tensor::empty(x.shape());
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float orig = x.f32()[i];
    auto difference = [&](float step) {
      const float up = orig + step, down = orig - step;
      x.f32()[i] = up;
      const double lp = loss();
      x.f32()[i] = down;
      const double lm = loss();
      x.f32()[i] = orig;
      return (lp - lm) / (double(up) - double(down));
    };
    grad.f32()[i] = float((4.0 * difference(eps / 2) - difference(eps)) / 3.0);
  }
  return grad;
}

// Every gradient of the chunked backward against central differences of
// loss = sum(dy * ssd_forward(...)), with packed documents and a partial last chunk. The
// forward computes in fp64 and rounds y to fp32, so with eps 1e-2 the differences carry
// about 1e-4 of truncation and rounding error.
TEST(Ssd, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 400;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ops::SsdDims d = dims_of(2, 7, 4, 2, 3, 2, 3);
  SsdInputs in = make_inputs(d, seed);
  const Tensor pos = positions({{4, 3}, {1, 6}});
  const Tensor dy = randn(in.x.shape(), seed + 10);
  const Grads g = run_backward(in, d, dy, pos, false, 0.25f);
  Tensor y = Tensor::empty(in.x.shape());
  auto loss = [&] {
    ops::ssd_forward(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, y, pos);
    return testing::dot(dy, y);
  };
  for (auto [input, grad, name] : {std::tuple{&in.x, &g.dx, "x"},
                                   {&in.dt, &g.ddt, "dt"},
                                   {&in.B, &g.dB, "B"},
                                   {&in.C, &g.dC, "C"},
                                   {&in.A_log, &g.dA_log, "A_log"},
                                   {&in.D, &g.dD, "D"},
                                   {&in.dt_bias, &g.ddt_bias, "dt_bias"}}) {
    SCOPED_TRACE(name);
    const Tensor fd = central_difference(*input, loss, 1e-2f);
    EXPECT_TRUE(allclose(*grad, fd, 2e-3, 2e-3));
    EXPECT_LT(testing::rel_error(*grad, fd), 1e-3);
  }
}

// The chunked backward against the reverse mode of the recurrence, both in fp64.
TEST(Ssd, ChunkedBackwardEqualsRecurrenceBackward) {
  const uint64_t seed = testing::test_seed() + 500;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Tensor pos = positions({{5, 1, 4, 9}, {6, 1, 8, 4}});
  for (int64_t chunk : {1, 3, 4, 8, 16})
    for (const Tensor* p : {static_cast<const Tensor*>(nullptr), &pos}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + (p ? ", position_ids" : ""));
      const ops::SsdDims d = dims_of(2, 19, 6, 2, chunk);
      const SsdInputs in = make_inputs(d, seed + uint64_t(chunk));
      const Tensor dy = randn(in.x.shape(), seed + 10);
      const Tensor ids = p ? *p : Tensor();
      const Grads chunked = run_backward(in, d, dy, ids, false, -0.5f);
      const Grads recurrent = run_backward(in, d, dy, ids, true, 0.0f);
      for (auto [a, b, name] : {std::tuple{&chunked.dx, &recurrent.dx, "dx"},
                                {&chunked.ddt, &recurrent.ddt, "ddt"},
                                {&chunked.dB, &recurrent.dB, "dB"},
                                {&chunked.dC, &recurrent.dC, "dC"},
                                {&chunked.dA_log, &recurrent.dA_log, "dA_log"},
                                {&chunked.dD, &recurrent.dD, "dD"},
                                {&chunked.ddt_bias, &recurrent.ddt_bias, "ddt_bias"}})
        EXPECT_TRUE(allclose(*a, *b, 1e-6, 5e-6)) << name;
    }
}

// Large enough for the chunked form to run its samples on several threads.
TEST(Ssd, LargerProblemEqualsRecurrence) {
  const uint64_t seed = testing::test_seed() + 600;
  const ops::SsdDims d = dims_of(3, 40, 4, 2, 16, 4, 8);
  const SsdInputs in = make_inputs(d, seed);
  const Tensor pos = positions({{40}, {17, 23}, {1, 30, 9}});
  const Forward chunked = run_forward(in, d, pos, false);
  const Forward recurrent = run_forward(in, d, pos, true);
  EXPECT_TRUE(allclose(chunked.y, recurrent.y, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(chunked.state, recurrent.state, 1e-6, 5e-6));
  const Tensor dy = randn(in.x.shape(), seed + 10);
  const Grads a = run_backward(in, d, dy, pos, false, 0.0f);
  const Grads b = run_backward(in, d, dy, pos, true, 0.0f);
  EXPECT_TRUE(allclose(a.dx, b.dx, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(a.ddt, b.ddt, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(a.dB, b.dB, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(a.dC, b.dC, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(a.dA_log, b.dA_log, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(a.ddt_bias, b.ddt_bias, 1e-6, 5e-6));
}

TEST(Ssd, ArgumentErrors) {
  const ops::SsdDims d = dims_of(2, 5, 4, 2, 4);
  const SsdInputs in = make_inputs(d, testing::test_seed());
  Tensor y = Tensor::empty(in.x.shape());
  ops::SsdDims bad_groups = d;
  bad_groups.ngroups = 3;
  EXPECT_THROW(ops::ssd_forward(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, bad_groups, y),
               InternalError);
  const Tensor short_dt = Tensor::empty({d.batch * d.seq, d.nheads - 1});
  EXPECT_THROW(ops::ssd_forward(in.x, short_dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, y),
               InternalError);
  const Tensor bad_pos = Tensor::from_i32({3}, {0, 1, 2});
  EXPECT_THROW(ops::ssd_forward_recurrent(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, y,
                                          bad_pos),
               InternalError);
  Tensor wrong_state = Tensor::empty({d.batch, d.nheads, d.head_dim, d.state_dim + 1});
  EXPECT_THROW(ops::ssd_forward(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, y, Tensor(),
                                &wrong_state),
               InternalError);
  // Backward: an accumulator of the wrong dtype; a gradient of the wrong shape.
  Tensor dx = Tensor::empty(in.x.shape()), ddt = Tensor::empty(in.dt.shape()),
         dB = Tensor::empty(in.B.shape()), dC = Tensor::empty(in.C.shape()),
         acc = Tensor::zeros({d.nheads}), acc_i32 = Tensor::zeros({d.nheads}, DType::I32);
  EXPECT_THROW(ops::ssd_backward(y, in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, dx, ddt,
                                 dB, dC, acc_i32, acc, acc),
               InternalError);
  Tensor wide_dx = Tensor::empty({d.batch * d.seq, d.nheads * d.head_dim + 1});
  EXPECT_THROW(ops::ssd_backward(y, in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, wide_dx,
                                 ddt, dB, dC, acc, acc, acc),
               InternalError);
  // Step: x must have dims.batch rows.
  Tensor state = Tensor::zeros({d.batch, d.nheads, d.head_dim, d.state_dim});
  Tensor y_step = Tensor::empty({d.batch, d.nheads * d.head_dim});
  EXPECT_THROW(ops::ssd_step(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, state, y_step),
               InternalError);
}

}  // namespace
}  // namespace megaton
