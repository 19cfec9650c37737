// Sampling and generation.
#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "train/arguments.h"

namespace megaton {

int32_t sample_token(const float* logits, int64_t vocab_size, const SamplingParams& p,
                     float draw) {
  if (p.greedy) return int32_t(std::max_element(logits, logits + vocab_size) - logits);
  if (!(p.temperature > 0)) fail("temperature must be > 0 (got {})", p.temperature);
  if (p.top_k < 0) fail("top-k must be >= 0 (got {})", p.top_k);
  if (!(p.top_p >= 0 && p.top_p <= 1)) fail("top-p must be in [0, 1] (got {})", p.top_p);
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
                                     int64_t vocab_size, int32_t eod, const SamplingParams& p) {
  if (tokens.empty()) tokens.push_back(eod);
  int64_t seq_length = model.config().seq_length;
  Philox rng(p.seed);
  for (int64_t step = 0; step < p.tokens_to_generate; ++step) {
    int64_t n = std::min<int64_t>(int64_t(tokens.size()), seq_length);
    std::vector<int32_t> context(tokens.end() - n, tokens.end());
    Tensor logits = model.logits(Tensor::from_i32({1, n}, context));
    const float* last = logits.f32() + (n - 1) * logits.dim(1);
    int32_t next = sample_token(last, vocab_size, p, rng.uniform(0, uint64_t(step)));
    tokens.push_back(next);
    if (next == eod) break;
  }
  return tokens;
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
    // Generate on whatever this machine has (a GPU-trained checkpoint samples on a CPU).
    raw.erase("device");
    LoadedModel out;
    TrainArgs args = parse_train_args(raw);
    out.tokenizer = data::make_tokenizer(meta.at("tokenizer_type").get<std::string>(),
                                         meta.at("tokenizer_model").get<std::string>(),
                                         args.vocab_size);
    args.model.vocab_size = out.tokenizer->vocab_size();
    args.model.finalize();
    out.model = std::make_unique<GPTModel>(args.model, args.seed);
    load_model_weights(ck, out.model->params());
    out.iteration = ck.iteration;
    return out;
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint metadata in '{}' is incomplete: {}", ck.path, e.what());
  }
}

}  // namespace megaton
