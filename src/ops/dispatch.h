// MEGATON_CUDA_DISPATCH: sends an op to its CUDA implementation when its tensors are on
// the GPU; compiles to nothing in a CPU-only build (the CPU door checks then reject
// device tensors).
#pragma once
#include "core/tensor.h"

#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/cuda_ops.h"
#define MEGATON_CUDA_DISPATCH(tensor, call) \
  if ((tensor).device() == ::megaton::Device::CUDA) return call
#else
#define MEGATON_CUDA_DISPATCH(tensor, call) ((void)0)
#endif
