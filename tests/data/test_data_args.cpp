// --data-args-path and --per-split-data-args-path (Megatron's file forms of the blend), and
// per-split blends: each split's datasets used whole.
#include <gtest/gtest.h>

#include <set>

#include "common/testing.h"
#include "data/blended_dataset.h"
#include "data/data_args.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::TempDir;
using testing::throws_error_with;
using testing::write_numbered_dataset;
using testing::write_text;

using Tokens = std::vector<std::string>;

TEST(DataArgsPath, TokensOverLines) {
  TempDir dir;
  write_text(dir.file("blend.txt"), "0.3 data/a_text_document\n  0.7\tdata/b_text_document\n\n");
  EXPECT_EQ(read_data_args_path(dir.file("blend.txt")),
            (Tokens{"0.3", "data/a_text_document", "0.7", "data/b_text_document"}));
  // The tokens are what --data-path would take.
  EXPECT_EQ(parse_data_path(read_data_args_path(dir.file("blend.txt"))),
            parse_data_path({"0.3", "data/a_text_document", "0.7", "data/b_text_document"}));
  write_text(dir.file("empty.txt"), " \n");
  EXPECT_TRUE(throws_error_with([&] { read_data_args_path(dir.file("empty.txt")); },
                                {"--data-args-path", "no dataset"}));
  EXPECT_TRUE(throws_error_with([&] { read_data_args_path(dir.file("none.txt")); },
                                {"--data-args-path", "cannot open"}));
}

TEST(PerSplitDataArgsPath, StringsListsAndNull) {
  TempDir dir;
  write_text(dir.file("splits.json"),
             R"({"train": "0.5 a 0.5 b", "valid": ["c"], "test": null})");
  auto splits = read_per_split_data_args_path(dir.file("splits.json"));
  EXPECT_EQ(*splits[0], (Tokens{"0.5", "a", "0.5", "b"}));
  EXPECT_EQ(*splits[1], (Tokens{"c"}));
  EXPECT_FALSE(splits[2].has_value());
  write_text(dir.file("missing.json"), R"({"train": "a", "valid": "b"})");
  EXPECT_TRUE(throws_error_with([&] { read_per_split_data_args_path(dir.file("missing.json")); },
                                {"--per-split-data-args-path", "'test'"}));
  write_text(dir.file("number.json"), R"({"train": 3, "valid": "b", "test": "c"})");
  EXPECT_TRUE(throws_error_with([&] { read_per_split_data_args_path(dir.file("number.json")); },
                                {"'train'", "string"}));
  write_text(dir.file("bad.json"), "{train: a}");
  EXPECT_TRUE(throws_error_with([&] { read_per_split_data_args_path(dir.file("bad.json")); },
                                {"not JSON"}));
}

std::set<int32_t> first_tokens(const SampleSource& source) {
  std::vector<int32_t> tokens(size_t(source.seq_length() + 1));
  std::set<int32_t> out;
  for (int64_t i = 0; i < source.size(); ++i) {
    source.get(i, tokens.data());
    out.insert(tokens[0]);
  }
  return out;
}

TEST(PerSplitBlend, EachSplitUsesItsDatasetsWhole) {
  TempDir dir;
  // Token numbers identify the dataset: a's are below 10000, b's above (offset below).
  const int64_t a_tokens = write_numbered_dataset(dir.file("a"), std::vector<int32_t>(40, 33));
  {
    IndexedDatasetBuilder builder(dir.file("b"), TokenDType::I32);
    for (int d = 0; d < 30; ++d) {
      std::vector<int32_t> tokens(29);
      for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = 10000 + d * 29 + int32_t(t);
      builder.add_document(tokens);
    }
    builder.finalize();
  }
  ASSERT_LT(a_tokens, 10000);
  GPTDatasetConfig config;
  config.seq_length = 16;
  config.seed = 7;
  config.path_to_cache = dir.file("cache");
  config.blend_per_split[0] = {{1.0, dir.file("a")}};
  config.blend_per_split[1] = {{1.0, dir.file("b")}};
  auto datasets = build_gpt_datasets(config, {50, 20, 5});
  ASSERT_TRUE(datasets[0] && datasets[1]);
  EXPECT_FALSE(datasets[2]) << "no test blend: no test dataset";
  for (int32_t t : first_tokens(*datasets[0])) EXPECT_LT(t, 10000) << "train samples come from a";
  for (int32_t t : first_tokens(*datasets[1])) EXPECT_GE(t, 10000) << "valid samples come from b";
  // Used whole: the same samples as a's dataset under --split 1,0,0 (all documents train).
  GPTDatasetConfig whole = config;
  whole.blend_per_split = {};
  whole.blend = {{1.0, dir.file("a")}};
  whole.split = "1,0,0";
  auto reference = build_gpt_datasets(whole, {50, 0, 0});
  ASSERT_EQ(reference[0]->size(), datasets[0]->size());
  std::vector<int32_t> x(17), y(17);
  for (int64_t i = 0; i < reference[0]->size(); ++i) {
    reference[0]->get(i, x.data());
    datasets[0]->get(i, y.data());
    ASSERT_EQ(x, y) << "sample " << i;
  }
  // A two-dataset train blend is a BlendedDataset drawing from both.
  config.blend_per_split[0] = {{0.5, dir.file("a")}, {0.5, dir.file("b")}};
  auto blended = build_gpt_datasets(config, {40, 0, 0});
  const auto firsts = first_tokens(*blended[0]);
  EXPECT_LT(*firsts.begin(), 10000);
  EXPECT_GE(*firsts.rbegin(), 10000);
}

}  // namespace
}  // namespace megaton::data
