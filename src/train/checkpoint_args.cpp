// --use-checkpoint-args: Megatron's load_args_from_checkpoint on Megaton's raw options.
#include "train/checkpoint_args.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

// One argument of Megatron's list: the Megaton flags that set it (its names, deprecated
// forms included), and whether the checkpoint's value wins over one given (Megatron's
// _set_arg force=True) or only fills in a missing one.
struct CheckpointArg {
  std::vector<const char*> keys;
  bool force;
};

// megatron/training/checkpointing.py load_args_from_checkpoint, in its order (Megatron-LM
// d98e8a6), on the flags Megaton has; "Megaton:" marks flags Megaton's weights also
// depend on that Megatron's list lacks.
const std::vector<CheckpointArg>& model_args() {
  static const std::vector<CheckpointArg> args = {
      {{"num-layers"}, false},
      {{"hidden-size"}, false},
      {{"ffn-hidden-size"}, false},
      {{"seq-length"}, false},
      {{"num-attention-heads"}, false},
      {{"num-query-groups"}, true},
      {{"group-query-attention"}, true},
      {{"kv-channels"}, false},
      {{"max-position-embeddings"}, false},
      // position_embedding_type, add_position_embedding, use_rotary_position_embeddings
      {{"position-embedding-type", "use-rotary-position-embeddings", "no-position-embedding"},
       true},
      {{"rotary-base"}, true},
      {{"rotary-percent"}, true},
      {{"rotary-interleaved"}, true},
      {{"disable-bias-linear"}, true},  // add_bias_linear
      {{"add-qkv-bias"}, true},
      {{"squared-relu"}, true},
      {{"swiglu"}, true},
      {{"untie-embeddings-and-output-weights"}, true},
      {{"apply-layernorm-1p"}, true},
      {{"normalization"}, true},
      {{"apply-query-key-layer-scaling"}, true},
      {{"attention-dropout"}, true},
      {{"hidden-dropout"}, true},
      {{"mtp-num-layers"}, true},
      {{"num-experts"}, true},
      {{"moe-layer-freq"}, true},
      {{"moe-ffn-hidden-size"}, true},  // Megatron: only with num_experts, else cleared
      {{"moe-router-topk"}, true},
      {{"moe-token-dispatcher-type"}, false},
      {{"moe-router-pre-softmax"}, true},
      {{"moe-grouped-gemm"}, true},
      {{"moe-shared-expert-intermediate-size"}, true},
      {{"moe-router-score-function"}, true},
      {{"moe-router-enable-expert-bias"}, true},
      {{"moe-router-topk-scaling-factor"}, true},
      // Mamba args.
      {{"mamba-state-dim"}, true},
      {{"mamba-head-dim"}, true},
      {{"mamba-num-groups"}, true},
      {{"mamba-num-heads"}, true},
      // Not forced: a run may split the pattern into other pipeline stages ('|'). An older
      // checkpoint's deprecated name fills in as well.
      {{"hybrid-layer-pattern", "hybrid-override-pattern"}, false},
      // Megaton: the weights' names and math depend on these as well.
      {{"qk-layernorm"}, true},
      {{"norm-epsilon"}, true},
      {{"rope-type"}, true},
      {{"moe-shared-expert-gate"}, true},
      {{"moe-router-num-groups"}, true},
      {{"moe-router-group-topk"}, true},
      // Megaton: multi-latent attention and its YaRN table (a DeepSeek-V3 checkpoint,
      // e.g. one `megaton convert` wrote, is not loadable without them).
      {{"multi-latent-attention"}, true},
      {{"q-lora-rank"}, true},
      {{"kv-lora-rank"}, true},
      {{"qk-head-dim"}, true},
      {{"qk-pos-emb-head-dim"}, true},
      {{"v-head-dim"}, true},
      {{"rotary-scaling-factor"}, true},
      {{"original-max-position-embeddings"}, true},
      {{"beta-fast"}, true},
      {{"beta-slow"}, true},
      {{"mscale"}, true},
      {{"mscale-all-dim"}, true},
  };
  return args;
}

// Megatron: tokenizer_model and tokenizer_type, forced, unless
// --no-use-tokenizer-model-from-checkpoint-args. Megaton's tokenizers also read these
// files and sizes.
const std::vector<CheckpointArg>& tokenizer_args() {
  static const std::vector<CheckpointArg> args = {
      {{"tokenizer-type"}, true}, {{"tokenizer-model"}, true},
      {{"vocab-file"}, true},     {{"merge-file"}, true},
      {{"vocab-size"}, true},     {{"tokenizer-hf-no-include-special-tokens"}, true},
  };
  return args;
}

// Megatron (checkpoint version 3): with --use-mp-args-from-checkpoint-args.
const std::vector<CheckpointArg>& model_parallel_args() {
  static const std::vector<CheckpointArg> args = {
      {{"tensor-model-parallel-size"}, true},
      {{"pipeline-model-parallel-size"}, true},
      {{"num-virtual-stages-per-pipeline-rank"}, true},  // virtual_pipeline_model_parallel_size
      {{"num-layers-per-virtual-pipeline-stage"}, false},
      {{"expert-model-parallel-size"}, true},
  };
  return args;
}

bool switch_on(const RawOptions& raw, const char* key) {
  auto it = raw.find(key);
  return it != raw.end() && it->second != std::vector<std::string>{"false"};
}

std::string shown(const std::vector<std::string>& values) {
  return values.empty() ? std::string("(given)") : fmt::format("{}", fmt::join(values, " "));
}

// The checkpoint's raw options ("args" of its metadata: the flags its run was given, by
// name, values as strings or lists of strings).
RawOptions checkpoint_options(const nlohmann::json& args, const std::string& path) {
  RawOptions out;
  if (!args.is_object()) fail("checkpoint metadata in '{}': 'args' is not an object", path);
  for (const auto& [key, value] : args.items()) {
    std::vector<std::string>& values = out[key];
    if (value.is_string()) {
      values.push_back(value.get<std::string>());
    } else if (value.is_array()) {
      for (const auto& v : value) {
        if (!v.is_string())
          fail("checkpoint metadata in '{}': args '{}' holds a non-string value", path, key);
        values.push_back(v.get<std::string>());
      }
    } else {
      fail("checkpoint metadata in '{}': args '{}' is neither a string nor a list", path, key);
    }
  }
  return out;
}

// Applies one argument of the lists above: the run's values of its keys replaced by the
// checkpoint's (force, or none of its keys given).
void apply_arg(const CheckpointArg& arg, const RawOptions& from, RawOptions& raw,
               std::vector<std::string>& messages) {
  const auto given = [&](const RawOptions& o) {
    for (const char* key : arg.keys)
      if (o.count(key)) return true;
    return false;
  };
  if (!arg.force && given(raw)) return;
  for (const char* key : arg.keys) {
    auto here = raw.find(key);
    auto there = from.find(key);
    if (there != from.end()) {
      if (here == raw.end() || here->second != there->second)
        messages.push_back(
            fmt::format("Setting --{} to {} from checkpoint", key, shown(there->second)));
      raw[key] = there->second;
    } else if (here != raw.end()) {
      messages.push_back(
          fmt::format("Setting --{} to its default: the checkpoint's run did not give it", key));
      raw.erase(here);
    }
  }
}

}  // namespace

CheckpointArgs apply_checkpoint_args(const RawOptions& raw) {
  CheckpointArgs result{raw, {}};
  if (!switch_on(raw, "use-checkpoint-args")) return result;
  ArgReader r{raw};
  std::string load;
  r.get("load", load);
  if (load.empty()) fail("use-checkpoint-args requires --load");
  int64_t ckpt_step = 0;
  r.get("ckpt-step", ckpt_step);
  if (ckpt_step < 0) fail("ckpt-step must be >= 0 (got {})", ckpt_step);
  // Megatron: a checkpoint to read the arguments from, or the run's own arguments.
  const bool found = ckpt_step > 0
                         ? std::filesystem::is_directory(std::filesystem::path(load) /
                                                         ckpt::iteration_dir_name(ckpt_step))
                         : ckpt::tracked_iteration(load) >= 0;
  if (!found) {
    result.messages.push_back(
        "Checkpoint not found to provide arguments, using provided arguments.");
    return result;
  }
  const ckpt::LoadedCheckpoint ck =
      ckpt::read_checkpoint_metadata(load, ckpt_step > 0 ? ckpt_step : -1);
  const nlohmann::json meta = nlohmann::json::parse(ck.metadata_json);
  if (!meta.contains("args")) {
    result.messages.push_back(
        "Checkpoint provided does not have arguments saved, using provided arguments.");
    return result;
  }
  RawOptions from = checkpoint_options(meta.at("args"), ck.path);
  // The tokenizer's files as the saving run resolved them (absolute paths), not as it
  // spelled them relative to its own working directory.
  for (const auto& [key, field] : {std::pair{"tokenizer-model", "tokenizer_model"},
                                   std::pair{"vocab-file", "tokenizer_vocab_file"},
                                   std::pair{"merge-file", "tokenizer_merge_file"}})
    if (from.count(key) && meta.contains(field) && meta[field].is_string() &&
        !meta[field].get<std::string>().empty())
      from[key] = {meta[field].get<std::string>()};
  RawOptions& out = result.raw;
  for (const CheckpointArg& arg : model_args()) apply_arg(arg, from, out, result.messages);
  // Megatron clears moe_ffn_hidden_size for a checkpoint without experts.
  if (!from.count("num-experts")) out.erase("moe-ffn-hidden-size");
  if (!switch_on(raw, "no-use-tokenizer-model-from-checkpoint-args") &&
      !switch_on(raw, "disable-use-tokenizer-model-from-checkpoint-args"))
    for (const CheckpointArg& arg : tokenizer_args()) apply_arg(arg, from, out, result.messages);
  if (switch_on(raw, "use-mp-args-from-checkpoint-args"))
    for (const CheckpointArg& arg : model_parallel_args())
      apply_arg(arg, from, out, result.messages);
  result.messages.insert(result.messages.begin(),
                         fmt::format("Model arguments from checkpoint {}", ck.path));
  return result;
}

TrainArgs parse_model_args(RawOptions raw) {
  // This machine's device (a GPU-trained checkpoint is read on a CPU too); the schedule and
  // data only a training run needs.
  raw.erase("device");
  if (!raw.count("train-iters") && !raw.count("train-samples")) raw["train-iters"] = {"1"};
  for (const char* data :
       {"data-path", "data-args-path", "train-data-path", "per-split-data-args-path", "mock-data"})
    if (raw.count(data)) return parse_train_args(raw);
  raw["mock-data"] = {"true"};
  return parse_train_args(raw);
}

std::vector<std::string> checkpoint_arg_keys() {
  std::vector<std::string> keys;
  for (const auto* list : {&model_args(), &tokenizer_args(), &model_parallel_args()})
    for (const CheckpointArg& arg : *list)
      for (const char* key : arg.keys) keys.emplace_back(key);
  return keys;
}

}  // namespace megaton
