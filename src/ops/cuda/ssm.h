// The CUDA side of ops/ssm.h (Mamba-2's convolution, SSD scan and gated RMSNorm), defined
// in ssm_conv.cu, ssm_scan.cu and ssm_norm.cu; reached through the doors in
// ops/cpu/ssm.cpp, which check the arguments first. Semantics: ops/ssm.h.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/ssm.h"

namespace megaton::ops::cuda {

void causal_conv1d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                           int64_t batch, bool silu, Tensor& y, const Tensor& position_ids);
void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                            const Tensor& bias, int64_t batch, bool silu, Tensor& dx,
                            Tensor& dweight_acc, Tensor& dbias_acc, const Tensor& position_ids);
void causal_conv1d_step(const Tensor& x, const Tensor& weight, const Tensor& bias, bool silu,
                        Tensor& conv_state, Tensor& y);
void causal_conv1d_final_state(const Tensor& x, int64_t batch, Tensor& conv_state);

void ssd_forward(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
                 const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
                 Tensor& y, const Tensor& position_ids, Tensor* final_state);
void ssd_backward(const Tensor& dy, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                  const Tensor& B, const Tensor& C, const Tensor& D, const Tensor& dt_bias,
                  const SsdDims& dims, Tensor& dx, Tensor& ddt, Tensor& dB, Tensor& dC,
                  Tensor& dA_log_acc, Tensor& dD_acc, Tensor& ddt_bias_acc,
                  const Tensor& position_ids);
void ssd_step(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
              const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
              Tensor& state, Tensor& y);

void gated_rmsnorm_forward(const Tensor& y, const Tensor& z, const Tensor& weight,
                           int64_t group_size, float eps, Tensor& out, Tensor& rstd);
void gated_rmsnorm_backward(const Tensor& dout, const Tensor& y, const Tensor& z,
                            const Tensor& weight, const Tensor& rstd, int64_t group_size,
                            Tensor& dy, Tensor& dz, Tensor& dweight_acc);

}  // namespace megaton::ops::cuda
