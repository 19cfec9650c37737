// parse_train_args: the flag groups (train/args/) put together, with the rules that span
// groups; YAML configs; the parallel layout check.
#include "train/arguments.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/printable.h"
#include "dist/comm.h"
#include "model/param_buffer.h"
#include "train/args/flag_table.h"
#include "train/pipeline_schedule.h"
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

static std::string normalize_key(std::string key) {
  std::replace(key.begin(), key.end(), '_', '-');
  return key;
}

RawOptions read_yaml_options(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) fail("config file '{}' does not exist", printable(path));
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
      fail("config file '{}' is not a text file (byte 0x{:02x} at offset {})", printable(path), c,
           i);
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
    const OptionSpec* spec = find_option_spec(key);
    if (!spec) fail("config file '{}': unknown key '{}'", printable(path), printable(written));
    // YAML leaves duplicate keys to the reader; yaml-cpp keeps both and the last would win
    // silently. "num_layers" and "num-layers" are the same option.
    if (raw.count(key))
      fail("config file '{}': key '{}' is given twice (line {})", printable(path), key,
           kv.first.Mark().line + 1);
    std::vector<std::string> values;
    if (kv.second.IsSequence()) {
      if (spec->max_values <= 1)
        fail("config file '{}': key '{}' takes one value, not a list", printable(path), key);
      for (const auto& v : kv.second) {
        if (!v.IsScalar())
          fail("config file '{}': key '{}' must be a list of scalars", printable(path), key);
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
  for (auto it = raw.begin(); it != raw.end();)
    it = it->second.empty() ? raw.erase(it) : std::next(it);
  return raw;
}

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
      for (int64_t i = 0; i < times; ++i)
        r.list.insert(r.list.end(), list.list.begin(), list.list.end());
      v = r;
    }
    return v;
  }
  Value expr() {
    Value v = product();
    while (take('+')) {
      Value w = product();
      if (v.is_list != w.is_list) bad("a list plus a number");
      if (v.is_list)
        v.list.insert(v.list.end(), w.list.begin(), w.list.end());
      else
        v.number += w.number;
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

// The rule of every flag given (OptionSpec::rule): an unsupported feature is refused, a flag
// without effect is listed for the start-up notice. A switch given as false asks for
// nothing.
void apply_flag_rules(const RawOptions& raw, TrainArgs& a) {
  for (const auto& [key, values] : raw) {
    const OptionSpec* spec = find_option_spec(key);
    if (!spec) fail("unknown option '{}' (neither a Megaton nor a Megatron-LM flag)", key);
    if (spec->rule == FlagRule::Implemented) continue;
    if (spec->is_switch && values == std::vector<std::string>{"false"}) continue;
    if (spec->rule == FlagRule::Unsupported)
      fail("--{} is not supported in Megaton: {}", key, spec->help);
    if (!spec->harmless_values.empty()) {
      const bool harmless = std::all_of(values.begin(), values.end(), [&](const std::string& v) {
        return std::find(spec->harmless_values.begin(), spec->harmless_values.end(), v) !=
               spec->harmless_values.end();
      });
      if (!harmless)
        fail("--{} {}: {}", key, printable(values.empty() ? std::string() : values[0]),
             spec->unsupported_value);
    }
    a.no_effect.push_back("--" + key + ": " + spec->help);
  }
}

// Iteration- or sample-based training, the batch-size schedule and the learning-rate and
// weight-decay schedule in samples: Megatron's validate_args checks (arguments.py),
// update_train_iters and get_optimizer_param_scheduler (training.py).
void finish_schedule(const ArgReader& r, TrainArgs& a) {
  const ScheduleFlags& f = a.schedule;
  const bool by_samples = r.has("train-samples");
  if (by_samples == r.has("train-iters"))
    fail("give one of train-iters and train-samples (got {})", by_samples ? "both" : "neither");
  if (by_samples && f.train_samples <= 0)
    fail("train-samples must be positive (got {})", f.train_samples);
  if (!by_samples && a.train_iters <= 0)
    fail("train-iters must be positive (got {})", a.train_iters);
  // Megatron's asserts: the lengths are all iterations or all samples.
  const char* iteration_keys[] = {"lr-decay-iters", "lr-warmup-iters", "lr-wsd-decay-iters"};
  const char* sample_keys[] = {"lr-decay-samples", "lr-warmup-samples", "lr-wsd-decay-samples"};
  for (const char* key : by_samples ? iteration_keys : sample_keys)
    if (r.has(key))
      fail("{} does not go with {} (Megatron: expected {}-based training)", key,
           by_samples ? "train-samples" : "train-iters", by_samples ? "sample" : "iteration");
  if (r.has("lr-warmup-fraction") && (r.has("lr-warmup-iters") || r.has("lr-warmup-samples")))
    fail("can only specify one of lr-warmup-fraction and lr-warmup-{}",
         by_samples ? "samples" : "iters");
  const bool scheduled = !f.rampup_batch_size.empty() || !f.step_batch_size_schedule.empty();
  if (scheduled && a.cuda_graph_impl != "none")
    fail(
        "a batch-size schedule with cuda-graph-impl {} is not supported in Megaton (the "
        "captured step has one micro-batch count)",
        a.cuda_graph_impl);
  const BatchSchedule batches(batch_schedule_config(a, 1));
  if (!f.step_batch_size_schedule.empty()) a.global_batch_size = batches.max_global_batch_size();
  optim::LRScheduleConfig& lr = a.lr;
  const int64_t gbs = a.global_batch_size;
  if (by_samples) {
    a.train_iters = batches.train_iters_for_samples(f.train_samples);
    if (a.train_iters <= 0)
      fail("train-samples {} gives no iteration (global batch size {})", f.train_samples, gbs);
    lr.lr_decay_steps = f.lr_decay_samples > 0 ? f.lr_decay_samples : f.train_samples;
    lr.wd_incr_steps = f.train_samples;
    lr.lr_wsd_decay_steps = f.lr_wsd_decay_samples;
    lr.lr_warmup_steps = double(f.lr_warmup_samples);
  } else {
    // Iteration lengths times the global batch size, as Megatron's scheduler counts them.
    // With a batch-size schedule that is its last batch size (Megatron multiplies by
    // micro-batch-size x data-parallel size there, its default global batch size, which
    // would end the schedule early; docs/launch-scripts.md).
    lr.lr_decay_steps = (f.lr_decay_iters > 0 ? f.lr_decay_iters : a.train_iters) * gbs;
    lr.wd_incr_steps = a.train_iters * gbs;
    lr.lr_wsd_decay_steps = f.lr_wsd_decay_iters >= 0 ? f.lr_wsd_decay_iters * gbs : -1;
    lr.lr_warmup_steps = double(f.lr_warmup_iters * gbs);
  }
  if (f.lr_warmup_fraction >= 0)
    lr.lr_warmup_steps = f.lr_warmup_fraction * double(lr.lr_decay_steps);
  if (lr.weight_decay_incr_style != optim::WeightDecayIncrStyle::Constant &&
      a.cuda_graph_impl != "none")
    fail(
        "weight-decay-incr-style {} with cuda-graph-impl {} is not supported in Megaton (the "
        "captured optimizer step has one weight decay)",
        lr.weight_decay_incr_style == optim::WeightDecayIncrStyle::Linear ? "linear" : "cosine",
        a.cuda_graph_impl);
}

// The optimizer against the precision, sharding and FP8 flags (Megatron's validate_args,
// OptimizerConfig.__post_init__ and _get_megatron_emerging_optimizer; docs/research/muon.md
// sections 1.3 and 6). FSDP2, several optimizer instances and
// --overlap-param-gather-with-optimizer-step are refused for every optimizer already.
void finish_optimizer(TrainArgs& a) {
  const optim::OptimizerKind kind = a.optimizer.kind;
  const char* name = optim::optimizer_kind_name(kind);
  const bool muon = kind == optim::OptimizerKind::Muon;
  if (a.model.fp16 && (muon || kind == optim::OptimizerKind::Lion))
    fail(
        "fp16 with optimizer {} is not supported (Megatron: emerging optimizer with fp16 is not "
        "supported); use --bf16",
        name);
  // --optimizer-cpu-offload needs the precision-aware optimizer (memory_flags.cpp), so
  // this refuses it too.
  if (a.adam.use_precision_aware_optimizer && kind != optim::OptimizerKind::Adam)
    fail(
        "use-precision-aware-optimizer{} needs optimizer adam (got {}), as Megatron's "
        "OptimizerConfig asserts",
        a.adam.optimizer_cpu_offload ? " (and with it optimizer-cpu-offload)" : "", name);
  if (a.parallel.use_megatron_fsdp && (muon || kind == optim::OptimizerKind::Lion))
    fail(
        "use-megatron-fsdp with optimizer {} is not supported (Megatron-FSDP takes adam or "
        "sgd)",
        name);
  if (muon && a.model.fp8.param_gather)
    fail(
        "fp8-param-gather with optimizer muon is not supported in Megaton yet (the FP8 "
        "weight buffers are cast from the flat main-param shards; Muon's matrices have no such "
        "cast yet)");
  // Lion's and SGD's steps keep whole fp32 main params: no bf16 remainders (Megatron has
  // them only in Transformer Engine's FusedAdam). Under Muon the Adam params keep theirs.
  if (kind == optim::OptimizerKind::Sgd || kind == optim::OptimizerKind::Lion ||
      (muon && a.optimizer.muon.scalar_optimizer == optim::OptimizerKind::Lion))
    a.adam.store_param_remainders = false;
}

// The rules that span groups, after every group has read its flags.
void finish_args(const ArgReader& r, TrainArgs& a) {
  // Megatron's arguments.py: the FP8 weights are all-gathered by the distributed optimizer.
  if (a.model.fp8.param_gather && !a.parallel.use_distributed_optimizer)
    fail(
        "fp8-param-gather needs use-distributed-optimizer (the FP8 weights are what its "
        "all-gather moves)");
  finish_optimizer(a);
  if (a.device.empty()) a.device = cuda_available() ? "cuda" : "cpu";
  if (a.device == "cuda") {
    if (!cuda_available())
      fail("option 'device' is 'cuda', but {}",
           cuda_built() ? "no CUDA GPU is visible" : "this build has no CUDA backend");
    a.model.device = Device::CUDA;
  } else if (a.device == "cpu") {
    a.model.device = Device::CPU;
  } else {
    fail("option 'device' must be cpu or cuda (got '{}')", a.device);
  }
  if (a.micro_batch_size <= 0)
    fail("micro-batch-size must be positive (got {})", a.micro_batch_size);
  if (r.has("global-batch-size") && a.global_batch_size <= 0)
    fail("global-batch-size must be positive (got {})", a.global_batch_size);
  if (a.global_batch_size == 0) a.global_batch_size = a.micro_batch_size;
  if (a.global_batch_size % a.micro_batch_size != 0)
    fail("global-batch-size ({}) is not divisible by micro-batch-size ({})", a.global_batch_size,
         a.micro_batch_size);
  finish_schedule(r, a);
  if (a.log_interval <= 0) fail("log-interval must be positive (got {})", a.log_interval);
  if (a.eval_interval < 0 || a.eval_iters < 0) fail("eval-interval and eval-iters must be >= 0");
  const bool per_split = !a.per_split_data_path[0].empty();
  if (a.data_path.empty() && !per_split && !a.mock_data)
    fail(
        "data-path is required (or data-args-path, train-data-path, "
        "per-split-data-args-path, or mock-data)");
  if (a.exit_interval < 0) fail("exit-interval must be >= 0 (got {})", a.exit_interval);
  if (a.tokenizer_type.empty()) fail("tokenizer-type is required");
  optim::validate(a.lr);
}

}  // namespace

TrainArgs parse_train_args(const RawOptions& raw) {
  TrainArgs a;
  apply_flag_rules(raw, a);
  ArgReader r{raw};
  for (const ArgGroup& g : train_arg_groups())
    if (g.parse) g.parse(r, a);
  finish_args(r, a);
  return a;
}

BatchScheduleConfig batch_schedule_config(const TrainArgs& a, int64_t data_parallel_size) {
  BatchScheduleConfig c;
  c.global_batch_size = a.global_batch_size;
  c.rampup_batch_size = a.schedule.rampup_batch_size;
  c.step_batch_size_schedule = a.schedule.step_batch_size_schedule;
  c.seq_length = a.model.seq_length;  // Megatron's training passes it: thresholds in tokens
  c.micro_batch_times_data_parallel_size = a.micro_batch_size * data_parallel_size;
  return c;
}

data::TokenizerOptions tokenizer_options(const TrainArgs& a) {
  data::TokenizerOptions t;
  t.type = a.tokenizer_type;
  t.model = a.tokenizer_model;
  t.vocab_file = a.vocab_file;
  t.merge_file = a.merge_file;
  t.vocab_size = a.vocab_size;
  t.include_special_tokens = a.tokenizer_hf_include_special_tokens;
  return t;
}

namespace {

// Context parallelism's own checks (Megatron's arguments.py and Transformer Engine's,
// docs/research/context-parallel.md 4), and what Megaton's CP does not cover yet.
void check_context_parallel(const TrainArgs& a, const dist::ValidatedLayout& layout) {
  const int64_t cp = layout.sizes.cp, tp = layout.sizes.tp;
  if (cp == 1) return;
  const GPTConfig& m = a.model;
  if (m.seq_length % (2 * cp) != 0)
    fail("seq-length ({}) is not divisible by 2 x context-parallel-size ({})", m.seq_length,
         2 * cp);
  if (layout.sequence_parallel && (m.seq_length / cp) % tp != 0)
    fail(
        "seq-length / context-parallel-size ({}) is not divisible by tensor-model-parallel-size "
        "({}) (sequence-parallel)",
        m.seq_length / cp, tp);
  if (a.parallel.cp_comm_type == "a2a") {
    const int64_t groups = m.group_query_attention && m.num_query_groups > 0
                               ? m.num_query_groups
                               : m.num_attention_heads;
    if ((m.num_attention_heads / tp) % cp != 0 || (groups / tp) % cp != 0)
      fail(
          "cp-comm-type a2a needs the attention heads ({}) and query groups ({}) per "
          "tensor-parallel rank divisible by context-parallel-size ({})",
          m.num_attention_heads / tp, groups / tp, cp);
  }
  auto not_yet = [cp](const std::string& what) {
    fail("context-parallel-size {} with {} is not supported yet", cp, what);
  };
  // Megatron's MambaContextParallel (heads over CP around the scan) is not built.
  if (m.is_hybrid() && m.hybrid_layer_pattern.find(kHybridMamba) != std::string::npos)
    not_yet("Mamba layers (hybrid-layer-pattern with M)");
  // Packed documents: the CP attention's document pieces are host decisions per micro-batch,
  // which a captured step cannot follow.
  if ((a.reset_attention_mask || a.reset_position_ids) && a.cuda_graph_impl == "full_iteration")
    not_yet(
        "--reset-attention-mask / --reset-position-ids (packed sequences) and "
        "--cuda-graph-impl full_iteration");
  // MTP: its depths' shifts gather the whole samples' labels and weigh by the whole
  // micro-batch's token counts; the per-token loss's weighting is not worked out under CP.
  if (m.mtp_num_layers > 0 && a.calculate_per_token_loss)
    not_yet("--mtp-num-layers and --calculate-per-token-loss");
  // FP8: the dense layers' token-split operands have their amaxes maxed over CP
  // (Linear::fp8_sharding). The experts would need the union over CP of the experts that
  // received rows (each CP rank quantizes only its non-empty ones): not built.
  if (m.fp8.enabled && m.num_experts > 0)
    not_yet("--fp8-format on a model with experts (--num-experts)");
  if (m.attention_dropout > 0.0f)
    not_yet(
        fmt::format("--attention-dropout {} (give 0: the context-parallel attention has no "
                    "dropout)",
                    m.attention_dropout));
  for (const std::string& type : m.moe_router_load_balancing_type)
    if (type == "seq_aux_loss") not_yet("--moe-router-load-balancing-type seq_aux_loss");
}

// Megatron-FSDP with what it cannot be combined with yet.
void check_megatron_fsdp(const TrainArgs& a) {
  const ParallelArgs& p = a.parallel;
  if (!p.use_megatron_fsdp) return;
  const ShardingStrategy s = parse_sharding_strategy(p.data_parallel_sharding_strategy);
  auto not_yet = [&](const std::string& what) {
    fail("use-megatron-fsdp with data-parallel-sharding-strategy {} and {} is not supported yet",
         p.data_parallel_sharding_strategy, what);
  };
  // (FP8 weight buffers are written by the optimizer's cast and all-gathered whole.)
  if (s >= ShardingStrategy::OptimGrads && a.model.fp8.param_gather) not_yet("--fp8-param-gather");
  // (The offload pins the layer's params' memory, which FSDP releases between uses.)
  if (s >= ShardingStrategy::OptimGrads && a.model.cpu_offloading.enabled)
    not_yet("--cpu-offloading");
  // (The step's graph would capture the buckets' allocations and releases.)
  if (s >= ShardingStrategy::OptimGrads && a.cuda_graph_impl == "full_iteration")
    not_yet("--cuda-graph-impl full_iteration");
  // (Each rank quantizes whole FP8 weights from whole main params.)
  if (a.model.init_model_with_meta_device && a.model.fp8.param_gather)
    fail("init-model-with-meta-device with --fp8-param-gather is not supported yet");
}

}  // namespace

dist::ValidatedLayout check_parallel_layout(const TrainArgs& a, int64_t world_size) {
  const ParallelArgs& p = a.parallel;
  const GPTConfig& m = a.model;
  // Here rather than in the flag parsers: it needs the run's device, which a dry run for
  // --device cuda on a machine without a GPU sets after parsing (cli/cmd_train.cpp).
  optim::check_main_params_dtype(a.adam, m.compute_dtype());
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
  if (m.is_hybrid()) {  // before GPTConfig::finalize: the pattern gives the layers
    const HybridPattern pattern = parse_hybrid_pattern(m.hybrid_layer_pattern);
    if (r.num_layers == 0) r.num_layers = int64_t(pattern.layers.size());
    r.pipeline_segment_layers = pattern.segment_layers;
  }
  dist::ValidatedLayout layout = dist::validate_layout(r);
  check_context_parallel(a, layout);
  check_megatron_fsdp(a);
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
