// Trainer checkpoints: save (full tensors whatever the layout), load (under any layout),
// and the FP8 delayed recipe's state that goes with them.
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "dist/gather.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"
#include "train/tensor_parallel_ckpt.h"
#include "train/trainer.h"

namespace megaton {

std::vector<std::pair<std::string, Tensor*>> Trainer::fp8_state(bool experts) {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (auto& chunk : chunks_)
    for (TransformerLayer* layer : chunk->all_layers())
      for (auto& entry : layer->fp8_state(experts)) out.push_back(entry);
  return out;
}

void Trainer::save(int64_t iteration) {
  ddp_->finish_param_sync();
  // Full tensors whatever the layout, gathered and written by world rank 0, so a
  // checkpoint loads under any other layout. Collective: every rank takes part.
  const std::map<std::string, const Param*> by_name = params_by_name();
  dist::NamedTensors local =
      assemble_tensor_parallel(optimizer_->full_state(), by_name, chunks_[0]->model_parallel());
  for (auto& entry : moe_->expert_bias_state()) local.push_back(std::move(entry));
  // The FP8 state once: dense layers' from data- and tensor-parallel rank 0, the experts'
  // from expert-data- and expert-tensor-parallel rank 0 of each expert-parallel rank.
  if (grid_->dp().rank == 0 && grid_->tp().rank == 0)
    for (auto& [name, t] : fp8_state(false)) local.emplace_back(name, *t);
  if (grid_->edp().rank == 0 && grid_->etp().rank == 0)
    for (auto& [name, t] : fp8_state(true)) local.emplace_back(name, *t);
  std::vector<std::pair<std::string, Tensor>> state =
      dist::gather_named_tensors(*comm_, grid_->world(), local);
  if (!is_logging_rank()) return;
  std::vector<std::pair<std::string, Tensor>> tensors;
  nlohmann::json shapes = nlohmann::json::object();
  for (auto& [name, t] : state) {
    if (name.starts_with("model.")) shapes[name] = t.shape();
    tensors.emplace_back(name, t.to(Device::CPU));
    // A checkpoint of NaN or inf would become the one a resume starts from: refuse it, so
    // the tracker keeps naming the last finite one. Every floating tensor, widened to fp32
    // on the host (the precision-aware optimizer's bf16 moments).
    const Tensor& host = tensors.back().second;
    if (is_floating(t.dtype()) && !std::isfinite(ops::sum_of_squares(
                                      host.dtype() == DType::F32 ? host : host.to(DType::F32))))
      fail(
          "not saving iteration {} to '{}': tensor '{}' holds NaN or Inf values (the "
          "checkpoint the tracker names is unchanged)",
          iteration, args_.save, name);
  }
  nlohmann::json meta;
  meta["iteration"] = iteration;
  meta["consumed_samples"] = consumed_samples_;
  meta["optimizer_step"] = optimizer_->step_count();
  meta["world_size"] = grid_->world_size();
  meta["floating_point_operations_so_far"] = floating_point_operations_so_far_;
  meta["skipped_iterations"] = skipped_iterations_;
  meta["nan_iterations"] = nan_iterations_;
  meta["scheduler_samples"] = scheduler_samples_;
  if (scaler_->dynamic()) {  // Megatron's DynamicGradScaler.state_dict
    const optim::GradScaler::State st = scaler_->state();
    meta["grad_scaler"] = {{"scale", st.scale},
                           {"growth_tracker", st.growth_tracker},
                           {"hysteresis_tracker", st.hysteresis_tracker}};
  }
  meta["rng_seed"] = args_.seed;
  meta["args"] = nlohmann::json::parse(args_to_json(raw_));
  meta["tokenizer_type"] = args_.tokenizer_type;
  const auto absolute = [](const std::string& path) {
    return path.empty() ? std::string() : std::filesystem::absolute(path).string();
  };
  meta["tokenizer_model"] = absolute(args_.tokenizer_model);
  meta["tokenizer_vocab_file"] = absolute(args_.vocab_file);
  meta["tokenizer_merge_file"] = absolute(args_.merge_file);
  meta["global_shapes"] = shapes;
  // The vocabulary rows of the embedding and output layer: real tokens, then padding that
  // depends on the tensor-parallel size (a load under another layout pads or trims it).
  meta["vocab_size"] = args_.model.vocab_size;
  meta["padded_vocab_size"] = args_.model.padded_vocab_size;
  ckpt::SaveOptions options;
  options.save_retain_interval = args_.save_retain_interval;
  const std::string removed =
      ckpt::save_checkpoint(args_.save, iteration, tensors, meta.dump(1), options);
  if (!removed.empty() && is_logging_rank())
    fmt::print(" removed {} (save-retain-interval {})\n", removed, args_.save_retain_interval);
  fmt::print(" saved checkpoint from iteration {:7} to {}\n", iteration, args_.save);
  // Megatron's compute_throughputs_and_append_to_progress_log (the cumulative throughput
  // over earlier jobs is not kept).
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - job_start_).count();
  run_logger_->progress(fmt::format(
      "Saved checkpoint\tIteration: {}\tJob throughput: {:.1f} TFLOP/s/GPU\tFloating-point "
      "operations: {:.2e}\tTokens (in billions): {:.2f}",
      iteration,
      (floating_point_operations_so_far_ - job_start_flops_) / std::max(seconds, 1e-9) / 1e12 /
          double(grid_->world_size()),
      floating_point_operations_so_far_,
      double(consumed_samples_) * double(args_.model.seq_length) / 1e9));
  std::fflush(stdout);
}

void Trainer::load() {
  // Megatron's load_checkpoint: a --load directory without a tracker (the first run of a
  // launch script that saves and loads the same directory) starts from random weights with
  // a warning, or exits with --exit-on-missing-checkpoint.
  // --ckpt-step names the iteration to read, whatever the tracker says (Megatron's
  // _load_base_checkpoint); a missing one is an error.
  if (args_.ckpt_step == 0 && !std::filesystem::exists(std::filesystem::path(args_.load) /
                                                       "latest_checkpointed_iteration.txt")) {
    if (args_.exit_on_missing_checkpoint)
      fail("--load {}: no checkpoint (latest_checkpointed_iteration.txt), and "
           "--exit-on-missing-checkpoint is set", args_.load);
    if (is_logging_rank())
      fmt::print("WARNING: could not find the metadata file {}/latest_checkpointed_iteration.txt\n"
                 "    will not load any checkpoints and will start from random\n", args_.load);
    return;
  }
  ckpt::LoadedCheckpoint ck =
      ckpt::load_checkpoint(args_.load, args_.ckpt_step > 0 ? args_.ckpt_step : -1);
  const bool optimizer_state = !args_.finetune && !args_.no_load_optim;
  auto meta = nlohmann::json::parse(ck.metadata_json);
  // Checkpoints from before the vocabulary was recorded have no such field.
  if (meta.contains("vocab_size") && (!meta["vocab_size"].is_number_integer() ||
                                      meta["vocab_size"].get<int64_t>() != args_.model.vocab_size))
    fail(
        "checkpoint '{}' was trained with a vocabulary of {} tokens, the tokenizer has {} "
        "(tokenizer-type / tokenizer-model / vocab-size)",
        ck.path, meta["vocab_size"].dump(), args_.model.vocab_size);
  const std::map<std::string, const Param*> by_name = params_by_name();
  // This rank's part of each entry: the vocabulary rows refitted to this layout's padding,
  // then the tensor-parallel slice.
  std::map<std::string, Tensor> parts;
  optimizer_->load_full_state(
      [&](const std::string& name) -> const Tensor* {
        auto it = ck.tensors.find(name);
        if (it == ck.tensors.end()) return nullptr;
        const Param* p = param_of_entry(name, by_name);
        if (!p) return &it->second;
        auto [part, fresh] = parts.try_emplace(name);
        if (!fresh) return &part->second;
        Tensor full = it->second;
        if (p->padded_vocab_rows)
          full = fit_padded_vocab_rows(full, args_.model.padded_vocab_size, args_.model.vocab_size,
                                       name, ck.path);
        if (full.shape() != p->full_shape)
          fail(
              "checkpoint '{}': tensor '{}' is {} {}, the model expects {} {} (whole tensors, "
              "before the tensor-parallel split)",
              ck.path, name, dtype_name(full.dtype()), shape_str(full.shape()),
              dtype_name(DType::F32), shape_str(p->full_shape));
        part->second = p->tp_split_dim < 0
                           ? full
                           : tensor_parallel_slice(full, *p, chunks_[0]->model_parallel());
        return &part->second;
      },
      ck.path, optimizer_state);
  moe_->load_expert_bias(
      [&](const std::string& name) -> const Tensor* {
        auto it = ck.tensors.find(name);
        return it == ck.tensors.end() ? nullptr : &it->second;
      },
      ck.path);
  // The delayed recipe's amax histories: a checkpoint without them (bf16, or another
  // recipe) starts them afresh, as Transformer Engine does without its extra state.
  std::vector<std::pair<std::string, Tensor*>> fp8_entries = fp8_state(false);
  for (auto& entry : fp8_state(true)) fp8_entries.push_back(entry);
  for (auto& [name, t] : fp8_entries) {
    auto it = ck.tensors.find(name);
    if (it == ck.tensors.end() || args_.finetune) continue;
    if (it->second.shape() != t->shape())
      fail(
          "checkpoint '{}': FP8 state '{}' is {}, this run expects {} "
          "(--fp8-amax-history-len differs)",
          ck.path, name, shape_str(it->second.shape()), shape_str(t->shape()));
    t->copy_from(it->second);
  }
  if (args_.finetune) {
    if (is_logging_rank())
      fmt::print(" loaded weights from {} (finetune: starting at iteration 0)\n", ck.path);
    return;
  }
  try {
    iteration_ = meta.at("iteration").get<int64_t>();
    consumed_samples_ = meta.at("consumed_samples").get<int64_t>();
    floating_point_operations_so_far_ = meta.at("floating_point_operations_so_far").get<double>();
    skipped_iterations_ = meta.value("skipped_iterations", int64_t(0));
    nan_iterations_ = meta.value("nan_iterations", int64_t(0));
    if (optimizer_state) optimizer_->set_step_count(meta.at("optimizer_step").get<int64_t>());
    // The schedule's samples: those of the updates applied. Older checkpoints count updates
    // (scheduler_steps) of a constant batch; without the optimizer state, the consumed
    // samples.
    if (!optimizer_state)
      scheduler_samples_ = consumed_samples_;
    else if (meta.contains("scheduler_samples"))
      scheduler_samples_ = meta.at("scheduler_samples").get<int64_t>();
    else
      scheduler_samples_ = meta.value("scheduler_steps", iteration_) * args_.global_batch_size;
    // A dynamic scaler resumes its scale and trackers; a checkpoint without them (bf16, or
    // static scaling) starts from --initial-loss-scale, as Megatron without the state.
    if (optimizer_state && meta.contains("grad_scaler")) {
      const auto& g = meta.at("grad_scaler");
      scaler_->load_state({g.at("scale").get<float>(), g.at("growth_tracker").get<int64_t>(),
                           g.at("hysteresis_tracker").get<int64_t>()},
                          ck.path.c_str());
    }
    if (!args_.no_load_rng) args_.seed = meta.at("rng_seed").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint metadata in '{}' is missing a field: {}", ck.path, e.what());
  }
  if (is_logging_rank())
    fmt::print(" loaded checkpoint from {} at iteration {}\n", ck.path, iteration_);
}

}  // namespace megaton
