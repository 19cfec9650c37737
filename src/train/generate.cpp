// Sampling and generation.
#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "model/kv_cache.h"
#include "train/arguments.h"
#include "train/checkpoint_args.h"
#include "train/tensor_parallel_ckpt.h"

namespace megaton {

void check_sampling_params(const SamplingParams& p) {
  if (p.tokens_to_generate < 0)
    fail("--tokens-to-generate must be >= 0 (got {})", p.tokens_to_generate);
  if (!(std::isfinite(p.temperature) && p.temperature > 0))
    fail("--temperature must be a finite number > 0 (got {})", p.temperature);
  if (p.top_k < 0) fail("--top-k must be >= 0 (got {})", p.top_k);
  if (!(p.top_p >= 0 && p.top_p <= 1)) fail("--top-p must be in [0, 1] (got {})", p.top_p);
}

int32_t sample_token(const float* logits, int64_t vocab_size, const SamplingParams& p,
                     float draw) {
  if (p.greedy) return int32_t(std::max_element(logits, logits + vocab_size) - logits);
  check_sampling_params(p);
  std::vector<int32_t> order(vocab_size);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  int64_t keep = p.top_k > 0 ? std::min(p.top_k, vocab_size) : vocab_size;
  std::vector<double> probs(keep);
  double max_logit = logits[order[0]] / p.temperature, total = 0;
  for (int64_t i = 0; i < keep; ++i) {
    probs[i] = std::exp(double(logits[order[i]]) / p.temperature - max_logit);
    total += probs[i];
  }
  for (double& x : probs) x /= total;
  if (p.top_p > 0) {
    double cumulative = 0;
    int64_t n = 0;
    while (n < keep && (n == 0 || cumulative < p.top_p)) cumulative += probs[n++];
    keep = n;
    total = cumulative;
  } else {
    total = 1.0;
  }
  double target = double(draw) * total, acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += probs[i];
    if (target < acc) return order[i];
  }
  return order[keep - 1];
}

std::vector<int32_t> generate_tokens(GPTModel& model, std::vector<int32_t> tokens,
                                     int64_t vocab_size, int32_t eod, const SamplingParams& p,
                                     const TokenCallback& on_token) {
  check_sampling_params(p);
  if (tokens.empty()) tokens.push_back(eod);
  if (p.tokens_to_generate == 0) return tokens;
  const int64_t window = max_inference_positions(model.config());
  // Tokens kept when the window slides: half, so a slide (one prefill of W/2 tokens)
  // comes once every W/2 decode steps.
  const int64_t keep = std::max<int64_t>(1, window / 2);
  InferenceContext context(model.config(), window);
  auto tail = [&](int64_t n) {
    return std::span<const int32_t>(tokens.data() + tokens.size() - n, size_t(n));
  };
  Tensor logits = model.prefill(tail(std::min<int64_t>(int64_t(tokens.size()), window)), context);
  Philox rng(p.seed);
  for (int64_t step = 0; step < p.tokens_to_generate; ++step) {
    const int32_t next = sample_token(logits.f32(), vocab_size, p, rng.uniform(0, uint64_t(step)));
    tokens.push_back(next);
    if (on_token) on_token(next);
    if (next == eod || step + 1 == p.tokens_to_generate) break;
    if (context.fits(1)) logits = model.decode_step(next, context);
    else logits = model.prefill(tail(keep), context);  // the window slides
  }
  return tokens;
}

std::string TextStreamer::text() const { return tokenizer_.decode(tokens_); }

void TextStreamer::start(std::vector<int32_t> prompt) {
  tokens_ = std::move(prompt);
  printed_.clear();
  print(text(), false);
}

void TextStreamer::push(int32_t token) {
  if (token == tokenizer_.eod()) return;
  tokens_.push_back(token);
  print(text(), false);
}

void TextStreamer::finish() {
  print(text(), true);
  std::fputc('\n', out_);
  std::fflush(out_);
}

// Length of the part of `text` no later token can change: without trailing U+FFFD
// characters (bytes that may yet become a character) and without a trailing incomplete
// UTF-8 sequence.
static size_t stable_length(const std::string& text) {
  static const std::string replacement = "\xEF\xBF\xBD";  // U+FFFD
  size_t n = text.size();
  while (n >= 3 && text.compare(n - 3, 3, replacement) == 0) n -= 3;
  // The last lead byte within the last 3 bytes: is its sequence complete?
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte
    const size_t length = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return length > back ? n - back : n;
  }
  return n;
}

void TextStreamer::print(const std::string& text, bool final) {
  if (text.compare(0, printed_.size(), printed_) != 0) {
    if (!final) return;  // earlier text was rewritten: wait for the end
    size_t common = 0;
    while (common < printed_.size() && common < text.size() && printed_[common] == text[common])
      ++common;
    printed_.resize(common);
  }
  const size_t end = final ? text.size() : stable_length(text);
  if (end <= printed_.size()) return;
  std::fwrite(text.data() + printed_.size(), 1, end - printed_.size(), out_);
  std::fflush(out_);
  printed_.assign(text, 0, end);
}

void load_model_weights(const ckpt::LoadedCheckpoint& ck, const std::vector<Param*>& params) {
  for (Param* p : params) {
    std::string name = "model." + p->name;
    auto it = ck.tensors.find(name);
    if (it == ck.tensors.end()) fail("checkpoint '{}' has no tensor '{}'", ck.path, name);
    if (it->second.shape() != p->main_param.shape() || it->second.dtype() != DType::F32)
      fail("checkpoint '{}': tensor '{}' has shape {} {}, the model expects F32 {}", ck.path,
           name, shape_str(it->second.shape()), dtype_name(it->second.dtype()),
           shape_str(p->main_param.shape()));
    p->main_param.copy_from(it->second);
    refresh_compute_weight(*p);
  }
}

LoadedModel load_model_for_inference(const std::string& load_dir) {
  ckpt::LoadedCheckpoint ck = ckpt::load_checkpoint(load_dir);
  nlohmann::json meta = nlohmann::json::parse(ck.metadata_json);
  RawOptions raw;
  try {
    for (auto& [k, v] : meta.at("args").items()) {
      if (v.is_array()) raw[k] = v.get<std::vector<std::string>>();
      else raw[k] = {v.get<std::string>()};
    }
    // Generate on whatever this machine has (a GPU-trained checkpoint samples on a CPU);
    // a converted checkpoint's args name no data or schedule.
    LoadedModel out;
    TrainArgs args = parse_model_args(raw);
    data::TokenizerOptions tok = tokenizer_options(args);
    tok.type = meta.at("tokenizer_type").get<std::string>();
    tok.model = meta.at("tokenizer_model").get<std::string>();
    // Absolute paths, as the checkpoint recorded them (older checkpoints: the args').
    tok.vocab_file = meta.value("tokenizer_vocab_file", tok.vocab_file);
    tok.merge_file = meta.value("tokenizer_merge_file", tok.merge_file);
    out.tokenizer = data::make_tokenizer(tok);
    args.model.vocab_size = out.tokenizer->vocab_size();
    args.model.finalize();
    out.model = std::make_unique<GPTModel>(args.model, args.seed);
    // The vocabulary rows as padded here (one tensor-parallel rank): a checkpoint saved
    // under another TP size (or make-vocab-size-divisible-by) holds another padding.
    for (const Param* p : out.model->params())
      if (p->padded_vocab_rows && ck.tensors.count("model." + p->name))
        ck.tensors["model." + p->name] =
            fit_padded_vocab_rows(ck.tensors["model." + p->name], args.model.padded_vocab_size,
                                  args.model.vocab_size, "model." + p->name, ck.path);
    load_model_weights(ck, out.model->params());
    // The routers' expert biases (--moe-router-enable-expert-bias) choose the experts.
    for (const auto& layer : out.model->layers()) {
      MoELayer* moe = layer->moe();
      if (!moe || !moe->router.expert_bias.defined()) continue;
      std::string name = "model." + moe->router.weight.name;
      name.replace(name.size() - std::string_view(".weight").size(), std::string::npos,
                   ".expert_bias");
      auto it = ck.tensors.find(name);
      if (it == ck.tensors.end() || it->second.shape() != moe->router.expert_bias.shape())
        fail("checkpoint '{}' has no tensor '{}' of shape {}", ck.path, name,
             shape_str(moe->router.expert_bias.shape()));
      moe->router.expert_bias.copy_from(
          it->second.to(DType::F32).to(moe->router.expert_bias.device()));
    }
    out.iteration = ck.iteration;
    return out;
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint metadata in '{}' is incomplete: {}", ck.path, e.what());
  }
}

}  // namespace megaton
