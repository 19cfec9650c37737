// `megaton train --config FILE.yaml [--flag value ...]`.
#include <cstdlib>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "dist/runtime.h"
#include "train/args/flag_table.h"
#include "train/arguments.h"
#include "train/checkpoint_args.h"
#include "train/hf_load.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace megaton::cli {

namespace {
struct TrainCommand {
  std::string config;
  std::map<std::string, std::vector<std::string>> values;
  std::map<std::string, bool> switches;
};
}  // namespace

void add_train_command(CLI::App& app) {
  auto state = std::make_shared<TrainCommand>();
  CLI::App* cmd = app.add_subcommand("train", "train a GPT model (flags as Megatron-LM's)");
  cmd->add_option("--config", state->config, "YAML file whose keys are the flag names");
  // --help shows the implemented flags under their group's heading; Megatron's flags that
  // Megaton takes without effect or refuses parse alike but stay out of it
  // (docs/megatron-flags.md lists them).
  for (const ArgGroup& group : train_arg_groups()) {
    for (const OptionSpec& spec : group.flags) {
      if (spec.name == "help") continue;  // CLI11's own
      const std::string heading = spec.rule == FlagRule::Implemented ? group.title : "";
      // A flag given twice takes its last value, as argparse does (launch scripts often
      // append an override to a shared argument list).
      if (spec.is_switch) {
        cmd->add_flag("--" + spec.name, state->switches[spec.name], spec.help)
            ->group(heading)
            ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
      } else {
        auto* opt = cmd->add_option("--" + spec.name, state->values[spec.name], spec.help);
        opt->expected(spec.min_values, spec.max_values)->group(heading);
        if (spec.max_values < kManyValues)
          opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
      }
    }
  }
  cmd->footer(
      "Megatron-LM's other flags are accepted without effect or refused naming the "
      "feature: see docs/megatron-flags.md.");
  cmd->callback([cmd, state] {
    RawOptions raw;
    if (!state->config.empty()) raw = read_yaml_options(state->config);
    for (const OptionSpec& spec : train_option_specs()) {
      if (spec.name == "help" || cmd->count("--" + spec.name) == 0) continue;
      raw[spec.name] = spec.is_switch
                           ? std::vector<std::string>{state->switches[spec.name] ? "true" : "false"}
                           : state->values[spec.name];
    }
    // --load of a Hugging Face model directory: imported first, then loaded as any checkpoint.
    const bool dry_run =
        raw.count("dry-run") && raw.at("dry-run") == std::vector<std::string>{"true"};
    std::unique_ptr<StagedHFLoad> hf_load = dry_run ? nullptr : stage_hf_load(raw);
    // --use-checkpoint-args: the model's arguments from the checkpoint to load.
    CheckpointArgs from_checkpoint = apply_checkpoint_args(raw);
    raw = std::move(from_checkpoint.raw);
    if (dist::world_rank() == 0)
      for (const std::string& line : from_checkpoint.messages) fmt::print("{}\n", line);
    // A dry run may plan a CUDA run on a machine without a GPU: its flags are checked as a
    // CPU run's, then the plan is made for the device asked for.
    const auto given = [&raw](const char* key, const char* value) {
      return raw.count(key) && raw.at(key) == std::vector<std::string>{value};
    };
    const bool plan_cuda_here =
        given("dry-run", "true") && given("device", "cuda") && !cuda_available();
    if (plan_cuda_here) raw["device"] = {"cpu"};
    TrainArgs args = parse_train_args(raw);
    if (plan_cuda_here) {
      args.device = "cuda";
      args.model.device = Device::CUDA;
    }
    // An impossible layout fails here, on every rank alike, before anything is built.
    const int64_t world = args.dry_run ? dry_run_world_size() : dist::world_size();
    dist::ValidatedLayout layout = check_parallel_layout(args, world);
    if (dist::world_rank() == 0) {
      for (const std::string& w : layout.warnings) fmt::print(stderr, "warning: {}\n", w);
      for (const std::string& w : args.warnings) fmt::print(stderr, "warning: {}\n", w);
      for (const std::string& n : args.no_effect)
        fmt::print(stderr, "no effect in Megaton: {}\n", n);
      // main() sets it for --tp-comm-overlap on the command line; from a --config file the
      // CUDA context was made before the flag was read.
      if (args.parallel.tp_comm_overlap && args.model.device == Device::CUDA &&
          !std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"))
        fmt::print(stderr,
                   "warning: --tp-comm-overlap runs best with CUDA_DEVICE_MAX_CONNECTIONS=1 in "
                   "the environment (as Megatron requires on Hopper)\n");
    }
    if (args.dry_run) {  // the memory plan, then exit 0: nothing is built
      run_dry_run(args, world, stdout, stderr);
      return;
    }
    {
      Trainer trainer(args, raw);
      trainer.train();
    }
    if (hf_load) hf_load->release();
  });
}

}  // namespace megaton::cli
