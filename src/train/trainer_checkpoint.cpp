// Trainer checkpoints: save (each rank its own pieces, ckpt/sharded.h), load (under any layout,
// either format),
// and the FP8 delayed recipe's state that goes with them.
#include <cmath>
#include <filesystem>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "ckpt/checkpoint.h"
#include "ckpt/sharded.h"
#include "core/copy_stream.h"
#include "core/printable.h"
#include "dist/gather.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"
#include "train/sharded_ckpt.h"
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

namespace {

// `s` from member `root` of g on every member (the save's temporary directory).
std::string broadcast_string(dist::Comm& comm, const dist::Group& g, const std::string& s,
                             int root) {
  Tensor length = Tensor::from_i32({1}, {int32_t(s.size())}).to(comm.device());
  comm.broadcast(length, root, g);
  const int32_t n = length.to(Device::CPU).i32()[0];
  if (n == 0) return {};
  std::vector<int32_t> chars(size_t(n), 0);
  if (g.rank == root)
    for (int32_t i = 0; i < n; ++i)
      chars[size_t(i)] = int32_t(static_cast<unsigned char>(s[size_t(i)]));
  Tensor t = Tensor::from_i32({n}, chars).to(comm.device());
  comm.broadcast(t, root, g);
  const Tensor host = t.to(Device::CPU);
  std::string out(size_t(n), '\0');
  for (int32_t i = 0; i < n; ++i) out[size_t(i)] = char(host.i32()[i]);
  return out;
}

Tensor string_tensor(const std::string& s) {
  std::vector<int32_t> chars(s.size());
  for (size_t i = 0; i < s.size(); ++i) chars[i] = int32_t(static_cast<unsigned char>(s[i]));
  return Tensor::from_i32({int64_t(chars.size())}, chars);
}

// Refuses optimizer state saved by another optimizer: `meta`'s "optimizer" (absent before
// the field existed: adam) and, for muon, "muon_scalar_optimizer" (absent: adam).
void check_checkpoint_optimizer(const nlohmann::json& meta, const optim::OptimizerConfig& run,
                                const std::string& path) {
  const auto field = [&](const char* key) {
    return meta.contains(key) && meta[key].is_string() ? meta[key].get<std::string>()
                                                       : std::string("adam");
  };
  std::string saved = field("optimizer"), wanted = optim::optimizer_kind_name(run.kind);
  if (saved == wanted && run.kind == optim::OptimizerKind::Muon) {
    saved += " with muon-scalar-optimizer " + field("muon_scalar_optimizer");
    wanted += std::string(" with muon-scalar-optimizer ") +
              optim::optimizer_kind_name(run.muon.scalar_optimizer);
  }
  if (saved != wanted)
    fail(
        "checkpoint '{}' holds the optimizer state of optimizer {}, this run uses optimizer {}: "
        "load its weights with --no-load-optim or --finetune",
        path, printable(saved), wanted);
}

std::string tensor_string(const Tensor& t) {
  const Tensor host = t.to(Device::CPU);
  std::string out(size_t(host.numel()), '\0');
  for (int64_t i = 0; i < host.numel(); ++i) out[size_t(i)] = char(host.i32()[i]);
  return out;
}

}  // namespace

std::string Trainer::checkpoint_metadata(int64_t iteration) const {
  nlohmann::json meta;
  meta["iteration"] = iteration;
  meta["consumed_samples"] = consumed_samples_;
  meta["optimizer_step"] = optimizer_->step_count();
  meta["world_size"] = grid_->world_size();
  meta["floating_point_operations_so_far"] = floating_point_operations_so_far_;
  meta["skipped_iterations"] = skipped_iterations_;
  meta["nan_iterations"] = nan_iterations_;
  meta["scheduler_samples"] = scheduler_samples_;
  // Whose state the optimizer entries are (Megatron's names); a load refuses another's.
  meta["optimizer"] = optim::optimizer_kind_name(args_.optimizer.kind);
  if (args_.optimizer.kind == optim::OptimizerKind::Muon)
    meta["muon_scalar_optimizer"] =
        optim::optimizer_kind_name(args_.optimizer.muon.scalar_optimizer);
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
  // The vocabulary rows of the embedding and output layer: real tokens, then padding that
  // depends on the tensor-parallel size (a load under another layout pads or trims it).
  meta["vocab_size"] = args_.model.vocab_size;
  meta["padded_vocab_size"] = args_.model.padded_vocab_size;
  return meta.dump(1);
}

std::vector<optim::DistributedAdamW::LocalStateEntry> Trainer::checkpoint_entries() {
  std::vector<optim::DistributedAdamW::LocalStateEntry> entries = optimizer_->local_state();
  // The expert biases and, once, the FP8 state: dense layers' from (data x context)- and
  // tensor-parallel rank 0, the experts' from expert-data- and expert-tensor-parallel rank 0 of
  // each expert-parallel rank.
  for (auto& [name, t] : moe_->expert_bias_state()) entries.push_back({name, nullptr, t, 0});
  if (grid_->dp_cp().rank == 0 && grid_->tp().rank == 0)
    for (auto& [name, t] : fp8_state(false)) entries.push_back({name, nullptr, *t, 0});
  if (grid_->edp().rank == 0 && grid_->etp().rank == 0)
    for (auto& [name, t] : fp8_state(true)) entries.push_back({name, nullptr, *t, 0});
  return entries;
}

void Trainer::reserve_snapshot(
    const std::vector<optim::DistributedAdamW::LocalStateEntry>& entries) {
  size_t bytes = 64;
  for (const auto& e : entries) bytes += (e.data.nbytes() + 63) / 64 * 64;
  if (!snapshot_buffer_) snapshot_buffer_ = std::make_unique<HostBuffer>(args_.model.device);
  snapshot_buffer_->reserve(bytes);
}

void Trainer::save(int64_t iteration) {
  finalize_async_save(true);  // the next save waits for the previous one
  const auto save_start = std::chrono::steady_clock::now();
  const auto ms_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  };
  ddp_->finish_param_sync();
  // Sharded (ckpt/sharded.h): every rank writes the pieces of the global tensors it holds
  // (its tensor-parallel slices, its distributed-optimizer shards; a replicated tensor by
  // one rank), rank 0 commits the index. No rank gathers another's state. Collective.
  const ModelParallel& mp = chunks_[0]->model_parallel();
  const std::map<std::string, const Param*> by_name = params_by_name();
  std::vector<optim::DistributedAdamW::LocalStateEntry> entries = checkpoint_entries();
  // A checkpoint of NaN or inf would become the one a resume starts from: refuse it on
  // every rank, so the tracker keeps naming the last finite one. Every floating tensor,
  // where it lives (fp32 on the device; other dtypes widened to fp32 on the host).
  std::string bad;
  for (const auto& e : entries) {
    if (!bad.empty() || !is_floating(e.data.dtype())) continue;
    const Tensor& t = e.data;
    const double sum_sq = t.dtype() == DType::F32
                              ? ops::sum_of_squares(t)
                              : ops::sum_of_squares(t.to(Device::CPU).to(DType::F32));
    if (!std::isfinite(sum_sq)) bad = e.name;
  }
  // The snapshot: every piece copied once into one host buffer (pinned on the GPU, reused
  // by the next save, which waits for this one's writes), so a save's copies are DMA into
  // memory already mapped.
  reserve_snapshot(entries);
  size_t snapshot_used = 0;
  const std::function<Tensor(const Tensor&)> snapshot = [&](const Tensor& t) {
    Tensor host =
        Tensor::borrow(snapshot_buffer_->data() + snapshot_used, t.shape(), t.dtype(), Device::CPU);
    snapshot_used += (t.nbytes() + 63) / 64 * 64;
    host.copy_from(t);
    return host;
  };
  std::vector<ckpt::ShardedPiece> pieces;
  for (const auto& e : entries) {
    const bool scale = !e.param && e.name.starts_with("optimizer.");
    for (auto& piece : scale
                           ? sharded_scale_pieces(e.name, e.data, by_name, mp, snapshot)
                           : sharded_pieces(e.name, e.param, e.data, e.param_offset, mp, snapshot))
      pieces.push_back(std::move(piece));
  }
  entries.clear();
  Tensor bad_rank =
      Tensor::from_i32({1}, {bad.empty() ? 0 : grid_->world_rank() + 1}).to(comm_->device());
  comm_->all_reduce(bad_rank, grid_->world(), dist::ReduceOp::Max);
  if (const int32_t r = bad_rank.to(Device::CPU).i32()[0]; r > 0)
    fail(
        "not saving iteration {} to '{}': {} holds NaN or Inf values (the checkpoint the "
        "tracker names is unchanged)",
        iteration, args_.save,
        bad.empty() ? fmt::format("a tensor of rank {}", r - 1) : fmt::format("tensor '{}'", bad));
  const dist::Group& world = grid_->world();
  SaveState state;
  state.iteration = iteration;
  state.tmp = broadcast_string(
      *comm_, world, world.rank == 0 ? ckpt::begin_sharded_save(args_.save, iteration) : "", 0);
  state.metadata = checkpoint_metadata(iteration);
  state.flops = floating_point_operations_so_far_;
  state.consumed_samples = consumed_samples_;
  if (args_.async_save) {
    // The pieces are host copies (the snapshot): the step goes on while a background
    // thread writes them; finalize_async_save commits once every rank's file is written.
    const auto stalled = std::chrono::steady_clock::now();
    async_save_.emplace();
    async_save_->state = state;
    async_save_->start = stalled;
    async_save_->record = std::async(
        std::launch::async, [tmp = state.tmp, rank = world.rank, pieces = std::move(pieces)] {
          return ckpt::write_rank_shard(tmp, rank, pieces);
        });
    if (is_logging_rank())
      fmt::print(
          " started saving iteration {} to {} in the background (the step stalled {:.1f} ms for "
          "the snapshot)\n",
          iteration, args_.save, ms_since(save_start));
    return;
  }
  ckpt::RankShardRecord record;
  std::string error;
  std::exception_ptr own;  // this rank's failure, rethrown as it was (an internal error too)
  try {
    record = ckpt::write_rank_shard(state.tmp, world.rank, pieces);
  } catch (const std::exception& e) {
    error = e.what();
    own = std::current_exception();
  }
  pieces.clear();
  fail_if_a_write_failed(state, error, false, own);
  finish_save(state, record);
  if (is_logging_rank())
    fmt::print(" (iteration {}: the step stalled {:.1f} ms; {} bytes in rank 0's file)\n",
               iteration, ms_since(save_start), record.file_bytes);
}

void Trainer::finalize_async_save(bool blocking) {
  if (!async_save_) return;
  const dist::Group& world = grid_->world();
  AsyncSave& pending = *async_save_;
  if (!blocking) {
    // Every rank's write must be done before rank 0 commits: a max of 'not done'.
    const bool done = pending.record.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    Tensor not_done = Tensor::from_i32({1}, {done ? 0 : 1}).to(comm_->device());
    comm_->all_reduce(not_done, world, dist::ReduceOp::Max);
    if (not_done.to(Device::CPU).i32()[0] != 0) return;
  }
  ckpt::RankShardRecord record;
  std::string error;
  try {
    record = pending.record.get();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const SaveState state = pending.state;
  const double write_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - pending.start)
          .count();
  async_save_.reset();
  fail_if_a_write_failed(state, error, true);
  finish_save(state, record);
  if (is_logging_rank())
    fmt::print(" (iteration {}: written in the background in {:.1f} ms)\n", state.iteration,
               write_ms);
}

void Trainer::fail_if_a_write_failed(const SaveState& state, const std::string& error,
                                     bool background, std::exception_ptr own) {
  const dist::Group& world = grid_->world();
  Tensor failed = Tensor::from_i32({1}, {error.empty() ? 0 : world.rank + 1}).to(comm_->device());
  comm_->all_reduce(failed, world, dist::ReduceOp::Max);
  const int32_t r = failed.to(Device::CPU).i32()[0];
  if (r == 0) return;
  comm_->barrier(world);  // every rank's writer has stopped
  if (world.rank == 0) {
    std::error_code ec;
    std::filesystem::remove_all(state.tmp, ec);
  }
  // A failure that is not bad input (an internal error) stays what it was on its rank.
  if (own) {
    try {
      std::rethrow_exception(own);
    } catch (const Error&) {
    }
  }
  fail(
      "the {}save of iteration {} to '{}' failed on rank {}{}{} (the checkpoint the tracker "
      "names is unchanged)",
      background ? "background " : "", state.iteration, args_.save, r - 1,
      error.empty() ? "" : ": ", error);
}

void Trainer::finish_save(const SaveState& state, const ckpt::RankShardRecord& record) {
  const dist::Group& world = grid_->world();
  const dist::NamedTensors records =
      dist::gather_named_tensors(*comm_, world, {{"record", string_tensor(record.to_json())}});
  std::string removed;
  if (world.rank == 0) {
    std::vector<ckpt::RankShardRecord> all;
    for (const auto& [name, t] : records)
      all.push_back(ckpt::RankShardRecord::from_json(tensor_string(t)));
    ckpt::SaveOptions options;
    options.save_retain_interval = args_.save_retain_interval;
    removed = ckpt::commit_sharded_checkpoint(args_.save, state.iteration, state.tmp, all,
                                              state.metadata, options);
  }
  comm_->barrier(world);  // no rank goes on before the checkpoint is complete
  if (!is_logging_rank()) return;
  if (!removed.empty())
    fmt::print(" removed {} (save-retain-interval {})\n", removed, args_.save_retain_interval);
  fmt::print(" saved checkpoint from iteration {:7} to {}\n", state.iteration, args_.save);
  // Megatron's compute_throughputs_and_append_to_progress_log (the cumulative throughput
  // over earlier jobs is not kept).
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - job_start_).count();
  run_logger_->progress(fmt::format(
      "Saved checkpoint\tIteration: {}\tJob throughput: {:.1f} TFLOP/s/GPU\tFloating-point "
      "operations: {:.2e}\tTokens (in billions): {:.2f}",
      state.iteration,
      (state.flops - job_start_flops_) / std::max(seconds, 1e-9) / 1e12 /
          double(grid_->world_size()),
      state.flops, double(state.consumed_samples) * double(args_.model.seq_length) / 1e9));
  std::fflush(stdout);
}

void Trainer::load() {
  const auto load_start = std::chrono::steady_clock::now();
  // Megatron's load_checkpoint: a --load directory without a tracker (the first run of a
  // launch script that saves and loads the same directory) starts from random weights with
  // a warning, or exits with --exit-on-missing-checkpoint.
  // --ckpt-step names the iteration to read, whatever the tracker says (Megatron's
  // _load_base_checkpoint); a missing one is an error.
  if (args_.ckpt_step == 0 && !std::filesystem::exists(std::filesystem::path(args_.load) /
                                                       "latest_checkpointed_iteration.txt")) {
    if (args_.exit_on_missing_checkpoint)
      fail(
          "--load {}: no checkpoint (latest_checkpointed_iteration.txt), and "
          "--exit-on-missing-checkpoint is set",
          args_.load);
    if (is_logging_rank())
      fmt::print(
          "WARNING: could not find the metadata file {}/latest_checkpointed_iteration.txt\n"
          "    will not load any checkpoints and will start from random\n",
          args_.load);
    return;
  }
  const int64_t step = args_.ckpt_step > 0 ? args_.ckpt_step : -1;
  ckpt::LoadedCheckpoint ck = ckpt::read_checkpoint_metadata(args_.load, step);
  // A sharded checkpoint is read by offset, each rank only the slices it holds; the
  // single-file format of earlier versions is read whole.
  std::optional<ckpt::ShardedCheckpointReader> reader;
  if (ckpt::is_sharded_checkpoint(ck.path))
    reader.emplace(ck.path);
  else
    ck = ckpt::load_checkpoint(args_.load, step);
  const bool optimizer_state = !args_.finetune && !args_.no_load_optim;
  auto meta = nlohmann::json::parse(ck.metadata_json);
  // Checkpoints from before the vocabulary was recorded have no such field.
  if (meta.contains("vocab_size") && (!meta["vocab_size"].is_number_integer() ||
                                      meta["vocab_size"].get<int64_t>() != args_.model.vocab_size))
    fail(
        "checkpoint '{}' was trained with a vocabulary of {} tokens, the tokenizer has {} "
        "(tokenizer-type / tokenizer-model / vocab-size)",
        ck.path, meta["vocab_size"].dump(), args_.model.vocab_size);
  if (optimizer_state && meta.value("optimizer_state", true) == false)
    fail(
        "checkpoint '{}' holds no optimizer state (weights only, e.g. from megaton convert): "
        "load it with --finetune (weights, iteration 0) or --no-load-optim",
        ck.path);
  if (optimizer_state) check_checkpoint_optimizer(meta, args_.optimizer, ck.path);
  const std::map<std::string, const Param*> by_name = params_by_name();
  const ModelParallel& mp = chunks_[0]->model_parallel();
  // An entry whole, as stored (scales, expert biases, FP8 state), or null when absent.
  std::map<std::string, Tensor> wholes;
  auto whole = [&](const std::string& name) -> const Tensor* {
    if (!reader) {
      auto it = ck.tensors.find(name);
      return it == ck.tensors.end() ? nullptr : &it->second;
    }
    if (!reader->tensors().contains(name)) return nullptr;
    auto [it, fresh] = wholes.try_emplace(name);
    if (fresh) it->second = reader->read(name);
    return &it->second;
  };
  // This rank's part of each param entry: the vocabulary rows refitted to this layout's
  // padding, then the tensor-parallel slice.
  std::map<std::string, Tensor> parts;
  // Sharded: the distributed optimizer reads only its shard's pieces of each moment.
  optim::DistributedAdamW::RangeReads ranges;
  if (reader) {
    ranges.dtype_of = [&](const std::string& name) -> std::optional<DType> {
      auto it = reader->tensors().find(name);
      if (it == reader->tensors().end()) return std::nullopt;
      return it->second.dtype;
    };
    ranges.read_range = [&](const std::string& name, int64_t offset, int64_t numel) {
      const Param* p = param_of_entry(name, by_name);
      MEGATON_CHECK(p, "checkpoint entry {} belongs to no param", name);
      return read_tensor_parallel_range(*reader, name, *p, mp, args_.model.padded_vocab_size,
                                        args_.model.vocab_size, offset, numel);
    };
  }
  // FSDP's sharded weights: whole while the load writes them, then each rank's shard kept.
  ddp_->gather_all_weights();
  optimizer_->load_full_state(
      [&](const std::string& name) -> const Tensor* {
        const Param* p = param_of_entry(name, by_name);
        if (!p) return whole(name);
        if (reader ? !reader->tensors().contains(name) : !ck.tensors.contains(name)) return nullptr;
        auto [part, fresh] = parts.try_emplace(name);
        if (!fresh) return &part->second;
        if (reader) {
          part->second = read_tensor_parallel_slice(
              *reader, name, *p, mp, args_.model.padded_vocab_size, args_.model.vocab_size);
          return &part->second;
        }
        Tensor full = ck.tensors.at(name);
        if (p->padded_vocab_rows)
          full = fit_padded_vocab_rows(full, args_.model.padded_vocab_size, args_.model.vocab_size,
                                       name, ck.path);
        if (full.shape() != p->full_shape)
          fail(
              "checkpoint '{}': tensor '{}' is {} {}, the model expects {} {} (whole tensors, "
              "before the tensor-parallel split)",
              ck.path, name, dtype_name(full.dtype()), shape_str(full.shape()),
              dtype_name(DType::F32), shape_str(p->full_shape));
        part->second = p->tp_split_dim < 0 ? full : tensor_parallel_slice(full, *p, mp);
        return &part->second;
      },
      ck.path, optimizer_state, ranges);
  ddp_->release_all_weights();
  moe_->load_expert_bias(whole, ck.path);
  // The delayed recipe's amax histories: a checkpoint without them (bf16, or another
  // recipe) starts them afresh, as Transformer Engine does without its extra state.
  std::vector<std::pair<std::string, Tensor*>> fp8_entries = fp8_state(false);
  for (auto& entry : fp8_state(true)) fp8_entries.push_back(entry);
  for (auto& [name, t] : fp8_entries) {
    const Tensor* stored = args_.finetune ? nullptr : whole(name);
    if (!stored) continue;
    if (stored->shape() != t->shape())
      fail(
          "checkpoint '{}': FP8 state '{}' is {}, this run expects {} "
          "(--fp8-amax-history-len differs)",
          ck.path, name, shape_str(stored->shape()), shape_str(t->shape()));
    t->copy_from(*stored);
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
    fmt::print(
        " loaded checkpoint from {} at iteration {} ({:.1f} ms{})\n", ck.path, iteration_,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - load_start)
            .count(),
        reader ? fmt::format(", {} bytes read by this rank", reader->bytes_read()) : "");
}

}  // namespace megaton
