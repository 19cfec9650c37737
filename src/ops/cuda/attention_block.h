// Internal to ops/cuda: the kernels of the GPU block attention (attention_block.cu), used by
// its host side (attention_block.cpp).
#pragma once
#include "core/tensor.h"

namespace megaton::ops::cuda {

// out [C, R] = in [R, C] transposed; both F32 on the GPU, contiguous. Between the block op's
// token-major lse [S, H] and cuDNN's packed head-major Stats [H, S]. InternalError on other
// shapes, dtypes or devices.
void lse_transpose(const Tensor& in, Tensor& out);

}  // namespace megaton::ops::cuda
