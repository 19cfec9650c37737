// Checkpoint flags: where to save and load, how often, what to keep and what to load
// (Megatron's "checkpointing" group).
#include <fmt/format.h>

#include "core/error.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

void parse_checkpoint(const ArgReader& r, TrainArgs& a) {
  r.get("save", a.save);
  r.get("save-interval", a.save_interval);
  if (r.has("persistent-save-interval")) {  // Megatron's other name of --save-interval
    if (r.has("save-interval"))
      fail("save-interval and persistent-save-interval name the same setting: give one");
    r.get("persistent-save-interval", a.save_interval);
  }
  r.get("save-retain-interval", a.save_retain_interval);
  r.get("async-save", a.async_save);
  r.get("load", a.load);
  r.get("no-load-optim", a.no_load_optim);
  r.get("exit-on-missing-checkpoint", a.exit_on_missing_checkpoint);
  r.get("no-load-rng", a.no_load_rng);
  r.get("finetune", a.finetune);
  r.get("ckpt-step", a.ckpt_step);
  if (a.ckpt_step < 0) fail("ckpt-step must be >= 0 (got {})", a.ckpt_step);
  if (a.ckpt_step > 0 && a.load.empty()) fail("ckpt-step needs --load (the directory to read)");
  r.get("use-checkpoint-args", a.use_checkpoint_args);
  if (a.use_checkpoint_args && a.load.empty()) fail("use-checkpoint-args requires --load");
  if (!a.use_checkpoint_args)
    for (const char* key :
         {"use-mp-args-from-checkpoint-args", "no-use-tokenizer-model-from-checkpoint-args",
          "disable-use-tokenizer-model-from-checkpoint-args"})
      if (r.on(key))
        a.warnings.push_back(fmt::format("--{} has no effect without --use-checkpoint-args", key));
  if (!a.save.empty() && a.save_interval < 0) fail("save-interval must be >= 0");
  // Megatron's arguments.py: the retained checkpoints are saved ones.
  if (r.has("save-retain-interval")) {
    if (a.save_retain_interval <= 0)
      fail("save-retain-interval must be positive (got {})", a.save_retain_interval);
    if (a.save_interval <= 0 || a.save_retain_interval % a.save_interval != 0)
      fail("save-retain-interval ({}) must be a multiple of save-interval ({})",
           a.save_retain_interval, a.save_interval);
  }
}

}  // namespace

std::vector<OptionSpec> checkpoint_megatron_rules();

ArgGroup checkpoint_flags() {
  ArgGroup g{"checkpoint", "checkpoints", {}, parse_checkpoint};
  g.flags = {
      flag("save", "checkpoint directory to write"),
      flag("save-interval", "save every this many iterations"),
      flag("persistent-save-interval", "Megatron's other name of --save-interval"),
      flag("save-retain-interval",
           "keep the checkpoints of multiples of this iteration; the "
           "others are removed once a newer save is complete"),
      toggle("async-save",
             "write each rank's checkpoint file in a background thread from a host snapshot; "
             "the index is committed at a later step once every rank's file is written"),
      flag("load", "checkpoint directory to resume from"),
      toggle("no-load-optim", "do not load optimizer state"),
      toggle("exit-on-missing-checkpoint",
             "with --load: exit (status 2) when the directory has "
             "no checkpoint, instead of starting from random"),
      toggle("no-load-rng", "do not load the RNG state"),
      toggle("finetune", "load weights only and start at iteration 0"),
      flag("ckpt-step", "load this iteration from --load instead of the tracker's"),
      toggle("use-checkpoint-args",
             "take the model's arguments (shape, attention, MoE, tokenizer) from the "
             "checkpoint in --load"),
      toggle("use-mp-args-from-checkpoint-args",
             "with --use-checkpoint-args: also the tensor-, pipeline- and expert-parallel sizes"),
      toggle("no-use-tokenizer-model-from-checkpoint-args",
             "with --use-checkpoint-args: keep this run's tokenizer arguments"),
      toggle("disable-use-tokenizer-model-from-checkpoint-args",
             "Megatron's other name of --no-use-tokenizer-model-from-checkpoint-args"),
  };
  for (OptionSpec& s : checkpoint_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
