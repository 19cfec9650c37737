// ops::fp8_transpose on the CPU: the FP8 weights' column-wise copy under --fp8-param-gather.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "common/testing.h"
#include "core/error.h"
#include "ops/fp8.h"

namespace megaton {
namespace {

// Each byte moves to its transposed place unchanged, NaN and negative-zero codes included.
TEST(Fp8Transpose, BytesMoveUnchanged) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{2, 3}, {1, 5}, {70, 130}}) {
    Tensor q = Tensor::empty({rows, cols}, DType::F8E4M3);
    auto* bytes = q.data<uint8_t>();
    for (int64_t i = 0; i < rows * cols; ++i) bytes[i] = uint8_t((i * 37 + 11) % 256);
    bytes[0] = 0x7F;  // NaN
    bytes[rows * cols - 1] = 0x80;  // -0
    Tensor q_t = Tensor::empty({cols, rows}, DType::F8E4M3);
    ops::fp8_transpose(q, q_t);
    const auto* t = q_t.data<uint8_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(t[c * rows + r], bytes[r * cols + c]) << rows << "x" << cols << " at " << r << "," << c;
  }
}

TEST(Fp8Transpose, RejectsBadArguments) {
  Tensor q = Tensor::empty({4, 8}, DType::F8E4M3);
  Tensor not_transposed = Tensor::empty({4, 8}, DType::F8E4M3);
  EXPECT_THROW(ops::fp8_transpose(q, not_transposed), InternalError);
  Tensor other_format = Tensor::empty({8, 4}, DType::F8E5M2);
  EXPECT_THROW(ops::fp8_transpose(q, other_format), InternalError);
  Tensor not_fp8 = Tensor::empty({8, 4}, DType::F32);
  EXPECT_THROW(ops::fp8_transpose(q, not_fp8), InternalError);
  EXPECT_THROW(ops::fp8_transpose(not_fp8, q), InternalError);
}

}  // namespace
}  // namespace megaton
