// Tokenizers: bytes and SentencePiece; SentencePiece training on our document readers.
#include "data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <deque>
#include <exception>
#include <filesystem>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "data/bpe_tokenizers.h"

namespace megaton::data {

namespace {

// SentencePiece status messages may hold newlines; our errors are one line.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

void check_ids(std::span<const int32_t> ids, int64_t vocab_size) {
  for (int32_t id : ids)
    if (id < 0 || id >= vocab_size)
      fail("decode: token id {} outside the vocabulary [0, {})", id, vocab_size);
}

}  // namespace

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  check_ids(ids, vocab_size());
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids)
    if (id < 256) out.push_back(static_cast<char>(id));  // eod decodes to nothing
  return out;
}

namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& model_path) {
    if (model_path.empty())
      fail("--tokenizer-model: required for SentencePieceTokenizer (a .model file)");
    auto status = processor_.Load(model_path);
    if (!status.ok())
      fail("--tokenizer-model {}: cannot load a SentencePiece model: {}", model_path,
           one_line(status.ToString()));
    vocab_size_ = processor_.GetPieceSize();
    eod_ = processor_.eos_id();
    if (eod_ < 0 || eod_ >= vocab_size_)
      fail(
          "--tokenizer-model {}: the model has no eos piece, needed as the end-of-document "
          "token",
          model_path);
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    auto status = processor_.Encode(text, &ids);
    if (!status.ok()) fail("SentencePiece encode failed: {}", one_line(status.ToString()));
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  std::string decode(std::span<const int32_t> ids) const override {
    check_ids(ids, vocab_size_);
    std::vector<int> v(ids.begin(), ids.end());
    std::string out;
    auto status = processor_.Decode(v, &out);
    if (!status.ok()) fail("SentencePiece decode failed: {}", one_line(status.ToString()));
    return out;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int32_t eod() const override { return eod_; }

 private:
  sentencepiece::SentencePieceProcessor processor_;
  int64_t vocab_size_ = 0;
  int32_t eod_ = -1;
};

}  // namespace

std::vector<int32_t> NullTokenizer::encode(std::string_view text) const {
  // Megatron's _NullTokenizer: the text is whitespace-separated token ids.
  std::vector<int32_t> ids;
  std::string word;
  auto flush = [&] {
    if (word.empty()) return;
    char* end = nullptr;
    long v = std::strtol(word.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v >= vocab_size_)
      fail("NullTokenizer: '{}' is not a token id below {}", word, vocab_size_);
    ids.push_back(int32_t(v));
    word.clear();
  };
  for (char c : text) {
    if (std::isspace(static_cast<unsigned char>(c))) flush();
    else word += c;
  }
  flush();
  return ids;
}

std::string NullTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += (out.empty() ? "" : " ") + std::to_string(id);
  return out;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& model_path,
                                          int64_t vocab_size) {
  TokenizerOptions options;
  options.type = type;
  options.model = model_path;
  options.vocab_size = vocab_size;
  return make_tokenizer(options);
}

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& o) {
  const std::string& type = o.type;
  if (type == "NullTokenizer") {
    if (o.vocab_size <= 0) fail("--tokenizer-type NullTokenizer needs --vocab-size");
    return std::make_unique<NullTokenizer>(o.vocab_size);
  }
  if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer")
    return std::make_unique<SentencePieceTokenizer>(o.model);
  if (type == "ByteTokenizer") return std::make_unique<ByteTokenizer>();
  if (type == "GPT2BPETokenizer") return make_gpt2_bpe_tokenizer(o.vocab_file, o.merge_file);
  if (type == "HuggingFaceTokenizer")
    return make_huggingface_tokenizer(o.model, o.include_special_tokens);
  std::string valid;
  for (std::string_view t : kTokenizerTypes) valid += (valid.empty() ? "" : ", ") + std::string(t);
  fail("--tokenizer-type '{}': expected one of {}", type, valid);
}

// ---------------------------------------------------------------------------------------
// Training

namespace {

// Feeds SentencePiece the lines of every document of the inputs, in input order.
// SentencePiece drives it as `for (; !it.done(); it.Next()) it.value()`, so it is
// positioned on the first sentence once constructed. Our errors cannot cross
// SentencePiece's frames safely, so they end the iteration and are rethrown after.
class DocumentSentenceIterator final : public sentencepiece::SentenceIterator {
 public:
  DocumentSentenceIterator(std::vector<std::string> files, const SentencePieceTrainOptions& opt)
      : files_(std::move(files)), options_(opt) {
    advance();
  }

  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return status_; }

  void rethrow_if_failed() const {
    if (error_) std::rethrow_exception(error_);
  }
  int64_t num_sentences() const { return num_sentences_; }

 private:
  void advance() {
    try {
      while (pending_.empty()) {
        if (!reader_) {
          if (next_file_ == files_.size()) {
            done_ = true;
            return;
          }
          const std::string& path = files_[next_file_++];
          reader_ = std::make_unique<DocumentReader>(
              path, resolve_input_format(options_.input_format, path));
        }
        SourceDocument doc;
        if (!reader_->next(doc)) {
          reader_.reset();
          continue;
        }
        auto texts =
            document_texts(std::move(doc), reader_->format(), options_.json_keys, reader_->path());
        for (const auto& sequences : texts)
          for (const auto& text : sequences) split_lines(text);
      }
      value_ = std::move(pending_.front());
      pending_.pop_front();
      ++num_sentences_;
    } catch (...) {
      error_ = std::current_exception();
      status_ = sentencepiece::util::Status(sentencepiece::util::StatusCode::kAborted,
                                            "reading the training documents failed");
      done_ = true;
    }
  }

  void split_lines(const std::string& text) {
    size_t start = 0;
    while (start <= text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      std::string_view line(text.data() + start, end - start);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      bool blank =
          std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c); });
      if (!blank) pending_.emplace_back(line);
      start = end + 1;
    }
  }

  std::vector<std::string> files_;
  SentencePieceTrainOptions options_;
  size_t next_file_ = 0;
  std::unique_ptr<DocumentReader> reader_;
  std::deque<std::string> pending_;
  std::string value_;
  bool done_ = false;
  sentencepiece::util::Status status_;
  std::exception_ptr error_;
  int64_t num_sentences_ = 0;
};

}  // namespace

void train_sentencepiece(const std::vector<std::string>& inputs, int64_t vocab_size,
                         const std::string& output_prefix,
                         const SentencePieceTrainOptions& options) {
  if (vocab_size <= 259 || vocab_size > (int64_t(1) << 30))
    fail("--vocab-size {}: expected more than 259 (256 byte pieces + unk, bos, eos)", vocab_size);
  if (options.model_type != "unigram" && options.model_type != "bpe")
    fail("--model-type '{}': expected unigram or bpe", options.model_type);
  if (!(options.character_coverage > 0 && options.character_coverage <= 1))
    fail("--character-coverage {}: expected a value in (0, 1]", options.character_coverage);
  if (options.input_sentence_size < 0)
    fail("--input-sentence-size {}: expected >= 0", options.input_sentence_size);
  if (output_prefix.empty()) fail("--output-prefix: required");
  std::filesystem::path parent = std::filesystem::path(output_prefix).parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent))
    fail("--output-prefix {}: directory {} does not exist", output_prefix, parent.string());

  std::vector<std::string> files = expand_inputs(inputs);
  int threads = options.num_threads > 0
                    ? options.num_threads
                    : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 16);
  const std::string temp_prefix = fmt::format("{}.tmp.{}", output_prefix, ::getpid());
  std::unordered_map<std::string, std::string> args = {
      {"model_prefix", temp_prefix},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", options.model_type},
      {"character_coverage", fmt::format("{}", options.character_coverage)},
      {"byte_fallback", "true"},
      // Identity normalisation and no whitespace collapsing keep decode(encode(s)) == s,
      // as in Llama's tokenizer.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"num_threads", std::to_string(threads)},
      {"input_sentence_size", std::to_string(options.input_sentence_size)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", "65536"},
      {"minloglevel", options.verbose ? "0" : "1"},
  };
  sentencepiece::SetRandomGeneratorSeed(options.seed);
  DocumentSentenceIterator sentences(std::move(files), options);
  auto status = sentencepiece::SentencePieceTrainer::Train(args, &sentences);
  auto cleanup = [&] {
    std::remove((temp_prefix + ".model").c_str());
    std::remove((temp_prefix + ".vocab").c_str());
  };
  try {
    sentences.rethrow_if_failed();
  } catch (...) {
    cleanup();
    throw;
  }
  if (sentences.num_sentences() == 0) {
    cleanup();
    fail("--input: no non-blank text found to train the tokenizer on");
  }
  if (!status.ok()) {
    cleanup();
    fail("SentencePiece training failed: {}", one_line(status.ToString()));
  }
  for (const char* ext : {".vocab", ".model"}) {  // .model last: it marks completion
    if (std::rename((temp_prefix + ext).c_str(), (output_prefix + ext).c_str()) != 0) {
      cleanup();
      fail("{}{}: cannot rename the trained file into place", output_prefix, ext);
    }
  }
}

}  // namespace megaton::data
