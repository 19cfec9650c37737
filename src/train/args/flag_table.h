// The flag groups of `megaton train`: each domain (model, moe, parallel, precision,
// optimizer, memory, data, checkpoint, logging, training) declares its flags and their
// rules in its own file (train/args/<domain>_flags.cpp), as Megatron-LM's argument groups
// do; the registry here puts them together.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "train/args/arg_reader.h"
#include "train/arguments.h"

namespace megaton {

// One flag group: its flags (rules included) and the function that reads its implemented
// flags into TrainArgs. Groups are parsed in registry order, so a group may read what an
// earlier one set.
struct ArgGroup {
  std::string name;   // "model", "moe", ...: OptionSpec::group
  std::string title;  // the --help heading
  std::vector<OptionSpec> flags;
  void (*parse)(const ArgReader&, TrainArgs&) = nullptr;
};

// Every group, in parse order: model, hybrid, moe, optimizer, data, tokenizer, training,
// checkpoint, parallel, precision, memory, logging, then Megatron's groups with no Megaton
// counterpart (inference, RL, vision, ...: no effect or unsupported only).
const std::vector<ArgGroup>& train_arg_groups();

// The groups, one function per domain file.
ArgGroup model_flags();
ArgGroup hybrid_flags();
ArgGroup moe_flags();
ArgGroup optimizer_flags();
ArgGroup data_flags();
ArgGroup tokenizer_flags();
ArgGroup training_flags();
ArgGroup checkpoint_flags();
ArgGroup parallel_flags();
ArgGroup precision_flags();
ArgGroup memory_flags();
ArgGroup logging_flags();
ArgGroup megatron_only_flags();

// Declaring flags. `nargs` is Megatron's argparse nargs as tests/golden/megatron_flags.tsv
// writes it: "0" (a switch), "1", "2", "3" (that many values), "?" (zero or one), "+"
// (one or more), "*" (any number).
// An implemented flag taking one value / a switch / one or more values.
OptionSpec flag(std::string name, std::string help);
OptionSpec toggle(std::string name, std::string help);
OptionSpec values(std::string name, std::string help);
OptionSpec implemented(std::string name, std::string_view nargs, std::string help);
// Marks `spec` as Megaton's own flag (not one of Megatron-LM's).
OptionSpec own(OptionSpec spec);
// Megatron's flag that changes nothing in Megaton, and why (printed once at start).
// With harmless_values, only those values have no effect; another value is refused as
// `unsupported_value` says.
OptionSpec no_effect(std::string name, std::string_view nargs, std::string reason,
                     std::vector<std::string> harmless_values = {},
                     std::string unsupported_value = "");
// Megatron's flag naming a feature Megaton does not have: refused (one line, exit 2)
// naming `feature`.
OptionSpec unsupported(std::string name, std::string_view nargs, std::string feature);

// The markdown table of every flag (docs/megatron-flags.md): one row per flag, grouped by
// domain, with its rule and text.
std::string flag_table_markdown();

}  // namespace megaton
