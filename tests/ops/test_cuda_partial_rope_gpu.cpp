// GPU tests of partial RoPE (Megatron's --rotary-percent, the ops' rotary_dim) against the
// CPU reference (tests/ops/test_partial_rope.cpp checks the CPU against Megatron's
// definition): rope_forward / rope_backward, qkv_split_rope / qkv_pack_rope_backward and
// qkv_split_norm_rope / qkv_pack_norm_rope_backward, F32, BF16 and F16, with rotary dims
// whose halves take the 16-byte vector path of qkv.cu and ones that take its scalar path,
// and with per-token position ids.
#include <cmath>
#include <string>
#include <vector>

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

// CUDA fp32, bf16 and fp16 tolerances of ../shared/CONVENTIONS.md (the GPU uses the CPU's
// fp32 frequencies and angles; 16-bit outputs add one rounding).
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance(DType dtype) {
  if (dtype == DType::F32) return {1e-5, 1e-4};
  return dtype == DType::F16 ? Tolerance{1e-5, 1e-3} : Tolerance{1e-5, 1e-2};
}
Tensor rounded_to(const Tensor& t, DType dtype) {
  return dtype == DType::F32 ? t : t.to(dtype).to(DType::F32);
}
const DType kDtypes[] = {DType::F32, DType::BF16, DType::F16};
constexpr float kBase = 500000.0f;

struct Case {
  int64_t D, R;
  std::string name() const {
    std::string out = "D";
    out += std::to_string(D) + " R" + std::to_string(R);
    return out;
  }
};
// qkv.cu's 16-byte packs hold 4 fp32 or 8 16-bit values: R/2 = 32, 8 and D - R multiples
// of 8 take the vector path in every dtype; R/2 = 20 (D - R = 40) in fp32 only; R/2 = 6
// (D - R = 52) and R/2 = 3 nowhere; an odd D with an even R; R = D.
const Case kCases[] = {{128, 64}, {64, 16}, {80, 40}, {64, 12}, {12, 6}, {9, 4}, {64, 64}};

TEST(CudaPartialRope, RopeForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1200;
  SCOPED_TRACE(seed_trace(seed));
  for (const Case& c : kCases) {
    for (DType dtype : kDtypes) {
      SCOPED_TRACE(c.name() + " " + std::string(dtype_name(dtype)));
      const Shape shape{2, 37, 3, c.D};
      const int64_t offset = 4000;
      const Tensor x = rounded_to(randn(shape, seed + c.D + c.R), dtype);
      const Tolerance tol = tolerance(dtype);
      Tensor y_ref = Tensor::empty(shape), dx_ref = Tensor::empty(shape);
      ops::rope_forward(x, y_ref, kBase, offset, c.R);
      ops::rope_backward(x, dx_ref, kBase, offset, c.R);
      Tensor y_d = poisoned_device(shape, dtype), dx_d = poisoned_device(shape, dtype);
      ops::rope_forward(to_device(x, dtype), y_d, kBase, offset, c.R);
      ops::rope_backward(to_device(x, dtype), dx_d, kBase, offset, c.R);
      const Tensor y = to_host_f32(y_d), dx = to_host_f32(dx_d);
      ASSERT_TRUE(all_finite(y, "y"));
      ASSERT_TRUE(all_finite(dx, "dx"));
      EXPECT_TRUE(allclose(y, y_ref, tol.atol, tol.rtol));
      EXPECT_TRUE(allclose(dx, dx_ref, tol.atol, tol.rtol));
      // In place: the same bits.
      Tensor alias_d = to_device(x, dtype);
      ops::rope_forward(alias_d, alias_d, kBase, offset, c.R);
      EXPECT_TRUE(bitwise_equal(to_host_f32(alias_d), y));
    }
  }
}

// Packed documents' positions (restarting; a run at 4000 and up) for B * S tokens.
Tensor packed_positions(int64_t tokens) {
  std::vector<int32_t> p;
  const int lengths[] = {7, 1, 13, 2};
  for (int i = 0; int64_t(p.size()) < tokens; ++i)
    for (int j = 0; j < lengths[i % 4] && int64_t(p.size()) < tokens; ++j) p.push_back(j);
  for (int64_t t = tokens / 2; t < tokens; ++t) p[size_t(t)] = int32_t(4000 + t);
  return Tensor::from_i32({tokens}, p);
}

struct QkvShape {
  int64_t B, S, heads, groups;
  int64_t tokens() const { return B * S; }
  Shape qkv(int64_t D) const { return {B * S, (heads + 2 * groups) * D}; }
  Shape q(int64_t D) const { return {B, S, heads, D}; }
  Shape kv(int64_t D) const { return {B, S, groups, D}; }
};
constexpr QkvShape kShape{2, 33, 8, 2};

TEST(CudaPartialRope, QkvSplitRopeAndPackMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1210;
  SCOPED_TRACE(seed_trace(seed));
  const QkvShape sh = kShape;
  const Tensor positions = packed_positions(sh.tokens());
  for (const Case& c : kCases) {
    for (DType dtype : kDtypes) {
      for (bool packed : {false, true}) {
        SCOPED_TRACE(c.name() + " " + std::string(dtype_name(dtype)) +
                     (packed ? " position ids" : ""));
        const Tensor ids = packed ? positions : Tensor();
        const Tensor ids_d = packed ? positions.to(Device::CUDA) : Tensor();
        const Tolerance tol = tolerance(dtype);
        const Tensor qkv = rounded_to(randn(sh.qkv(c.D), seed + c.D), dtype);
        const Tensor dq = rounded_to(randn(sh.q(c.D), seed + 1), dtype),
                     dk = rounded_to(randn(sh.kv(c.D), seed + 2), dtype),
                     dv = rounded_to(randn(sh.kv(c.D), seed + 3), dtype);
        Tensor q_ref = Tensor::empty(sh.q(c.D)), k_ref = Tensor::empty(sh.kv(c.D)),
               v_ref = Tensor::empty(sh.kv(c.D)), dqkv_ref = Tensor::empty(sh.qkv(c.D));
        ops::qkv_split_rope(qkv, sh.B, sh.groups, q_ref, k_ref, v_ref, true, kBase, ids, c.R);
        ops::qkv_pack_rope_backward(dq, dk, dv, sh.groups, true, kBase, dqkv_ref, ids, c.R);

        Tensor q_d = poisoned_device(sh.q(c.D), dtype), k_d = poisoned_device(sh.kv(c.D), dtype),
               v_d = poisoned_device(sh.kv(c.D), dtype),
               dqkv_d = poisoned_device(sh.qkv(c.D), dtype);
        ops::qkv_split_rope(to_device(qkv, dtype), sh.B, sh.groups, q_d, k_d, v_d, true, kBase,
                            ids_d, c.R);
        ops::qkv_pack_rope_backward(to_device(dq, dtype), to_device(dk, dtype),
                                    to_device(dv, dtype), sh.groups, true, kBase, dqkv_d,
                                    ids_d, c.R);
        const Tensor q = to_host_f32(q_d), k = to_host_f32(k_d), v = to_host_f32(v_d),
                     dqkv = to_host_f32(dqkv_d);
        ASSERT_TRUE(all_finite(q, "q"));
        ASSERT_TRUE(all_finite(k, "k"));
        ASSERT_TRUE(all_finite(v, "v"));
        ASSERT_TRUE(all_finite(dqkv, "dqkv"));
        EXPECT_TRUE(allclose(q, q_ref, tol.atol, tol.rtol));
        EXPECT_TRUE(allclose(k, k_ref, tol.atol, tol.rtol));
        EXPECT_TRUE(allclose(v, v_ref, 0, 0));  // a copy
        EXPECT_TRUE(allclose(dqkv, dqkv_ref, tol.atol, tol.rtol));
      }
    }
  }
}

// The norm parameters of a random q/k norm (weights around 1), host F32 and device `dtype`.
struct Norms {
  ops::QkNorm host, device;
};
Norms random_norms(ops::QkNormType type, int64_t D, DType dtype, uint64_t seed) {
  Norms n;
  n.host.type = n.device.type = type;
  const bool bias = type == ops::QkNormType::LayerNorm;
  Tensor* host[4] = {&n.host.q_weight, &n.host.k_weight, &n.host.q_bias, &n.host.k_bias};
  Tensor* device[4] = {&n.device.q_weight, &n.device.k_weight, &n.device.q_bias,
                       &n.device.k_bias};
  for (int p = 0; p < (bias ? 4 : 2); ++p) {
    Tensor t = randn({D}, seed + uint64_t(p), 0.5f);
    if (p < 2)
      for (int64_t j = 0; j < D; ++j) t.f32()[j] += 1.0f;
    *host[p] = rounded_to(t, dtype);
    *device[p] = to_device(*host[p], dtype);
  }
  return n;
}

ops::QkNormSaved make_saved(const QkvShape& sh, int64_t D, ops::QkNormType type, DType dtype,
                            Device device) {
  ops::QkNormSaved s;
  s.q_input = Tensor::empty(sh.q(D), dtype, device);
  s.k_input = Tensor::empty(sh.kv(D), dtype, device);
  s.q_rstd = Tensor::empty({sh.tokens() * sh.heads}, DType::F32, device);
  s.k_rstd = Tensor::empty({sh.tokens() * sh.groups}, DType::F32, device);
  if (type == ops::QkNormType::LayerNorm) {
    s.q_mean = Tensor::empty({sh.tokens() * sh.heads}, DType::F32, device);
    s.k_mean = Tensor::empty({sh.tokens() * sh.groups}, DType::F32, device);
  }
  for (Tensor* t : {&s.q_input, &s.k_input, &s.q_rstd, &s.k_rstd, &s.q_mean, &s.k_mean})
    if (t->defined()) testing::poison(*t);
  return s;
}

ops::QkNormGrads zero_grads(int64_t D, bool bias, Device device) {
  ops::QkNormGrads g{Tensor::zeros({D}, DType::F32, device), Tensor::zeros({D}, DType::F32, device),
                     Tensor(), Tensor()};
  if (bias) {
    g.q_bias = Tensor::zeros({D}, DType::F32, device);
    g.k_bias = Tensor::zeros({D}, DType::F32, device);
  }
  return g;
}

// The fused split + q/k norm + partial RoPE: the warp kernels' lanes hold the rotary pairs
// and then the tail's pairs (rope_table.cuh's head_channels).
TEST(CudaPartialRope, QkvSplitNormRopeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1220;
  SCOPED_TRACE(seed_trace(seed));
  const QkvShape sh = kShape;
  const Tensor positions = packed_positions(sh.tokens());
  for (const Case& c : kCases) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      for (ops::QkNormType type : {ops::QkNormType::RMSNorm, ops::QkNormType::LayerNorm}) {
        for (bool packed : {false, true}) {
          const bool layernorm = type == ops::QkNormType::LayerNorm;
          SCOPED_TRACE(c.name() + " " + std::string(dtype_name(dtype)) +
                       (layernorm ? " LayerNorm" : " RMSNorm") + (packed ? " position ids" : ""));
          const Tensor ids = packed ? positions : Tensor();
          const Tensor ids_d = packed ? positions.to(Device::CUDA) : Tensor();
          const Tolerance tol = tolerance(dtype);
          const Tensor qkv = rounded_to(randn(sh.qkv(c.D), seed + c.D, 2.0f), dtype);
          const Norms norms = random_norms(type, c.D, dtype, seed + 1);

          Tensor q_ref = Tensor::empty(sh.q(c.D)), k_ref = Tensor::empty(sh.kv(c.D)),
                 v_ref = Tensor::empty(sh.kv(c.D));
          ops::QkNormSaved saved_ref = make_saved(sh, c.D, type, DType::F32, Device::CPU);
          ops::qkv_split_norm_rope(qkv, sh.B, sh.groups, norms.host, true, kBase, q_ref, k_ref,
                                   v_ref, saved_ref, ids, c.R);
          Tensor q_d = poisoned_device(sh.q(c.D), dtype), k_d = poisoned_device(sh.kv(c.D), dtype),
                 v_d = poisoned_device(sh.kv(c.D), dtype);
          ops::QkNormSaved saved_d = make_saved(sh, c.D, type, dtype, Device::CUDA);
          ops::qkv_split_norm_rope(to_device(qkv, dtype), sh.B, sh.groups, norms.device, true,
                                   kBase, q_d, k_d, v_d, saved_d, ids_d, c.R);
          const Tensor q = to_host_f32(q_d), k = to_host_f32(k_d), v = to_host_f32(v_d);
          ASSERT_TRUE(all_finite(q, "q"));
          ASSERT_TRUE(all_finite(k, "k"));
          ASSERT_TRUE(all_finite(v, "v"));
          EXPECT_TRUE(allclose(q, q_ref, tol.atol, tol.rtol));
          EXPECT_TRUE(allclose(k, k_ref, tol.atol, tol.rtol));
          EXPECT_TRUE(allclose(v, v_ref, 0, 0));
          EXPECT_TRUE(allclose(to_host_f32(saved_d.q_input), saved_ref.q_input, 0, 0));

          // Backward from the CPU's saved tensors on both sides.
          const Tensor dq = rounded_to(randn(sh.q(c.D), seed + 2), dtype),
                       dk = rounded_to(randn(sh.kv(c.D), seed + 3), dtype),
                       dv = rounded_to(randn(sh.kv(c.D), seed + 4), dtype);
          Tensor dqkv_ref = Tensor::empty(sh.qkv(c.D));
          ops::QkNormGrads grads_ref = zero_grads(c.D, layernorm, Device::CPU);
          ops::qkv_pack_norm_rope_backward(dq, dk, dv, saved_ref, sh.groups, norms.host, true,
                                           kBase, dqkv_ref, grads_ref, ids, c.R);
          ops::QkNormSaved saved_ref_d{
              to_device(saved_ref.q_input, dtype), to_device(saved_ref.k_input, dtype),
              layernorm ? saved_ref.q_mean.to(Device::CUDA) : Tensor(),
              saved_ref.q_rstd.to(Device::CUDA),
              layernorm ? saved_ref.k_mean.to(Device::CUDA) : Tensor(),
              saved_ref.k_rstd.to(Device::CUDA)};
          Tensor dqkv_d = poisoned_device(sh.qkv(c.D), dtype);
          ops::QkNormGrads grads_d = zero_grads(c.D, layernorm, Device::CUDA);
          ops::qkv_pack_norm_rope_backward(to_device(dq, dtype), to_device(dk, dtype),
                                           to_device(dv, dtype), saved_ref_d, sh.groups,
                                           norms.device, true, kBase, dqkv_d, grads_d, ids_d,
                                           c.R);
          const Tensor dqkv = to_host_f32(dqkv_d);
          ASSERT_TRUE(all_finite(dqkv, "dqkv"));
          EXPECT_TRUE(allclose(dqkv, dqkv_ref, tol.atol, tol.rtol));
          EXPECT_LE(rel_error(dqkv, dqkv_ref), dtype == DType::F32 ? 1e-5 : 1e-2);
          // The weight gradients: sums over all rows in different orders (fp32 or better).
          EXPECT_LE(rel_error(to_host_f32(grads_d.q_weight), grads_ref.q_weight), 1e-5);
          EXPECT_LE(rel_error(to_host_f32(grads_d.k_weight), grads_ref.k_weight), 1e-5);
          if (layernorm) {
            EXPECT_LE(rel_error(to_host_f32(grads_d.q_bias), grads_ref.q_bias), 1e-5);
            EXPECT_LE(rel_error(to_host_f32(grads_d.k_bias), grads_ref.k_bias), 1e-5);
          }
        }
      }
    }
  }
}

TEST(CudaPartialRope, BadRotaryDimsAreRefused) {
  MEGATON_SKIP_WITHOUT_GPU();
  const QkvShape sh{1, 2, 2, 1};
  const int64_t D = 8;
  const Tensor x = to_device(randn(sh.q(D), 1), DType::BF16),
               qkv = to_device(randn(sh.qkv(D), 2), DType::BF16);
  Tensor y = Tensor::empty(sh.q(D), DType::BF16, Device::CUDA);
  Tensor q = Tensor::empty(sh.q(D), DType::BF16, Device::CUDA),
         k = Tensor::empty(sh.kv(D), DType::BF16, Device::CUDA),
         v = Tensor::empty(sh.kv(D), DType::BF16, Device::CUDA);
  const Norms norms = random_norms(ops::QkNormType::RMSNorm, D, DType::BF16, 3);
  ops::QkNormSaved saved = make_saved(sh, D, ops::QkNormType::RMSNorm, DType::BF16, Device::CUDA);
  for (int64_t bad : {int64_t(3), int64_t(10), int64_t(-2)}) {
    SCOPED_TRACE("rotary_dim " + std::to_string(bad));
    EXPECT_THROW(ops::rope_forward(x, y, 1e4f, 0, bad), InternalError);
    EXPECT_THROW(ops::qkv_split_rope(qkv, sh.B, sh.groups, q, k, v, true, 1e4f, Tensor(), bad),
                 InternalError);
    EXPECT_THROW(ops::qkv_split_norm_rope(qkv, sh.B, sh.groups, norms.device, true, 1e4f, q, k, v,
                                          saved, Tensor(), bad),
                 InternalError);
  }
  cuda::synchronize();
}

}  // namespace
}  // namespace megaton

#else

TEST(CudaPartialRope, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif  // MEGATON_WITH_CUDA
