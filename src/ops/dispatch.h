// MEGATON_CUDA_DISPATCH: sends an op to its CUDA implementation when its tensors are on
// the GPU; compiles to nothing in a CPU-only build (the CPU door checks then reject
// device tensors).
#pragma once
#include "core/tensor.h"
#include "ops/profiler.h"

#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/cuda_ops.h"
// Used at the top of a door function, so __func__ names the op in the profiler's table
// (ops/profiler.h). `call` is spelled twice so that, with profiling off, the GPU path pays
// one branch on a cached bool and no scope object.
#define MEGATON_CUDA_DISPATCH(tensor, call)                                   \
  if ((tensor).device() == ::megaton::Device::CUDA) {                         \
    if (!::megaton::ops::profile_enabled()) return call;                      \
    const ::megaton::ops::OpProfileScope megaton_op_profile_scope_(__func__); \
    return call;                                                              \
  }
#else
#define MEGATON_CUDA_DISPATCH(tensor, call) ((void)0)
#endif
