// Preprocessing (Megatron tools/preprocess_data.py): documents -> tokens -> .bin/.idx.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/documents.h"
#include "data/tokenizer.h"

namespace megaton::data {

// The most tokenizer threads --workers may ask for. Tokenizing is CPU-bound, so threads
// beyond the cores only add memory (each keeps up to 4 chunks of up to 4 MiB in flight);
// a fixed cap, rather than one derived from the cores, gives every machine the same
// accepted range and keeps an absurd value from exhausting the thread limit.
inline constexpr int kMaxPreprocessWorkers = 256;

struct PreprocessOptions {
  // --input: files, directories or globs (expand_inputs), read in order.
  std::vector<std::string> inputs;
  // --output-prefix: writes <prefix>_<key>_document.bin/.idx per json key.
  std::string output_prefix;
  // --tokenizer-type / --tokenizer-model / --vocab-file / --merge-file /
  // --tokenizer-hf-no-include-special-tokens (make_tokenizer's TokenizerOptions).
  std::string tokenizer_type;
  std::string tokenizer_model;
  std::string vocab_file;
  std::string merge_file;
  bool tokenizer_hf_include_special_tokens = true;
  // --workers: tokenizer threads, 1 to kMaxPreprocessWorkers. The output does not depend
  // on it.
  int workers = 1;
  // --append-eod / --no-append-eod: append tokenizer.eod() to every non-empty document.
  bool append_eod = true;
  // --json-keys: fields of each JSONL object; one output per key. Formats other than
  // jsonl have exactly one field, named by the single key (default "text").
  std::vector<std::string> json_keys = {"text"};
  // --input-format.
  InputFormat input_format = InputFormat::Auto;
};

struct PreprocessProgress {
  int64_t documents = 0;       // documents written
  int64_t tokens = 0;          // tokens written (all keys)
  int64_t bytes = 0;           // input bytes of the written documents
  int64_t replaced_bytes = 0;  // invalid UTF-8 bytes read as Latin-1 (repair_utf8)
  double seconds = 0;          // since the start
  bool done = false;           // the last report
};

struct PreprocessResult {
  PreprocessProgress totals;
  std::vector<std::string> input_files;      // after expansion
  std::vector<std::string> output_prefixes;  // <prefix>_<key>_document, one per key
};

// Reads, tokenizes and writes. Documents are tokenized by options.workers threads and
// written in input order, so the files are identical for any number of workers.
// on_progress (optional) is called from the calling thread about twice a second and
// once at the end (done = true). Throws megaton::Error for bad options or inputs (naming
// the flag or file:line), for threads that cannot be started, and for an input without
// tokens (no documents, or only empty ones: for any json key) since an empty dataset
// cannot be trained on. Outputs are written under temporary names and renamed only when
// every output is complete, so on any error nothing is left behind.
PreprocessResult preprocess(const PreprocessOptions& options,
                            const std::function<void(const PreprocessProgress&)>& on_progress = {});

// The same with a tokenizer given by the caller (tokenizer_type/model are ignored).
PreprocessResult preprocess(const PreprocessOptions& options, const Tokenizer& tokenizer,
                            const std::function<void(const PreprocessProgress&)>& on_progress = {});

// "<output_prefix>_<key>_document", Megatron's output name.
std::string preprocess_output_prefix(const std::string& output_prefix, const std::string& key);

}  // namespace megaton::data
