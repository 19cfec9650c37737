// The CUDA side of ops/muon.h: the Newton-Schulz iteration (muon.cpp, cuBLASLt GEMMs) and
// its kernels (muon.cu), the momentum update and the QKV split; reached through the doors in
// ops/cpu/muon.cpp, which check the arguments first.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/muon.h"

namespace megaton::ops::cuda {

// ops::newton_schulz on the GPU with the steps' coefficients already resolved
// (per_step[k] for step k, per_step.size() >= 1). g, out [batch, rows, cols] (batch 1 for a
// 2-d g), F32 or BF16, not empty.
void newton_schulz(const Tensor& g, Tensor& out, int64_t batch, int64_t rows, int64_t cols,
                   const std::vector<NsCoefficientSet>& per_step, float eps);

// muon.cu: out[b] = g[b] / max(||g[b]||_F, eps) for each of the batch matrices of
// per_matrix elements, the squares summed in fp64 in a fixed order, the norm rounded to
// fp32 and the division done in fp32 (EO's torch.nn.functional.normalize). g, out F32 or
// BF16 alike; out may be g.
void frobenius_normalize(const Tensor& g, Tensor& out, int64_t batch, int64_t per_matrix,
                         float eps);

// muon.cu: ops::muon_momentum_update (F32, checked at the door).
void muon_momentum_update(Tensor& momentum, const Tensor& grad, float beta, bool nesterov,
                          Tensor& update);

// ops::split_qkv_update / join_qkv_update as one strided copy per piece (cudaMemcpy2DAsync).
// groups = u's rows / sum(split_shapes); pieces allocated by the caller.
void split_qkv_update(const Tensor& u, const std::vector<int64_t>& split_shapes,
                      std::vector<Tensor>& pieces);
void join_qkv_update(const std::vector<Tensor>& pieces, const std::vector<int64_t>& split_shapes,
                     Tensor& u);

}  // namespace megaton::ops::cuda
