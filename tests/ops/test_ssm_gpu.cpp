// GPU test of Mamba-2's ops (ops/ssm.h; kernels in ops/cuda/ssm_*.cu) against the CPU
// doors on the same inputs: the SSD scan's forward (outputs and final state) and every
// output of its backward, the causal conv1d's forward and backward, the gated RMSNorm's
// forward and backward, in F32, BF16 (inputs rounded to bf16 first, so the CPU sees what
// the GPU sees) and F16; with and without packed documents; the generation steps against
// the GPU forward.
//
// Tolerances (||gpu - cpu|| / ||cpu||): F32 2e-5 for per-element outputs (the GPU runs
// 64-token chunks in fp32, the CPU its own chunk size in fp64; the chunk's cumulative log
// decay loses ~1 ulp of its magnitude), 1e-4 for the per-head sums dA_log and ddt_bias
// (sums over every token, with cancellation). BF16: 1e-2 (outputs rounded to bf16, and the
// chunk products' operands rounded to bf16 for the tensor cores, as mamba_ssm's kernels do).
// F16: 3e-3 (outputs rounded to fp16; products in fp32).
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/ssm.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

using testing::poisoned_device;
using testing::to_device;
using testing::to_host_f32;

double tolerance(DType dtype) {
  return dtype == DType::F32 ? 2e-5 : dtype == DType::BF16 ? 1e-2 : 3e-3;
}
double sum_tolerance(DType dtype) { return dtype == DType::F32 ? 1e-4 : tolerance(dtype); }

// The same values rounded to dtype, held in fp32 on the host.
Tensor rounded(const Tensor& x, DType dtype) { return x.to(dtype).to(DType::F32); }

// ||got - want|| / ||want||, or ||got|| where want is exactly zero (a one-token sequence's
// dA_log); got is a device tensor, want an fp32 host tensor. Checks every element of got
// was written and is finite first.
::testing::AssertionResult close(const Tensor& got_device, const Tensor& want, double tol,
                                 const char* name) {
  const Tensor got = to_host_f32(got_device);
  ::testing::AssertionResult finite = testing::all_finite(got, name);
  if (!finite) return finite;
  double want_norm = 0;
  for (int64_t i = 0; i < want.numel(); ++i) want_norm += double(want.f32()[i]) * want.f32()[i];
  double err = 0;
  if (want_norm == 0) {
    for (int64_t i = 0; i < got.numel(); ++i) err += double(got.f32()[i]) * got.f32()[i];
    err = std::sqrt(err);
  } else {
    err = testing::rel_error(got, want);
  }
  if (err <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": error " << err << " > " << tol;
}

// position_ids of documents with the given lengths per sample (each sample's lengths sum to
// its sequence length).
Tensor positions(const std::vector<std::vector<int>>& lengths) {
  std::vector<int32_t> p;
  for (const auto& sample : lengths)
    for (int len : sample)
      for (int k = 0; k < len; ++k) p.push_back(k);
  return Tensor::from_i32({int64_t(p.size())}, p);
}

// ---- SSD ----

struct SsdCase {
  int64_t batch, seq, nheads, head_dim, ngroups, state_dim, chunk_size;
  std::vector<std::vector<int>> documents;  // empty: no position_ids
};

std::string describe(const SsdCase& c, DType dtype) {
  return "B " + std::to_string(c.batch) + ", S " + std::to_string(c.seq) + ", heads " +
         std::to_string(c.nheads) + " x " + std::to_string(c.head_dim) + ", groups " +
         std::to_string(c.ngroups) + ", N " + std::to_string(c.state_dim) + ", chunk " +
         std::to_string(c.chunk_size) + (c.documents.empty() ? "" : ", documents") + ", " +
         std::string(dtype_name(dtype));
}

ops::SsdDims dims_of(const SsdCase& c) {
  ops::SsdDims d;
  d.batch = c.batch;
  d.seq = c.seq;
  d.nheads = c.nheads;
  d.head_dim = c.head_dim;
  d.ngroups = c.ngroups;
  d.state_dim = c.state_dim;
  d.chunk_size = c.chunk_size;
  return d;
}

struct SsdInputs {
  Tensor x, dt, A_log, B, C, D, dt_bias;
};

// Host fp32 inputs, activations rounded to dtype: decays exp(delta A) mostly in 0.5..0.95
// per token (states carry across chunks), some dt past softplus's threshold of 20.
SsdInputs make_inputs(const ops::SsdDims& d, uint64_t seed, DType dtype) {
  const int64_t rows = d.batch * d.seq;
  SsdInputs in{testing::randn({rows, d.nheads * d.head_dim}, seed),
               testing::randn({rows, d.nheads}, seed + 1, 0.5f),
               testing::randn({d.nheads}, seed + 2, 0.3f),
               testing::randn({rows, d.ngroups * d.state_dim}, seed + 3),
               testing::randn({rows, d.ngroups * d.state_dim}, seed + 4),
               testing::randn({d.nheads}, seed + 5),
               testing::randn({d.nheads}, seed + 6, 0.3f)};
  for (int64_t h = 0; h < d.nheads; ++h) in.A_log.f32()[h] += std::log(0.3f);
  for (int64_t i = 0; i < in.dt.numel(); i += 37) in.dt.f32()[i] = 21.0f;
  for (Tensor* t : {&in.x, &in.dt, &in.B, &in.C}) *t = rounded(*t, dtype);
  return in;
}

struct DeviceInputs {
  Tensor x, dt, A_log, B, C, D, dt_bias;
};
DeviceInputs on_device(const SsdInputs& in, DType dtype) {
  // The per-head vectors stay F32 (any float dtype is accepted; read as fp32).
  return {to_device(in.x, dtype),           to_device(in.dt, dtype),
          to_device(in.A_log, DType::F32),  to_device(in.B, dtype),
          to_device(in.C, dtype),           to_device(in.D, DType::F32),
          to_device(in.dt_bias, DType::F32)};
}

void check_ssd_case(const SsdCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(describe(c, dtype) + ", " + testing::seed_trace(seed));
  const ops::SsdDims d = dims_of(c);
  const int64_t rows = d.batch * d.seq, H = d.nheads;
  const SsdInputs in = make_inputs(d, seed, dtype);
  const Tensor pos = c.documents.empty() ? Tensor() : positions(c.documents);
  const Tensor pos_d = pos.defined() ? pos.to(Device::CUDA) : Tensor();
  const DeviceInputs dev = on_device(in, dtype);
  const Shape state_shape{d.batch, H, d.head_dim, d.state_dim};

  // Forward.
  Tensor y = Tensor::empty(in.x.shape()), state = Tensor::empty(state_shape);
  ops::ssd_forward(in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, y, pos, &state);
  Tensor y_d = poisoned_device(in.x.shape(), dtype);
  Tensor state_d = poisoned_device(state_shape, DType::F32);
  ops::ssd_forward(dev.x, dev.dt, dev.A_log, dev.B, dev.C, dev.D, dev.dt_bias, d, y_d, pos_d,
                   &state_d);
  EXPECT_TRUE(close(y_d, y, tolerance(dtype), "y"));
  EXPECT_TRUE(close(state_d, state, tolerance(dtype), "final_state"));

  // Backward; the accumulators start at 0.25 (they are added to).
  const Tensor dy = rounded(testing::randn(in.x.shape(), seed + 10), dtype);
  Tensor dx = Tensor::empty(in.x.shape()), ddt = Tensor::empty(in.dt.shape()),
         dB = Tensor::empty(in.B.shape()), dC = Tensor::empty(in.C.shape());
  Tensor dA_log = Tensor::zeros({H}), dD = Tensor::zeros({H}), ddt_bias = Tensor::zeros({H});
  for (Tensor* t : {&dA_log, &dD, &ddt_bias}) t->fill(0.25f);
  ops::ssd_backward(dy, in.x, in.dt, in.A_log, in.B, in.C, in.D, in.dt_bias, d, dx, ddt, dB, dC,
                    dA_log, dD, ddt_bias, pos);
  Tensor dx_d = poisoned_device(in.x.shape(), dtype), ddt_d = poisoned_device({rows, H}, dtype),
         dB_d = poisoned_device(in.B.shape(), dtype), dC_d = poisoned_device(in.C.shape(), dtype);
  Tensor dA_log_d = to_device(Tensor::zeros({H}), DType::F32);
  Tensor dD_d = to_device(Tensor::zeros({H}), DType::F32);
  Tensor ddt_bias_d = to_device(Tensor::zeros({H}), DType::F32);
  for (Tensor* t : {&dA_log_d, &dD_d, &ddt_bias_d}) t->fill(0.25f);
  ops::ssd_backward(to_device(dy, dtype), dev.x, dev.dt, dev.A_log, dev.B, dev.C, dev.D,
                    dev.dt_bias, d, dx_d, ddt_d, dB_d, dC_d, dA_log_d, dD_d, ddt_bias_d, pos_d);
  EXPECT_TRUE(close(dx_d, dx, tolerance(dtype), "dx"));
  EXPECT_TRUE(close(ddt_d, ddt, tolerance(dtype), "ddt"));
  EXPECT_TRUE(close(dB_d, dB, tolerance(dtype), "dB"));
  EXPECT_TRUE(close(dC_d, dC, tolerance(dtype), "dC"));
  EXPECT_TRUE(close(dA_log_d, dA_log, sum_tolerance(dtype), "dA_log"));
  EXPECT_TRUE(close(dD_d, dD, sum_tolerance(dtype), "dD"));
  EXPECT_TRUE(close(ddt_bias_d, ddt_bias, sum_tolerance(dtype), "ddt_bias"));

  // No float atomics: a second backward gives the same bits.
  Tensor dx2 = poisoned_device(in.x.shape(), dtype), ddt2 = poisoned_device({rows, H}, dtype),
         dB2 = poisoned_device(in.B.shape(), dtype), dC2 = poisoned_device(in.C.shape(), dtype);
  Tensor acc2[3] = {to_device(Tensor::zeros({H}), DType::F32),
                    to_device(Tensor::zeros({H}), DType::F32),
                    to_device(Tensor::zeros({H}), DType::F32)};
  for (Tensor& t : acc2) t.fill(0.25f);
  ops::ssd_backward(to_device(dy, dtype), dev.x, dev.dt, dev.A_log, dev.B, dev.C, dev.D,
                    dev.dt_bias, d, dx2, ddt2, dB2, dC2, acc2[0], acc2[1], acc2[2], pos_d);
  EXPECT_TRUE(testing::bitwise_equal(to_host_f32(dx2), to_host_f32(dx_d)));
  EXPECT_TRUE(testing::bitwise_equal(to_host_f32(dB2), to_host_f32(dB_d)));
  EXPECT_TRUE(testing::bitwise_equal(to_host_f32(acc2[0]), to_host_f32(dA_log_d)));
}

const std::vector<SsdCase>& ssd_cases() {
  static const std::vector<SsdCase> cases{
      // S not a multiple of the chunk, Megatron's chunk 128, head_dim 64.
      {2, 300, 4, 64, 2, 16, 128, {}},
      {2, 300, 4, 64, 2, 16, 128, {{5, 59, 1, 63, 172}, {64, 64, 100, 72}}},
      // One token.
      {2, 1, 2, 64, 1, 16, 128, {}},
      // ngroups 1 and state 128, documents across chunk boundaries.
      {1, 130, 4, 64, 1, 128, 64, {{20, 44, 66}}},
      {2, 200, 4, 64, 2, 128, 32, {}},
      // Sizes off the 8-element vector loads and 64-wide tiles: head_dim 12, N 20.
      {1, 77, 6, 12, 3, 20, 16, {{30, 47}}},
  };
  return cases;
}

TEST(CudaSsd, ForwardAndBackwardMatchCpuF32) {
  MEGATON_SKIP_WITHOUT_GPU();
  uint64_t seed = testing::test_seed();
  for (const SsdCase& c : ssd_cases()) check_ssd_case(c, DType::F32, seed += 100);
}

TEST(CudaSsd, ForwardAndBackwardMatchCpuBf16) {
  MEGATON_SKIP_WITHOUT_GPU();
  uint64_t seed = testing::test_seed() + 5000;
  for (const SsdCase& c : ssd_cases()) check_ssd_case(c, DType::BF16, seed += 100);
}

TEST(CudaSsd, ForwardAndBackwardMatchCpuF16) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 9000;
  check_ssd_case({2, 150, 4, 64, 2, 128, 128, {{10, 140}, {150}}}, DType::F16, seed);
}

// Rows [s, s + 1) of each sample of a [batch * seq, C] host tensor: [batch, C].
Tensor step_rows(const Tensor& t, int64_t batch, int64_t seq, int64_t s, int64_t count = 1) {
  Tensor out = Tensor::empty({batch * count, t.dim(1)});
  for (int64_t b = 0; b < batch; ++b)
    out.rows(b * count, count).copy_from(t.rows(b * seq + s, count));
  return out;
}

// The forward over S tokens with its final state, then steps over the rest, give the
// forward's outputs over all of them and its final state.
TEST(CudaSsd, StepContinuesTheForward) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 700;
  for (DType dtype : {DType::F32, DType::BF16})
    for (int64_t prefix : {1, 70}) {
      const SsdCase c{2, prefix + 3, 4, 64, 2, 128, 128, {}};
      SCOPED_TRACE(describe(c, dtype) + ", prefix " + std::to_string(prefix));
      const ops::SsdDims d = dims_of(c);
      const SsdInputs in = make_inputs(d, seed + uint64_t(prefix), dtype);
      const DeviceInputs dev = on_device(in, dtype);
      const Shape state_shape{d.batch, d.nheads, d.head_dim, d.state_dim};
      Tensor y_full = poisoned_device(in.x.shape(), dtype);
      Tensor state_full = poisoned_device(state_shape, DType::F32);
      ops::ssd_forward(dev.x, dev.dt, dev.A_log, dev.B, dev.C, dev.D, dev.dt_bias, d, y_full,
                       Tensor(), &state_full);
      const Tensor y_full_host = to_host_f32(y_full);

      ops::SsdDims head = d;
      head.seq = prefix;
      auto first = [&](const Tensor& t) {
        return to_device(step_rows(t, d.batch, d.seq, 0, prefix), dtype);
      };
      Tensor y_head = poisoned_device({d.batch * prefix, in.x.dim(1)}, dtype);
      Tensor state = poisoned_device(state_shape, DType::F32);
      ops::ssd_forward(first(in.x), first(in.dt), dev.A_log, first(in.B), first(in.C), dev.D,
                       dev.dt_bias, head, y_head, Tensor(), &state);
      for (int64_t s = prefix; s < d.seq; ++s) {
        auto row = [&](const Tensor& t) {
          return to_device(step_rows(t, d.batch, d.seq, s), dtype);
        };
        Tensor y = poisoned_device({d.batch, in.x.dim(1)}, dtype);
        ops::ssd_step(row(in.x), row(in.dt), dev.A_log, row(in.B), row(in.C), dev.D, dev.dt_bias, d,
                      state, y);
        EXPECT_TRUE(close(y, step_rows(y_full_host, d.batch, d.seq, s),
                          dtype == DType::F32 ? 1e-5 : 1e-2, "step y"))
            << "step " << s;
      }
      // The forward's final state comes from chunk products (BF16: bf16 operands), the
      // steps' from the fp32 recurrence.
      EXPECT_TRUE(close(state, to_host_f32(state_full), dtype == DType::F32 ? 1e-5 : 1e-2,
                        "state after the steps"));
    }
}

// ---- causal conv1d ----

struct ConvCase {
  int64_t batch, seq, channels, width;
  bool silu;
  std::vector<std::vector<int>> documents;
};

void check_conv_case(const ConvCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE("B " + std::to_string(c.batch) + ", S " + std::to_string(c.seq) + ", C " +
               std::to_string(c.channels) + ", K " + std::to_string(c.width) +
               (c.silu ? ", silu" : "") + (c.documents.empty() ? "" : ", documents") + ", " +
               std::string(dtype_name(dtype)) + ", " + testing::seed_trace(seed));
  const int64_t rows = c.batch * c.seq, C = c.channels, K = c.width;
  const Tensor x = rounded(testing::randn({rows, C}, seed), dtype);
  const Tensor w = rounded(testing::randn({C, K}, seed + 1, 0.5f), dtype);
  const Tensor bias = rounded(testing::randn({C}, seed + 2), dtype);
  const Tensor dy = rounded(testing::randn({rows, C}, seed + 3), dtype);
  const Tensor pos = c.documents.empty() ? Tensor() : positions(c.documents);
  const Tensor pos_d = pos.defined() ? pos.to(Device::CUDA) : Tensor();
  const Tensor x_d = to_device(x, dtype), w_d = to_device(w, dtype),
               bias_d = to_device(bias, dtype);

  Tensor y = Tensor::empty({rows, C});
  ops::causal_conv1d_forward(x, w, bias, c.batch, c.silu, y, pos);
  Tensor y_d = poisoned_device({rows, C}, dtype);
  ops::causal_conv1d_forward(x_d, w_d, bias_d, c.batch, c.silu, y_d, pos_d);
  EXPECT_TRUE(close(y_d, y, tolerance(dtype), "y"));

  Tensor dx = Tensor::empty({rows, C}), dw = Tensor::zeros({C, K}), db = Tensor::zeros({C});
  dw.fill(0.25f);
  db.fill(0.25f);
  ops::causal_conv1d_backward(dy, x, w, bias, c.batch, c.silu, dx, dw, db, pos);
  Tensor dx_d = poisoned_device({rows, C}, dtype);
  Tensor dw_d = to_device(Tensor::zeros({C, K}), DType::F32);
  Tensor db_d = to_device(Tensor::zeros({C}), DType::F32);
  dw_d.fill(0.25f);
  db_d.fill(0.25f);
  ops::causal_conv1d_backward(to_device(dy, dtype), x_d, w_d, bias_d, c.batch, c.silu, dx_d, dw_d,
                              db_d, pos_d);
  EXPECT_TRUE(close(dx_d, dx, tolerance(dtype), "dx"));
  EXPECT_TRUE(close(dw_d, dw, sum_tolerance(dtype), "dweight"));
  EXPECT_TRUE(close(db_d, db, sum_tolerance(dtype), "dbias"));
}

TEST(CudaCausalConv1d, ForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const std::vector<ConvCase> cases{
      {2, 150, 70, 4, true, {}},
      {2, 150, 70, 4, false, {{3, 61, 1, 85}, {64, 86}}},
      {3, 5, 33, 4, true, {{2, 3}, {5}, {1, 1, 1, 2}}},
      {1, 1, 8, 4, true, {}},
      {2, 300, 256, 2, true, {}},
      {2, 130, 96, 3, true, {{65, 65}, {130}}},
  };
  uint64_t seed = testing::test_seed() + 20000;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (const ConvCase& c : cases) check_conv_case(c, dtype, seed += 10);
}

// The final state of a prefix, then steps, give the forward's rows; the state after the
// steps is the whole sequence's final state; both states as the CPU's.
TEST(CudaCausalConv1d, StepContinuesFromFinalState) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 21000;
  const int64_t B = 2, S = 12, C = 70, K = 4;
  for (DType dtype : {DType::F32, DType::BF16})
    for (int64_t prefix : {1, 2, 9}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", prefix " + std::to_string(prefix));
      const Tensor x = rounded(testing::randn({B * S, C}, seed), dtype);
      const Tensor w = rounded(testing::randn({C, K}, seed + 1, 0.5f), dtype);
      const Tensor bias = rounded(testing::randn({C}, seed + 2), dtype);
      const Tensor w_d = to_device(w, dtype), bias_d = to_device(bias, dtype);
      Tensor full_d = poisoned_device({B * S, C}, dtype);
      ops::causal_conv1d_forward(to_device(x, dtype), w_d, bias_d, B, true, full_d);
      const Tensor full = to_host_f32(full_d);

      const Tensor head = step_rows(x, B, S, 0, prefix);
      Tensor state = Tensor::empty({B, K - 1, C});
      ops::causal_conv1d_final_state(head, B, state);
      Tensor state_d = poisoned_device({B, K - 1, C}, dtype);
      ops::causal_conv1d_final_state(to_device(head, dtype), B, state_d);
      EXPECT_TRUE(close(state_d, state, 0, "final_state"));
      for (int64_t s = prefix; s < S; ++s) {
        Tensor y = poisoned_device({B, C}, dtype);
        ops::causal_conv1d_step(to_device(step_rows(x, B, S, s), dtype), w_d, bias_d, true, state_d,
                                y);
        EXPECT_TRUE(close(y, step_rows(full, B, S, s), dtype == DType::F32 ? 1e-6 : 1e-2, "step y"))
            << "step " << s;
      }
      Tensor last = Tensor::empty({B, K - 1, C});
      ops::causal_conv1d_final_state(x, B, last);
      EXPECT_TRUE(close(state_d, last, 0, "state after the steps"));
    }
}

// ---- gated RMSNorm ----

TEST(CudaGatedRmsNorm, ForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  struct NormCase {
    int64_t rows, cols, group_size;
  };
  const std::vector<NormCase> cases{{37, 96, 32}, {37, 96, 96}, {300, 512, 64}, {20, 24, 3}};
  uint64_t seed = testing::test_seed() + 30000;
  const float eps = 1e-5f;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (const NormCase& c : cases) {
      seed += 10;
      SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.cols) + ", group " +
                   std::to_string(c.group_size) + ", " + std::string(dtype_name(dtype)) + ", " +
                   testing::seed_trace(seed));
      const Shape shape{c.rows, c.cols};
      const int64_t groups = c.rows * c.cols / c.group_size;
      const Tensor y = rounded(testing::randn(shape, seed), dtype);
      const Tensor z = rounded(testing::randn(shape, seed + 1), dtype);
      Tensor w = testing::randn({c.cols}, seed + 2, 0.1f);
      for (int64_t j = 0; j < c.cols; ++j) w.f32()[j] += 1.0f;
      w = rounded(w, dtype);
      const Tensor dout = rounded(testing::randn(shape, seed + 3), dtype);
      const Tensor y_d = to_device(y, dtype), z_d = to_device(z, dtype), w_d = to_device(w, dtype);

      Tensor out = Tensor::empty(shape), rstd = Tensor::empty({groups});
      ops::gated_rmsnorm_forward(y, z, w, c.group_size, eps, out, rstd);
      Tensor out_d = poisoned_device(shape, dtype), rstd_d = poisoned_device({groups}, DType::F32);
      ops::gated_rmsnorm_forward(y_d, z_d, w_d, c.group_size, eps, out_d, rstd_d);
      EXPECT_TRUE(close(out_d, out, tolerance(dtype), "out"));
      EXPECT_TRUE(close(rstd_d, rstd, 1e-5, "rstd"));

      Tensor dy = Tensor::empty(shape), dz = Tensor::empty(shape), dw = Tensor::zeros({c.cols});
      dw.fill(0.25f);
      ops::gated_rmsnorm_backward(dout, y, z, w, rstd, c.group_size, dy, dz, dw);
      Tensor dy_d = poisoned_device(shape, dtype), dz_d = poisoned_device(shape, dtype);
      Tensor dw_d = to_device(Tensor::zeros({c.cols}), DType::F32);
      dw_d.fill(0.25f);
      ops::gated_rmsnorm_backward(to_device(dout, dtype), y_d, z_d, w_d, rstd_d, c.group_size, dy_d,
                                  dz_d, dw_d);
      EXPECT_TRUE(close(dy_d, dy, tolerance(dtype), "dy"));
      EXPECT_TRUE(close(dz_d, dz, tolerance(dtype), "dz"));
      EXPECT_TRUE(close(dw_d, dw, sum_tolerance(dtype), "dweight"));
    }
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
