// Activation offloading on the GPU (model/activation_offload.h): the side stream's copies
// out and back give the losses and gradients of keeping everything, bit for bit (bf16,
// dropout, deterministic ops), for a dense and an MoE model; the device holds less
// between forward and backward and at its peak; the pinned buffers are reused.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cstdio>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "core/cuda/allocator.h"
#include "model/gpt.h"
#include "model/tiny_gpt_testing.h"
#include "ops/determinism.h"

namespace megaton {
namespace {

// 6 layers of hidden 256 over 4 x 256 tokens: activations of a few MiB per layer.
GPTConfig config(bool moe, int64_t offloaded) {
  testing::TinyGptVariant v = testing::tiny_gpt_variants()[moe ? 3 : 1];  // Llama-style
  GPTConfig c = testing::tiny_gpt_config(v, Device::CUDA, /*bf16=*/true);
  c.num_layers = 6;
  c.hidden_size = 256;
  c.ffn_hidden_size = 1024;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 0;
  c.seq_length = 256;
  c.max_position_embeddings = 0;
  c.vocab_size = 1000;
  c.init_method_std = 0.02f;
  if (moe) {
    c.moe_ffn_hidden_size = 512;
    c.moe_layer_pattern = {1, 0, 1, 1, 0, 1};
  }
  c.cpu_offloading.enabled = offloaded > 0;
  c.cpu_offloading.num_layers = offloaded;
  c.finalize();
  return c;
}

struct Step {
  std::vector<Tensor> losses, grads;  // host fp32
  int64_t held_bytes = 0;             // device bytes allocated between forward and backward
  int64_t peak_bytes = 0;             // device peak over forward and backward
  int64_t offloaded_bytes = 0, host_bytes = 0;
};

// Three steps of one micro-batch each; the last one's numbers.
Step run(const GPTConfig& cfg) {
  GPTModel model(cfg, 1234);
  const int64_t B = 4, S = cfg.seq_length;
  Step r;
  for (int64_t step = 0; step < 3; ++step) {
    const Tensor tokens = testing::randint({B, S}, int32_t(cfg.vocab_size), 10 + uint64_t(step));
    const Tensor labels = testing::randint({B, S}, int32_t(cfg.vocab_size), 20 + uint64_t(step));
    const Tensor dlosses = testing::randn({B * S}, 30 + uint64_t(step), 1e-3f);
    model.zero_grad();
    cuda::synchronize();
    cuda::reset_peak_device_memory();
    const int64_t before = cuda::device_memory_stats().allocated_bytes;
    MicroBatchLoss loss = model.forward(tokens, labels, ForwardContext{true, 1234, step, 0});
    r.held_bytes = cuda::device_memory_stats().allocated_bytes - before;
    model.backward(dlosses, 1.0f);
    cuda::synchronize();
    r.peak_bytes = cuda::device_memory_stats().peak_allocated_bytes - before;
    r.losses = {testing::to_host_f32(loss.losses)};
    if (const ActivationOffload* o = model.activation_offload()) {
      r.offloaded_bytes = 0;
      for (int64_t i = 0; i < o->num_offloaded(); ++i) r.offloaded_bytes += o->offloaded_bytes(i);
      if (step > 0 && cfg.num_experts == 0) {
        EXPECT_EQ(o->host_bytes(), r.host_bytes);
      }
      r.host_bytes = o->host_bytes();
    }
  }
  for (Param* p : model.params()) r.grads.push_back(testing::to_host_f32(p->main_grad));
  return r;
}

class OffloadGpu : public ::testing::TestWithParam<bool> {};

TEST_P(OffloadGpu, SameBitsLowerPeak) {
  MEGATON_SKIP_WITHOUT_GPU();
  ops::set_deterministic(true);  // cuDNN's attention backward without atomics
  const bool moe = GetParam();
  const Step keep = run(config(moe, 0));
  for (int64_t n : {2, 5}) {
    SCOPED_TRACE(std::to_string(n) + " layers offloaded");
    const Step off = run(config(moe, n));
    ASSERT_EQ(off.grads.size(), keep.grads.size());
    EXPECT_TRUE(testing::allclose(off.losses[0], keep.losses[0], 0, 0)) << "losses";
    for (size_t i = 0; i < keep.grads.size(); ++i)
      EXPECT_TRUE(testing::allclose(off.grads[i], keep.grads[i], 0, 0)) << "gradient " << i;
    std::printf("  %s, %lld layers offloaded: held %.1f MiB (kept %.1f), peak %.1f MiB (kept "
                "%.1f), offloaded %.1f MiB, pinned %.1f MiB\n",
                moe ? "MoE" : "dense", static_cast<long long>(n), off.held_bytes / 1048576.0,
                keep.held_bytes / 1048576.0, off.peak_bytes / 1048576.0,
                keep.peak_bytes / 1048576.0, off.offloaded_bytes / 1048576.0,
                off.host_bytes / 1048576.0);
    EXPECT_GT(off.offloaded_bytes, 0);
    EXPECT_GE(off.host_bytes, off.offloaded_bytes);
    // Between forward and backward the offloaded bytes are back in the allocator (its
    // blocks are at least the tensors' bytes, and a little of what is offloaded is held
    // elsewhere too).
    EXPECT_LE(off.held_bytes, keep.held_bytes - off.offloaded_bytes * 9 / 10);
    EXPECT_LT(off.peak_bytes, keep.peak_bytes);
  }
  ops::set_deterministic(false);
}

INSTANTIATE_TEST_SUITE_P(Models, OffloadGpu, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "MoE" : "Dense"; });

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(OffloadGpu, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
