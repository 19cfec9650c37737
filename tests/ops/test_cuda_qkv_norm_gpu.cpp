// GPU tests of the fused QKV split + q/k norm + RoPE op (--qk-layernorm) and its gradient
// against the CPU reference (ops/cpu/qkv_norm.cpp), and of the weight gradients'
// determinism.
#include <cmath>
#include <string>

#include "common/testing.h"
#include "ops/ops.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

using testing::all_finite;
using testing::allclose;
using testing::bitwise_equal;
using testing::poisoned_device;
using testing::randn;
using testing::rel_error;
using testing::seed_trace;
using testing::to_device;
using testing::to_host_f32;

struct QkvCase {
  int64_t B, S, heads, groups, D;
  int64_t tokens() const { return B * S; }
  Shape qkv_shape() const { return {B * S, (heads + 2 * groups) * D}; }
  Shape q_shape() const { return {B, S, heads, D}; }
  Shape kv_shape() const { return {B, S, groups, D}; }
};

std::string case_name(const ::testing::TestParamInfo<QkvCase>& info) {
  const QkvCase& c = info.param;
  return "B" + std::to_string(c.B) + "_S" + std::to_string(c.S) + "_np" + std::to_string(c.heads) +
         "_ng" + std::to_string(c.groups) + "_d" + std::to_string(c.D);
}

// CUDA fp32, bf16 and fp16 tolerances of ../shared/CONVENTIONS.md. The GPU computes in fp32
// what the CPU computes partly in fp64 (the norms), and rounds once to bf16 or fp16 where
// the CPU reference (fp32 throughout) does not round: 16-bit outputs differ by their
// rounding, 2^-9 (bf16) or 2^-12 (fp16) relative.
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance(DType dtype) {
  if (dtype == DType::F32) return {1e-5, 1e-4};
  return dtype == DType::F16 ? Tolerance{1e-5, 1e-3} : Tolerance{1e-5, 1e-2};
}
// Values `dtype` holds exactly, in fp32.
Tensor rounded_to(const Tensor& t, DType dtype) {
  return dtype == DType::F32 ? t : t.to(dtype).to(DType::F32);
}
// Whole-tensor check of the fp32 statistics and weight gradients: the inputs the two sides
// see are the same (bf16 inputs are rounded on the host first) and both sum in fp32 or
// better, in different orders.
constexpr double kSumRelError = 1e-5;

struct NormForm {
  ops::QkNormType type;
  bool bias;
  std::string name() const {
    return type == ops::QkNormType::RMSNorm ? "RMSNorm" : bias ? "LayerNorm" : "LayerNorm no bias";
  }
};

// Host norm parameters (F32, rounded to param_dtype's values) and their device copies.
struct Norms {
  ops::QkNorm host, device;
};

Norms random_norms(const NormForm& form, int64_t D, DType param_dtype, uint64_t seed) {
  auto param = [&](uint64_t s, float offset) {
    Tensor t = randn({D}, s, 0.5f);
    for (int64_t j = 0; j < D; ++j) t.f32()[j] += offset;
    return rounded_to(t, param_dtype);
  };
  Norms n;
  n.host.type = n.device.type = form.type;
  n.host.eps = n.device.eps = 1e-5f;
  n.host.q_weight = param(seed, 1.0f);
  n.host.k_weight = param(seed + 1, 1.0f);
  if (form.bias) {
    n.host.q_bias = param(seed + 2, 0.0f);
    n.host.k_bias = param(seed + 3, 0.0f);
  }
  n.device.q_weight = to_device(n.host.q_weight, param_dtype);
  n.device.k_weight = to_device(n.host.k_weight, param_dtype);
  if (form.bias) {
    n.device.q_bias = to_device(n.host.q_bias, param_dtype);
    n.device.k_bias = to_device(n.host.k_bias, param_dtype);
  }
  return n;
}

// Saved tensors of activation dtype `dtype` on `device`, poisoned.
ops::QkNormSaved make_saved(const QkvCase& c, ops::QkNormType type, DType dtype, Device device) {
  auto make = [&](const Shape& shape, DType dt) {
    Tensor t = Tensor::empty(shape, dt, device);
    testing::poison(t);
    return t;
  };
  ops::QkNormSaved s;
  s.q_input = make(c.q_shape(), dtype);
  s.k_input = make(c.kv_shape(), dtype);
  s.q_rstd = make({c.tokens() * c.heads}, DType::F32);
  s.k_rstd = make({c.tokens() * c.groups}, DType::F32);
  if (type == ops::QkNormType::LayerNorm) {
    s.q_mean = make({c.tokens() * c.heads}, DType::F32);
    s.k_mean = make({c.tokens() * c.groups}, DType::F32);
  }
  return s;
}

ops::QkNormGrads random_grads(int64_t D, bool bias, uint64_t seed) {
  ops::QkNormGrads g{randn({D}, seed), randn({D}, seed + 1), Tensor(), Tensor()};
  if (bias) {
    g.q_bias = randn({D}, seed + 2);
    g.k_bias = randn({D}, seed + 3);
  }
  return g;
}
ops::QkNormGrads grads_to(const ops::QkNormGrads& g, Device device) {
  auto move = [&](const Tensor& t) { return t.defined() ? t.clone().to(device) : Tensor(); };
  return {move(g.q_weight), move(g.k_weight), move(g.q_bias), move(g.k_bias)};
}
ops::QkNormGrads grads_to_host(const ops::QkNormGrads& g) { return grads_to(g, Device::CPU); }

// Every gradient within kSumRelError of the reference (whole tensor), or bitwise equal.
::testing::AssertionResult grads_match(const ops::QkNormGrads& got, const ops::QkNormGrads& want,
                                       bool bitwise) {
  const Tensor* a[4] = {&got.q_weight, &got.k_weight, &got.q_bias, &got.k_bias};
  const Tensor* b[4] = {&want.q_weight, &want.k_weight, &want.q_bias, &want.k_bias};
  const char* names[4] = {"q_weight", "k_weight", "q_bias", "k_bias"};
  for (int i = 0; i < 4; ++i) {
    if (a[i]->defined() != b[i]->defined())
      return ::testing::AssertionFailure() << names[i] << " defined on one side only";
    if (!a[i]->defined()) continue;
    if (bitwise) {
      auto r = bitwise_equal(*a[i], *b[i]);
      if (!r) return r << " (" << names[i] << ")";
    } else if (double e = rel_error(*a[i], *b[i]); !(e <= kSumRelError)) {
      return ::testing::AssertionFailure() << names[i] << ": relative error " << e;
    }
  }
  return ::testing::AssertionSuccess();
}

// One configuration: forward and backward on both devices, compared.
void check_against_cpu(const QkvCase& c, DType dtype, DType param_dtype, const NormForm& form,
                       bool rope, uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " activations, " +
               std::string(dtype_name(param_dtype)) + " parameters, " + form.name() +
               (rope ? ", rope" : ", no rope"));
  const float base = 500000.0f;
  const Tolerance tol = tolerance(dtype);
  auto input = [&](const Shape& shape, uint64_t s, float std, float mean) {
    Tensor t = randn(shape, s, std);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] += mean;
    return rounded_to(t, dtype);
  };
  const Tensor qkv = input(c.qkv_shape(), seed, 2.0f, 0.5f);
  const Norms norms = random_norms(form, c.D, param_dtype, seed + 1);

  // Forward.
  Tensor q_ref = Tensor::empty(c.q_shape()), k_ref = Tensor::empty(c.kv_shape()),
         v_ref = Tensor::empty(c.kv_shape());
  ops::QkNormSaved saved_ref = make_saved(c, form.type, DType::F32, Device::CPU);
  ops::qkv_split_norm_rope(qkv, c.B, c.groups, norms.host, rope, base, q_ref, k_ref, v_ref,
                           saved_ref);
  Tensor q_d = poisoned_device(c.q_shape(), dtype), k_d = poisoned_device(c.kv_shape(), dtype),
         v_d = poisoned_device(c.kv_shape(), dtype);
  ops::QkNormSaved saved_d = make_saved(c, form.type, dtype, Device::CUDA);
  ops::qkv_split_norm_rope(to_device(qkv, dtype), c.B, c.groups, norms.device, rope, base, q_d, k_d,
                           v_d, saved_d);
  cuda::synchronize();
  const Tensor q = to_host_f32(q_d), k = to_host_f32(k_d), v = to_host_f32(v_d);
  ASSERT_TRUE(all_finite(q, "q"));
  ASSERT_TRUE(all_finite(k, "k"));
  ASSERT_TRUE(all_finite(v, "v"));
  EXPECT_TRUE(allclose(q, q_ref, tol.atol, tol.rtol));
  EXPECT_TRUE(allclose(k, k_ref, tol.atol, tol.rtol));
  EXPECT_TRUE(allclose(v, v_ref, 0, 0));  // copied
  EXPECT_TRUE(allclose(to_host_f32(saved_d.q_input), saved_ref.q_input, 0, 0));
  EXPECT_TRUE(allclose(to_host_f32(saved_d.k_input), saved_ref.k_input, 0, 0));
  const Tensor q_rstd = to_host_f32(saved_d.q_rstd), k_rstd = to_host_f32(saved_d.k_rstd);
  ASSERT_TRUE(all_finite(q_rstd, "q_rstd"));
  ASSERT_TRUE(all_finite(k_rstd, "k_rstd"));
  EXPECT_TRUE(allclose(q_rstd, saved_ref.q_rstd, 1e-5, 1e-4));
  EXPECT_TRUE(allclose(k_rstd, saved_ref.k_rstd, 1e-5, 1e-4));
  if (form.type == ops::QkNormType::LayerNorm) {
    const Tensor q_mean = to_host_f32(saved_d.q_mean), k_mean = to_host_f32(saved_d.k_mean);
    ASSERT_TRUE(all_finite(q_mean, "q_mean"));
    ASSERT_TRUE(all_finite(k_mean, "k_mean"));
    EXPECT_TRUE(allclose(q_mean, saved_ref.q_mean, 1e-5, 1e-4));
    EXPECT_TRUE(allclose(k_mean, saved_ref.k_mean, 1e-5, 1e-4));
  }

  // Backward, from the CPU's saved statistics on both sides (the forward's are compared
  // above), accumulating into nonzero gradients.
  const Tensor dq = input(c.q_shape(), seed + 10, 1.0f, 0.0f),
               dk = input(c.kv_shape(), seed + 11, 1.0f, 0.0f),
               dv = input(c.kv_shape(), seed + 12, 1.0f, 0.0f);
  const ops::QkNormGrads initial = random_grads(c.D, form.bias, seed + 13);
  ops::QkNormGrads grads_ref = grads_to(initial, Device::CPU);
  Tensor dqkv_ref = Tensor::empty(c.qkv_shape());
  ops::qkv_pack_norm_rope_backward(dq, dk, dv, saved_ref, c.groups, norms.host, rope, base,
                                   dqkv_ref, grads_ref);
  ops::QkNormSaved saved_ref_d{
      to_device(saved_ref.q_input, dtype),
      to_device(saved_ref.k_input, dtype),
      saved_ref.q_mean.defined() ? saved_ref.q_mean.to(Device::CUDA) : Tensor(),
      saved_ref.q_rstd.to(Device::CUDA),
      saved_ref.k_mean.defined() ? saved_ref.k_mean.to(Device::CUDA) : Tensor(),
      saved_ref.k_rstd.to(Device::CUDA)};
  ops::QkNormGrads grads_d = grads_to(initial, Device::CUDA);
  Tensor dqkv_d = poisoned_device(c.qkv_shape(), dtype);
  ops::qkv_pack_norm_rope_backward(to_device(dq, dtype), to_device(dk, dtype), to_device(dv, dtype),
                                   saved_ref_d, c.groups, norms.device, rope, base, dqkv_d,
                                   grads_d);
  cuda::synchronize();
  const Tensor dqkv = to_host_f32(dqkv_d);
  ASSERT_TRUE(all_finite(dqkv, "dqkv"));
  // A LayerNorm over one element has the constant output bias: its exact input gradient is
  // 0, what the GPU leaves of the cancellation dy w - mean(dy w) is multiplied by
  // rstd = 1 / sqrt(eps). Measured on an H200: 1.2e-5 where the CPU has 0 (d = 1, fp32);
  // that case gets an absolute tolerance scaled by rstd, the others the usual one.
  const bool degenerate = c.D == 1 && form.type == ops::QkNormType::LayerNorm;
  const double dx_atol = degenerate ? tol.atol / std::sqrt(double(norms.host.eps)) : tol.atol;
  EXPECT_TRUE(allclose(dqkv, dqkv_ref, dx_atol, tol.rtol));
  if (!degenerate) {
    EXPECT_LE(rel_error(dqkv, dqkv_ref), dtype == DType::F32   ? 1e-5
                                         : dtype == DType::F16 ? 1e-3
                                                               : 1e-2);
  }
  EXPECT_TRUE(grads_match(grads_to_host(grads_d), grads_ref, false));
}

class CudaQkvNormTest : public ::testing::TestWithParam<QkvCase> {};

TEST_P(CudaQkvNormTest, ForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const QkvCase c = GetParam();
  const uint64_t seed = testing::test_seed() + 800 + c.D + c.groups;
  SCOPED_TRACE(seed_trace(seed));
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    for (bool rope : {true, false}) {
      if (rope && c.D % 2 != 0) continue;
      for (const NormForm& form : {NormForm{ops::QkNormType::RMSNorm, false},
                                   NormForm{ops::QkNormType::LayerNorm, true}}) {
        // The model's parameters have the compute dtype.
        check_against_cpu(c, dtype, dtype, form, rope, seed);
        if (HasFatalFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaQkvNormTest,
    ::testing::Values(QkvCase{2, 256, 16, 16, 128},  // llama-1.3B-like, MHA
                      QkvCase{2, 256, 16, 8, 128},   // GQA
                      QkvCase{2, 256, 16, 8, 64},    // d = 64: one value pair per lane
                      QkvCase{3, 700, 4, 2, 64},     // 2100 tokens: 3 per backward chunk
                      QkvCase{1, 9, 4, 2, 512},      // the largest d: 8 pairs per lane
                      QkvCase{2, 19, 6, 3, 72},      // 36 pairs: a second, partial round
                      QkvCase{2, 9, 6, 3, 6},        // fewer pairs than lanes
                      QkvCase{2, 7, 4, 2, 5},        // odd d (no RoPE): an unpaired value
                      QkvCase{1, 5, 2, 1, 1}),       // d = 1
    case_name);

// The norm parameters in fp32 while the activations are bf16 (any pairing is accepted),
// and LayerNorm without a bias.
TEST(CudaQkvNorm, MixedParameterDtypeAndLayerNormWithoutBias) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 820;
  SCOPED_TRACE(seed_trace(seed));
  const QkvCase c{2, 64, 8, 2, 128};
  check_against_cpu(c, DType::BF16, DType::F32, {ops::QkNormType::RMSNorm, false}, true, seed);
  check_against_cpu(c, DType::F32, DType::BF16, {ops::QkNormType::LayerNorm, true}, true, seed);
  check_against_cpu(c, DType::BF16, DType::BF16, {ops::QkNormType::LayerNorm, false}, true, seed);
  check_against_cpu(c, DType::F16, DType::F32, {ops::QkNormType::LayerNorm, true}, true, seed);
  check_against_cpu(c, DType::F16, DType::F16, {ops::QkNormType::LayerNorm, false}, true, seed);
}

// The weight gradients are sums over all B*S*heads rows, in blocks then across blocks: two
// runs give the same bits (and the same dqkv), on a shape with several tokens per chunk.
TEST(CudaQkvNorm, WeightGradientsAreDeterministic) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 830;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : {QkvCase{2, 256, 16, 8, 128}, QkvCase{4, 1024, 16, 8, 128}}) {
    SCOPED_TRACE(std::to_string(c.tokens()) + " tokens");
    for (DType dtype : {DType::BF16, DType::F32}) {
      const Norms norms = random_norms({ops::QkNormType::LayerNorm, true}, c.D, dtype, seed);
      Tensor qkv = to_device(randn(c.qkv_shape(), seed + 1, 2.0f), dtype);
      Tensor q = Tensor::empty(c.q_shape(), dtype, Device::CUDA),
             k = Tensor::empty(c.kv_shape(), dtype, Device::CUDA),
             v = Tensor::empty(c.kv_shape(), dtype, Device::CUDA);
      ops::QkNormSaved saved = make_saved(c, ops::QkNormType::LayerNorm, dtype, Device::CUDA);
      ops::qkv_split_norm_rope(qkv, c.B, c.groups, norms.device, true, 10000.0f, q, k, v, saved);
      const Tensor dq = to_device(randn(c.q_shape(), seed + 2), dtype),
                   dk = to_device(randn(c.kv_shape(), seed + 3), dtype),
                   dv = to_device(randn(c.kv_shape(), seed + 4), dtype);
      const ops::QkNormGrads initial = random_grads(c.D, true, seed + 5);
      Tensor dqkv[2];
      ops::QkNormGrads grads[2];
      for (int run = 0; run < 2; ++run) {
        grads[run] = grads_to(initial, Device::CUDA);
        dqkv[run] = poisoned_device(c.qkv_shape(), dtype);
        ops::qkv_pack_norm_rope_backward(dq, dk, dv, saved, c.groups, norms.device, true, 10000.0f,
                                         dqkv[run], grads[run]);
      }
      cuda::synchronize();
      const ops::QkNormGrads first = grads_to_host(grads[0]), second = grads_to_host(grads[1]);
      EXPECT_TRUE(grads_match(first, second, true));
      EXPECT_TRUE(bitwise_equal(to_host_f32(dqkv[0]), to_host_f32(dqkv[1])));
      // The gradients moved: the op accumulated something.
      EXPECT_GT(rel_error(first.q_weight, initial.q_weight), 1e-3);
      EXPECT_GT(rel_error(first.k_bias, initial.k_bias), 1e-3);
    }
  }
}

TEST(CudaQkvNorm, RejectsBadArguments) {
  MEGATON_SKIP_WITHOUT_GPU();
  const QkvCase c{2, 3, 4, 2, 8};
  const Norms norms = random_norms({ops::QkNormType::LayerNorm, true}, c.D, DType::BF16, 1);
  Tensor qkv = to_device(randn(c.qkv_shape(), 1), DType::BF16);
  Tensor q = Tensor::empty(c.q_shape(), DType::BF16, Device::CUDA);
  Tensor k = Tensor::empty(c.kv_shape(), DType::BF16, Device::CUDA);
  Tensor v = Tensor::empty(c.kv_shape(), DType::BF16, Device::CUDA);
  ops::QkNormSaved saved = make_saved(c, ops::QkNormType::LayerNorm, DType::BF16, Device::CUDA);
  EXPECT_NO_THROW(
      ops::qkv_split_norm_rope(qkv, c.B, c.groups, norms.device, true, 1e4f, q, k, v, saved));
  // The parameters of mixed dtypes.
  ops::QkNorm mixed = norms.device;
  mixed.k_weight = to_device(norms.host.k_weight, DType::F32);
  EXPECT_THROW(ops::qkv_split_norm_rope(qkv, c.B, c.groups, mixed, true, 1e4f, q, k, v, saved),
               InternalError);
  // Statistics not F32; split heads not of qkv's dtype.
  ops::QkNormSaved bad = make_saved(c, ops::QkNormType::LayerNorm, DType::BF16, Device::CUDA);
  bad.q_rstd = Tensor::empty({c.tokens() * c.heads}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::qkv_split_norm_rope(qkv, c.B, c.groups, norms.device, true, 1e4f, q, k, v, bad),
               InternalError);
  bad = make_saved(c, ops::QkNormType::LayerNorm, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::qkv_split_norm_rope(qkv, c.B, c.groups, norms.device, true, 1e4f, q, k, v, bad),
               InternalError);
  // A head dim past the GPU's 512.
  const QkvCase wide{1, 2, 2, 1, 514};
  const Norms wide_norms = random_norms({ops::QkNormType::RMSNorm, false}, wide.D, DType::F32, 2);
  Tensor wide_qkv = Tensor::empty(wide.qkv_shape(), DType::F32, Device::CUDA);
  Tensor wq = Tensor::empty(wide.q_shape(), DType::F32, Device::CUDA);
  Tensor wk = Tensor::empty(wide.kv_shape(), DType::F32, Device::CUDA);
  Tensor wv = Tensor::empty(wide.kv_shape(), DType::F32, Device::CUDA);
  ops::QkNormSaved wide_saved =
      make_saved(wide, ops::QkNormType::RMSNorm, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::qkv_split_norm_rope(wide_qkv, wide.B, wide.groups, wide_norms.device, false,
                                        1e4f, wq, wk, wv, wide_saved),
               InternalError);
  // Backward: gradients not F32; dqkv of the wrong shape.
  Tensor dqkv = Tensor::empty(c.qkv_shape(), DType::BF16, Device::CUDA);
  ops::QkNormGrads grads = grads_to(random_grads(c.D, true, 3), Device::CUDA);
  EXPECT_NO_THROW(ops::qkv_pack_norm_rope_backward(q, k, v, saved, c.groups, norms.device, true,
                                                   1e4f, dqkv, grads));
  ops::QkNormGrads bf16_grads = grads;
  bf16_grads.q_weight = to_device(random_grads(c.D, false, 4).q_weight, DType::BF16);
  EXPECT_THROW(ops::qkv_pack_norm_rope_backward(q, k, v, saved, c.groups, norms.device, true, 1e4f,
                                                dqkv, bf16_grads),
               InternalError);
  Tensor short_dqkv = Tensor::empty({c.tokens() - 1, c.qkv_shape()[1]}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::qkv_pack_norm_rope_backward(q, k, v, saved, c.groups, norms.device, true, 1e4f,
                                                short_dqkv, grads),
               InternalError);
  cuda::synchronize();
}

}  // namespace
}  // namespace megaton

#else

TEST(CudaQkvNorm, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif  // MEGATON_WITH_CUDA
