// The registry of flag groups, the declaration helpers and the generated flag table.
#include "train/args/flag_table.h"

#include <fmt/format.h>

#include <set>
#include <unordered_map>

#include "core/error.h"

namespace megaton {

namespace {

OptionSpec with_nargs(std::string name, std::string_view nargs, std::string help, FlagRule rule) {
  OptionSpec s;
  s.name = std::move(name);
  s.help = std::move(help);
  s.rule = rule;
  if (nargs == "0") {
    s.is_switch = true;
    s.min_values = s.max_values = 0;
  } else if (nargs == "?") {
    s.min_values = 0;
    s.max_values = 1;
  } else if (nargs == "+") {
    s.max_values = kManyValues;
  } else if (nargs == "*") {
    s.min_values = 0;
    s.max_values = kManyValues;
  } else {
    MEGATON_CHECK(nargs.size() == 1 && nargs[0] >= '1' && nargs[0] <= '9', "flag '{}': nargs '{}'",
                  s.name, nargs);
    s.min_values = s.max_values = nargs[0] - '0';
  }
  return s;
}

}  // namespace

const char* flag_rule_name(FlagRule rule) {
  switch (rule) {
    case FlagRule::Implemented:
      return "implemented";
    case FlagRule::NoEffect:
      return "no effect";
    case FlagRule::Unsupported:
      return "unsupported";
  }
  return "?";
}

OptionSpec flag(std::string name, std::string help) {
  return with_nargs(std::move(name), "1", std::move(help), FlagRule::Implemented);
}
OptionSpec toggle(std::string name, std::string help) {
  return with_nargs(std::move(name), "0", std::move(help), FlagRule::Implemented);
}
OptionSpec values(std::string name, std::string help) {
  return with_nargs(std::move(name), "+", std::move(help), FlagRule::Implemented);
}
OptionSpec implemented(std::string name, std::string_view nargs, std::string help) {
  return with_nargs(std::move(name), nargs, std::move(help), FlagRule::Implemented);
}
OptionSpec own(OptionSpec spec) {
  spec.megatron = false;
  return spec;
}
OptionSpec no_effect(std::string name, std::string_view nargs, std::string reason,
                     std::vector<std::string> harmless_values, std::string unsupported_value) {
  OptionSpec s = with_nargs(std::move(name), nargs, std::move(reason), FlagRule::NoEffect);
  s.harmless_values = std::move(harmless_values);
  s.unsupported_value = std::move(unsupported_value);
  return s;
}
OptionSpec unsupported(std::string name, std::string_view nargs, std::string feature) {
  return with_nargs(std::move(name), nargs, std::move(feature), FlagRule::Unsupported);
}

const std::vector<ArgGroup>& train_arg_groups() {
  static const std::vector<ArgGroup> groups = [] {
    std::vector<ArgGroup> g = {model_flags(),      hybrid_flags(),    moe_flags(),
                               optimizer_flags(),
                               data_flags(),       tokenizer_flags(), training_flags(),
                               checkpoint_flags(), parallel_flags(),  precision_flags(),
                               memory_flags(),     logging_flags(),   megatron_only_flags()};
    std::set<std::string> seen;
    for (ArgGroup& group : g)
      for (OptionSpec& s : group.flags) {
        s.group = group.name;
        MEGATON_CHECK(seen.insert(s.name).second, "flag '{}' declared twice", s.name);
      }
    return g;
  }();
  return groups;
}

const std::vector<OptionSpec>& train_option_specs() {
  static const std::vector<OptionSpec> specs = [] {
    std::vector<OptionSpec> all;
    for (const ArgGroup& g : train_arg_groups())
      all.insert(all.end(), g.flags.begin(), g.flags.end());
    return all;
  }();
  return specs;
}

const OptionSpec* find_option_spec(const std::string& name) {
  static const std::unordered_map<std::string, const OptionSpec*> index = [] {
    std::unordered_map<std::string, const OptionSpec*> m;
    for (const OptionSpec& s : train_option_specs()) m.emplace(s.name, &s);
    return m;
  }();
  auto it = index.find(name);
  return it == index.end() ? nullptr : it->second;
}

std::string flag_table_markdown() {
  std::string out;
  for (const ArgGroup& g : train_arg_groups()) {
    out += fmt::format("\n## {}\n\n| flag | rule | Megaton |\n|---|---|---|\n", g.title);
    for (const OptionSpec& s : g.flags) {
      std::string text = s.help;
      if (!s.harmless_values.empty()) {
        std::string list;
        for (const std::string& v : s.harmless_values) list += (list.empty() ? "" : ", ") + v;
        text += fmt::format(" (values {}; others: {})", list, s.unsupported_value);
      }
      if (!s.megatron) text = "Megaton's own: " + text;
      std::string escaped;
      for (char c : text) escaped += c == '|' ? std::string("\\|") : std::string(1, c);
      out += fmt::format("| `--{}` | {} | {} |\n", s.name, flag_rule_name(s.rule), escaped);
    }
  }
  return out;
}

}  // namespace megaton
