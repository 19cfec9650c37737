// `megaton tokenizer train`: a SentencePiece model trained on the preprocessing documents.
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "data/tokenizer.h"

namespace megaton::cli {

namespace {

struct TokenizerTrainFlags {
  std::vector<std::string> inputs;
  int64_t vocab_size = 0;
  std::string output_prefix;
  std::string input_format = "auto";
  data::SentencePieceTrainOptions options;
};

void run_tokenizer_train(const TokenizerTrainFlags& flags) {
  data::SentencePieceTrainOptions options = flags.options;
  options.input_format = data::parse_input_format(flags.input_format);
  data::train_sentencepiece(flags.inputs, flags.vocab_size, flags.output_prefix, options);
  std::printf("wrote %s.model and %s.vocab (%s, vocab size %lld)\n", flags.output_prefix.c_str(),
              flags.output_prefix.c_str(), options.model_type.c_str(),
              static_cast<long long>(flags.vocab_size));
}

}  // namespace

void add_tokenizer_command(CLI::App& app) {
  CLI::App* tokenizer = app.add_subcommand("tokenizer", "Tokenizer tools");
  tokenizer->require_subcommand(1);

  auto flags = std::make_shared<TokenizerTrainFlags>();
  CLI::App* train = tokenizer->add_subcommand(
      "train", "Train a SentencePiece model on documents; writes <output-prefix>.model/.vocab");
  auto& o = flags->options;
  train
      ->add_option("--input", flags->inputs,
                   "Input files, directories or globs (as for preprocess)")
      ->required();
  train
      ->add_option("--vocab-size", flags->vocab_size,
                   "Pieces in the vocabulary, including 256 byte pieces and unk/bos/eos")
      ->required();
  train
      ->add_option("--output-prefix", flags->output_prefix,
                   "Writes <prefix>.model and <prefix>.vocab")
      ->required();
  train
      ->add_option("--input-format", flags->input_format,
                   "auto, jsonl, text, lines or fortune (as for preprocess)")
      ->capture_default_str();
  train->add_option("--json-keys", o.json_keys, "JSONL keys whose text is used")
      ->capture_default_str();
  train->add_option("--model-type", o.model_type, "unigram or bpe")->capture_default_str();
  train
      ->add_option("--character-coverage", o.character_coverage,
                   "Fraction of characters given their own piece; the rest use bytes")
      ->capture_default_str();
  train
      ->add_option("--input-sentence-size", o.input_sentence_size,
                   "Sentences (lines) sampled for training, 0 = all")
      ->capture_default_str();
  train->add_option("--num-threads", o.num_threads, "Trainer threads, 0 = all cores (max 16)")
      ->capture_default_str();
  train->add_option("--seed", o.seed, "Seed of SentencePiece's sampling")->capture_default_str();
  train->add_flag("--verbose", o.verbose, "Print SentencePiece's training log");
  train->callback([flags] { run_tokenizer_train(*flags); });
}

}  // namespace megaton::cli
