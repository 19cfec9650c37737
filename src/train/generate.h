// Text generation from a trained model: greedy, temperature, top-k and top-p sampling.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
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

// Checks every knob, greedy or not, naming its flag: throws megaton::Error for
// --tokens-to-generate < 0, --temperature not a finite number > 0, --top-k < 0, or
// --top-p outside [0, 1] (NaN included).
void check_sampling_params(const SamplingParams& params);

// Picks the next token from logits [vocab_size] (entries past vocab_size — the padded
// vocabulary — are never chosen). `draw` is a uniform number in [0, 1).
// Unless greedy, throws megaton::Error as check_sampling_params.
int32_t sample_token(const float* logits, int64_t vocab_size, const SamplingParams& params,
                     float draw);

// Called with each token as soon as it is sampled (the trailing eod included).
using TokenCallback = std::function<void(int32_t)>;

// Continues `prompt` (token ids; an empty prompt starts from eod) by up to
// tokens_to_generate tokens, stopping after `eod`; returns the prompt followed by the new
// tokens. Runs with a KV cache (GPTModel::prefill / decode_step): one forward over the
// context, then one token per step.
// The window: the model attends over at most W = max_inference_positions(config)
// positions (model/kv_cache.h). A prompt longer than W keeps its last W tokens. When the
// cache is full and another token must be run, the window slides: the last max(1, W / 2)
// tokens are run again in one prefill from position 0 (the positions restart; RoPE and
// learned position embeddings see them at 0 .. W/2 - 1) and decoding continues. Each
// step's logits equal GPTModel::logits of the window's tokens (last row).
// Throws as check_sampling_params.
std::vector<int32_t> generate_tokens(GPTModel& model, std::vector<int32_t> prompt,
                                     int64_t vocab_size, int32_t eod,
                                     const SamplingParams& params,
                                     const TokenCallback& on_token = {});

// Prints a generation's text while it grows (megaton generate): the decoded prompt first,
// then, after each token, the new suffix of the decoded text of all the tokens so far, so
// that what was printed is always a prefix of the final text. A token may end inside a
// multi-byte UTF-8 character (byte tokens, SentencePiece byte fallback, which decodes
// such bytes as U+FFFD until the character is complete): a trailing incomplete UTF-8
// sequence or trailing U+FFFD characters are held back until a later token completes them
// or finish() prints the rest. Should a tokenizer ever rewrite text it printed earlier,
// the streamer waits, and finish() prints from where the two texts part (the only case in
// which the stream and the final text differ). Writes to `out` and flushes after each
// write.
class TextStreamer {
 public:
  TextStreamer(const data::Tokenizer& tokenizer, std::FILE* out)
      : tokenizer_(tokenizer), out_(out) {}
  // The prompt's tokens (generate_tokens' first tokens): prints what is stable of its text.
  void start(std::vector<int32_t> prompt);
  // A sampled token; eod is the end and prints nothing (generation stops after it).
  void push(int32_t token);
  // Prints the rest of the text and a newline.
  void finish();
  // The text of every token so far (eod excluded), printed or not yet.
  std::string text() const;

 private:
  void print(const std::string& text, bool final);

  const data::Tokenizer& tokenizer_;
  std::FILE* out_;
  std::vector<int32_t> tokens_;
  std::string printed_;
};

// Copies "model.<name>" tensors of a checkpoint into the params. Throws megaton::Error
// naming the checkpoint and tensor on a missing name or a shape mismatch.
void load_model_weights(const ckpt::LoadedCheckpoint& ck, const std::vector<Param*>& params);

// A model and tokenizer rebuilt from a checkpoint's saved args and weights (one
// tensor-parallel rank: the vocabulary rows of a checkpoint padded for another TP size are
// refitted; the routers' expert biases are loaded too). The args need no data or schedule
// flags (parse_model_args), so a `megaton convert` checkpoint loads.
struct LoadedModel {
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::unique_ptr<GPTModel> model;
  int64_t iteration = 0;
};
LoadedModel load_model_for_inference(const std::string& load_dir);

}  // namespace megaton
