// GPU test of multi-latent attention's data movement (ops/mla.h) against the CPU ops, in
// F32 and BF16: the column split/concat exactly, the RoPE assembly and its backward.
#include <cmath>
#include <vector>

#include "common/testing.h"
#include "ops/mla.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

TEST(CudaMla, SplitAndConcatColumnsMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor x = testing::randn({37, 29}, testing::test_seed()).to(dtype).to(DType::F32);
    std::vector<Tensor> parts{Tensor::empty({37, 16}), Tensor::empty({37, 13})};
    ops::split_columns(x, parts);
    std::vector<Tensor> parts_d{testing::poisoned_device({37, 16}, dtype),
                                testing::poisoned_device({37, 13}, dtype)};
    ops::split_columns(testing::to_device(x, dtype), parts_d);
    for (size_t i = 0; i < parts.size(); ++i)
      EXPECT_TRUE(testing::allclose(testing::to_host_f32(parts_d[i]), parts[i], 0, 0));
    Tensor y_d = testing::poisoned_device({37, 29}, dtype);
    ops::concat_columns(parts_d, y_d);
    EXPECT_TRUE(testing::allclose(testing::to_host_f32(y_d), x, 0, 0));
  }
}

TEST(CudaMla, QkvRopeForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  // DeepSeek-V3's head dims (qk 128, rope 64, v 128), 4 heads, positions from 4000.
  const int64_t B = 2, S = 40, n = 4, qk = 128, rope = 64, v = 128;
  std::vector<float> f;
  for (int64_t j = 0; j < rope / 2; ++j)
    f.push_back(float(std::pow(10000.0, -2.0 * double(j) / double(rope)) / (1.0 + 0.1 * double(j))));
  const float scale = 1.085726f;
  const uint64_t seed = testing::test_seed() + 300;
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto input = [&](const Shape& shape, uint64_t s) {
      return testing::randn(shape, s).to(dtype).to(DType::F32);
    };
    const Tensor q = input({B, S, n, qk + rope}, seed), kv = input({B, S, n, qk + v}, seed + 1),
                 k_pe = input({B, S, rope}, seed + 2), gq = input(q.shape(), seed + 3),
                 gk = input(q.shape(), seed + 4), gv = input({B, S, n, v}, seed + 5);
    Tensor query = Tensor::empty(q.shape()), key = Tensor::empty(q.shape()),
           value = Tensor::empty(gv.shape());
    ops::mla_qkv_rope(q, kv, k_pe, qk, f, scale, query, key, value, 4000);
    Tensor dq = Tensor::empty(q.shape()), dkv = Tensor::empty(kv.shape()),
           dk_pe = Tensor::empty(k_pe.shape());
    ops::mla_qkv_rope_backward(gq, gk, gv, qk, f, scale, dq, dkv, dk_pe, 4000);
    Tensor query_d = testing::poisoned_device(q.shape(), dtype),
           key_d = testing::poisoned_device(q.shape(), dtype),
           value_d = testing::poisoned_device(gv.shape(), dtype);
    ops::mla_qkv_rope(testing::to_device(q, dtype), testing::to_device(kv, dtype),
                      testing::to_device(k_pe, dtype), qk, f, scale, query_d, key_d, value_d,
                      4000);
    Tensor dq_d = testing::poisoned_device(q.shape(), dtype),
           dkv_d = testing::poisoned_device(kv.shape(), dtype),
           dk_pe_d = testing::poisoned_device(k_pe.shape(), dtype);
    ops::mla_qkv_rope_backward(testing::to_device(gq, dtype), testing::to_device(gk, dtype),
                               testing::to_device(gv, dtype), qk, f, scale, dq_d, dkv_d,
                               dk_pe_d, 4000);
    // F32: the same fp32 arithmetic (cos/sin a few ulps apart at most); BF16: one rounding
    // of each output (2^-9), the summed k_pe gradient in fp32 before it.
    const double tol = dtype == DType::F32 ? 1e-6 : 4e-3;
    EXPECT_LE(testing::rel_error(testing::to_host_f32(query_d), query), tol);
    EXPECT_LE(testing::rel_error(testing::to_host_f32(key_d), key), tol);
    EXPECT_LE(testing::rel_error(testing::to_host_f32(value_d), value), tol);
    EXPECT_LE(testing::rel_error(testing::to_host_f32(dq_d), dq), tol);
    EXPECT_LE(testing::rel_error(testing::to_host_f32(dkv_d), dkv), tol);
    EXPECT_LE(testing::rel_error(testing::to_host_f32(dk_pe_d), dk_pe), tol);
  }
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
