// Generation with a KV cache: every decode step's logits against a full forward of the
// window (GPTModel::logits), across window slides, for the model variants; cached greedy
// and sampled generation against a no-cache reference loop kept here; the sampling flag
// checks; the text streamer; and `megaton generate` through the binary.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/rng.h"
#include "data/preprocess.h"
#include "data/tokenizer.h"
#include "model/kv_cache.h"
#include "model/tiny_gpt_testing.h"
#include "train/generate.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

using testing::TinyGptVariant;

// The window the generation rule promises (--tokens-to-generate's help): the position
// table's rows with learned positions, seq_length with RoPE; half of it kept on a slide.
int64_t window_of(const GPTConfig& cfg) {
  return cfg.position_embedding_type == PositionEmbedding::Rope ? cfg.seq_length
                                                                : cfg.max_position_embeddings;
}
int64_t keep_of(int64_t window) { return std::max<int64_t>(1, window / 2); }

// Logits of the last token of `context` by a full forward (no cache) [padded_vocab].
Tensor full_forward_last(GPTModel& model, const std::vector<int32_t>& context) {
  const int64_t n = int64_t(context.size());
  const Tensor all = model.logits(Tensor::from_i32({1, n}, context));
  return all.rows(n - 1, 1).view({all.dim(1)}).clone();
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  const Tensor t = testing::randint({n}, int32_t(vocab), seed);
  return std::vector<int32_t>(t.i32(), t.i32() + n);
}

class KvCacheTest : public ::testing::TestWithParam<TinyGptVariant> {};

// Teacher-forced random tokens, so that every step runs whatever was sampled: the prefill
// and each decode step give the logits a full forward of the current window gives, also
// right after the window slides (a fresh prefill of the kept half, positions from 0).
TEST_P(KvCacheTest, DecodeLogitsMatchFullForwardOfTheWindow) {
  const GPTConfig cfg = testing::tiny_gpt_config(GetParam());
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPTModel model(cfg, seed);
  testing::randomize_params(model, seed + 1);
  const int64_t W = window_of(cfg), keep = keep_of(W);
  ASSERT_EQ(max_inference_positions(cfg), W);
  const int64_t prompt = 3, total = prompt + 2 * W + 3;  // at least two slides
  const std::vector<int32_t> tokens = random_tokens(total, cfg.vocab_size, seed + 2);

  InferenceContext context(cfg, W);
  int64_t start = 0, slides = 0;
  Tensor got = model.prefill(std::span(tokens.data(), size_t(prompt)), context);
  for (int64_t end = prompt;; ++end) {
    SCOPED_TRACE("window [" + std::to_string(start) + ", " + std::to_string(end) + ")");
    ASSERT_EQ(context.sequence_len_offset, end - start);
    const std::vector<int32_t> window(tokens.begin() + start, tokens.begin() + end);
    const Tensor want = full_forward_last(model, window);
    ASSERT_EQ(got.numel(), cfg.padded_vocab_size);
    EXPECT_LE(testing::rel_error(got, want), 1e-5);
    if (end == total) break;
    if (end + 1 - start > W) {  // the cache is full: slide
      start = end + 1 - keep;
      got = model.prefill(std::span(tokens.data() + start, size_t(end + 1 - start)), context);
      ++slides;
    } else {
      got = model.decode_step(tokens[size_t(end)], context);
    }
  }
  EXPECT_GE(slides, 2);
}

// A prefill of a whole window, then the cache refuses another token (the caller slides).
TEST_P(KvCacheTest, FullWindowPrefillThenCacheIsFull) {
  const GPTConfig cfg = testing::tiny_gpt_config(GetParam());
  const uint64_t seed = testing::test_seed() + 10;
  GPTModel model(cfg, seed);
  testing::randomize_params(model, seed + 1);
  const int64_t W = window_of(cfg);
  const std::vector<int32_t> tokens = random_tokens(W, cfg.vocab_size, seed + 2);
  InferenceContext context(cfg, W);
  const Tensor got = model.prefill(tokens, context);
  EXPECT_LE(testing::rel_error(got, full_forward_last(model, tokens)), 1e-5);
  EXPECT_FALSE(context.fits(1));
  EXPECT_THROW(model.decode_step(tokens[0], context), InternalError);
}

std::string variant_name(const ::testing::TestParamInfo<TinyGptVariant>& info) {
  return info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Variants, KvCacheTest, ::testing::ValuesIn(testing::tiny_gpt_variants()),
                         variant_name);

// The reference generation: a full forward over the window every step, the same window
// rule and the same random draws as generate_tokens.
std::vector<int32_t> generate_without_cache(GPTModel& model, std::vector<int32_t> tokens,
                                            int64_t vocab_size, int32_t eod,
                                            const SamplingParams& p) {
  const int64_t W = window_of(model.config()), keep = keep_of(W);
  size_t start = tokens.size() > size_t(W) ? tokens.size() - size_t(W) : 0;
  Philox rng(p.seed);
  for (int64_t step = 0; step < p.tokens_to_generate; ++step) {
    if (int64_t(tokens.size() - start) > W) start = tokens.size() - size_t(keep);
    const std::vector<int32_t> window(tokens.begin() + int64_t(start), tokens.end());
    const Tensor logits = full_forward_last(model, window);
    const int32_t next = sample_token(logits.f32(), vocab_size, p, rng.uniform(0, uint64_t(step)));
    tokens.push_back(next);
    if (next == eod) break;
  }
  return tokens;
}

class GenerateTest : public ::testing::TestWithParam<TinyGptVariant> {};

TEST_P(GenerateTest, GreedyWithCacheEqualsWithout) {
  const GPTConfig cfg = testing::tiny_gpt_config(GetParam());
  const uint64_t seed = testing::test_seed() + 20;
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPTModel model(cfg, seed);
  testing::randomize_params(model, seed + 1);
  const int64_t W = window_of(cfg);
  SamplingParams greedy;
  greedy.greedy = true;
  greedy.tokens_to_generate = 3 * W;  // slides several times
  // No end-of-document id (-1 is never sampled): every run is 3W tokens long.
  const int32_t no_eod = -1;
  // A short prompt, and one longer than the window (it keeps its last W tokens).
  for (int64_t prompt_length : {int64_t(2), W + 3}) {
    const std::vector<int32_t> prompt = random_tokens(prompt_length, cfg.vocab_size, seed + 2);
    std::vector<int32_t> streamed;
    const std::vector<int32_t> got =
        generate_tokens(model, prompt, cfg.vocab_size, no_eod, greedy,
                        [&](int32_t token) { streamed.push_back(token); });
    const std::vector<int32_t> want =
        generate_without_cache(model, prompt, cfg.vocab_size, no_eod, greedy);
    ASSERT_EQ(got.size(), size_t(prompt_length + 3 * W));
    EXPECT_EQ(got, want) << "prompt of " << prompt_length;
    EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), got.begin()));
    // The callback saw every new token, in order.
    EXPECT_EQ(streamed, std::vector<int32_t>(got.begin() + prompt_length, got.end()));
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GenerateTest, ::testing::ValuesIn(testing::tiny_gpt_variants()),
                         variant_name);

// Temperature, top-k and top-p draw the same tokens with the cache as without it.
TEST(Generate, SampledWithCacheEqualsWithout) {
  const TinyGptVariant variant = testing::tiny_gpt_variants()[3];  // MoE, RoPE, GQA
  const GPTConfig cfg = testing::tiny_gpt_config(variant);
  const uint64_t seed = testing::test_seed() + 30;
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPTModel model(cfg, seed);
  testing::randomize_params(model, seed + 1);
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 20;
  p.top_p = 0.9f;
  p.seed = seed + 2;
  p.tokens_to_generate = 2 * cfg.seq_length + 1;
  const std::vector<int32_t> prompt = random_tokens(3, cfg.vocab_size, seed + 3);
  const int32_t eod = int32_t(cfg.vocab_size - 1);
  EXPECT_EQ(generate_tokens(model, prompt, cfg.vocab_size, eod, p),
            generate_without_cache(model, prompt, cfg.vocab_size, eod, p));
}

TEST(Generate, StopsAfterEodAndAddsNothingForZeroTokens) {
  const GPTConfig cfg = testing::tiny_gpt_config(testing::tiny_gpt_variants()[1]);
  GPTModel model(cfg, testing::test_seed() + 40);
  testing::randomize_params(model, testing::test_seed() + 41);
  const std::vector<int32_t> prompt = random_tokens(4, cfg.vocab_size, testing::test_seed() + 42);
  SamplingParams greedy;
  greedy.greedy = true;
  greedy.tokens_to_generate = 5;
  // The greedy first token, declared the end of document: generation stops there.
  const std::vector<int32_t> free_run = generate_tokens(model, prompt, cfg.vocab_size, -1, greedy);
  const int32_t first = free_run[prompt.size()];
  const std::vector<int32_t> stopped =
      generate_tokens(model, prompt, cfg.vocab_size, first, greedy);
  EXPECT_EQ(stopped.size(), prompt.size() + 1);
  EXPECT_EQ(stopped.back(), first);
  greedy.tokens_to_generate = 0;
  EXPECT_EQ(generate_tokens(model, prompt, cfg.vocab_size, -1, greedy), prompt);
}

// ---------------------------------------------------------------------------------------
// Sampling flags

TEST(SamplingParams, BadValuesNameTheFlag) {
  auto expect_error = [](SamplingParams p, const std::string& flag) {
    try {
      check_sampling_params(p);
      ADD_FAILURE() << "accepted a bad " << flag;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  SamplingParams p;
  EXPECT_NO_THROW(check_sampling_params(p));
  p.tokens_to_generate = -1;
  expect_error(p, "--tokens-to-generate");
  for (float t : {0.0f, -1.0f, NAN, INFINITY}) {
    p = SamplingParams();
    p.temperature = t;
    expect_error(p, "--temperature");
    p.greedy = true;  // checked whether or not greedy
    expect_error(p, "--temperature");
  }
  p = SamplingParams();
  p.top_k = -1;
  expect_error(p, "--top-k");
  for (float top_p : {-0.1f, 1.5f, NAN}) {
    p = SamplingParams();
    p.top_p = top_p;
    expect_error(p, "--top-p");
  }
  p = SamplingParams();
  p.tokens_to_generate = 0;
  p.top_k = 0;
  p.top_p = 1.0f;
  EXPECT_NO_THROW(check_sampling_params(p));
}

// ---------------------------------------------------------------------------------------
// Streaming

// Decodes as SentencePiece with byte fallback does: ids < 256 are bytes, and a byte that
// does not begin a complete UTF-8 character decodes as U+FFFD. id 256 is eod.
class ReplacingByteTokenizer final : public data::Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    return data::ByteTokenizer().encode(text);
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string bytes;
    for (int32_t id : ids)
      if (id < 256) bytes.push_back(char(id));
    std::string out;
    for (size_t i = 0; i < bytes.size();) {
      const unsigned char c = static_cast<unsigned char>(bytes[i]);
      const size_t length = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
      bool whole = length > 0 && i + length <= bytes.size();
      for (size_t k = 1; whole && k < length; ++k)
        whole = (static_cast<unsigned char>(bytes[i + k]) & 0xC0) == 0x80;
      if (whole) {
        out.append(bytes, i, length);
        i += length;
      } else {
        out += "\xEF\xBF\xBD";
        ++i;
      }
    }
    return out;
  }
  int64_t vocab_size() const override { return 257; }
  int32_t eod() const override { return 256; }
};

// What a TextStreamer writes, read back after each call.
class StreamCapture {
 public:
  StreamCapture()
      : path_(fs::temp_directory_path() / ("megaton_stream_" + std::to_string(::getpid()))) {
    file_ = std::fopen(path_.c_str(), "w+");
  }
  ~StreamCapture() {
    std::fclose(file_);
    fs::remove(path_);
  }
  std::FILE* file() { return file_; }
  std::string written() const {
    std::ifstream in(path_, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  fs::path path_;
  std::FILE* file_;
};

bool ends_inside_a_character(const std::string& s) {
  if (s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0) return true;
  for (size_t back = 1; back <= std::min<size_t>(3, s.size()); ++back) {
    const unsigned char c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;
    const size_t length = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return length > back;
  }
  return false;
}

// Streams prompt + continuation token by token; checks that the output only grows, is
// always a prefix of the final text, never stops inside a character until the end, and
// ends as the final text and a newline.
void check_stream(const data::Tokenizer& tokenizer, const std::string& prompt_text,
                  const std::vector<int32_t>& continuation) {
  StreamCapture capture;
  TextStreamer streamer(tokenizer, capture.file());
  std::vector<int32_t> all = tokenizer.encode(prompt_text);
  streamer.start(all);
  for (int32_t t : continuation)
    if (t != tokenizer.eod()) all.push_back(t);
  const std::string final_text = tokenizer.decode(all);
  std::string before = capture.written();
  for (int32_t t : continuation) {
    streamer.push(t);
    const std::string now = capture.written();
    EXPECT_EQ(now.compare(0, before.size(), before), 0) << "the output shrank";
    EXPECT_EQ(final_text.compare(0, now.size(), now), 0) << "'" << now << "' is not a prefix";
    EXPECT_FALSE(ends_inside_a_character(now)) << "'" << now << "'";
    before = now;
  }
  EXPECT_EQ(streamer.text(), final_text);
  streamer.finish();
  EXPECT_EQ(capture.written(), final_text + "\n");
}

std::vector<int32_t> bytes_of(const std::string& s) { return data::ByteTokenizer().encode(s); }

TEST(TextStreamer, ByteTokensSplittingCharacters) {
  const data::ByteTokenizer tokenizer;
  // Two-, three- and four-byte characters arrive one byte at a time; eod ends it.
  std::vector<int32_t> continuation = bytes_of(" wörld € \xF0\x9F\x98\x80!");
  continuation.push_back(tokenizer.eod());
  check_stream(tokenizer, "héllo", continuation);
  // A continuation ending inside a character: finish() prints the dangling bytes too.
  check_stream(tokenizer, "a", bytes_of("b\xE2\x82"));
}

TEST(TextStreamer, ReplacementCharactersAreHeldUntilResolved) {
  const ReplacingByteTokenizer tokenizer;
  StreamCapture capture;
  TextStreamer streamer(tokenizer, capture.file());
  streamer.start(bytes_of("a"));
  EXPECT_EQ(capture.written(), "a");
  streamer.push(0xE2);  // "a\uFFFD": may become a character
  streamer.push(0x82);
  EXPECT_EQ(capture.written(), "a");
  streamer.push(0xAC);  // "a€"
  EXPECT_EQ(capture.written(), "a\xE2\x82\xAC");
  streamer.push(0xFF);  // never valid, but only a later character shows it
  EXPECT_EQ(capture.written(), "a\xE2\x82\xAC");
  streamer.push('d');
  EXPECT_EQ(capture.written(), "a\xE2\x82\xAC\xEF\xBF\xBD" "d");
  streamer.push(tokenizer.eod());
  streamer.finish();
  EXPECT_EQ(capture.written(), "a\xE2\x82\xAC\xEF\xBF\xBD" "d\n");

  check_stream(tokenizer, "x", bytes_of("y\xE2\x82\xAC\xFF\xC3\xA9z\xF0\x9F"));
}

// ---------------------------------------------------------------------------------------
// `megaton generate` through the binary

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("megaton_generate_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // Runs the binary; returns its exit status, with its stdout and stderr lines.
  int run(const std::string& args) {
    const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
    const std::string cmd = std::string(MEGATON_BINARY) + " generate " + args + " > " +
                            out.string() + " 2> " + err.string();
    const int status = std::system(cmd.c_str());
    std::ifstream out_in(out, std::ios::binary);
    stdout_text.assign(std::istreambuf_iterator<char>(out_in), {});
    std::ifstream err_in(err);
    stderr_lines.clear();
    for (std::string line; std::getline(err_in, line);) stderr_lines.push_back(line);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path dir;
  std::string stdout_text;
  std::vector<std::string> stderr_lines;
};

// Flags are checked before the checkpoint is read: a missing checkpoint is not what the
// error names.
TEST_F(GenerateCli, BadFlagsExitWithStatus2AndOneLine) {
  const std::string load = "--load " + (dir / "no_such_checkpoint").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--tokens-to-generate -1", "--tokens-to-generate"},
      {"--temperature 0", "--temperature"},
      {"--temperature nan", "--temperature"},
      {"--temperature inf", "--temperature"},
      {"--top-k -2", "--top-k"},
      {"--top-p 1.5", "--top-p"},
      {"--top-p nan", "--top-p"},
  };
  for (const auto& [flags, name] : cases) {
    EXPECT_EQ(run(load + " " + flags), 2) << flags;
    ASSERT_EQ(stderr_lines.size(), 1u) << flags;
    EXPECT_NE(stderr_lines[0].find(name), std::string::npos) << stderr_lines[0];
    EXPECT_EQ(stdout_text, "") << flags;
  }
  EXPECT_FALSE(fs::exists(dir / "no_such_checkpoint"));
}

// A tiny checkpoint (one training iteration, window 8): the streamed stdout is the prompt
// and the continuation that generate_tokens gives for the same flags, on one line.
TEST_F(GenerateCli, StreamsTheTextOfTheGeneratedTokens) {
  std::ofstream(dir / "corpus.jsonl") << "{\"text\": \"the cat sees the red apple\"}\n"
                                      << "{\"text\": \"a dog eats fresh bread\"}\n";
  data::PreprocessOptions opt;
  opt.inputs = {(dir / "corpus.jsonl").string()};
  opt.output_prefix = (dir / "corpus").string();
  opt.tokenizer_type = "ByteTokenizer";
  data::preprocess(opt);
  RawOptions raw = {{"num-layers", {"2"}},           {"hidden-size", {"32"}},
                    {"num-attention-heads", {"4"}},  {"group-query-attention", {"true"}},
                    {"num-query-groups", {"2"}},     {"seq-length", {"8"}},
                    {"position-embedding-type", {"rope"}}, {"normalization", {"RMSNorm"}},
                    {"swiglu", {"true"}},            {"num-experts", {"4"}},
                    {"moe-ffn-hidden-size", {"24"}}, {"micro-batch-size", {"1"}},
                    {"train-iters", {"1"}},          {"eval-iters", {"0"}},
                    {"split", {"1,0,0"}},            {"tokenizer-type", {"ByteTokenizer"}},
                    {"device", {"cpu"}},
                    {"data-path", {(dir / "corpus_text_document").string()}},
                    {"save", {(dir / "ckpt").string()}}};
  TrainArgs args = parse_train_args(raw);
  Trainer(args, raw).train();

  const std::string prompt = "héllo wörld";
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_k = 50;
  p.seed = 11;
  p.tokens_to_generate = 30;  // several window slides
  ASSERT_EQ(run("--load " + (dir / "ckpt").string() + " --prompt '" + prompt +
                "' --temperature 0.9 --top-k 50 --seed 11 --tokens-to-generate 30"),
            0)
      << (stderr_lines.empty() ? "" : stderr_lines[0]);

  LoadedModel lm = load_model_for_inference((dir / "ckpt").string());
  std::vector<int32_t> tokens =
      generate_tokens(*lm.model, lm.tokenizer->encode(prompt), lm.tokenizer->vocab_size(),
                      lm.tokenizer->eod(), p);
  if (tokens.back() == lm.tokenizer->eod()) tokens.pop_back();
  EXPECT_EQ(stdout_text, lm.tokenizer->decode(tokens) + "\n");
  EXPECT_EQ(stdout_text.rfind(prompt, 0), 0u);
}

}  // namespace
}  // namespace megaton
