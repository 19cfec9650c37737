// The CUDA side of ops/mla.h, defined in mla.cu; reached through the doors in
// ops/cpu/mla.cpp (which check the arguments first).
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops::cuda {

void split_columns(const Tensor& x, std::vector<Tensor>& parts);
void concat_columns(const std::vector<Tensor>& parts, Tensor& y);
void mla_qkv_rope(const Tensor& q, const Tensor& kv, const Tensor& k_pe, int64_t qk_head_dim,
                  const std::vector<float>& inv_freq, float rope_scale, Tensor& query, Tensor& key,
                  Tensor& value, int64_t position_offset, const Tensor& position_ids);
void mla_qkv_rope_backward(const Tensor& dquery, const Tensor& dkey, const Tensor& dvalue,
                           int64_t qk_head_dim, const std::vector<float>& inv_freq,
                           float rope_scale, Tensor& dq, Tensor& dkv, Tensor& dk_pe,
                           int64_t position_offset, const Tensor& position_ids);

}  // namespace megaton::ops::cuda
