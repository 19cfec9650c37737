// The CUDA side of ops/rope_interleaved.h, defined in rope_interleaved.cu; reached through
// the doors in ops/cpu/rope_interleaved.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops::cuda {

void rope_interleaved_forward(const Tensor& x, Tensor& y, const std::vector<float>& inv_freq,
                              float scale, int64_t position_offset);
void rope_interleaved_backward(const Tensor& dy, Tensor& dx, const std::vector<float>& inv_freq,
                               float scale, int64_t position_offset);

}  // namespace megaton::ops::cuda
