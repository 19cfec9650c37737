// Model FLOPs (docs/flops.md) and the log line's per-GPU throughput.
#include <gtest/gtest.h>

#include "core/error.h"
#include "train/flops.h"

namespace megaton {
namespace {

GPTConfig small_config() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;  // kv_channels 16, no GQA
  c.seq_length = 32;
  c.ffn_hidden_size = 128;
  c.swiglu = true;
  c.vocab_size = 250;
  c.make_vocab_size_divisible_by = 128;  // padded to 256
  c.finalize();
  return c;
}

// Forward FLOPs per token from the table of docs/flops.md, worked by hand for
// h 64, s 32, q = kv = 64, f 128 (SwiGLU), V 256:
//   linear_qkv 2 x 64 x (64 + 128) = 24576, core attention 2 x 32 x 64 = 4096,
//   linear_proj 2 x 64 x 64 = 8192, MLP 2 x 64 x 128 x 2 + 2 x 128 x 64 = 49152,
//   a layer 86016, two layers 172032, logits 2 x 64 x 256 = 32768: 204800 per token.
TEST(Flops, DenseModelMatchesTheTableByHand) {
  const GPTConfig c = small_config();
  ASSERT_EQ(c.padded_vocab_size, 256);
  EXPECT_DOUBLE_EQ(num_floating_point_operations(c, 10), 3.0 * 204800.0 * 10);
}

// A MoE layer counts its top-k experts and the router only: experts 8, top-2, expert FFN
// 32 (SwiGLU): 2 x (2 x 64 x 32 x 2 + 2 x 32 x 64) + 2 x 64 x 8 = 25600 instead of the
// dense MLP's 49152, in both layers.
TEST(Flops, MoELayerCountsActiveExperts) {
  GPTConfig c = small_config();
  c.num_experts = 8;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 32;
  c.finalize();
  const double per_token = 204800.0 - 2 * 49152.0 + 2 * 25600.0;
  EXPECT_DOUBLE_EQ(num_floating_point_operations(c, 3), 3.0 * per_token * 3);
}

// Multi-latent attention with q LoRA 32, kv LoRA 16, qk 8 + rope 8, v 4 (4 heads) replaces
// the 36864 of self attention per layer and token by
//   q down + up 2 x (64 x 32 + 32 x 4 x 16) = 8192, kv down + up 2 x (64 x (16 + 8) +
//   16 x 4 x (8 + 4)) = 4608, linear_proj 2 x 4 x 4 x 64 = 2048, causal QK^T and PV
//   32 x 4 x (16 + 4) = 2560: 17408.
TEST(Flops, MultiLatentAttentionByHand) {
  GPTConfig c = small_config();
  c.position_embedding_type = PositionEmbedding::Rope;
  c.multi_latent_attention = true;
  c.q_lora_rank = 32;
  c.kv_lora_rank = 16;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 4;
  c.finalize();
  const double per_token = 204800.0 - 2 * 36864.0 + 2 * 17408.0;
  EXPECT_DOUBLE_EQ(num_floating_point_operations(c, 5), 3.0 * per_token * 5);
}

// Two MTP depths add, each, a dense layer (86016), eh_proj 2 x 128 x 64 = 16384 and the
// logits 2 x 64 x 256 = 32768 per token.
TEST(Flops, MultiTokenPredictionDepths) {
  GPTConfig c = small_config();
  c.position_embedding_type = PositionEmbedding::Rope;
  c.mtp_num_layers = 2;
  c.finalize();
  const double per_token = 204800.0 + 2 * (86016.0 + 16384.0 + 32768.0);
  EXPECT_DOUBLE_EQ(num_floating_point_operations(c, 7), 3.0 * per_token * 7);
}

// Megatron logs FLOPs / (time x world size): eight GPUs sharing an iteration of 8e12
// FLOPs in one second run 1 TFLOP/s each, not 8.
TEST(Flops, ThroughputIsPerGpu) {
  EXPECT_DOUBLE_EQ(throughput_per_gpu_tflops(8e12, 1000.0, 8), 1.0);
  EXPECT_DOUBLE_EQ(throughput_per_gpu_tflops(8e12, 500.0, 1), 16.0);
  EXPECT_THROW(throughput_per_gpu_tflops(1e12, 0.0, 1), InternalError);
  EXPECT_THROW(throughput_per_gpu_tflops(1e12, 1.0, 0), InternalError);
}

}  // namespace
}  // namespace megaton
