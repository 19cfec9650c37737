// BlendedDataset: --data-path parsing, Megatron's blending index, blended proportions.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "data/blended_dataset.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::TempDir;
using testing::throws_error_with;

TEST(ParseDataPath, PrefixOrWeightedPairs) {
  using Blend = std::vector<std::pair<double, std::string>>;
  EXPECT_EQ(parse_data_path({"data/a_text_document"}), (Blend{{1.0, "data/a_text_document"}}));
  EXPECT_EQ(parse_data_path({"0.3", "a", "0.7", "b"}), (Blend{{0.3, "a"}, {0.7, "b"}}));
  EXPECT_EQ(parse_data_path({"3", "a", "1e-1", "b"}), (Blend{{3.0, "a"}, {0.1, "b"}}));
  EXPECT_TRUE(throws_error_with([] { parse_data_path({}); }, {"--data-path"}));
  EXPECT_TRUE(throws_error_with([] { parse_data_path({"a", "b"}); }, {"--data-path", "'a'"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        parse_data_path({"0.3", "a", "b"});
      },
      {"--data-path", "3 values"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        parse_data_path({"0.5", "a", "x", "b"});
      },
      {"--data-path", "'x'"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        parse_data_path({"-1", "a", "1", "b"});
      },
      {"--data-path", "-1"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        parse_data_path({"0", "a", "1", "b"});
      },
      {"--data-path", "positive"}));
  EXPECT_TRUE(throws_error_with(
      [] {
        parse_data_path({"nan", "a", "1", "b"});
      },
      {"--data-path", "nan"}));
}

TEST(Blending, SamplesPerDatasetWithSurplus) {
  EXPECT_EQ(blended_samples_per_dataset(0.3, 1000), 302);    // ceil(300 * 1.005)
  EXPECT_EQ(blended_samples_per_dataset(0.5, 10), 6);        // ceil(5 * 1.005)
  EXPECT_EQ(blended_samples_per_dataset(1.0 / 3, 100), 35);  // ceil(ceil(33.3) * 1.005)
}

TEST(Blending, IndicesFollowMegatronFormula) {
  // By hand with error_d = w_d * max(i, 1) - taken_d, first index on ties:
  // i=0: .5 .3 .2 -> 0;  i=1: -.5 .3 .2 -> 1;  i=2: 0 -.4 .4 -> 2;
  // i=3: .5 -.1 -.4 -> 0;  i=4: 0 .2 -.2 -> 1.
  std::vector<double> w = {0.5, 0.3, 0.2};
  std::vector<int16_t> dataset;
  std::vector<int64_t> sample;
  build_blending_indices(w, 5, dataset, sample);
  EXPECT_EQ(dataset, (std::vector<int16_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(sample, (std::vector<int64_t>{0, 0, 0, 1, 1}));
}

// The greedy keeps every dataset about one sample from its share at every prefix (the
// worst seen over many random weight sets is 1.23); 2 leaves room without hiding drift.
TEST(Blending, EveryPrefixStaysWithinTwoSamplesOfTheWeights) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(0.05, 1.0);
  std::vector<double> w(4);
  double sum = 0;
  for (auto& x : w) sum += (x = u(gen));
  for (auto& x : w) x /= sum;
  std::vector<int16_t> dataset;
  std::vector<int64_t> sample;
  build_blending_indices(w, 5000, dataset, sample);
  std::vector<int64_t> taken(4, 0);
  for (int64_t i = 0; i < 5000; ++i) {
    ASSERT_EQ(sample[i], taken[dataset[i]]) << "samples of a dataset are taken in order";
    ++taken[dataset[i]];
    for (int d = 0; d < 4; ++d)
      ASSERT_LE(std::fabs(taken[d] - w[d] * (i + 1)), 2.0) << "after " << i + 1 << " samples";
  }
}

TEST(BlendedDataset, ProportionsAndSamplesFromThePartsOfABlend) {
  TempDir dir;
  std::vector<std::string> prefixes;
  for (int d = 0; d < 3; ++d) {
    prefixes.push_back(dir.file("ds" + std::to_string(d)));
    testing::write_numbered_dataset(prefixes.back(), testing::random_lengths(80, 1, 30, 100 + d));
  }
  GPTDatasetConfig config;
  config.blend = {{5, prefixes[0]}, {3, prefixes[1]}, {2, prefixes[2]}};
  config.seq_length = 8;
  config.split = "9,1,0";
  auto sets = build_gpt_datasets(config, {1000, 40, 10});
  ASSERT_NE(sets[0], nullptr);
  ASSERT_NE(sets[1], nullptr);
  EXPECT_EQ(sets[2], nullptr) << "test fraction 0";
  auto* blend = dynamic_cast<const BlendedDataset*>(sets[0].get());
  ASSERT_NE(blend, nullptr);
  EXPECT_EQ(blend->size(), 1000);
  EXPECT_EQ(sets[1]->size(), 40);
  const double weights[3] = {0.5, 0.3, 0.2};
  int64_t counts[3] = {0, 0, 0};
  std::vector<int32_t> got(9), want(9);
  for (int64_t i = 0; i < blend->size(); ++i) {
    const int d = blend->dataset_of(i);
    ++counts[d];
    blend->get(i, got.data());
    blend->dataset(d).get(blend->sample_of(i), want.data());
    ASSERT_EQ(got, want) << "sample " << i;
  }
  for (int d = 0; d < 3; ++d) {
    EXPECT_NEAR(counts[d], 1000 * weights[d], 1.0) << "dataset " << d;
    // Each part was asked for ceil(ceil(n * w) * 1.005) samples, at least.
    EXPECT_GE(blend->dataset(d).size(), blended_samples_per_dataset(weights[d], 1000));
  }
}

TEST(BlendedDataset, SplitEmptyForSomeDatasetsOnly) {
  TempDir dir;
  testing::write_numbered_dataset(dir.file("big"), testing::random_lengths(100, 1, 10, 1));
  testing::write_numbered_dataset(dir.file("tiny"), {5, 5});
  GPTDatasetConfig config;
  config.blend = {{1, dir.file("big")}, {1, dir.file("tiny")}};
  config.seq_length = 4;
  config.split = "90,10,0";  // tiny: round(0.2) = 0 valid documents
  EXPECT_TRUE(throws_error_with(
      [&] {
        build_gpt_datasets(config, {10, 10, 0});
      },
      {"valid", "tiny", "no documents"}));
}

}  // namespace
}  // namespace megaton::data
