// `megaton generate --load DIR --prompt TEXT [sampling flags]`.
#include <cstdio>
#include <memory>

#include "cli/commands.h"
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
  cmd->add_option("--tokens-to-generate", s->params.tokens_to_generate, "tokens to add");
  cmd->callback([s] {
    // Checks the flags before the (slower) model load.
    std::vector<float> probe = {0.0f, 1.0f};
    sample_token(probe.data(), 2, s->params, 0.5f);
    LoadedModel lm = load_model_for_inference(s->load);
    std::vector<int32_t> prompt = lm.tokenizer->encode(s->prompt);
    std::vector<int32_t> out =
        generate_tokens(*lm.model, prompt, lm.tokenizer->vocab_size(), lm.tokenizer->eod(),
                        s->params);
    if (!out.empty() && out.back() == lm.tokenizer->eod()) out.pop_back();
    std::string text = lm.tokenizer->decode(out);
    std::printf("%s\n", text.c_str());
  });
}

}  // namespace megaton::cli
