// The MoE layer with the per-expert counts left on the device against the same layer on
// the host-count path, for test_moe_device_counts.cpp (CPU) and its _gpu twin.
//
// One rank, no expert biases: the dispatcher keeps the counts on the device and the
// grouped GEMMs read them there. The reference layer has a capacity factor so large that
// no copy is dropped, which takes the host-count path through the same kernels with the
// same rows: the probabilities times a keep of 1 and the counts of the kept copies are
// the same numbers. The outputs, the input gradient, every main_grad, the aux loss and the
// tokens per expert must then be equal bit for bit.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/testing.h"
#include "model/moe.h"

namespace megaton::testing {

struct DeviceCountsCase {
  const char* name;
  TokenDispatcher dispatcher;
  bool swiglu;
};

inline std::vector<DeviceCountsCase> device_counts_cases() {
  return {{"alltoall_swiglu", TokenDispatcher::AllToAll, true},
          {"alltoall_gelu", TokenDispatcher::AllToAll, false},
          {"allgather_swiglu", TokenDispatcher::AllGather, true}};
}

inline Tensor host_f32(const Tensor& t) {
  return t.device() == Device::CPU ? t.to(DType::F32) : t.to(Device::CPU).to(DType::F32);
}

inline void check_device_counts_equal_host_counts(const DeviceCountsCase& c, Device device,
                                                  bool bf16) {
  const uint64_t seed = test_seed();
  GPTConfig cfg;
  cfg.num_layers = 1;
  cfg.hidden_size = 64;
  cfg.num_experts = 8;
  cfg.moe_router_topk = 2;
  cfg.moe_ffn_hidden_size = 128;
  cfg.swiglu = c.swiglu;
  cfg.disable_bias_linear = true;
  cfg.moe_aux_loss_coeff = 1e-2f;
  cfg.moe_z_loss_coeff = 1e-3f;
  cfg.init_method_std = 0.05f;
  cfg.device = device;
  cfg.bf16 = bf16;
  GPTConfig host_cfg = cfg;
  host_cfg.moe_expert_capacity_factor = 100.0f;  // no copy dropped: the host-count path
  ModelParallel mp;
  mp.dispatcher = c.dispatcher;
  MoELayer on_device("decoder.layers.0.mlp", cfg, seed, mp);
  MoELayer on_host("decoder.layers.0.mlp", host_cfg, seed, mp);
  std::vector<Param*> device_params, host_params;
  on_device.collect_params(device_params);
  on_host.collect_params(host_params);
  ASSERT_EQ(device_params.size(), host_params.size());
  for (size_t i = 0; i < device_params.size(); ++i) {
    device_params[i]->main_grad = Tensor::zeros(device_params[i]->weight.shape(), DType::F32, device);
    host_params[i]->main_grad = Tensor::zeros(host_params[i]->weight.shape(), DType::F32, device);
  }
  const DType dtype = cfg.compute_dtype();
  const Tensor x = randn({96, cfg.hidden_size}, seed + 1).to(dtype).to(device);
  const Tensor dy = randn({96, cfg.hidden_size}, seed + 2, 0.1f).to(dtype).to(device);
  ForwardContext ctx;
  ctx.training = true;
  const Tensor y_device = on_device.forward(x, ctx);
  const Tensor y_host = on_host.forward(x, ctx);
  // The device layer did keep its counts on the device, the reference did not.
  MoELayer::Activations device_state = on_device.take_saved(), host_state = on_host.take_saved();
  EXPECT_TRUE(device_state.moe.expert_counts.defined());
  EXPECT_TRUE(device_state.moe.tokens_per_local_expert.empty());
  EXPECT_FALSE(host_state.moe.expert_counts.defined());
  on_device.restore_saved(std::move(device_state));
  on_host.restore_saved(std::move(host_state));
  EXPECT_EQ(on_device.last_tokens_per_local_expert(), on_host.last_tokens_per_local_expert());
  EXPECT_EQ(on_device.last_aux_loss(), on_host.last_aux_loss());
  EXPECT_GT(on_device.last_aux_loss(), 0.0f);
  on_device.aux_grad_scale = on_host.aux_grad_scale = 0.5f;
  const Tensor dx_device = on_device.backward(dy);
  const Tensor dx_host = on_host.backward(dy);
  EXPECT_TRUE(allclose(host_f32(y_device), host_f32(y_host), 0, 0));
  EXPECT_TRUE(allclose(host_f32(dx_device), host_f32(dx_host), 0, 0));
  for (size_t i = 0; i < device_params.size(); ++i)
    EXPECT_TRUE(allclose(host_f32(device_params[i]->main_grad), host_f32(host_params[i]->main_grad),
                         0, 0))
        << device_params[i]->name;
}

}  // namespace megaton::testing
