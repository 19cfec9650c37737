// One rule for every Megatron-LM flag (issue 19): every flag of Megatron's parser
// (tests/golden/megatron_flags.tsv, tools/megatron_flag_inventory.py) is declared by a flag
// group, with Megatron's arity; docs/megatron-flags.md is the generated table.
//   MEGATON_WRITE_FLAG_TABLE=1 build-cpu/test_megatron_flag_coverage   rewrites the doc.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "train/args/flag_table.h"

namespace megaton {
namespace {

const std::string kSource = MEGATON_SOURCE_DIR;

struct MegatronFlag {
  std::string group, nargs;
};

std::map<std::string, MegatronFlag> megatron_inventory() {
  std::ifstream in(kSource + "/tests/golden/megatron_flags.tsv");
  EXPECT_TRUE(in.good());
  std::map<std::string, MegatronFlag> flags;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream row(line);
    std::string flag, group, dest, nargs;
    std::getline(row, flag, '\t');
    std::getline(row, group, '\t');
    std::getline(row, dest, '\t');
    std::getline(row, nargs, '\t');
    flags[flag.substr(2)] = {group, nargs};
  }
  return flags;
}

TEST(MegatronFlagCoverage, EveryMegatronFlagHasARule) {
  const auto inventory = megatron_inventory();
  ASSERT_GT(inventory.size(), 800u);
  std::string missing;
  for (const auto& [name, f] : inventory)
    if (!find_option_spec(name)) missing += " --" + name;
  EXPECT_EQ(missing, "") << "Megatron flags without a rule in src/train/args/";
}

TEST(MegatronFlagCoverage, ArityAndProvenanceMatchMegatron) {
  const auto inventory = megatron_inventory();
  for (const OptionSpec& s : train_option_specs()) {
    SCOPED_TRACE("--" + s.name);
    auto it = inventory.find(s.name);
    EXPECT_EQ(it != inventory.end(), s.megatron)
        << (s.megatron ? "marked Megatron's, but Megatron has no such flag"
                       : "marked Megaton's own, but Megatron has it");
    if (it == inventory.end()) continue;
    const std::string& nargs = it->second.nargs;
    if (nargs == "0") {
      EXPECT_TRUE(s.is_switch);
    } else {
      EXPECT_FALSE(s.is_switch);
      // A value Megatron takes once may be a list in Megaton only where Megaton documents it.
      if (nargs == "1") EXPECT_EQ(s.min_values, 1);
      if (nargs == "+" || nargs == "*") EXPECT_GT(s.max_values, 1);
      if (nargs == "?") EXPECT_EQ(s.min_values, 0);
    }
    EXPECT_FALSE(s.help.empty());
  }
}

TEST(MegatronFlagCoverage, DocTableIsGenerated) {
  const std::string doc_path = kSource + "/docs/megatron-flags.md";
  const std::string header =
      "# Megatron-LM's flags in Megaton\n\n"
      "Every flag of Megatron-LM's `pretrain_gpt.py` parser (the commit in\n"
      "`tests/golden/megatron_flags.tsv`) and Megaton's own, with the rule `megaton train`\n"
      "applies: **implemented** (Megatron's meaning), **no effect** (accepted and listed once\n"
      "at start with the reason: what Megaton always does, or what does not apply to a native\n"
      "program), or **unsupported** (refused with one line naming the feature; an open issue\n"
      "is named where one will build it). Generated from `src/train/args/` by\n"
      "`MEGATON_WRITE_FLAG_TABLE=1 build-cpu/test_megatron_flag_coverage`; a test fails when it\n"
      "is stale.\n";
  const std::string table = header + flag_table_markdown();
  if (std::getenv("MEGATON_WRITE_FLAG_TABLE")) {
    std::ofstream(doc_path) << table;
    GTEST_SKIP() << "wrote " << doc_path;
  }
  std::ifstream in(doc_path);
  std::stringstream doc;
  doc << in.rdbuf();
  EXPECT_TRUE(doc.str() == table) << doc_path << " is stale: regenerate it";
}

TEST(MegatronFlagCoverage, RulesAreCounted) {
  std::map<FlagRule, int> counts;
  for (const OptionSpec& s : train_option_specs()) ++counts[s.rule];
  // Every rule is in use: a table that only implements or only refuses is wrong.
  EXPECT_GT(counts[FlagRule::Implemented], 150);
  EXPECT_GT(counts[FlagRule::NoEffect], 100);
  EXPECT_GT(counts[FlagRule::Unsupported], 300);
  std::printf("flags: %d implemented, %d no effect, %d unsupported\n",
              counts[FlagRule::Implemented], counts[FlagRule::NoEffect],
              counts[FlagRule::Unsupported]);
}

}  // namespace
}  // namespace megaton
