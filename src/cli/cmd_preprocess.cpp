// `megaton preprocess`: documents -> tokenized .bin/.idx (Megatron tools/preprocess_data.py).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <thread>

#include "cli/commands.h"
#include "core/error.h"
#include "data/preprocess.h"

namespace megaton::cli {

namespace {

struct PreprocessFlags {
  data::PreprocessOptions options;
  std::string input_format = "auto";
};

void print_progress(const data::PreprocessProgress& p) {
  const double secs = std::max(p.seconds, 1e-9);
  std::fprintf(stderr, "\r[preprocess] %lld docs | %lld tokens | %.0f docs/s | %.2f MB/s   ",
               static_cast<long long>(p.documents), static_cast<long long>(p.tokens),
               p.documents / secs, p.bytes / secs / 1e6);
  if (p.done) std::fputc('\n', stderr);
  std::fflush(stderr);
}

void run_preprocess(const PreprocessFlags& flags) {
  data::PreprocessOptions options = flags.options;
  options.input_format = data::parse_input_format(flags.input_format);
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  auto result = data::preprocess(
      options, tty ? print_progress : std::function<void(const data::PreprocessProgress&)>{});
  const auto& t = result.totals;
  for (const auto& prefix : result.output_prefixes)
    std::printf("wrote %s.bin and %s.idx\n", prefix.c_str(), prefix.c_str());
  std::printf("%lld documents from %zu files, %lld tokens, %.1f MB in %.1f s (%.2f MB/s)\n",
              static_cast<long long>(t.documents), result.input_files.size(),
              static_cast<long long>(t.tokens), t.bytes / 1e6, t.seconds,
              t.bytes / std::max(t.seconds, 1e-9) / 1e6);
  if (t.replaced_bytes > 0)
    std::printf("note: %lld bytes of invalid UTF-8 were read as Latin-1\n",
                static_cast<long long>(t.replaced_bytes));
}

}  // namespace

void add_preprocess_command(CLI::App& app) {
  auto flags = std::make_shared<PreprocessFlags>();
  // One thread per core, within the accepted range (kMaxPreprocessWorkers).
  flags->options.workers = std::clamp(int(std::thread::hardware_concurrency()), 1,
                                      data::kMaxPreprocessWorkers);
  CLI::App* cmd = app.add_subcommand(
      "preprocess", "Tokenize documents into <output-prefix>_<key>_document.bin/.idx");
  auto& o = flags->options;
  cmd->add_option("--input", o.inputs,
                  "Input files, directories (their regular files, skipping symlinks, hidden, "
                  "*.dat and *.u8) or globs, read in order")
      ->required();
  cmd->add_option("--output-prefix", o.output_prefix,
                  "Output prefix; writes <prefix>_<key>_document.bin/.idx per json key")
      ->required();
  cmd->add_option("--tokenizer-type", o.tokenizer_type,
                  "SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer, "
                  "GPT2BPETokenizer or ByteTokenizer")
      ->required();
  cmd->add_option("--tokenizer-model", o.tokenizer_model,
                  "SentencePiece .model file, or a tokenizer.json (or its directory, with "
                  "tokenizer_config.json) for HuggingFaceTokenizer");
  cmd->add_option("--vocab-file", o.vocab_file, "GPT2BPETokenizer's vocab.json");
  cmd->add_option("--merge-file", o.merge_file, "GPT2BPETokenizer's merges.txt");
  cmd->add_flag("!--tokenizer-hf-no-include-special-tokens", o.tokenizer_hf_include_special_tokens,
                "HuggingFaceTokenizer: no post-processor specials (e.g. Llama-3's "
                "<|begin_of_text|>) around each document");
  cmd->add_option("--workers", o.workers,
                  fmt::format("Tokenizer threads, 1 to {} (output does not depend on it)",
                              data::kMaxPreprocessWorkers))
      ->capture_default_str();
  cmd->add_flag("--append-eod,!--no-append-eod", o.append_eod,
                "Append the tokenizer's eod token to every document (default on)");
  cmd->add_option("--json-keys", o.json_keys, "JSONL keys to extract; one output per key")
      ->capture_default_str();
  cmd->add_option("--input-format", flags->input_format,
                  "auto (.jsonl/.json -> jsonl, else text), jsonl, text (file = document), "
                  "lines (line = document), fortune (documents separated by '%' lines)")
      ->capture_default_str();
  cmd->callback([flags] { run_preprocess(*flags); });
}

}  // namespace megaton::cli
