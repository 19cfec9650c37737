// Memory plan: the table `megaton train --dry-run` prints, and the dry run itself.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "data/tokenizer.h"
#include "dist/runtime.h"
#include "train/memory_check.h"
#include "train/memory_plan.h"
#include "train/pipeline_schedule.h"
#include "train/step_graph.h"
#include "train/trainer.h"

namespace megaton {

namespace {

// "1.41 B", "705.2 M", "12.3 K", "812": a parameter count for the header.
std::string count_str(double n) {
  if (n >= 1e9) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f} M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f} K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

const char* dtype_flag(DType d) {
  return d == DType::BF16 ? "bf16" : d == DType::F16 ? "fp16" : d == DType::F8E4M3 ? "fp8" : "fp32";
}

}  // namespace

std::string format_memory_plan(const MemoryPlan& p) {
  const dist::ParallelSizes& z = p.sizes;
  const int64_t vpp = z.vpp.value_or(1);
  std::string out;
  out += fmt::format(
      "memory plan (megaton train --dry-run): the busiest rank is on pipeline stage {} of {}; "
      "device {}, compute {}, optimizer {}\n",
      p.stage, z.pp, p.device == Device::CUDA ? "cuda" : "cpu", dtype_flag(p.compute_dtype),
      p.optimizer);
  out += fmt::format(
      " layout: world {} = tp {} x cp {} x pp {} x dp {}; experts: ep {} x etp {} x edp {}{}{}\n",
      z.world, z.tp, z.cp, z.pp, z.dp, z.ep, z.etp, z.edp,
      p.sequence_parallel ? "; sequence parallel" : "",
      vpp > 1 ? fmt::format("; {} model chunks per stage", vpp) : std::string());
  out += fmt::format(
      " parameters: {} total, {} active (top-k experts); this rank holds {} ({} in experts), "
      "{} layers ({} MoE)\n",
      count_str(p.total_parameters), count_str(p.active_parameters), count_str(p.rank_parameters),
      count_str(p.rank_expert_parameters), p.stage_layers, p.stage_moe_layers);
  out += fmt::format(
      " schedule: {}, {} micro-batches per step and data-parallel rank; recompute: {}; one "
      "micro-batch's activations on this stage: {:.3f} GiB\n",
      p.schedule, p.micro_batches, p.recompute, p.activations_per_micro_batch / double(1 << 30));
  out += fmt::format(" {:<58} {:>16} {:>9} {:>11}\n", "term", "bytes", "GiB", "MB (2^20)");
  auto line = [&](const std::string& name, double bytes) {
    out += fmt::format(" {:<58} {:>16.0f} {:>9.3f} {:>11.1f}\n", name, bytes,
                       bytes / double(1 << 30), bytes / double(1 << 20));
  };
  const int64_t dense_shards = z.dp * z.cp, expert_shards = z.edp;
  const bool fsdp_grads = p.fsdp == "optim_grads" || p.fsdp == "optim_grads_params";
  line(fmt::format("weights ({}{})", dtype_flag(p.compute_dtype),
                   p.fsdp == "optim_grads_params" ? ", this rank's shard + 3 units gathered" : ""),
       p.weights);
  line(fsdp_grads ? "main grads (this rank's shard + 4 units' buckets, FSDP)"
       : p.main_grads_dtype == DType::BF16
           ? "main grads (bf16, whole on every data-parallel rank; fp32 scratch)"
           : "main grads (fp32, whole on every data-parallel rank)",
       p.main_grads);
  line(p.main_params_dtype == DType::F16 && p.compute_dtype != DType::F32
           ? "main params (fp16 + an fp32 scale per param; fp32 beside fp8)"
           : "main params (fp32, or int16 remainders beside bf16)",
       p.main_params);
  line("Adam exp_avg", p.exp_avg);
  line("Adam exp_avg_sq", p.exp_avg_sq);
  if (p.momentum > 0 || p.optimizer != "adam")
    line("Muon / SGD momentum_buffer, Lion exp_avg (fp32)", p.momentum);
  line("other state (router statistics, step state, batch buffers)", p.other_state);
  line("= persistent", p.persistent());
  line("activations of the peak's micro-batch (its chunk)", p.activations);
  line(fmt::format("activations of {} more in-flight (micro-batch, chunk)",
                   std::max<int64_t>(p.in_flight - 1, 0)),
       p.in_flight_activations);
  line("logits [T, V/tp] and loss vectors at the peak", p.logits_and_loss);
  line(p.peak_at.starts_with("the optimizer step") ? "working set: Muon's step scratch"
       : p.peak_at.starts_with("the gradients' reduce-scatter")
           ? "working set: the CPU's copies of the gradient buckets"
           : "working set of the peak's step",
       p.working_set);
  line(p.device == Device::CUDA ? "workspaces (cuBLASLt 32 MiB, cuDNN attention estimate)"
                                : "workspaces (none on the CPU)",
       p.workspaces);
  line("= total (the planned peak)", p.total());
  out += fmt::format(" peak at: {}\n", p.peak_at);
  out += fmt::format(
      " shares: dense optimizer state / {} ({}), expert optimizer state / {} (edp), "
      "experts / ep {} / etp {}, layers / pp {}\n",
      dense_shards, "dp x cp", expert_shards, z.ep, z.etp, z.pp);
  if (p.stage_totals.size() > 1) {
    std::string stages;
    for (size_t s = 0; s < p.stage_totals.size(); ++s)
      stages +=
          fmt::format("{}{}: {:.3f} GiB", s ? ", " : "", s, p.stage_totals[s] / double(1 << 30));
    out += fmt::format(" planned peak per stage: {}\n", stages);
  }
  for (const std::string& a : p.assumptions) out += fmt::format(" assumes: {}\n", a);
  return out;
}

int64_t dry_run_world_size() {
  if (dist::launched_by_mpi()) return dist::world_size();
  const char* env = std::getenv("WORLD_SIZE");
  if (!env || !*env) return 1;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  if (*end != '\0' || errno != 0 || v < 1 || v > (1ll << 24))
    fail("environment variable WORLD_SIZE must be a positive integer (got '{}')", env);
  return int64_t(v);
}

int run_dry_run(TrainArgs args, int64_t world, std::FILE* out, std::FILE* err) {
  // As the Trainer finishes and checks them (train/trainer.cpp), before anything is built.
  dist::ValidatedLayout layout;
  finish_train_args(args, world, layout);  // the tokenizer is only needed for its vocabulary
  check_micro_batch_split(args, layout.sizes);
  check_full_iteration_graph(args, world);
  const MemoryPlan plan = plan_memory(args, layout);
  if (dist::world_rank() != 0) return 0;
  std::fputs(format_memory_plan(plan).c_str(), out);
  // The host's dataset indices (real data), from the memory check's count.
  const MemoryLowerBound bound = memory_lower_bound(args, layout.sizes);
  if (bound.dataset_index_bytes > 0)
    std::fprintf(out, " host memory besides: the GPT dataset's indices, at least %s (%s)\n",
                 human_bytes(bound.dataset_index_bytes).c_str(), bound.dataset_flags.c_str());
  const MemoryAvailable available = memory_available(args.model.device);
  const double have = args.model.device == Device::CUDA
                          ? available.device_free
                          : std::min(available.host_physical, available.host_address_space);
  const char* where = args.model.device == Device::CUDA ? "device memory free (cudaMemGetInfo)"
                                                        : "host memory available";
  if (std::isinf(have))
    std::fprintf(out, " %s: unknown here, not compared\n", where);
  else if (plan.total() > have)
    std::fprintf(err, "warning: the planned peak of %s exceeds the %s of %s\n",
                 human_bytes_exact(plan.total()).c_str(), where, human_bytes_exact(have).c_str());
  else
    std::fprintf(out, " fits: %s of %s\n", where, human_bytes_exact(have).c_str());
  std::fflush(out);
  return 0;
}

}  // namespace megaton
