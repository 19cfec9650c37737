// GPTDataset: splits, epochs, document/sample/shuffle indices, samples, caching.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "common/testing.h"
#include "data/blended_dataset.h"
#include "data/gpt_dataset.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::TempDir;
using testing::throws_error_with;

TEST(Split, ParseAndNormalise) {
  auto f = parse_split("969,30,1");
  EXPECT_DOUBLE_EQ(f[0], 0.969);
  EXPECT_DOUBLE_EQ(f[1], 0.030);
  EXPECT_DOUBLE_EQ(f[2], 0.001);
  f = parse_split("98/2");
  EXPECT_DOUBLE_EQ(f[0], 0.98);
  EXPECT_DOUBLE_EQ(f[1], 0.02);
  EXPECT_DOUBLE_EQ(f[2], 0.0);
  EXPECT_EQ(parse_split("1"), (std::array<double, 3>{1, 0, 0}));
  for (std::string bad : {"a,b", "1,2,3,4", "-1,2", "0,0,0", "", "1,,2"})
    EXPECT_TRUE(throws_error_with([&] { parse_split(bad); }, {"--split"})) << bad;
}

TEST(Split, RangesAsMegatron) {
  using R = std::array<std::pair<int64_t, int64_t>, 3>;
  EXPECT_EQ(split_ranges(parse_split("969,30,1"), 1000), (R{{{0, 969}, {969, 999}, {999, 1000}}}));
  // round(3.33) = 3 three times: bounds 0,3,6,9; the missing document shifts them: 0,4,7,10.
  EXPECT_EQ(split_ranges(parse_split("1,1,1"), 10), (R{{{0, 4}, {4, 7}, {7, 10}}}));
  // round(2.5) = 2 (half to even, as Python): bounds 0,2,4,9 -> 0,3,5,10.
  EXPECT_EQ(split_ranges(parse_split("1,1,2"), 10), (R{{{0, 3}, {3, 5}, {5, 10}}}));
  EXPECT_EQ(split_ranges(parse_split("1,0,0"), 7), (R{{{0, 7}, {7, 7}, {7, 7}}}));
}

TEST(Epochs, CountAndSeparateFinalEpoch) {
  // 100 tokens per epoch, 10 tokens per sample, +1 extra token at the end.
  EXPECT_EQ(gpt_num_epochs(100, 9, 10), 1);   // 91 tokens
  EXPECT_EQ(gpt_num_epochs(100, 10, 10), 2);  // 101 tokens
  EXPECT_EQ(gpt_num_epochs(100, 19, 10), 2);
  EXPECT_EQ(gpt_num_epochs(100, 20, 10), 3);
  EXPECT_FALSE(gpt_separate_final_epoch(1, 100, 9, 10));
  // Two epochs: 9 samples before the last, 9 per epoch; 1 from the last < int(0.8 * 9).
  EXPECT_TRUE(gpt_separate_final_epoch(2, 100, 10, 10));
  EXPECT_TRUE(gpt_separate_final_epoch(2, 100, 15, 10));   // 6 < 7
  EXPECT_FALSE(gpt_separate_final_epoch(2, 100, 16, 10));  // 7
  EXPECT_FALSE(gpt_separate_final_epoch(2, 100, 19, 10));
}

TEST(ShuffleRng, BoundedUniformAndDeterministic) {
  ShuffleRng a(7), b(7);
  std::vector<int> counts(6, 0);
  for (int i = 0; i < 60000; ++i) {
    uint64_t x = a.below(6);
    ASSERT_LT(x, 6u);
    ASSERT_EQ(x, b.below(6));
    ++counts[x];
  }
  for (int c : counts) EXPECT_NEAR(c, 10000, 500);
  std::vector<int> v(100);
  std::iota(v.begin(), v.end(), 0);
  ShuffleRng(3).shuffle(std::span<int>(v));
  EXPECT_NE(v[0] + v[1] * 1000, 1000) << "shuffled";
  std::vector<int> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 100; ++i) ASSERT_EQ(sorted[i], i);
}

// (position in document_index, offset) of token k of the stream of documents.
std::pair<int64_t, int64_t> locate(std::span<const int32_t> lengths,
                                   std::span<const int32_t> doc_index, int64_t k) {
  for (int64_t pos = 0; pos < static_cast<int64_t>(doc_index.size()); ++pos) {
    int64_t len = lengths[doc_index[pos]];
    if (k < len) return {pos, k};
    k -= len;
  }
  return {-1, -1};
}

TEST(SampleIndex, PairsAreTheStreamPositionsOfEverySeqLengthTokens) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto lengths = testing::random_lengths(60, 0, 25, seed);  // includes empty sequences
  int64_t tokens = std::accumulate(lengths.begin(), lengths.end(), int64_t(0));
  for (int64_t seq_length : {1, 7, 32, 200}) {
    ShuffleRng rng(seed);
    auto doc_index = build_document_index(0, 60, 2, false, rng);
    auto index = build_sample_index(lengths, doc_index, seq_length, 2, tokens);
    const int64_t samples = (2 * tokens - 1) / seq_length;
    ASSERT_EQ(index.size(), size_t(2 * (samples + 1)));
    for (int64_t i = 0; i <= samples; ++i) {
      auto expected = locate(lengths, doc_index, i * seq_length);
      ASSERT_EQ(index[2 * i], expected.first) << "sample " << i << " seq_length " << seq_length;
      ASSERT_EQ(index[2 * i + 1], expected.second)
          << "sample " << i << " seq_length " << seq_length;
    }
  }
}

// A numbered dataset (token = global token number) and what each token belongs to.
struct Numbered {
  std::string prefix;
  std::vector<int32_t> lengths;
  std::vector<int64_t> doc_start;  // first token number of each document
  int64_t tokens = 0;
  int64_t doc_of(int32_t token) const {
    return std::upper_bound(doc_start.begin(), doc_start.end(), token) - doc_start.begin() - 1;
  }
};

Numbered make_numbered(const TempDir& dir, const std::string& name, std::vector<int32_t> lengths) {
  Numbered n;
  n.prefix = dir.file(name);
  n.lengths = std::move(lengths);
  n.tokens = testing::write_numbered_dataset(n.prefix, n.lengths);
  int64_t start = 0;
  for (int32_t len : n.lengths) {
    n.doc_start.push_back(start);
    start += len;
  }
  return n;
}

std::vector<std::vector<int32_t>> all_samples(const SampleSource& ds) {
  std::vector<std::vector<int32_t>> out(ds.size());
  for (int64_t i = 0; i < ds.size(); ++i) {
    out[i].assign(ds.seq_length() + 2, -1);  // poison + guard
    ds.get(i, out[i].data());
    EXPECT_EQ(out[i].back(), -1) << "sample " << i << " wrote past seq_length + 1 tokens";
    out[i].pop_back();
    for (int32_t t : out[i]) EXPECT_GE(t, 0) << "sample " << i << " has an unwritten token";
  }
  return out;
}

GPTDatasetConfig config_for(const std::string& prefix, int64_t seq_length, const std::string& split,
                            uint64_t seed = 1234) {
  GPTDatasetConfig c;
  c.blend = {{1.0, prefix}};
  c.seq_length = seq_length;
  c.split = split;
  c.seed = seed;
  return c;
}

TEST(GPTDataset, EveryTokenUsedOncePerEpoch) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t L = 16;
  for (int64_t epochs : {1, 3}) {
    TempDir dir;
    auto lengths = testing::random_lengths(300, 1, 40, seed + epochs);
    // Make epochs * T - 1 a multiple of L so whole epochs give whole samples.
    int64_t t = std::accumulate(lengths.begin(), lengths.end(), int64_t(0));
    while ((epochs * t - 1) % L != 0) ++lengths.back(), ++t;
    auto n = make_numbered(dir, "ds", lengths);
    const int64_t samples = (epochs * n.tokens - 1) / L;
    GPTDataset ds(std::make_shared<IndexedDataset>(n.prefix),
                  config_for(n.prefix, L, "1,0,0", seed), Split::Train, samples);
    ASSERT_EQ(ds.num_epochs(), epochs);
    ASSERT_EQ(ds.size(), samples);
    std::vector<int> uses(n.tokens, 0);
    for (const auto& s : all_samples(ds))
      for (int64_t j = 0; j < L; ++j) ++uses[s[j]];  // inputs: the overlap token counted once
    // The very last token of the stream only ever appears as a label.
    int64_t short_by_one = 0;
    for (int64_t tok = 0; tok < n.tokens; ++tok) {
      if (uses[tok] == epochs - 1)
        ++short_by_one;
      else
        ASSERT_EQ(uses[tok], epochs) << "token " << tok;
    }
    EXPECT_EQ(short_by_one, 1);
  }
}

TEST(GPTDataset, SamplesCrossDocumentsAndOverlapByOneToken) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TempDir dir;
  auto n = make_numbered(dir, "ds", testing::random_lengths(200, 1, 30, seed));
  const int64_t L = 24;
  GPTDataset ds(std::make_shared<IndexedDataset>(n.prefix), config_for(n.prefix, L, "1,0,0", seed),
                Split::Train, 2 * n.tokens / L);  // about two epochs
  auto samples = all_samples(ds);
  int crossing = 0;
  for (int64_t i = 0; i < ds.size(); ++i) {
    const auto& s = samples[i];
    // Cut the sample into runs of consecutive tokens of one document.
    std::vector<std::pair<size_t, size_t>> runs;  // [begin, end) in s
    size_t begin = 0;
    for (size_t j = 1; j <= s.size(); ++j)
      if (j == s.size() || s[j] != s[j - 1] + 1 || n.doc_of(s[j]) != n.doc_of(s[j - 1])) {
        runs.push_back({begin, j});
        begin = j;
      }
    crossing += runs.size() > 1;
    for (size_t r = 0; r < runs.size(); ++r) {
      const int64_t doc = n.doc_of(s[runs[r].first]);
      const bool starts_doc = s[runs[r].first] == n.doc_start[doc];
      const bool ends_doc = s[runs[r].second - 1] == n.doc_start[doc] + n.lengths[doc] - 1;
      if (r > 0) {
        ASSERT_TRUE(starts_doc) << "sample " << i << " run " << r;
      }
      if (r + 1 < runs.size()) {
        ASSERT_TRUE(ends_doc) << "sample " << i << " run " << r;
      }
    }
  }
  EXPECT_GT(crossing, ds.size() / 2) << "samples run across document boundaries";
  // In unshuffled order, sample j's last token is sample j + 1's first.
  std::vector<int64_t> position_of(ds.size());
  auto shuffle = ds.shuffle_index();
  for (int64_t k = 0; k < ds.size(); ++k) position_of[shuffle[k]] = k;
  for (int64_t j = 0; j + 1 < ds.size(); ++j)
    ASSERT_EQ(samples[position_of[j]].back(), samples[position_of[j + 1]].front())
        << "sample " << j;
}

TEST(GPTDataset, SeparateFinalEpochShuffledApart) {
  TempDir dir;
  auto n = make_numbered(dir, "ds", testing::random_lengths(100, 1, 30, 99));
  const int64_t L = 8;
  const int64_t per_epoch = (n.tokens - 1) / L;
  GPTDataset ds(std::make_shared<IndexedDataset>(n.prefix), config_for(n.prefix, L, "1,0,0"),
                Split::Train, per_epoch + 3);  // a sliver of a second epoch
  ASSERT_EQ(ds.num_epochs(), 2);
  auto docs = ds.document_index();
  ASSERT_EQ(docs.size(), 200u);
  for (auto part : {docs.subspan(0, 100), docs.subspan(100)}) {
    std::vector<int32_t> sorted(part.begin(), part.end());
    std::sort(sorted.begin(), sorted.end());
    for (int i = 0; i < 100; ++i) ASSERT_EQ(sorted[i], i) << "each epoch holds every document once";
  }
  auto shuffle = ds.shuffle_index();
  const int64_t first = (n.tokens - 1) / L;  // samples before the final epoch
  for (int64_t k = 0; k < ds.size(); ++k)
    ASSERT_EQ(shuffle[k] < first, k < first) << "the final epoch's samples are shuffled apart";
}

TEST(GPTDataset, SplitUsesOnlyItsDocuments) {
  TempDir dir;
  auto n = make_numbered(dir, "ds", testing::random_lengths(300, 1, 30, 5));
  auto ds_ptr = std::make_shared<IndexedDataset>(n.prefix);
  const std::array<std::pair<int64_t, int64_t>, 3> expected{{{0, 180}, {180, 270}, {270, 300}}};
  for (Split split : {Split::Train, Split::Valid, Split::Test}) {
    GPTDataset ds(ds_ptr, config_for(n.prefix, 8, "6,3,1"), split, 50);
    const auto [lo, hi] = expected[static_cast<int>(split)];
    EXPECT_EQ(ds.document_range(), std::make_pair(lo, hi));
    for (int32_t d : ds.document_index()) ASSERT_TRUE(d >= lo && d < hi);
    for (const auto& s : all_samples(ds))
      for (int32_t t : s) ASSERT_TRUE(n.doc_of(t) >= lo && n.doc_of(t) < hi) << split_name(split);
  }
}

TEST(GPTDataset, DeterministicForASeedDifferentAcrossSeeds) {
  TempDir dir;
  auto n = make_numbered(dir, "ds", testing::random_lengths(100, 1, 30, 11));
  auto ds_ptr = std::make_shared<IndexedDataset>(n.prefix);
  auto c1 = config_for(n.prefix, 16, "1,0,0", 42);
  c1.path_to_cache = dir.file("cache_a");
  auto c2 = c1;
  c2.path_to_cache = dir.file("cache_b");
  auto c3 = c1;
  c3.seed = 43;
  GPTDataset a(ds_ptr, c1, Split::Train, 100), b(ds_ptr, c2, Split::Train, 100),
      c(ds_ptr, c3, Split::Train, 100);
  EXPECT_TRUE(a.built_indices() && b.built_indices() && c.built_indices());
  EXPECT_EQ(all_samples(a), all_samples(b));
  EXPECT_NE(all_samples(a), all_samples(c));
  EXPECT_TRUE(
      std::equal(a.shuffle_index().begin(), a.shuffle_index().end(), b.shuffle_index().begin()));
  EXPECT_NE(std::vector<int32_t>(a.document_index().begin(), a.document_index().end()),
            std::vector<int32_t>(c.document_index().begin(), c.document_index().end()));
}

TEST(GPTDataset, CacheReusedAndRebuiltWhenDescriptionChanges) {
  TempDir dir;
  auto n = make_numbered(dir, "ds", testing::random_lengths(100, 1, 30, 13));
  auto ds_ptr = std::make_shared<IndexedDataset>(n.prefix);
  auto config = config_for(n.prefix, 16, "1,0,0");
  GPTDataset first(ds_ptr, config, Split::Train, 100);
  EXPECT_TRUE(first.built_indices());
  const std::string p = first.cache_prefix();
  EXPECT_EQ(std::filesystem::path(p).parent_path(), dir.path()) << "cache next to the data";
  const std::vector<std::string> files = {p + "_doc_idx.bin", p + "_sample_idx.bin",
                                          p + "_shuffle_idx.bin", p + "_description.json"};
  std::vector<std::filesystem::file_time_type> mtimes;
  for (const auto& f : files) {
    ASSERT_TRUE(std::filesystem::exists(f)) << f;
    mtimes.push_back(std::filesystem::last_write_time(f));
  }
  auto samples = all_samples(first);

  GPTDataset again(ds_ptr, config, Split::Train, 100);
  EXPECT_FALSE(again.built_indices());
  EXPECT_EQ(again.cache_prefix(), p);
  for (size_t i = 0; i < files.size(); ++i)
    EXPECT_EQ(std::filesystem::last_write_time(files[i]), mtimes[i]) << files[i];
  EXPECT_EQ(all_samples(again), samples);

  GPTDataset more(ds_ptr, config, Split::Train, 150);  // a new description
  EXPECT_TRUE(more.built_indices());
  EXPECT_NE(more.cache_prefix(), p);
  auto other_split = config;
  other_split.split = "9,1,0";
  GPTDataset resplit(ds_ptr, other_split, Split::Train, 100);
  EXPECT_TRUE(resplit.built_indices());
  EXPECT_NE(resplit.cache_prefix(), p);

  std::filesystem::remove(files[2]);  // a damaged cache is rebuilt
  GPTDataset repaired(ds_ptr, config, Split::Train, 100);
  EXPECT_TRUE(repaired.built_indices());
  EXPECT_EQ(all_samples(repaired), samples);
  for (const auto& e : dir.entries()) EXPECT_EQ(e.find(".tmp."), std::string::npos) << e;
}

TEST(GPTDataset, Errors) {
  TempDir dir;
  auto n = make_numbered(dir, "ds", {5, 5});
  auto ds_ptr = std::make_shared<IndexedDataset>(n.prefix);
  EXPECT_TRUE(throws_error_with(
      [&] { GPTDataset(ds_ptr, config_for(n.prefix, 4, "1,0,0"), Split::Valid, 10); },
      {"ds", "valid", "no documents"}));
  EXPECT_TRUE(throws_error_with(
      [&] { GPTDataset(ds_ptr, config_for(n.prefix, 0, "1,0,0"), Split::Train, 10); },
      {"--seq-length"}));
  // Empty documents have no sequences at all; zero-length sequences have no tokens.
  auto empty = make_numbered(dir, "empty", {0, 0});
  EXPECT_TRUE(throws_error_with(
      [&] {
        GPTDataset(std::make_shared<IndexedDataset>(empty.prefix), config_for(empty.prefix, 4, "1"),
                   Split::Train, 1);
      },
      {"empty", "no documents"}));
  {
    IndexedDatasetBuilder builder(dir.file("zero"), TokenDType::U16);
    std::vector<int32_t> zero_lengths = {0, 0};
    builder.add_document(std::span<const int32_t>{}, zero_lengths);
    builder.finalize();
  }
  EXPECT_TRUE(throws_error_with(
      [&] {
        GPTDataset(std::make_shared<IndexedDataset>(dir.file("zero")),
                   config_for(dir.file("zero"), 4, "1"), Split::Train, 1);
      },
      {"zero", "no tokens"}));
}

TEST(BuildGPTDatasets, NullForEmptySplitsAndZeroSamples) {
  TempDir dir;
  auto n = make_numbered(dir, "ds", testing::random_lengths(50, 1, 30, 3));
  auto sets = build_gpt_datasets(config_for(n.prefix, 8, "1,0,0"), {20, 5, 5});
  ASSERT_NE(sets[0], nullptr);
  EXPECT_GE(sets[0]->size(), 20);
  EXPECT_EQ(sets[1], nullptr);
  EXPECT_EQ(sets[2], nullptr);
  sets = build_gpt_datasets(config_for(n.prefix, 8, "8,1,1"), {20, 0, 5});
  EXPECT_NE(sets[0], nullptr);
  EXPECT_EQ(sets[1], nullptr);
  EXPECT_NE(sets[2], nullptr);
  EXPECT_TRUE(throws_error_with(
      [&] {
        build_gpt_datasets(config_for(n.prefix, 8, "1"), {-1, 0, 0});
      },
      {"train", "-1"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        build_gpt_datasets(config_for(dir.file("nope"), 8, "1"), {1, 0, 0});
      },
      {"nope.idx"}));
  GPTDatasetConfig none;
  none.seq_length = 8;
  EXPECT_TRUE(throws_error_with([&] { build_gpt_datasets(none, {1, 0, 0}); }, {"--data-path"}));
}

}  // namespace
}  // namespace megaton::data
