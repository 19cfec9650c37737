// Text generation from a trained model: greedy, temperature, top-k and top-p sampling.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "ckpt/checkpoint.h"
#include "data/tokenizer.h"
#include "model/gpt.h"

namespace megaton {

// Megatron's text-generation knobs (megatron/inference: temperature, top_k, top_p).
struct SamplingParams {
  bool greedy = false;       // argmax; ignores the others
  float temperature = 1.0f;  // logits / temperature before softmax; must be > 0
  int64_t top_k = 0;         // keep the k most likely tokens (0: all)
  float top_p = 0.0f;        // keep the smallest set with probability >= top_p (0: all)
  uint64_t seed = 1234;
  int64_t tokens_to_generate = 64;
};

// Picks the next token from logits [vocab_size] (entries past vocab_size — the padded
// vocabulary — are never chosen). `draw` is a uniform number in [0, 1).
// Throws megaton::Error for temperature <= 0, top_k < 0 or top_p outside [0, 1].
int32_t sample_token(const float* logits, int64_t vocab_size, const SamplingParams& params,
                     float draw);

// Continues `prompt` (token ids) by up to tokens_to_generate tokens, stopping after `eod`.
// The context is the last seq_length tokens (no KV cache: each step recomputes it).
std::vector<int32_t> generate_tokens(GPTModel& model, std::vector<int32_t> prompt,
                                     int64_t vocab_size, int32_t eod,
                                     const SamplingParams& params);

// Copies "model.<name>" tensors of a checkpoint into the params. Throws megaton::Error
// naming the checkpoint and tensor on a missing name or a shape mismatch.
void load_model_weights(const ckpt::LoadedCheckpoint& ck, const std::vector<Param*>& params);

// A model and tokenizer rebuilt from a checkpoint's saved args and weights.
struct LoadedModel {
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::unique_ptr<GPTModel> model;
  int64_t iteration = 0;
};
LoadedModel load_model_for_inference(const std::string& load_dir);

}  // namespace megaton
