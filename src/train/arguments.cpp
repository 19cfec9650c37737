// Option table, YAML reading and conversion to TrainArgs.
#include "train/arguments.h"
#include "train/pipeline_schedule.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdlib>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/printable.h"
#include "dist/comm.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#endif

namespace megaton {

bool cuda_built() {
#ifdef MEGATON_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() {
#ifdef MEGATON_WITH_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

const std::vector<OptionSpec>& train_option_specs() {
  static const std::vector<OptionSpec> specs = {
      // model
      {"num-layers", "number of transformer layers"},
      {"hidden-size", "transformer hidden size"},
      {"ffn-hidden-size", "MLP hidden size (default 4 x hidden-size)"},
      {"num-attention-heads", "attention heads"},
      {"group-query-attention", "use grouped-query attention", true},
      {"num-query-groups", "key/value head groups with group-query-attention"},
      {"kv-channels", "head dimension (default hidden-size / num-attention-heads)"},
      {"seq-length", "tokens per sample"},
      {"max-position-embeddings", "positions of learned_absolute embeddings (default seq-length)"},
      {"make-vocab-size-divisible-by", "pad the vocabulary up to a multiple of this"},
      {"normalization", "LayerNorm or RMSNorm"},
      {"norm-epsilon", "epsilon of the norms"},
      {"qk-layernorm", "normalize each query and key head before RoPE (Qwen3's q_norm/k_norm)",
       true},
      {"swiglu", "SwiGLU MLP instead of GeLU", true},
      {"position-embedding-type", "learned_absolute or rope"},
      {"rotary-base", "RoPE base"},
      {"untie-embeddings-and-output-weights", "separate output layer", true},
      {"init-method-std", "std of the normal weight init"},
      {"disable-bias-linear", "no biases in linear layers", true},
      {"hidden-dropout", "dropout after attention, MLP and embedding"},
      {"attention-dropout", "dropout on attention probabilities"},
      {"num-experts", "experts per MoE layer (0: dense)"},
      {"moe-ffn-hidden-size", "expert MLP hidden size"},
      {"moe-router-topk", "experts per token"},
      {"moe-router-pre-softmax", "softmax over all experts before top-k", true},
      {"moe-layer-freq", "every n-th layer is MoE, or a pattern like [0]*1+[1]*3"},
      {"moe-router-load-balancing-type",
       "aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none (several allowed)", false,
       true},
      {"moe-aux-loss-coeff", "coefficient of each load-balancing loss", false, true},
      {"moe-router-score-function", "softmax, sigmoid or sqrtsoftplus"},
      {"moe-router-topk-scaling-factor", "multiply the top-k probabilities by this"},
      {"moe-router-dtype", "fp32 or fp64: the router's gating GEMM and statistics"},
      {"moe-router-num-groups", "expert groups for group-limited routing"},
      {"moe-router-group-topk", "groups each token may use"},
      {"moe-z-loss-coeff", "coefficient of the router z-loss"},
      {"moe-input-jitter-eps", "multiply router inputs by Uniform(1-eps, 1+eps)"},
      {"moe-router-enable-expert-bias", "aux-loss-free balancing with a per-expert bias", true},
      {"moe-router-bias-update-rate", "expert bias update rate"},
      {"moe-router-force-load-balancing", "random routing scores (benchmarking)", true},
      {"moe-expert-capacity-factor", "per-expert capacity factor (token dropping)"},
      {"moe-token-drop-policy", "probs or position: which routed tokens an expert keeps"},
      {"moe-pad-expert-input-to-capacity", "pad every expert to its capacity", true},
      {"moe-shared-expert-intermediate-size", "hidden size of the shared expert"},
      {"moe-shared-expert-gate", "sigmoid gate on the shared expert output", true},
      {"moe-per-layer-logging", "log MoE metrics per layer", true},
      // optimizer and schedule
      {"optimizer", "adam (AdamW)"},
      {"lr", "peak learning rate"},
      {"min-lr", "minimum learning rate"},
      {"lr-decay-style", "constant, linear, cosine, inverse-square-root or WSD"},
      {"lr-wsd-decay-style", "exponential, linear, cosine or minus_sqrt"},
      {"lr-wsd-decay-iters", "iterations of the WSD decay phase"},
      {"lr-warmup-iters", "linear warmup iterations"},
      {"lr-warmup-init", "learning rate at the start of warmup"},
      {"lr-decay-iters", "iterations to decay over (default train-iters)"},
      {"weight-decay", "AdamW weight decay"},
      {"adam-beta1", "AdamW beta1"},
      {"adam-beta2", "AdamW beta2"},
      {"adam-eps", "AdamW epsilon"},
      {"use-precision-aware-optimizer",
       "allow the main params, main grads and Adam moments below fp32 (Megatron / Transformer "
       "Engine FusedAdam)", true},
      {"main-params-dtype", "dtype of the main params with the precision-aware optimizer: fp32 "
       "(fp16 not supported yet)"},
      {"main-grads-dtype", "dtype of the main grads with the precision-aware optimizer: fp32 "
       "or bf16 (bf16 grad buffers under --bf16: accumulated and reduced in bf16)"},
      {"grad-reduce-in-bf16", "with --bf16: bf16 grad buffers, accumulated and reduced over "
       "data-parallel ranks in bf16 (Megatron's)", true},
      {"accumulate-allreduce-grads-in-fp32", "fp32 grad buffers (the --bf16 default unless "
       "--grad-reduce-in-bf16 or --main-grads-dtype bf16; Megatron's)", true},
      {"exp-avg-dtype", "dtype Adam's first moment is stored in with the precision-aware "
       "optimizer: fp32 or bf16 (the update math stays fp32)"},
      {"exp-avg-sq-dtype", "dtype Adam's second moment is stored in with the precision-aware "
       "optimizer: fp32 or bf16 (the update math stays fp32)"},
      {"optimizer-cpu-offload", "keep the fp32 main params and Adam moments of "
                                "optimizer-offload-fraction of the elements in host memory "
                                "and update them there (needs use-precision-aware-optimizer)",
       true},
      {"optimizer-offload-fraction", "fraction of the optimizer's elements offloaded, whole "
                                     "params in order (default 1.0)"},
      {"overlap-cpu-optimizer-d2h-h2d", "Megatron's: the offloaded copies overlap the device "
                                        "step (always in Megaton)", true},
      {"use-torch-optimizer-for-cpu-offload", "Megatron's: the host update is Megaton's own "
                                              "AdamW", true},
      {"no-pin-cpu-grads", "Megatron's: the host buffers are always pinned", true},
      {"no-pin-cpu-params", "Megatron's: the host buffers are always pinned", true},
      {"no-store-param-remainders",
       "keep whole fp32 main params beside bf16 weights, not their low 16 bits (Megatron's "
       "store_param_remainders, on by default: lossless, 2 bytes per parameter less)", true},
      {"clip-grad", "clip gradients to this global L2 norm (0: off)"},
      {"check-for-nan-in-loss-and-grad",
       "stop when the loss or the gradient norm is NaN or inf, naming the iteration and rank "
       "(the default)", true},
      {"no-check-for-nan-in-loss-and-grad",
       "skip iterations whose gradient norm is NaN or inf instead of stopping", true},
      // data
      {"data-path", "one prefix, or weight prefix weight prefix ...", false, true},
      {"split", "train,valid,test proportions of documents"},
      {"tokenizer-type", "SentencePieceTokenizer or ByteTokenizer"},
      {"tokenizer-model", "tokenizer model file"},
      {"vocab-size", "vocabulary of the NullTokenizer (ids 0..N-1, eod N)"},
      {"mock-data", "train on random tokens (throughput runs; no data-path)", true},
      // run
      {"micro-batch-size", "samples per micro-batch"},
      {"global-batch-size", "samples per iteration"},
      {"train-iters", "iterations to train"},
      {"eval-interval", "evaluate every this many iterations"},
      {"eval-iters", "validation iterations per evaluation"},
      {"log-interval", "log every this many iterations"},
      {"exit-interval", "exit (after saving) when the iteration is a multiple of this"},
      {"log-params-norm", "log the L2 norm of the parameters", true},
      {"log-num-zeros-in-grad", "log the number of zero gradient elements", true},
      {"log-metrics-file", "Megaton: append one JSON line per iteration (iteration, lm_loss, "
                           "grad_norm, load_balancing_loss, lr) in full precision to this file"},
      {"seed", "random seed"},
      {"dry-run", "Megaton: print the memory plan of the busiest rank (weights, grads, "
                  "optimizer state, activations, total) and exit 0; builds nothing. Plans for "
                  "the launcher's ranks, else WORLD_SIZE, else 1", true},
      {"deterministic-mode", "bitwise-reproducible GPU runs (deterministic embedding and "
                             "attention backward; NCCL_ALGO Ring unless set), slower", true},
      // CUDA graphs (train/step_graph.h, docs/cuda.md)
      {"cuda-graph-impl", "none (default) or full_iteration: capture the whole training step "
                          "once and replay it (local and transformer_engine are refused)"},
      {"cuda-graph-warmup-steps", "steps run without a graph before the capture (default 3)"},
      {"cuda-graph-modules", "per-layer capture regions of --cuda-graph-impl local (refused; "
                             "must be empty with full_iteration)", false, true},
      {"cuda-graph-scope", "deprecated name of cuda-graph-modules ('full_iteration' selects "
                           "--cuda-graph-impl full_iteration, as in Megatron)", false, true},
      {"save", "checkpoint directory to write"},
      {"save-interval", "save every this many iterations"},
      {"load", "checkpoint directory to resume from"},
      {"no-load-optim", "do not load optimizer state", true},
      {"no-load-rng", "do not load the RNG state", true},
      {"finetune", "load weights only and start at iteration 0", true},
      {"device", "cpu or cuda (default: cuda when a GPU is visible)"},
      {"bf16", "bf16 compute with fp32 main params and grads (GPU; the CPU computes fp32); bf16 "
               "grads with grad-reduce-in-bf16 or main-grads-dtype bf16", true},
      {"fp16", "fp16 compute with fp32 main params and grads and a loss scale (GPU; the CPU "
               "computes fp32 and still scales the loss)", true},
      {"loss-scale", "static loss scale (fp16 or bf16); default: dynamic under --fp16"},
      {"initial-loss-scale", "first dynamic loss scale (default 2^32)"},
      {"min-loss-scale", "lowest dynamic loss scale (default 1)"},
      {"loss-scale-window", "clean iterations before the dynamic loss scale doubles (default 1000)"},
      {"hysteresis", "iterations with inf/NaN gradients before the dynamic loss scale halves "
                     "(default 2)"},
      // FP8 (docs/fp8.md)
      {"fp8-format", "e4m3 or hybrid (e4m3 forward, e5m2 gradients): the transformer layers' "
                     "linear GEMMs in FP8 (default: off)"},
      {"fp8-recipe", "delayed (default), tensorwise (per-tensor current scaling) or blockwise "
                     "(1x128 / 128x128 blocks)"},
      {"fp8-margin", "the delayed recipe's scales are divided by 2^margin (default 0)"},
      {"fp8-amax-history-len", "amaxes kept per tensor by the delayed recipe (default 1)"},
      {"fp8-amax-compute-algo", "max or most_recent (default): the delayed recipe's amax"},
      {"no-fp8-wgrad", "weight-gradient GEMMs in bf16 in FP8 runs", true},
      {"fp8-param-gather", "all-gather the FP8 copy of the weights (distributed optimizer)", true},
      {"first-last-layers-bf16", "keep the first and last transformer layers in bf16", true},
      {"num-layers-at-start-in-bf16", "layers kept in bf16 at the start (default 1)"},
      {"num-layers-at-end-in-bf16", "layers kept in bf16 at the end (default 1)"},
      {"moe-router-padding-for-fp8", "pad each expert's tokens to FP8 GEMM multiples", true},
      // activation recomputation (docs/memory.md)
      {"recompute-granularity", "full (whole layers, by recompute-method) or selective (the "
                                "recompute-modules); default: keep every activation"},
      {"recompute-method", "uniform (groups of recompute-num-layers layers) or block (the "
                           "first recompute-num-layers layers of each model chunk)"},
      {"recompute-num-layers", "layers per recompute group (uniform) or recomputed per model "
                               "chunk (block)"},
      {"recompute-modules", "core_attn (default), moe_act, layernorm, mlp, moe, shared_experts "
                            "(selective granularity)", false, true},
      {"recompute-activations", "Megatron's older name of recompute-granularity selective", true},
      {"moe-layer-recompute", "deprecated: recompute-modules moe (selective)", true},
      // activation offloading (docs/memory.md)
      {"cpu-offloading", "offload the saved activations of the first cpu-offloading-num-layers "
                         "layers to host memory", true},
      {"cpu-offloading-num-layers", "layers whose activations are offloaded (0 .. num-layers - "
                                    "1; > 0 turns cpu-offloading on)"},
      {"cpu-offloading-retain-pinned-cpu-buffers", "Megatron's: the pinned buffers are kept "
                                                   "for the next step (always in Megaton)", true},
      // parallelism (docs/parallelism.md)
      {"tensor-model-parallel-size", "tensor parallel ranks (tp)"},
      {"pipeline-model-parallel-size", "pipeline stages (pp)"},
      {"expert-model-parallel-size", "expert parallel ranks (ep)"},
      {"expert-tensor-parallel-size", "tensor parallel ranks of the experts (default tp)"},
      {"context-parallel-size", "context parallel ranks (only 1 so far)"},
      {"sequence-parallel", "shard activations along the sequence over tp ranks", true},
      {"num-layers-per-virtual-pipeline-stage", "layers per model chunk (interleaved pipeline)"},
      {"decoder-first-pipeline-num-layers", "layers of the first pipeline stage"},
      {"decoder-last-pipeline-num-layers", "layers of the last pipeline stage"},
      {"use-distributed-optimizer", "shard optimizer state over data-parallel ranks", true},
      {"overlap-grad-reduce", "overlap the gradient reduction with backward", true},
      {"overlap-param-gather", "overlap the parameter all-gather with forward", true},
      {"ddp-bucket-size", "elements per gradient bucket with --overlap-grad-reduce (default "
                          "max(40M, 1M x data-parallel size))"},
      {"moe-token-dispatcher-type", "alltoall or allgather"},
      {"distributed-timeout-minutes", "deadline of one collective (default: 5 minutes)"},
  };
  return specs;
}

static std::string normalize_key(std::string key) {
  std::replace(key.begin(), key.end(), '_', '-');
  return key;
}

static const OptionSpec* find_spec(const std::string& name) {
  for (const auto& s : train_option_specs())
    if (s.name == name) return &s;
  return nullptr;
}

RawOptions read_yaml_options(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status))
    fail("config file '{}' does not exist", printable(path));
  if (std::filesystem::is_directory(status))
    fail("config file '{}' is a directory, expected a YAML file", printable(path));
  if (!std::filesystem::is_regular_file(status))
    fail("config file '{}' is not a regular file", printable(path));
  std::string text;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("config file '{}' cannot be read", printable(path));
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  // A YAML file is text: a NUL or a control byte means the path names something else (a
  // checkpoint, a binary), whose bytes must not reach the terminal through the messages.
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == 0 || (c < 0x20 && c != '\n' && c != '\r' && c != '\t') || c == 0x7f)
      fail("config file '{}' is not a text file (byte 0x{:02x} at offset {})", printable(path), c, i);
  }
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail("config file '{}' is not valid YAML: {}", printable(path), printable(e.what(), 200));
  }
  RawOptions raw;
  if (root.IsNull()) return raw;
  if (!root.IsMap()) fail("config file '{}' must be a mapping of option: value", printable(path));
  for (const auto& kv : root) {
    if (!kv.first.IsScalar())
      fail("config file '{}': keys must be option names (line {})", printable(path),
           kv.first.Mark().line + 1);
    const std::string& written = kv.first.Scalar();
    std::string key = normalize_key(written);
    const OptionSpec* spec = find_spec(key);
    if (!spec) fail("config file '{}': unknown key '{}'", printable(path), printable(written));
    // YAML leaves duplicate keys to the reader; yaml-cpp keeps both and the last would win
    // silently. "num_layers" and "num-layers" are the same option.
    if (raw.count(key))
      fail("config file '{}': key '{}' is given twice (line {})", printable(path), key,
           kv.first.Mark().line + 1);
    std::vector<std::string> values;
    if (kv.second.IsSequence()) {
      if (!spec->multi_value) fail("config file '{}': key '{}' takes one value, not a list", printable(path), key);
      for (const auto& v : kv.second) {
        if (!v.IsScalar()) fail("config file '{}': key '{}' must be a list of scalars", printable(path), key);
        values.push_back(v.Scalar());
      }
    } else if (kv.second.IsScalar()) {
      values.push_back(kv.second.Scalar());
    } else if (kv.second.IsNull()) {
      raw[key];  // an empty value: nothing set, but the key counts as given once
      continue;
    } else {
      fail("config file '{}': key '{}' must be a scalar or a list", printable(path), key);
    }
    raw[key] = values;
  }
  // Keys written with an empty value set nothing.
  for (auto it = raw.begin(); it != raw.end();) it = it->second.empty() ? raw.erase(it) : std::next(it);
  return raw;
}

namespace {
// Every count and size a flag sets fits in 31 bits: products of a few of them (a tensor's
// elements, tokens per batch) then stay exact in 64-bit arithmetic, and the memory check
// (train/memory_check.h) refuses what cannot fit before anything is allocated.
constexpr int64_t kMaxFlagInteger = std::numeric_limits<int32_t>::max();

struct Reader {
  const RawOptions& raw;
  bool has(const std::string& k) const { return raw.count(k) > 0; }
  const std::string& one(const std::string& k) const {
    const auto& v = raw.at(k);
    if (v.size() != 1) fail("option '{}' takes exactly one value (got {})", k, v.size());
    return v[0];
  }
  int64_t integer(const std::string& k, int64_t max) const {
    const std::string& s = one(k);
    int64_t out = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    if (ec == std::errc::result_out_of_range || (ec == std::errc() && p == s.data() + s.size() &&
                                                 (out > max || out < -max)))
      fail("option '{}' must be at most {} in magnitude (got '{}')", k, max, printable(s));
    if (ec != std::errc() || p != s.data() + s.size())
      fail("option '{}' expects an integer (got '{}')", k, printable(s));
    return out;
  }
  void get(const std::string& k, int64_t& out) const {
    if (has(k)) out = integer(k, kMaxFlagInteger);
  }
  void get(const std::string& k, uint64_t& out) const {  // the seed: any 63-bit value
    if (!has(k)) return;
    const int64_t v = integer(k, std::numeric_limits<int64_t>::max());
    if (v < 0) fail("option '{}' must be >= 0 (got {})", k, v);
    out = uint64_t(v);
  }
  // Every float flag is a finite number: none means anything by nan or inf, and a NaN
  // hyperparameter trains a model to NaN without any other error.
  void get(const std::string& k, double& out) const {
    if (!has(k)) return;
    const std::string& s = one(k);
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || std::isspace(static_cast<unsigned char>(s[0])))
      fail("option '{}' expects a number (got '{}')", k, printable(s));
    if (!std::isfinite(v))
      fail("option '{}' must be a finite number (got '{}')", k, printable(s));
    out = v;
  }
  void get(const std::string& k, float& out) const {
    double v = out;
    get(k, v);
    if (std::fabs(v) > double(std::numeric_limits<float>::max()))
      fail("option '{}' must be a finite 32-bit float (got '{}')", k, one(k));
    out = float(v);
  }
  void get(const std::string& k, bool& out) const {
    if (!has(k)) return;
    std::string s = one(k);
    std::transform(s.begin(), s.end(), s.begin(), ::tolower);
    if (s == "true" || s == "1" || s == "yes") out = true;
    else if (s == "false" || s == "0" || s == "no") out = false;
    else fail("option '{}' expects true or false (got '{}')", k, printable(s));
  }
  void get(const std::string& k, std::string& out) const {
    if (has(k)) out = one(k);
  }
};

// Range checks of the values read (`key` names the flag). The bounds are Megatron's or
// PyTorch's where they state one (Adam's betas in [0, 1), PyTorch's torch.optim.Adam).
void check_at_least(const char* key, double v, double lo) {
  if (!(v >= lo)) fail("option '{}' must be >= {} (got {})", key, lo, v);
}
void check_positive(const char* key, double v) {
  if (!(v > 0)) fail("option '{}' must be > 0 (got {})", key, v);
}
void check_fraction(const char* key, double v) {  // [0, 1)
  if (!(v >= 0 && v < 1)) fail("option '{}' must be in [0, 1) (got {})", key, v);
}
}  // namespace

namespace {
// Megatron's --moe-layer-freq pattern: a Python expression of lists of integers, '+'
// (concatenation, or addition of integers), '*' (repetition, or multiplication) and
// parentheses, e.g. "[0]*1+[1]*3" -> [0, 1, 1, 1]. Megatron eval()s it after checking
// those characters; this is a parser for exactly that grammar.
class LayerPatternParser {
 public:
  LayerPatternParser(const std::string& text, const char* key) : s_(text), key_(key) {}
  std::vector<int> parse() {
    Value v = expr();
    skip();
    if (pos_ != s_.size()) bad("unexpected '" + s_.substr(pos_, 1) + "'");
    if (!v.is_list) bad("the pattern must be a list");
    return v.list;
  }

 private:
  struct Value {
    bool is_list = false;
    std::vector<int> list;
    int64_t number = 0;
  };
  [[noreturn]] void bad(const std::string& why) const {
    fail("option '{}': cannot read pattern '{}': {}", key_, s_, why);
  }
  void skip() {
    while (pos_ < s_.size() && s_[pos_] == ' ') ++pos_;
  }
  bool take(char c) {
    skip();
    if (pos_ < s_.size() && s_[pos_] == c) return ++pos_, true;
    return false;
  }
  int64_t integer() {
    skip();
    size_t start = pos_;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
    if (start == pos_) bad("expected a number at position " + std::to_string(start));
    if (pos_ - start > 6) bad("number too large");
    return std::stoll(s_.substr(start, pos_ - start));
  }
  Value atom() {
    Value v;
    if (take('(')) {
      v = expr();
      if (!take(')')) bad("missing ')'");
    } else if (take('[')) {
      v.is_list = true;
      if (!take(']')) {
        do v.list.push_back(int(integer()));
        while (take(','));
        if (!take(']')) bad("missing ']'");
      }
    } else {
      v.number = integer();
    }
    return v;
  }
  Value product() {
    Value v = atom();
    while (take('*')) {
      Value w = atom();
      if (v.is_list && w.is_list) bad("a list times a list");
      if (!v.is_list && !w.is_list) {
        v.number *= w.number;
        continue;
      }
      const Value& list = v.is_list ? v : w;
      const int64_t times = v.is_list ? w.number : v.number;
      if (times * int64_t(list.list.size()) > 100000) bad("pattern too long");
      Value r;
      r.is_list = true;
      for (int64_t i = 0; i < times; ++i) r.list.insert(r.list.end(), list.list.begin(), list.list.end());
      v = r;
    }
    return v;
  }
  Value expr() {
    Value v = product();
    while (take('+')) {
      Value w = product();
      if (v.is_list != w.is_list) bad("a list plus a number");
      if (v.is_list) v.list.insert(v.list.end(), w.list.begin(), w.list.end());
      else v.number += w.number;
    }
    return v;
  }
  std::string s_;
  const char* key_;
  size_t pos_ = 0;
};
}  // namespace

std::vector<int> parse_layer_pattern(const std::string& text, const char* key) {
  return LayerPatternParser(text, key).parse();
}

namespace {
// The ranges of the values parse_train_args reads (integers are already within
// kMaxFlagInteger in magnitude and floats finite). Sizes that default when unset (0) must be
// positive when given.
void check_value_ranges(const Reader& r, const TrainArgs& a) {
  const GPTConfig& m = a.model;
  for (auto [key, value] : {std::pair{"ffn-hidden-size", m.ffn_hidden_size},
                            {"num-query-groups", m.num_query_groups},
                            {"kv-channels", m.kv_channels},
                            {"max-position-embeddings", m.max_position_embeddings},
                            {"moe-ffn-hidden-size", m.moe_ffn_hidden_size},
                            {"moe-router-num-groups", m.moe_router_num_groups},
                            {"moe-router-group-topk", m.moe_router_group_topk},
                            {"vocab-size", a.vocab_size}})
    if (r.has(key)) check_positive(key, double(value));
  check_at_least("num-experts", double(m.num_experts), 0);
  check_at_least("moe-router-topk", double(m.moe_router_topk), 1);
  check_at_least("moe-layer-freq", double(m.moe_layer_freq), 1);
  check_at_least("moe-shared-expert-intermediate-size", double(m.moe_shared_expert_intermediate_size), 0);
  check_positive("norm-epsilon", m.norm_epsilon);
  check_positive("rotary-base", m.rotary_base);
  check_positive("init-method-std", m.init_method_std);
  check_fraction("hidden-dropout", m.hidden_dropout);
  check_fraction("attention-dropout", m.attention_dropout);
  check_at_least("moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor, 0);
  check_at_least("moe-aux-loss-coeff", m.moe_aux_loss_coeff, 0);
  check_at_least("moe-z-loss-coeff", m.moe_z_loss_coeff, 0);
  check_fraction("moe-input-jitter-eps", m.moe_input_jitter_eps);
  check_at_least("moe-router-bias-update-rate", m.moe_router_bias_update_rate, 0);
  check_at_least("moe-expert-capacity-factor", m.moe_expert_capacity_factor, 0);
  check_at_least("lr", a.lr.lr, 0);
  check_at_least("min-lr", a.lr.min_lr, 0);
  check_at_least("lr-warmup-init", a.lr.lr_warmup_init, 0);
  if (r.has("lr-wsd-decay-iters"))
    check_at_least("lr-wsd-decay-iters", double(a.lr.lr_wsd_decay_iters), 0);
  check_at_least("weight-decay", a.adam.weight_decay, 0);
  check_fraction("adam-beta1", a.adam.adam_beta1);
  check_fraction("adam-beta2", a.adam.adam_beta2);
  // PyTorch allows eps = 0, but a parameter whose gradient is always zero (an unused
  // padded vocabulary row) then divides 0 by 0.
  check_positive("adam-eps", a.adam.adam_eps);
  check_at_least("clip-grad", a.clip_grad, 0);
}
}  // namespace

namespace {
// --use-precision-aware-optimizer and its dtypes, with Megatron's choices (arguments.py)
// and refusals (optim::check_precision_aware_config).
void parse_precision_aware_args(const Reader& r, optim::AdamWConfig& c) {
  r.get("use-precision-aware-optimizer", c.use_precision_aware_optimizer);
  bool no_remainders = false;
  r.get("no-store-param-remainders", no_remainders);
  c.store_param_remainders = !no_remainders;
  const std::pair<const char*, std::vector<std::string>> choices[] = {
      {"main-params-dtype", {"fp32", "fp16"}},
      {"main-grads-dtype", {"fp32", "bf16"}},
      {"exp-avg-dtype", {"fp32", "fp16", "bf16", "fp8"}},
      {"exp-avg-sq-dtype", {"fp32", "fp16", "bf16", "fp8"}}};
  DType* fields[] = {&c.main_params_dtype, &c.main_grads_dtype, &c.exp_avg_dtype,
                     &c.exp_avg_sq_dtype};
  for (size_t i = 0; i < std::size(choices); ++i)
    if (r.has(choices[i].first))
      *fields[i] = optim::precision_aware_dtype(choices[i].first, r.one(choices[i].first),
                                                choices[i].second);
  optim::check_precision_aware_config(c);
}

// The main grads' dtype (GPTConfig::main_grads_dtype), as Megatron's arguments.py
// resolves accumulate_allreduce_grads_in_fp32 under --bf16 (its grad buffers are fp32 when
// that is set, else the params' bf16; param_and_grad_buffer.py grad_dtype): set, together
// with --main-grads-dtype bf16, is refused; --grad-reduce-in-bf16 clears it; otherwise it
// is set when the main grads dtype is fp32. Without --bf16 Megaton keeps fp32 main grads
// (fp32 runs: the params' dtype, as Megatron; --fp16: fp32 where Megatron's default is
// fp16 grads), so the two bf16 ways are noted as having no effect.
void parse_main_grads_dtype(const Reader& r, TrainArgs& a) {
  bool grad_reduce_in_bf16 = false, accumulate_allreduce_grads_in_fp32 = false;
  r.get("grad-reduce-in-bf16", grad_reduce_in_bf16);
  r.get("accumulate-allreduce-grads-in-fp32", accumulate_allreduce_grads_in_fp32);
  const bool bf16_main_grads = a.adam.main_grads_dtype == DType::BF16;
  if (!a.model.bf16) {
    if (grad_reduce_in_bf16)
      a.no_effect.push_back("--grad-reduce-in-bf16: bf16 grad buffers are for --bf16 runs");
    if (bf16_main_grads)
      a.no_effect.push_back("--main-grads-dtype bf16: bf16 grad buffers are for --bf16 runs");
    a.model.main_grads_dtype = DType::F32;
    return;
  }
  // Megatron's assertion and message (arguments.py, validate_args under args.bf16).
  if (accumulate_allreduce_grads_in_fp32 && bf16_main_grads)
    fail("--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set");
  if (grad_reduce_in_bf16) accumulate_allreduce_grads_in_fp32 = false;
  else if (!bf16_main_grads) accumulate_allreduce_grads_in_fp32 = true;
  a.model.main_grads_dtype = accumulate_allreduce_grads_in_fp32 ? DType::F32 : DType::BF16;
}

// --fp16 and the loss scaler's flags, with Megatron's rules (arguments.py,
// validate_args): fp16 and bf16 exclude each other; under dynamic loss scaling the
// non-finite check is turned off with a warning (inf/NaN gradients are the scaler's
// signal). A static --loss-scale also applies to bf16 runs (Megatron's ConstantGradScaler);
// fp32 runs take no scaler. The values are checked when the scaler is built
// (optim::GradScaler).
void parse_mixed_precision_args(const Reader& r, TrainArgs& a) {
  r.get("bf16", a.model.bf16);
  r.get("fp16", a.model.fp16);
  if (a.model.fp16 && a.model.bf16) fail("fp16 and bf16 exclude each other: give one");
  optim::GradScalerConfig& c = a.loss_scaler;
  r.get("loss-scale", c.loss_scale);
  r.get("initial-loss-scale", c.initial_loss_scale);
  r.get("min-loss-scale", c.min_loss_scale);
  r.get("loss-scale-window", c.loss_scale_window);
  r.get("hysteresis", c.hysteresis);
  if (r.has("loss-scale") && !(c.loss_scale > 0))
    fail("loss-scale must be positive (got {})", c.loss_scale);
  const bool half = a.model.fp16 || a.model.bf16;
  if (!half && r.has("loss-scale"))
    a.no_effect.push_back("--loss-scale: fp32 training scales no loss (give --fp16 or --bf16)");
  const bool dynamic = a.model.fp16 && c.loss_scale == 0;
  for (const char* key : {"initial-loss-scale", "min-loss-scale", "loss-scale-window", "hysteresis"})
    if (r.has(key) && !dynamic)
      a.no_effect.push_back(std::string("--") + key + ": dynamic loss scaling is --fp16 without "
                            "--loss-scale");
  optim::GradScaler check(c, dynamic);  // DynamicGradScaler's assertions, as errors now
  if (a.model.fp16 && a.model.fp8.enabled)
    fail("fp16 with fp8-format is not supported in Megaton yet: FP8 runs compute in bf16");
  if (dynamic && a.check_for_nan_in_loss_and_grad) {
    a.check_for_nan_in_loss_and_grad = false;
    a.warnings.push_back("check-for-nan-in-loss-and-grad is off under dynamic loss scaling: "
                         "inf/NaN gradients make the scaler skip the step and lower the scale "
                         "(as Megatron)");
  }
  if (dynamic && a.cuda_graph_impl == "full_iteration")
    fail("cuda-graph-impl full_iteration with --fp16 dynamic loss scaling is not supported in "
         "Megaton yet (the scale changes between steps); give a static --loss-scale");
}

// --optimizer-cpu-offload and its options (Megatron's arguments.py: the offload needs the
// precision-aware optimizer; with FP8 param gather, Megatron needs the delayed recipe,
// which Megaton does not offload yet). After the precision-aware, FP8 and CUDA graph flags.
void parse_optimizer_offload_args(const Reader& r, TrainArgs& a) {
  optim::AdamWConfig& c = a.adam;
  r.get("optimizer-cpu-offload", c.optimizer_cpu_offload);
  r.get("optimizer-offload-fraction", c.optimizer_offload_fraction);
  const char* switches[][2] = {
      {"overlap-cpu-optimizer-d2h-h2d", "the copies always run on a side stream, overlapped "
                                        "with the device's update"},
      {"use-torch-optimizer-for-cpu-offload", "the host update is Megaton's AdamW (the CPU "
                                              "twin of the device kernel)"},
      {"no-pin-cpu-grads", "the host buffers are always pinned"},
      {"no-pin-cpu-params", "the host buffers are always pinned"}};
  for (auto [key, why] : switches) {
    bool on = false;
    r.get(key, on);
    if (on) a.no_effect.push_back(std::string("--") + key + ": " + why);
  }
  if (!c.optimizer_cpu_offload) {
    if (r.has("optimizer-offload-fraction"))
      a.no_effect.push_back("--optimizer-offload-fraction: no --optimizer-cpu-offload");
    return;
  }
  if (!(c.optimizer_offload_fraction >= 0 && c.optimizer_offload_fraction <= 1))
    fail("optimizer-offload-fraction must be in [0, 1] (got {})", c.optimizer_offload_fraction);
  if (!c.use_precision_aware_optimizer)
    fail("The optimizer cpu offload must be used in conjunction with "
         "`--use-precision-aware-optimizer`, as Megatron's hybrid device optimizer reuses "
         "its code path");
  if (a.model.fp8.param_gather)
    fail("optimizer-cpu-offload with fp8-param-gather is not supported in Megaton yet (the "
         "FP8 weights are quantized from device main params)");
  if (a.cuda_graph_impl != "none")
    fail("optimizer-cpu-offload with cuda-graph-impl {} is not supported in Megaton yet (the "
         "host update waits for the device each step)", a.cuda_graph_impl);
}

// --cuda-graph-impl and its options, with Megatron's rules (arguments.py): the old
// --cuda-graph-scope is --cuda-graph-modules, except its value full_iteration, which selects
// the implementation; modules are empty with full_iteration; warmup steps are positive.
void parse_cuda_graph_args(const Reader& r, TrainArgs& a) {
  r.get("cuda-graph-impl", a.cuda_graph_impl);
  if (r.has("cuda-graph-modules") && r.has("cuda-graph-scope"))
    fail("cuda-graph-scope and cuda-graph-modules cannot be used together (cuda-graph-scope is "
         "the deprecated name)");
  for (const char* key : {"cuda-graph-modules", "cuda-graph-scope"}) {
    if (!r.has(key)) continue;
    for (const std::string& v : r.raw.at(key)) {
      if (std::string(key) == "cuda-graph-scope" && v == "full_iteration") {
        if (a.cuda_graph_impl != "none" && a.cuda_graph_impl != "local" &&
            a.cuda_graph_impl != "full_iteration")
          fail("cuda-graph-scope full_iteration cannot be combined with cuda-graph-impl {}",
               printable(a.cuda_graph_impl));
        a.cuda_graph_impl = "full_iteration";
        continue;
      }
      if (v != "attn" && v != "mlp" && v != "moe" && v != "moe_router" && v != "moe_preprocess" &&
          v != "mamba" && v != "full")
        fail("{}: '{}' is not one of attn, mlp, moe, moe_router, moe_preprocess, mamba", key,
             printable(v));
      if (v != "full") a.cuda_graph_modules.push_back(v);  // "full": the whole layer (empty)
    }
  }
  r.get("cuda-graph-warmup-steps", a.cuda_graph_warmup_steps);
  const std::string& impl = a.cuda_graph_impl;
  if (impl != "none" && impl != "local" && impl != "transformer_engine" && impl != "full_iteration")
    fail("cuda-graph-impl must be none, local, transformer_engine or full_iteration (got '{}')",
         printable(impl));
  if (impl == "transformer_engine")
    fail("cuda-graph-impl transformer_engine captures Transformer Engine's layers, which Megaton "
         "does not use: use cuda-graph-impl full_iteration");
  if (impl == "local")
    fail("cuda-graph-impl local (per-layer CUDA graphs) is not built in Megaton: use "
         "cuda-graph-impl full_iteration, which captures the whole step");
  if (impl == "full_iteration" && !a.cuda_graph_modules.empty())
    fail("cuda-graph-modules must be empty with cuda-graph-impl full_iteration (it captures the "
         "whole step)");
  // Megatron: the modules have no effect with impl none.
  if (impl == "none" && !a.cuda_graph_modules.empty())
    a.no_effect.push_back("--cuda-graph-modules: no CUDA graphs are captured (cuda-graph-impl "
                          "none)");
  if (a.cuda_graph_warmup_steps <= 0)
    fail("cuda-graph-warmup-steps must be positive (got {})", a.cuda_graph_warmup_steps);
}

// The FP8 flags (Megatron's arguments.py and TransformerConfig checks). Every --fp8-*
// flag other than the format is refused without --fp8-format, rather than ignored.
void parse_fp8_args(const Reader& r, GPTConfig& m, std::vector<std::string>& no_effect) {
  Fp8Config& f = m.fp8;
  const char* dependents[] = {"fp8-recipe", "fp8-margin", "fp8-amax-history-len",
                              "fp8-amax-compute-algo", "no-fp8-wgrad", "fp8-param-gather",
                              "first-last-layers-bf16", "num-layers-at-start-in-bf16",
                              "num-layers-at-end-in-bf16", "moe-router-padding-for-fp8"};
  if (!r.has("fp8-format")) {
    for (const char* key : dependents) {
      if (!r.has(key)) continue;
      bool on = true;  // a switch set to false asks for nothing
      if (find_spec(key)->is_switch) r.get(key, on);
      if (on) fail("option '{}' needs --fp8-format (e4m3 or hybrid)", key);
    }
    return;
  }
  std::string format;
  r.get("fp8-format", format);
  if (format == "e4m3") f.hybrid = false;
  else if (format == "hybrid") f.hybrid = true;
  else fail("option 'fp8-format' must be e4m3 or hybrid (got '{}')", printable(format));
  f.enabled = true;
  std::string recipe = "delayed";
  r.get("fp8-recipe", recipe);
  if (recipe == "delayed") f.recipe = Fp8Recipe::Delayed;
  else if (recipe == "tensorwise") f.recipe = Fp8Recipe::Tensorwise;
  else if (recipe == "blockwise") f.recipe = Fp8Recipe::Blockwise;
  else if (recipe == "mxfp8" || recipe == "nvfp4")
    fail("option 'fp8-recipe' {} needs Blackwell's block-scaled tensor cores; on Hopper use "
         "delayed, tensorwise or blockwise", recipe);
  else
    fail("option 'fp8-recipe' must be delayed, tensorwise or blockwise (got '{}')",
         printable(recipe));
  r.get("fp8-margin", f.margin);
  check_at_least("fp8-margin", double(f.margin), 0);
  r.get("fp8-amax-history-len", f.amax_history_len);
  check_at_least("fp8-amax-history-len", double(f.amax_history_len), 1);
  if (f.amax_history_len > 1024)
    fail("option 'fp8-amax-history-len' must be at most 1024 (got {})", f.amax_history_len);
  std::string algo = "most_recent";
  r.get("fp8-amax-compute-algo", algo);
  if (algo == "max") f.amax_compute_max = true;
  else if (algo != "most_recent")
    fail("option 'fp8-amax-compute-algo' must be max or most_recent (got '{}')", printable(algo));
  bool no_wgrad = false;
  r.get("no-fp8-wgrad", no_wgrad);
  f.wgrad = !no_wgrad;
  r.get("first-last-layers-bf16", f.first_last_layers_bf16);
  r.get("num-layers-at-start-in-bf16", f.num_layers_at_start_in_bf16);
  r.get("num-layers-at-end-in-bf16", f.num_layers_at_end_in_bf16);
  check_at_least("num-layers-at-start-in-bf16", double(f.num_layers_at_start_in_bf16), 0);
  check_at_least("num-layers-at-end-in-bf16", double(f.num_layers_at_end_in_bf16), 0);
  // Megatron's TransformerConfig: delayed scaling keeps amax histories across layers that
  // the bf16 ones would leave stale ("Delayed scaling does not support first / last layer
  // in BF16").
  if (f.first_last_layers_bf16 && f.recipe == Fp8Recipe::Delayed)
    fail("first-last-layers-bf16 needs --fp8-recipe tensorwise or blockwise (delayed scaling "
         "does not support first / last layers in bf16, as in Megatron)");
  if (f.first_last_layers_bf16 &&
      f.num_layers_at_start_in_bf16 + f.num_layers_at_end_in_bf16 > m.num_layers)
    fail("num-layers-at-start-in-bf16 ({}) + num-layers-at-end-in-bf16 ({}) exceed num-layers ({})",
         f.num_layers_at_start_in_bf16, f.num_layers_at_end_in_bf16, m.num_layers);
  bool router_padding = false;
  r.get("fp8-param-gather", f.param_gather);
  r.get("moe-router-padding-for-fp8", router_padding);
  if (f.param_gather && f.recipe == Fp8Recipe::Blockwise)
    fail("fp8-param-gather is not available with --fp8-recipe blockwise in Megaton (its "
         "weights would need 128x128-block FP8 copies); use tensorwise or delayed");
  // Megatron pads the routing map so that each expert receives a multiple of 16 tokens
  // (extra copies of real tokens with probability 0), which spares its GroupedMLP the
  // explicit Fp8Padding. Megaton's experts always pad each expert's rows to the FP8 GEMM
  // multiple with zero rows (MoELayer, docs/fp8.md), so what the flag asks for already
  // holds and it changes nothing.
  if (router_padding)
    no_effect.push_back("--moe-router-padding-for-fp8: the experts always pad each expert's "
                        "rows to the FP8 GEMM multiple (16, 128 blockwise) with zero rows");
}
}  // namespace

namespace {
// The largest count of transformer layers on one pipeline stage (uneven first and last
// stages included): the bound of --recompute-num-layers.
int64_t max_stage_layers(const TrainArgs& a) {
  const ParallelArgs& p = a.parallel;
  const int64_t pp = std::max<int64_t>(p.pipeline_model_parallel_size, 1);
  int64_t rest = a.model.num_layers, stages = pp, most = 0;
  for (int64_t uneven : {p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers}) {
    if (uneven <= 0 || stages <= 1) continue;
    most = std::max(most, uneven);
    rest -= uneven;
    --stages;
  }
  return std::max(most, stages > 0 ? (rest + stages - 1) / stages : 0);
}

// The recompute flags (Megatron's TransformerConfig.__post_init__ and arguments.py). After
// the FP8 and pipeline flags: both constrain them. What Megatron ignores (a method, count
// or modules that the granularity does not read) is listed as having no effect, not
// refused, so launch scripts that carry them run.
void parse_recompute_args(const Reader& r, TrainArgs& a) {
  RecomputeConfig& rc = a.model.recompute;
  std::string granularity, method;
  r.get("recompute-granularity", granularity);
  r.get("recompute-method", method);
  bool activations = false, moe_layer = false;
  r.get("recompute-activations", activations);
  r.get("moe-layer-recompute", moe_layer);
  if (activations) {  // Megatron's arguments.py: replaces the granularity
    if (!granularity.empty() && granularity != "selective")
      a.no_effect.push_back("--recompute-granularity " + granularity +
                            ": --recompute-activations sets selective, as in Megatron");
    granularity = "selective";
  }
  if (granularity == "full") rc.granularity = RecomputeGranularity::Full;
  else if (granularity == "selective") rc.granularity = RecomputeGranularity::Selective;
  else if (!granularity.empty())
    fail("recompute-granularity must be full or selective (got '{}')", printable(granularity));
  if (method == "uniform") rc.method = RecomputeMethod::Uniform;
  else if (method == "block") rc.method = RecomputeMethod::Block;
  else if (!method.empty())
    fail("recompute-method must be uniform or block (got '{}')", printable(method));
  r.get("recompute-num-layers", rc.num_layers);
  if (r.has("recompute-modules")) {
    rc.modules = 0;
    for (const std::string& name : r.raw.at("recompute-modules")) {
      const uint32_t bit = recompute_module_bit(name);
      if (bit == 0)
        fail("recompute-modules: '{}' is not one of core_attn, moe_act, layernorm, mlp, moe, "
             "shared_experts, mla_up_proj", printable(name));
      if (bit == kRecomputeMlaUpProj)
        fail("recompute-modules: mla_up_proj needs multi-latent attention, which Megaton does "
             "not build yet");
      rc.modules |= bit;
    }
  }
  if (moe_layer) {  // Megatron: deprecated, selective with moe added to the modules
    if (rc.granularity == RecomputeGranularity::Full)
      fail("moe-layer-recompute cannot be combined with recompute-granularity full");
    rc.granularity = RecomputeGranularity::Selective;
    rc.modules |= kRecomputeMoe;  // to the default core_attn, or to the modules given
    a.no_effect.push_back("--moe-layer-recompute: deprecated, read as --recompute-granularity "
                          "selective --recompute-modules " + recompute_module_names(rc.modules));
  }
  switch (rc.granularity) {
    case RecomputeGranularity::None:
      for (const char* key : {"recompute-method", "recompute-num-layers", "recompute-modules"})
        if (r.has(key))
          a.no_effect.push_back(std::string("--") + key + ": no recompute-granularity given");
      rc = RecomputeConfig{};
      break;
    case RecomputeGranularity::Full: {
      if (rc.method == RecomputeMethod::None)
        fail("recompute-granularity full needs recompute-method uniform or block");
      const int64_t most = max_stage_layers(a);
      if (!r.has("recompute-num-layers") || rc.num_layers < 1 || rc.num_layers > most)
        fail("recompute-granularity full needs recompute-num-layers between 1 and the layers of "
             "a pipeline stage ({}){}", most,
             r.has("recompute-num-layers") ? " (got " + std::to_string(rc.num_layers) + ")" : "");
      if (r.has("recompute-modules"))
        a.no_effect.push_back("--recompute-modules: recompute-granularity full recomputes whole "
                              "layers");
      break;
    }
    case RecomputeGranularity::Selective:
      // Megatron's arguments.py and TransformerConfig refuse both with selective.
      if (rc.method != RecomputeMethod::None)
        fail("recompute-method applies to recompute-granularity full, not selective");
      if (r.has("recompute-num-layers"))
        fail("recompute-num-layers applies to recompute-granularity full, not selective");
      if (rc.selective(kRecomputeMoeAct))
        a.no_effect.push_back("--recompute-modules moe_act: Megaton always recomputes the "
                              "experts' activation, in the pass of its backward");
      if (a.model.num_experts == 0 &&
          (rc.modules & (kRecomputeMoe | kRecomputeSharedExperts | kRecomputeMoeAct)) != 0)
        a.no_effect.push_back("--recompute-modules moe, moe_act, shared_experts: the model has "
                              "no MoE layer");
      break;
  }
  // A forward re-run quantizes its FP8 GEMM inputs again: the delayed recipe would roll
  // its amax history twice per step (the re-run would not be the first forward's bits).
  const uint32_t rerun = kRecomputeMlp | kRecomputeMoe | kRecomputeSharedExperts;
  if (a.model.fp8.enabled && a.model.fp8.recipe == Fp8Recipe::Delayed &&
      (rc.granularity == RecomputeGranularity::Full ||
       (rc.granularity == RecomputeGranularity::Selective && (rc.modules & rerun) != 0)))
    fail("recompute-granularity full and recompute-modules mlp, moe, shared_experts are not "
         "supported with fp8-recipe delayed (a re-run forward would update the amax history "
         "again): use fp8-recipe tensorwise or blockwise");
}

// --cpu-offloading, --cpu-offloading-num-layers (Megatron's arguments.py: a count > 0 turns
// cpu_offloading on; TransformerConfig.__post_init__'s checks and messages). After the
// recompute, pipeline and CUDA graph flags.
void parse_cpu_offloading_args(const Reader& r, TrainArgs& a) {
  CpuOffloadingConfig& c = a.model.cpu_offloading;
  r.get("cpu-offloading", c.enabled);
  r.get("cpu-offloading-num-layers", c.num_layers);
  bool retain = false;
  r.get("cpu-offloading-retain-pinned-cpu-buffers", retain);
  if (retain)
    a.no_effect.push_back("--cpu-offloading-retain-pinned-cpu-buffers: Megaton always keeps "
                          "the pinned buffers for the next step");
  if (c.num_layers > 0) c.enabled = true;
  if (!c.enabled) {
    c = CpuOffloadingConfig{};
    return;
  }
  if (c.num_layers < 0 || c.num_layers >= a.model.num_layers)
    fail("CPU offloading can be done only for layers less than num-layers ({}): "
         "cpu-offloading-num-layers is {}", a.model.num_layers, c.num_layers);
  if (a.parallel.pipeline_model_parallel_size > 1)
    fail("Currently there is no support for Pipeline parallelism with CPU offloading "
         "(pipeline-model-parallel-size {})", a.parallel.pipeline_model_parallel_size);
  if (a.model.recompute.granularity != RecomputeGranularity::None)
    fail("CPU offloading does not work when activation recomputation is enabled "
         "(recompute-granularity)");
  if (a.cuda_graph_impl != "none")
    fail("cpu-offloading with cuda-graph-impl {} is not supported in Megaton yet (the copy "
         "stream is not captured)", a.cuda_graph_impl);
  if (c.num_layers == 0)
    a.no_effect.push_back("--cpu-offloading: cpu-offloading-num-layers is 0, no layer is "
                          "offloaded");
}
}  // namespace

TrainArgs parse_train_args(const RawOptions& raw) {
  for (const auto& [k, v] : raw)
    if (!find_spec(k)) fail("unknown option '{}'", k);
  Reader r{raw};
  TrainArgs a;
  GPTConfig& m = a.model;
  r.get("num-layers", m.num_layers);
  r.get("hidden-size", m.hidden_size);
  r.get("ffn-hidden-size", m.ffn_hidden_size);
  r.get("num-attention-heads", m.num_attention_heads);
  r.get("group-query-attention", m.group_query_attention);
  r.get("num-query-groups", m.num_query_groups);
  r.get("kv-channels", m.kv_channels);
  r.get("seq-length", m.seq_length);
  r.get("max-position-embeddings", m.max_position_embeddings);
  r.get("make-vocab-size-divisible-by", m.make_vocab_size_divisible_by);
  std::string norm = "LayerNorm";
  r.get("normalization", norm);
  if (norm == "LayerNorm") m.normalization = Normalization::LayerNorm;
  else if (norm == "RMSNorm") m.normalization = Normalization::RMSNorm;
  else fail("option 'normalization' must be LayerNorm or RMSNorm (got '{}')", norm);
  r.get("norm-epsilon", m.norm_epsilon);
  r.get("qk-layernorm", m.qk_layernorm);
  r.get("swiglu", m.swiglu);
  std::string pos = "learned_absolute";
  r.get("position-embedding-type", pos);
  if (pos == "learned_absolute") m.position_embedding_type = PositionEmbedding::LearnedAbsolute;
  else if (pos == "rope") m.position_embedding_type = PositionEmbedding::Rope;
  else fail("option 'position-embedding-type' must be learned_absolute or rope (got '{}')", pos);
  r.get("rotary-base", m.rotary_base);
  r.get("untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights);
  r.get("init-method-std", m.init_method_std);
  r.get("disable-bias-linear", m.disable_bias_linear);
  r.get("hidden-dropout", m.hidden_dropout);
  r.get("attention-dropout", m.attention_dropout);
  r.get("num-experts", m.num_experts);
  r.get("moe-ffn-hidden-size", m.moe_ffn_hidden_size);
  r.get("moe-router-topk", m.moe_router_topk);
  r.get("moe-router-pre-softmax", m.moe_router_pre_softmax);
  if (r.has("moe-layer-freq")) {
    const std::string& freq = r.one("moe-layer-freq");
    if (freq.find('[') != std::string::npos)
      m.moe_layer_pattern = parse_layer_pattern(freq, "moe-layer-freq");
    else
      r.get("moe-layer-freq", m.moe_layer_freq);
  }
  if (r.has("moe-router-load-balancing-type"))
    m.moe_router_load_balancing_type = raw.at("moe-router-load-balancing-type");
  if (r.has("moe-aux-loss-coeff")) {
    const std::vector<std::string>& coeffs = raw.at("moe-aux-loss-coeff");
    for (const std::string& c : coeffs) {
      char* end = nullptr;
      const double v = std::strtod(c.c_str(), &end);
      if (c.empty() || *end != '\0')
        fail("option 'moe-aux-loss-coeff' expects numbers (got '{}')", printable(c));
      if (!std::isfinite(v) || v < 0 || v > double(std::numeric_limits<float>::max()))
        fail("option 'moe-aux-loss-coeff' values must be finite and >= 0 (got '{}')", printable(c));
      m.moe_aux_loss_coeffs.push_back(float(v));
    }
    m.moe_aux_loss_coeff = m.moe_aux_loss_coeffs.empty() ? 0.0f : m.moe_aux_loss_coeffs[0];
    if (coeffs.size() == 1) m.moe_aux_loss_coeffs.clear();  // one value for every type
  }
  r.get("moe-router-score-function", m.moe_router_score_function);
  r.get("moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor);
  r.get("moe-router-dtype", m.moe_router_dtype);
  r.get("moe-router-num-groups", m.moe_router_num_groups);
  r.get("moe-router-group-topk", m.moe_router_group_topk);
  r.get("moe-z-loss-coeff", m.moe_z_loss_coeff);
  r.get("moe-input-jitter-eps", m.moe_input_jitter_eps);
  r.get("moe-router-enable-expert-bias", m.moe_router_enable_expert_bias);
  r.get("moe-router-bias-update-rate", m.moe_router_bias_update_rate);
  r.get("moe-router-force-load-balancing", m.moe_router_force_load_balancing);
  r.get("moe-expert-capacity-factor", m.moe_expert_capacity_factor);
  r.get("moe-token-drop-policy", m.moe_token_drop_policy);
  r.get("moe-pad-expert-input-to-capacity", m.moe_pad_expert_input_to_capacity);
  r.get("moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size);
  r.get("moe-shared-expert-gate", m.moe_shared_expert_gate);
  r.get("moe-per-layer-logging", a.moe_per_layer_logging);

  std::string optimizer = "adam";
  r.get("optimizer", optimizer);
  if (optimizer != "adam") fail("option 'optimizer' must be adam (got '{}')", optimizer);
  r.get("lr", a.lr.lr);
  r.get("min-lr", a.lr.min_lr);
  std::string style = "linear";
  r.get("lr-decay-style", style);
  a.lr.lr_decay_style = optim::parse_lr_decay_style(style);
  std::string wsd = "exponential";
  r.get("lr-wsd-decay-style", wsd);
  a.lr.lr_wsd_decay_style = optim::parse_wsd_decay_style(wsd);
  r.get("lr-wsd-decay-iters", a.lr.lr_wsd_decay_iters);
  r.get("lr-warmup-iters", a.lr.lr_warmup_iters);
  r.get("lr-warmup-init", a.lr.lr_warmup_init);
  r.get("lr-decay-iters", a.lr.lr_decay_iters);
  r.get("weight-decay", a.adam.weight_decay);
  r.get("adam-beta1", a.adam.adam_beta1);
  r.get("adam-beta2", a.adam.adam_beta2);
  r.get("adam-eps", a.adam.adam_eps);
  parse_precision_aware_args(r, a.adam);
  r.get("clip-grad", a.clip_grad);
  r.get("check-for-nan-in-loss-and-grad", a.check_for_nan_in_loss_and_grad);
  if (r.has("no-check-for-nan-in-loss-and-grad")) {
    bool off = false;
    r.get("no-check-for-nan-in-loss-and-grad", off);
    if (off && r.has("check-for-nan-in-loss-and-grad") && a.check_for_nan_in_loss_and_grad)
      fail("check-for-nan-in-loss-and-grad and no-check-for-nan-in-loss-and-grad contradict");
    if (off) a.check_for_nan_in_loss_and_grad = false;
  }

  if (r.has("data-path")) a.data_path = raw.at("data-path");
  r.get("split", a.split);
  r.get("tokenizer-type", a.tokenizer_type);
  r.get("tokenizer-model", a.tokenizer_model);
  r.get("vocab-size", a.vocab_size);
  r.get("mock-data", a.mock_data);

  r.get("micro-batch-size", a.micro_batch_size);
  r.get("global-batch-size", a.global_batch_size);
  r.get("train-iters", a.train_iters);
  r.get("eval-interval", a.eval_interval);
  r.get("eval-iters", a.eval_iters);
  r.get("log-interval", a.log_interval);
  r.get("exit-interval", a.exit_interval);
  r.get("log-metrics-file", a.log_metrics_file);
  r.get("log-params-norm", a.log_params_norm);
  r.get("log-num-zeros-in-grad", a.log_num_zeros_in_grad);
  r.get("seed", a.seed);
  r.get("deterministic-mode", a.deterministic_mode);
  // Megatron asks for NCCL_ALGO to be one of these in deterministic mode (its all-reduce
  // order otherwise depends on the algorithm NCCL picks); the Trainer sets Ring when it is
  // unset, and the others are refused here.
  if (a.deterministic_mode) {
    if (const char* algo = std::getenv("NCCL_ALGO")) {
      const std::string v = algo;
      if (v != "Tree" && v != "Ring" && v != "CollnetDirect" && v != "CollnetChain" && v != "^NVLS")
        fail("deterministic-mode needs NCCL_ALGO unset or one of Tree, Ring, CollnetDirect, "
             "CollnetChain, ^NVLS (got '{}')", printable(v));
    }
  }
  parse_cuda_graph_args(r, a);
  r.get("save", a.save);
  r.get("save-interval", a.save_interval);
  r.get("load", a.load);
  r.get("no-load-optim", a.no_load_optim);
  r.get("no-load-rng", a.no_load_rng);
  r.get("finetune", a.finetune);
  r.get("device", a.device);

  ParallelArgs& p = a.parallel;
  r.get("tensor-model-parallel-size", p.tensor_model_parallel_size);
  r.get("pipeline-model-parallel-size", p.pipeline_model_parallel_size);
  r.get("expert-model-parallel-size", p.expert_model_parallel_size);
  r.get("expert-tensor-parallel-size", p.expert_tensor_parallel_size);
  r.get("context-parallel-size", p.context_parallel_size);
  r.get("sequence-parallel", p.sequence_parallel);
  r.get("num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage);
  r.get("decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers);
  r.get("decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers);
  r.get("use-distributed-optimizer", p.use_distributed_optimizer);
  r.get("overlap-grad-reduce", p.overlap_grad_reduce);
  r.get("overlap-param-gather", p.overlap_param_gather);
  r.get("ddp-bucket-size", p.ddp_bucket_size);
  r.get("moe-token-dispatcher-type", p.moe_token_dispatcher_type);
  r.get("distributed-timeout-minutes", p.distributed_timeout_minutes);
  check_value_ranges(r, a);
  // Optional counts: 0 means "not set", so a value given must be positive.
  for (const char* key : {"expert-tensor-parallel-size", "num-layers-per-virtual-pipeline-stage",
                          "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
                          "distributed-timeout-minutes", "ddp-bucket-size"}) {
    int64_t v = 0;
    r.get(key, v);
    if (r.has(key) && v <= 0) fail("{} must be positive (got {})", key, v);
  }
  if (p.moe_token_dispatcher_type != "alltoall" && p.moe_token_dispatcher_type != "allgather")
    fail("option 'moe-token-dispatcher-type' must be alltoall or allgather (got '{}')",
         p.moe_token_dispatcher_type);
  // Megatron's arguments.py: the parameter all-gather exists only with the distributed
  // optimizer, and is overlapped only together with the gradient reduction.
  if (p.overlap_param_gather && !p.use_distributed_optimizer)
    fail("overlap-param-gather needs use-distributed-optimizer");
  if (p.overlap_param_gather && !p.overlap_grad_reduce)
    fail("overlap-param-gather needs overlap-grad-reduce");

  r.get("dry-run", a.dry_run);
  parse_fp8_args(r, a.model, a.no_effect);
  parse_mixed_precision_args(r, a);
  parse_main_grads_dtype(r, a);
  parse_recompute_args(r, a);
  parse_cpu_offloading_args(r, a);
  parse_optimizer_offload_args(r, a);
  // Megatron's arguments.py: the FP8 weights are all-gathered by the distributed optimizer.
  if (a.model.fp8.param_gather && !p.use_distributed_optimizer)
    fail("fp8-param-gather needs use-distributed-optimizer (the FP8 weights are what its "
         "all-gather moves)");
  if (a.device.empty()) a.device = cuda_available() ? "cuda" : "cpu";
  if (a.device == "cuda") {
    if (!cuda_available())
      fail("option 'device' is 'cuda', but {}", cuda_built() ? "no CUDA GPU is visible"
                                                              : "this build has no CUDA backend");
    a.model.device = Device::CUDA;
  } else if (a.device == "cpu") {
    a.model.device = Device::CPU;
  } else {
    fail("option 'device' must be cpu or cuda (got '{}')", a.device);
  }
  if (a.micro_batch_size <= 0) fail("micro-batch-size must be positive (got {})", a.micro_batch_size);
  if (r.has("global-batch-size") && a.global_batch_size <= 0)
    fail("global-batch-size must be positive (got {})", a.global_batch_size);
  if (a.global_batch_size == 0) a.global_batch_size = a.micro_batch_size;
  if (a.global_batch_size % a.micro_batch_size != 0)
    fail("global-batch-size ({}) is not divisible by micro-batch-size ({})", a.global_batch_size,
         a.micro_batch_size);
  if (a.train_iters <= 0) fail("train-iters must be positive (got {})", a.train_iters);
  if (a.log_interval <= 0) fail("log-interval must be positive (got {})", a.log_interval);
  if (a.eval_interval < 0 || a.eval_iters < 0) fail("eval-interval and eval-iters must be >= 0");
  if (a.data_path.empty() && !a.mock_data) fail("data-path is required (or mock-data)");
  if (!a.data_path.empty() && a.mock_data)
    fail("mock-data trains on random tokens: it takes no data-path (got '{}')",
         printable(a.data_path[0]));
  if (a.exit_interval < 0) fail("exit-interval must be >= 0 (got {})", a.exit_interval);
  if (a.tokenizer_type.empty()) fail("tokenizer-type is required");
  if (!a.save.empty() && a.save_interval < 0) fail("save-interval must be >= 0");
  if (a.lr.lr_decay_iters == 0) a.lr.lr_decay_iters = a.train_iters;
  optim::validate(a.lr);
  return a;
}

dist::ValidatedLayout check_parallel_layout(const TrainArgs& a, int64_t world_size) {
  const ParallelArgs& p = a.parallel;
  const GPTConfig& m = a.model;
  dist::LayoutRequest r;
  r.sizes.tp = p.tensor_model_parallel_size;
  r.sizes.cp = p.context_parallel_size;
  r.sizes.ep = p.expert_model_parallel_size;
  r.sizes.etp = p.expert_tensor_parallel_size;
  r.sizes.pp = p.pipeline_model_parallel_size;
  r.world_size = world_size;
  r.sequence_parallel = p.sequence_parallel;
  r.num_layers_per_virtual_pipeline_stage = p.num_layers_per_virtual_pipeline_stage;
  r.decoder_first_pipeline_num_layers = p.decoder_first_pipeline_num_layers;
  r.decoder_last_pipeline_num_layers = p.decoder_last_pipeline_num_layers;
  r.num_layers = m.num_layers;
  r.num_attention_heads = m.num_attention_heads;
  // As GPTConfig::finalize() will set it: the heads themselves without GQA.
  r.num_query_groups = m.group_query_attention && m.num_query_groups > 0 ? m.num_query_groups
                                                                         : m.num_attention_heads;
  r.num_experts = m.num_experts;
  dist::ValidatedLayout layout = dist::validate_layout(r);
  // The interleaved schedule's micro-batch groups (the trainer checks the batch split).
  const int64_t per_step = a.micro_batch_size * layout.sizes.dp;
  if (per_step > 0 && a.global_batch_size % per_step == 0)
    check_interleaved_micro_batches(a.global_batch_size / per_step, layout.sizes.pp,
                                    layout.sizes.vpp.value_or(1));
  return layout;
}

double comm_timeout_s(const ParallelArgs& p) {
  if (p.distributed_timeout_minutes > 0) return 60.0 * double(p.distributed_timeout_minutes);
  return dist::default_timeout_s();
}

std::string args_to_json(const RawOptions& raw) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : raw) j[k] = v.size() == 1 ? nlohmann::json(v[0]) : nlohmann::json(v);
  return j.dump();
}

}  // namespace megaton
