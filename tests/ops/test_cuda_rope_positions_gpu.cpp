// GPU tests of the per-token RoPE positions (packed sequences, --reset-position-ids) of the
// fused ops that rotate, against the CPU reference with the same position ids:
// qkv_split_rope / qkv_pack_rope_backward, qkv_split_norm_rope /
// qkv_pack_norm_rope_backward and mla_qkv_rope / mla_qkv_rope_backward (ops/ops.h,
// ops/mla.h). The CPU side is checked token by token in tests/ops/test_rope_positions.cpp.
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "ops/mla.h"
#include "ops/ops.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

using testing::all_finite;
using testing::allclose;
using testing::poisoned_device;
using testing::randn;
using testing::rel_error;
using testing::seed_trace;
using testing::to_device;
using testing::to_host_f32;

constexpr int64_t B = 2, S = 96, kHeads = 8, kGroups = 2, D = 64;
constexpr float kBase = 10000.0f;

// Documents of 1 to 40 tokens packed into each sample (positions restarting after each
// document end), and in the last sample a stretch at positions 4000 and up, where the
// angle's fp32 rounding matters.
Tensor packed_positions() {
  std::vector<int32_t> p;
  const int lengths[] = {7, 1, 40, 13, 2, 33};
  for (int64_t b = 0; b < B; ++b) {
    int64_t s = 0;
    for (int i = 0; s < S; ++i) {
      const int length = lengths[(i + b) % 6];
      for (int j = 0; j < length && s < S; ++j, ++s) p.push_back(j);
    }
  }
  for (int64_t s = S / 2; s < S; ++s) p[size_t((B - 1) * S + s)] = int32_t(4000 + s);
  return Tensor::from_i32({B * S}, p);
}

// CUDA tolerances of ../shared/CONVENTIONS.md: fp32 (the CPU's fp32 angle and double
// cos/sin, contraction aside) and bf16 (one rounding of each output).
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance(DType dtype) {
  return dtype == DType::F32 ? Tolerance{1e-5, 1e-4} : Tolerance{1e-5, 1e-2};
}
Tensor rounded_to(const Tensor& t, DType dtype) {
  return dtype == DType::F32 ? t : t.to(dtype).to(DType::F32);
}

Shape q_shape() { return {B, S, kHeads, D}; }
Shape kv_shape() { return {B, S, kGroups, D}; }
Shape qkv_shape() { return {B * S, (kHeads + 2 * kGroups) * D}; }

TEST(CudaRopePositions, QkvSplitRopeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 900;
  SCOPED_TRACE(seed_trace(seed));
  const Tensor positions = packed_positions(), positions_d = positions.to(Device::CUDA);
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tolerance tol = tolerance(dtype);
    const Tensor qkv = rounded_to(randn(qkv_shape(), seed), dtype);
    const Tensor dq = rounded_to(randn(q_shape(), seed + 1), dtype),
                 dk = rounded_to(randn(kv_shape(), seed + 2), dtype),
                 dv = rounded_to(randn(kv_shape(), seed + 3), dtype);
    Tensor q_ref = Tensor::empty(q_shape()), k_ref = Tensor::empty(kv_shape()),
           v_ref = Tensor::empty(kv_shape()), dqkv_ref = Tensor::empty(qkv_shape());
    ops::qkv_split_rope(qkv, B, kGroups, q_ref, k_ref, v_ref, true, kBase, positions);
    ops::qkv_pack_rope_backward(dq, dk, dv, kGroups, true, kBase, dqkv_ref, positions);

    Tensor q_d = poisoned_device(q_shape(), dtype), k_d = poisoned_device(kv_shape(), dtype),
           v_d = poisoned_device(kv_shape(), dtype), dqkv_d = poisoned_device(qkv_shape(), dtype);
    ops::qkv_split_rope(to_device(qkv, dtype), B, kGroups, q_d, k_d, v_d, true, kBase, positions_d);
    ops::qkv_pack_rope_backward(to_device(dq, dtype), to_device(dk, dtype), to_device(dv, dtype),
                                kGroups, true, kBase, dqkv_d, positions_d);
    const Tensor q = to_host_f32(q_d), k = to_host_f32(k_d), v = to_host_f32(v_d),
                 dqkv = to_host_f32(dqkv_d);
    ASSERT_TRUE(all_finite(q, "q"));
    ASSERT_TRUE(all_finite(k, "k"));
    ASSERT_TRUE(all_finite(v, "v"));
    ASSERT_TRUE(all_finite(dqkv, "dqkv"));
    EXPECT_TRUE(allclose(q, q_ref, tol.atol, tol.rtol));
    EXPECT_TRUE(allclose(k, k_ref, tol.atol, tol.rtol));
    EXPECT_TRUE(allclose(v, v_ref, 0, 0));
    EXPECT_TRUE(allclose(dqkv, dqkv_ref, tol.atol, tol.rtol));
  }
}

ops::QkNorm random_norm(ops::QkNormType type, DType dtype, Device device, uint64_t seed) {
  auto param = [&](uint64_t s, float offset) {
    Tensor t = randn({D}, s, 0.5f);
    for (int64_t j = 0; j < D; ++j) t.f32()[j] += offset;
    t = rounded_to(t, dtype);
    return device == Device::CPU ? t : to_device(t, dtype);
  };
  ops::QkNorm n;
  n.type = type;
  n.q_weight = param(seed, 1.0f);
  n.k_weight = param(seed + 1, 1.0f);
  if (type == ops::QkNormType::LayerNorm) {
    n.q_bias = param(seed + 2, 0.0f);
    n.k_bias = param(seed + 3, 0.0f);
  }
  return n;
}

ops::QkNormSaved make_saved(ops::QkNormType type, DType dtype, Device device) {
  auto make = [&](const Shape& shape, DType dt) {
    Tensor t = Tensor::empty(shape, dt, device);
    testing::poison(t);
    return t;
  };
  ops::QkNormSaved s;
  s.q_input = make(q_shape(), dtype);
  s.k_input = make(kv_shape(), dtype);
  s.q_rstd = make({B * S * kHeads}, DType::F32);
  s.k_rstd = make({B * S * kGroups}, DType::F32);
  if (type == ops::QkNormType::LayerNorm) {
    s.q_mean = make({B * S * kHeads}, DType::F32);
    s.k_mean = make({B * S * kGroups}, DType::F32);
  }
  return s;
}

ops::QkNormGrads zero_grads(bool bias, Device device) {
  ops::QkNormGrads g;
  g.q_weight = Tensor::zeros({D}, DType::F32, device);
  g.k_weight = Tensor::zeros({D}, DType::F32, device);
  if (bias) {
    g.q_bias = Tensor::zeros({D}, DType::F32, device);
    g.k_bias = Tensor::zeros({D}, DType::F32, device);
  }
  return g;
}

TEST(CudaRopePositions, QkvSplitNormRopeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const Tensor positions = packed_positions(), positions_d = positions.to(Device::CUDA);
  for (ops::QkNormType type : {ops::QkNormType::RMSNorm, ops::QkNormType::LayerNorm}) {
    const bool layernorm = type == ops::QkNormType::LayerNorm;
    for (DType dtype : {DType::F32, DType::BF16}) {
      const uint64_t seed = testing::test_seed() + 910 + (layernorm ? 10 : 0);
      SCOPED_TRACE(seed_trace(seed) + ", " + std::string(dtype_name(dtype)) +
                   (layernorm ? ", LayerNorm" : ", RMSNorm"));
      const Tolerance tol = tolerance(dtype);
      const Tensor qkv = rounded_to(randn(qkv_shape(), seed, 2.0f), dtype);
      const ops::QkNorm norm = random_norm(type, dtype, Device::CPU, seed + 1),
                        norm_d = random_norm(type, dtype, Device::CUDA, seed + 1);
      Tensor q_ref = Tensor::empty(q_shape()), k_ref = Tensor::empty(kv_shape()),
             v_ref = Tensor::empty(kv_shape());
      ops::QkNormSaved saved_ref = make_saved(type, DType::F32, Device::CPU);
      ops::qkv_split_norm_rope(qkv, B, kGroups, norm, true, kBase, q_ref, k_ref, v_ref, saved_ref,
                               positions);
      Tensor q_d = poisoned_device(q_shape(), dtype), k_d = poisoned_device(kv_shape(), dtype),
             v_d = poisoned_device(kv_shape(), dtype);
      ops::QkNormSaved saved_d = make_saved(type, dtype, Device::CUDA);
      ops::qkv_split_norm_rope(to_device(qkv, dtype), B, kGroups, norm_d, true, kBase, q_d, k_d,
                               v_d, saved_d, positions_d);
      const Tensor q = to_host_f32(q_d), k = to_host_f32(k_d);
      ASSERT_TRUE(all_finite(q, "q"));
      ASSERT_TRUE(all_finite(k, "k"));
      EXPECT_TRUE(allclose(q, q_ref, tol.atol, tol.rtol));
      EXPECT_TRUE(allclose(k, k_ref, tol.atol, tol.rtol));
      EXPECT_TRUE(allclose(to_host_f32(v_d), v_ref, 0, 0));

      // Backward from the CPU's saved state on both sides.
      const Tensor dq = rounded_to(randn(q_shape(), seed + 2), dtype),
                   dk = rounded_to(randn(kv_shape(), seed + 3), dtype),
                   dv = rounded_to(randn(kv_shape(), seed + 4), dtype);
      Tensor dqkv_ref = Tensor::empty(qkv_shape());
      ops::QkNormGrads grads_ref = zero_grads(layernorm, Device::CPU);
      ops::qkv_pack_norm_rope_backward(dq, dk, dv, saved_ref, kGroups, norm, true, kBase, dqkv_ref,
                                       grads_ref, positions);
      ops::QkNormSaved saved_ref_d;
      saved_ref_d.q_input = to_device(saved_ref.q_input, dtype);
      saved_ref_d.k_input = to_device(saved_ref.k_input, dtype);
      saved_ref_d.q_rstd = saved_ref.q_rstd.to(Device::CUDA);
      saved_ref_d.k_rstd = saved_ref.k_rstd.to(Device::CUDA);
      if (layernorm) {
        saved_ref_d.q_mean = saved_ref.q_mean.to(Device::CUDA);
        saved_ref_d.k_mean = saved_ref.k_mean.to(Device::CUDA);
      }
      Tensor dqkv_d = poisoned_device(qkv_shape(), dtype);
      ops::QkNormGrads grads_d = zero_grads(layernorm, Device::CUDA);
      ops::qkv_pack_norm_rope_backward(to_device(dq, dtype), to_device(dk, dtype),
                                       to_device(dv, dtype), saved_ref_d, kGroups, norm_d, true,
                                       kBase, dqkv_d, grads_d, positions_d);
      const Tensor dqkv = to_host_f32(dqkv_d);
      ASSERT_TRUE(all_finite(dqkv, "dqkv"));
      EXPECT_TRUE(allclose(dqkv, dqkv_ref, tol.atol, tol.rtol));
      // fp32 sums in different orders on the two sides.
      EXPECT_LE(rel_error(to_host_f32(grads_d.q_weight), grads_ref.q_weight), 1e-5);
      EXPECT_LE(rel_error(to_host_f32(grads_d.k_weight), grads_ref.k_weight), 1e-5);
      if (layernorm) {
        EXPECT_LE(rel_error(to_host_f32(grads_d.q_bias), grads_ref.q_bias), 1e-5);
        EXPECT_LE(rel_error(to_host_f32(grads_d.k_bias), grads_ref.k_bias), 1e-5);
      }
    }
  }
}

TEST(CudaRopePositions, MlaQkvRopeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  // DeepSeek-V3's head dims (qk 128, rope 64, v 128), 4 heads.
  const int64_t n = 4, qk = 128, rope = 64, v = 128, offset = 3;
  std::vector<float> f;
  for (int64_t j = 0; j < rope / 2; ++j)
    f.push_back(
        float(std::pow(10000.0, -2.0 * double(j) / double(rope)) / (1.0 + 0.1 * double(j))));
  const float scale = 1.085726f;
  const uint64_t seed = testing::test_seed() + 930;
  SCOPED_TRACE(seed_trace(seed));
  const Tensor positions = packed_positions(), positions_d = positions.to(Device::CUDA);
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto input = [&](const Shape& shape, uint64_t s) { return rounded_to(randn(shape, s), dtype); };
    const Tensor q = input({B, S, n, qk + rope}, seed), kv = input({B, S, n, qk + v}, seed + 1),
                 k_pe = input({B, S, rope}, seed + 2), gq = input(q.shape(), seed + 3),
                 gk = input(q.shape(), seed + 4), gv = input({B, S, n, v}, seed + 5);
    Tensor query = Tensor::empty(q.shape()), key = Tensor::empty(q.shape()),
           value = Tensor::empty(gv.shape());
    ops::mla_qkv_rope(q, kv, k_pe, qk, f, scale, query, key, value, offset, positions);
    Tensor dq = Tensor::empty(q.shape()), dkv = Tensor::empty(kv.shape()),
           dk_pe = Tensor::empty(k_pe.shape());
    ops::mla_qkv_rope_backward(gq, gk, gv, qk, f, scale, dq, dkv, dk_pe, offset, positions);
    Tensor query_d = poisoned_device(q.shape(), dtype), key_d = poisoned_device(q.shape(), dtype),
           value_d = poisoned_device(gv.shape(), dtype);
    ops::mla_qkv_rope(to_device(q, dtype), to_device(kv, dtype), to_device(k_pe, dtype), qk, f,
                      scale, query_d, key_d, value_d, offset, positions_d);
    Tensor dq_d = poisoned_device(q.shape(), dtype), dkv_d = poisoned_device(kv.shape(), dtype),
           dk_pe_d = poisoned_device(k_pe.shape(), dtype);
    ops::mla_qkv_rope_backward(to_device(gq, dtype), to_device(gk, dtype), to_device(gv, dtype), qk,
                               f, scale, dq_d, dkv_d, dk_pe_d, offset, positions_d);
    // As tests/ops/test_cuda_mla_gpu.cpp: F32 the same arithmetic (cos/sin a few ulps apart
    // at most), BF16 one rounding of each output.
    const double tol = dtype == DType::F32 ? 1e-6 : 4e-3;
    for (auto [got, want, name] : {std::tuple{&query_d, &query, "query"},
                                   {&key_d, &key, "key"},
                                   {&value_d, &value, "value"},
                                   {&dq_d, &dq, "dq"},
                                   {&dkv_d, &dkv, "dkv"},
                                   {&dk_pe_d, &dk_pe, "dk_pe"}}) {
      const Tensor host = to_host_f32(*got);
      ASSERT_TRUE(all_finite(host, name));
      EXPECT_LE(rel_error(host, *want), tol) << name;
    }
  }
}

TEST(CudaRopePositions, RejectsBadPositionIds) {
  MEGATON_SKIP_WITHOUT_GPU();
  const Tensor qkv = to_device(randn(qkv_shape(), 1), DType::BF16);
  Tensor q = Tensor::empty(q_shape(), DType::BF16, Device::CUDA),
         k = Tensor::empty(kv_shape(), DType::BF16, Device::CUDA),
         v = Tensor::empty(kv_shape(), DType::BF16, Device::CUDA);
  const Tensor on_host = packed_positions();
  const Tensor too_short = Tensor::zeros({B * S - 1}, DType::I32, Device::CUDA);
  EXPECT_THROW(ops::qkv_split_rope(qkv, B, kGroups, q, k, v, true, kBase, on_host), InternalError);
  EXPECT_THROW(ops::qkv_split_rope(qkv, B, kGroups, q, k, v, true, kBase, too_short),
               InternalError);
}

}  // namespace
}  // namespace megaton

#else
TEST(CudaRopePositions, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }
#endif  // MEGATON_WITH_CUDA
