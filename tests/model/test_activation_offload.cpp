// Activation offloading (--cpu-offloading, model/activation_offload.h) on the CPU backend:
// the losses, aux losses, input and parameter gradients and router statistics of keeping
// every activation, bit for bit, for dense and MoE models (FP8 recipes, token dropping or
// device counts, a pipeline stashing the chunk); the offloaded layers' saved tensors are
// taken out between forward and backward and their memory returned to the allocator;
// views come back as views; evaluation offloads nothing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/testing.h"
#include "model/gpt.h"
#include "model/tiny_gpt_testing.h"

namespace megaton {
namespace {

// The tiny variants with 4 layers, and for MoE the router features whose state a layer
// saves (jitter, capacity or device counts, the aux-loss terms, the z-loss). fp8: the
// linear layers' GEMMs in FP8 by that recipe ("tensorwise" or "delayed").
GPTConfig config(const testing::TinyGptVariant& v, int64_t offloaded, bool capacity = true,
                 const char* fp8 = nullptr) {
  GPTConfig cfg = testing::tiny_gpt_config(v);
  cfg.num_layers = 4;
  if (fp8 != nullptr) {
    cfg.fp8.enabled = true;
    cfg.fp8.recipe = std::string(fp8) == "delayed" ? Fp8Recipe::Delayed : Fp8Recipe::Tensorwise;
    cfg.fp8.amax_history_len = 4;
    cfg.seq_length = 8;  // every FP8 GEMM dimension a multiple of 16: 16 tokens,
    cfg.moe_ffn_hidden_size = 32;  // 32 expert features
  }
  if (v.moe) {
    cfg.moe_layer_pattern = {1, 0, 1, 1};  // MoE and dense layers among the offloaded
    cfg.moe_input_jitter_eps = 0.01f;
    cfg.moe_expert_capacity_factor = capacity ? 1.0f : 0.0f;
    cfg.moe_router_load_balancing_type = {"aux_loss", "global_aux_loss"};
    cfg.moe_aux_loss_coeffs = {0.01f, 0.02f};
    cfg.moe_z_loss_coeff = 0.001f;
  }
  cfg.cpu_offloading.enabled = offloaded > 0;
  cfg.cpu_offloading.num_layers = offloaded;
  cfg.finalize();
  return cfg;
}

struct RunResult {
  std::vector<Tensor> losses, aux, input_grads;
  std::vector<Tensor> grads;         // every parameter's main_grad
  std::vector<Tensor> router_stats;  // per MoE layer: tokens per expert, metric sums
  // Per micro-batch: host tensor bytes held between forward and backward, and per layer
  // the defined tensors of its saved state then.
  std::vector<int64_t> held_bytes;
  std::vector<std::vector<int64_t>> defined_slots;
  std::vector<int64_t> offloaded_bytes;  // per micro-batch: ActivationOffload's sum
};

// Two micro-batches through a chunk of layers [first, first + n) one after the other
// (forward, backward, forward, backward: the gradients accumulate, the host buffers are
// reused); `stash`: each forward's state is taken out and put back before its backward
// (GPTModel::take_activations, as a pipeline schedule does).
RunResult run(const GPTConfig& cfg, const PipelineChunk& part, bool stash = false) {
  const uint64_t seed = 1234;
  GPTModel model(cfg, seed, ModelParallel{}, 1, 1, part);
  testing::randomize_params(model, seed + 7);
  const int64_t B = 2, S = cfg.seq_length, T = B * S, H = cfg.hidden_size;
  RunResult r;
  for (int64_t m = 0; m < 2; ++m) {
    const uint64_t s = seed + 100 * uint64_t(m);
    ChunkInput in{B, S, testing::randint({B, S}, int32_t(cfg.vocab_size), s + 1),
                  testing::randint({B, S}, int32_t(cfg.vocab_size), s + 2), Tensor(), Tensor()};
    if (!part.pre_process) in.hidden = testing::randn({T, H}, s + 3);
    const Tensor dout = part.post_process ? testing::randn({T}, s + 4, 0.5f)
                                          : testing::randn({T, H}, s + 5);
    const int64_t before = host_allocator_stats().allocated_bytes;
    ChunkOutput out = model.forward_chunk(in, ForwardContext{true, seed, 3, m});
    r.losses.push_back((out.hidden.defined() ? out.hidden : out.loss.losses).clone());
    if (out.loss.aux_losses.defined()) r.aux.push_back(out.loss.aux_losses.clone());
    r.held_bytes.push_back(host_allocator_stats().allocated_bytes - before);
    std::vector<int64_t> defined;
    for (auto& layer : model.layers()) {
      int64_t n = 0;
      layer->for_each_saved_tensor([&](Tensor& t) { n += t.defined(); });
      defined.push_back(n);
    }
    r.defined_slots.push_back(defined);
    int64_t offloaded = 0;
    if (const ActivationOffload* o = model.activation_offload())
      for (int64_t i = 0; i < o->num_offloaded(); ++i) offloaded += o->offloaded_bytes(i);
    r.offloaded_bytes.push_back(offloaded);
    if (stash) {
      ChunkActivations held = model.take_activations();
      model.restore_activations(std::move(held));
    }
    Tensor dx = model.backward_chunk(dout, 0.5f);
    if (dx.defined()) r.input_grads.push_back(dx);
    if (const ActivationOffload* o = model.activation_offload()) {
      EXPECT_FALSE(o->holds());
    }
  }
  for (Param* p : model.params()) r.grads.push_back(p->main_grad.clone());
  for (auto& layer : model.layers()) {
    if (!layer->moe()) continue;
    r.router_stats.push_back(layer->moe()->router.tokens_per_expert().clone());
    r.router_stats.push_back(layer->moe()->router.metric_sums().clone());
  }
  return r;
}

void expect_bitwise(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                    const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(testing::allclose(got[i], want[i], 0, 0)) << what << " " << i;
}

// Offloading the first `offloaded` layers against keeping everything, on the whole model
// and on a last pipeline stage (input gradient, no embedding).
void check(const testing::TinyGptVariant& v, int64_t offloaded, bool capacity, const char* fp8,
           bool stash = false) {
  const std::vector<PipelineChunk> parts = {{}, {1, 3, false, true}};
  for (const PipelineChunk& part : parts) {
    SCOPED_TRACE(std::to_string(offloaded) + " layers offloaded, layers from " +
                 std::to_string(part.first_layer) + (stash ? ", stashed" : ""));
    const RunResult want = run(config(v, 0, capacity, fp8), part);
    const RunResult got = run(config(v, offloaded, capacity, fp8), part, stash);
    expect_bitwise(got.losses, want.losses, "output");
    expect_bitwise(got.aux, want.aux, "aux loss");
    expect_bitwise(got.input_grads, want.input_grads, "input gradient");
    expect_bitwise(got.grads, want.grads, "parameter gradient");
    expect_bitwise(got.router_stats, want.router_stats, "router statistics");
    const int64_t chunk_layers = int64_t(want.defined_slots[0].size());
    for (size_t m = 0; m < 2; ++m) {
      // Between forward and backward the offloaded layers hold no saved tensor, the others
      // all they saved, and the allocator has their bytes back.
      for (int64_t i = 0; i < chunk_layers; ++i) {
        const int64_t have = got.defined_slots[m][size_t(i)], all = want.defined_slots[m][size_t(i)];
        EXPECT_GT(all, 0) << "layer " << i;
        EXPECT_EQ(have, i < offloaded ? 0 : all) << "layer " << i;
      }
      // (A chunk's input, which its first layer keeps, is the caller's too: copied, not freed.)
      const int64_t input_bytes =
          part.pre_process ? 0 : 2 * config(v, 0).seq_length * config(v, 0).hidden_size * 4;
      EXPECT_GT(got.offloaded_bytes[m], input_bytes);
      EXPECT_LE(got.held_bytes[m], want.held_bytes[m] - got.offloaded_bytes[m] + input_bytes)
          << "micro-batch " << m;
    }
  }
}

class Offload : public ::testing::TestWithParam<testing::TinyGptVariant> {};

TEST_P(Offload, SameBitsAsKeepingEverything) {
  for (int64_t n : {1, 3}) check(GetParam(), n, true, nullptr);
}

// Without token dropping the dispatcher keeps the token counts on the device (a tensor
// the MoE layer keeps too: one memory, copied once).
TEST_P(Offload, WithoutTokenDropping) {
  if (!GetParam().moe) GTEST_SKIP() << "dense";
  check(GetParam(), 2, false, nullptr);
}

// FP8 on the CPU twins: the saved FP8 copies and scales go and come back (the delayed
// recipe's amax histories and scales, which are not saved state, stay).
TEST_P(Offload, Fp8Recipes) {
  check(GetParam(), 2, true, "tensorwise");
  check(GetParam(), 2, true, "delayed");
}

// take_activations brings the offloaded layers back first (the stash holds its tensors).
TEST_P(Offload, StashedForward) { check(GetParam(), 3, true, nullptr, /*stash=*/true); }

INSTANTIATE_TEST_SUITE_P(TinyModels, Offload, ::testing::ValuesIn(testing::tiny_gpt_variants()),
                         [](const auto& info) { return info.param.name; });

// Tensors that share memory come back sharing memory: linear_proj's input is a view of
// the attention output, the MoE router's input is the MoE layer's.
TEST(OffloadViews, ComeBackAsViews) {
  testing::TinyGptVariant v = testing::tiny_gpt_variants()[3];  // MoE
  GPTConfig cfg = config(v, 3, true, nullptr);
  cfg.moe_input_jitter_eps = 0;  // the router keeps the MoE layer's own input
  GPTModel model(cfg, 1234);
  testing::randomize_params(model, 5);
  const Tensor tokens = testing::randint({2, cfg.seq_length}, int32_t(cfg.vocab_size), 6);
  model.forward(tokens, tokens, ForwardContext{true, 1234, 0, 0});
  ASSERT_TRUE(model.activation_offload()->holds());
  ChunkActivations stash = model.take_activations();  // puts them back, then moves them out
  model.restore_activations(std::move(stash));
  for (int64_t i = 0; i < 3; ++i) {
    TransformerLayer& layer = *model.layers()[size_t(i)];
    TransformerLayer::Activations a = layer.take_saved();
    const auto& attention = std::any_cast<SelfAttention::Activations&>(a.mixer);
    ASSERT_TRUE(attention.attention.out.defined()) << i;
    EXPECT_EQ(attention.attention.out.raw(), attention.linear_proj.x.raw()) << i;
    if (layer.moe()) {
      const auto& moe = std::any_cast<MoELayer::Activations&>(a.mlp);
      ASSERT_TRUE(moe.moe.x.defined()) << i;
      EXPECT_EQ(moe.moe.x.raw(), moe.router.x.raw()) << i;
    }
    layer.restore_saved(std::move(a));
  }
  model.backward(testing::randn({2 * cfg.seq_length}, 7), 1.0f);
}

// Evaluation (forward_only) and a forward without training offload nothing; the host
// buffers are allocated once and reused by the next steps.
TEST(OffloadEvaluation, NothingOffloadedBuffersReused) {
  const testing::TinyGptVariant v = testing::tiny_gpt_variants()[1];
  const GPTConfig cfg = config(v, 2, true, nullptr);
  GPTModel model(cfg, 1234);
  const Tensor tokens = testing::randint({2, cfg.seq_length}, int32_t(cfg.vocab_size), 6);
  ForwardContext eval{false, 1234, 0, 0};
  eval.forward_only = true;
  model.forward(tokens, tokens, eval);
  EXPECT_FALSE(model.activation_offload()->holds());
  EXPECT_EQ(model.activation_offload()->host_bytes(), 0);
  model.take_activations();
  int64_t host_bytes = -1;
  for (int64_t step = 0; step < 3; ++step) {
    model.forward(tokens, tokens, ForwardContext{true, 1234, step, 0});
    EXPECT_TRUE(model.activation_offload()->holds());
    if (host_bytes < 0) host_bytes = model.activation_offload()->host_bytes();
    EXPECT_GT(host_bytes, 0);
    EXPECT_EQ(model.activation_offload()->host_bytes(), host_bytes) << "step " << step;
    model.backward(testing::randn({2 * cfg.seq_length}, 7), 1.0f);
  }
  // A training forward that is not followed by its backward is dropped by the next one.
  model.forward(tokens, tokens, ForwardContext{true, 1234, 5, 0});
  model.forward(tokens, tokens, ForwardContext{true, 1234, 6, 0});
  model.backward(testing::randn({2 * cfg.seq_length}, 7), 1.0f);
  EXPECT_FALSE(model.activation_offload()->holds());
}

}  // namespace
}  // namespace megaton
