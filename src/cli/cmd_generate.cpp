// `megaton generate --load DIR --prompt TEXT [sampling flags]`: streams the continuation.
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "data/tokenizer.h"
#include "train/generate.h"

namespace megaton::cli {

void add_generate_command(CLI::App& app) {
  struct State {
    std::string load, prompt;
    SamplingParams params;
  };
  auto s = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand("generate", "sample text from a checkpoint");
  cmd->add_option("--load", s->load, "checkpoint directory (as written by train --save)")
      ->required();
  cmd->add_option("--prompt", s->prompt, "text to continue");
  cmd->add_flag("--greedy", s->params.greedy, "always take the most likely token");
  cmd->add_option("--temperature", s->params.temperature, "softmax temperature (> 0)");
  cmd->add_option("--top-k", s->params.top_k, "sample among the k most likely tokens (0: all)");
  cmd->add_option("--top-p", s->params.top_p, "nucleus sampling threshold (0: off)");
  cmd->add_option("--seed", s->params.seed, "sampling seed");
  cmd->add_option("--tokens-to-generate", s->params.tokens_to_generate,
                  "tokens to add (>= 0; default 64). The context is at most the model's "
                  "positions, W = max-position-embeddings (learned_absolute) or seq-length "
                  "(rope); a longer prompt keeps its last W tokens. When the KV cache is full, "
                  "the window slides: the last W/2 tokens are run again from position 0 and "
                  "generation goes on");
  cmd->callback([s] {
    // Checks the flags before the (slower) model load.
    check_sampling_params(s->params);
    LoadedModel lm = load_model_for_inference(s->load);
    const data::Tokenizer& tokenizer = *lm.tokenizer;
    std::vector<int32_t> prompt = tokenizer.encode(s->prompt);
    if (prompt.empty()) prompt.push_back(tokenizer.eod());  // as generate_tokens starts
    // The prompt's text first, then each token's as soon as it is sampled.
    TextStreamer streamer(tokenizer, stdout);
    streamer.start(prompt);
    generate_tokens(*lm.model, prompt, tokenizer.vocab_size(), tokenizer.eod(), s->params,
                    [&](int32_t token) { streamer.push(token); });
    streamer.finish();
  });
}

}  // namespace megaton::cli
