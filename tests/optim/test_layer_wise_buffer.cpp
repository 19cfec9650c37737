// The layer-wise distributed optimizer's buffer layout (BufferLayout::WholeParams): every
// param whole inside one shard, 64-aligned, the shards balanced by Newton-Schulz cost
// across buckets, buckets cut as Megatron's _compute_per_buffer_param_layout cuts them; and
// GPTModel's routing of the Muon params into such buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "model/gpt.h"
#include "model/param_buffer.h"
#include "model/tiny_gpt_testing.h"

namespace megaton {
namespace {

using testing::randn;
using testing::test_seed;

// A param of random values (seeded by its position in the list).
std::unique_ptr<Param> make_param(const std::string& name, const Shape& shape, uint64_t seed) {
  auto p = std::make_unique<Param>();
  p->name = name;
  p->weight = randn(shape, seed);
  p->main_param = p->weight;
  return p;
}

// "<prefix><i>" (not "literal" + std::to_string: GCC 12 warns falsely, -Wrestrict).
std::string numbered(std::string prefix, int64_t i) {
  prefix += std::to_string(i);
  return prefix;
}

struct Params {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Tensor> values;  // copies of the initial weights
  Param* add(const std::string& name, const Shape& shape) {
    owned.push_back(make_param(name, shape, test_seed() + owned.size()));
    values.push_back(owned.back()->weight.clone());
    return owned.back().get();
  }
  std::vector<Param*> list() const {
    std::vector<Param*> out;
    for (const auto& p : owned) out.push_back(p.get());
    return out;
  }
};

ParamAndGradBuffer whole_params(const std::vector<Param*>& ps, int64_t shards,
                                int64_t bucket_size) {
  return ParamAndGradBuffer(ps, shards, false, bucket_size, {}, DType::F32, {}, {},
                            BufferLayout::WholeParams);
}

// Everything a WholeParams buffer promises, checked on any layout: buckets back to back,
// each num_shards equal shards of a multiple of 64 elements; each param in one bucket,
// whole inside one shard (owner_shard), 64-aligned, overlapping no other; bucket params in
// buffer order; shard_pieces giving each param once, whole, on its owner; the weights moved
// into the buffer unchanged.
void expect_whole_params(const ParamAndGradBuffer& b, const Params& ps) {
  int64_t end = 0;
  for (size_t k = 0; k < b.buckets().size(); ++k) {
    const BufferBucket& bucket = b.buckets()[k];
    EXPECT_EQ(bucket.begin, end);
    end = bucket.end;
    EXPECT_EQ(bucket.numel() % (64 * b.num_shards()), 0);
    for (size_t j = 1; j < bucket.params.size(); ++j) {
      const auto at = [&](const Param* p) {
        return b.offset(
            size_t(std::find(b.params().begin(), b.params().end(), p) - b.params().begin()));
      };
      EXPECT_LT(at(bucket.params[j - 1]), at(bucket.params[j]));
    }
  }
  EXPECT_EQ(end, b.numel());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i = 0; i < b.params().size(); ++i) {
    const Param* p = b.params()[i];
    SCOPED_TRACE(p->name);
    const int bk = b.bucket_of(p);
    ASSERT_GE(bk, 0);
    const int64_t shard = b.owner_shard(p);
    ASSERT_GE(shard, 0);
    const int64_t begin = b.shard_begin(size_t(bk), shard);
    EXPECT_EQ(b.offset(i) % 64, 0);
    EXPECT_GE(b.offset(i), begin);
    EXPECT_LE(b.offset(i) + p->weight.numel(), begin + b.shard_numel(size_t(bk)));
    ranges.push_back({b.offset(i), b.offset(i) + p->weight.numel()});
    EXPECT_TRUE(testing::allclose(p->weight.view({p->weight.numel()}),
                                  ps.values[i].view({p->weight.numel()}), 0, 0));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t j = 1; j < ranges.size(); ++j) EXPECT_LE(ranges[j - 1].second, ranges[j].first);
  std::map<const Param*, int> seen;
  for (int64_t s = 0; s < b.num_shards(); ++s)
    for (const BufferPiece& piece : b.shard_pieces(s)) {
      ++seen[piece.param];
      EXPECT_EQ(piece.param_offset, 0) << piece.param->name;
      EXPECT_EQ(piece.numel, piece.param->weight.numel()) << piece.param->name;
      EXPECT_EQ(b.owner_shard(piece.param), s) << piece.param->name;
    }
  EXPECT_EQ(seen.size(), b.params().size());
  for (const auto& [p, n] : seen) EXPECT_EQ(n, 1) << p->name;
}

std::vector<int64_t> owners(const ParamAndGradBuffer& b) {
  std::vector<int64_t> out;
  for (const Param* p : b.params()) out.push_back(b.owner_shard(p));
  return out;
}

TEST(LayerWiseBuffer, EqualMatricesSplitEvenly) {
  SCOPED_TRACE(test_seed());
  Params ps;
  for (int i = 0; i < 4; ++i) ps.add(numbered("m", i), {64, 64});
  const ParamAndGradBuffer b = whole_params(ps.list(), 2, 0);
  expect_whole_params(b, ps);
  ASSERT_EQ(b.buckets().size(), 1u);
  EXPECT_EQ(b.shard_numel(0), 2 * 4096);  // no padding
  // Walked in reverse (m3 first), equal costs: the shards alternate.
  EXPECT_EQ(owners(b), (std::vector<int64_t>{1, 0, 1, 0}));
}

TEST(LayerWiseBuffer, AHugeMatrixTakesAShardAndTheSmallOnesTheOther) {
  SCOPED_TRACE(test_seed());
  Params ps;
  for (int i = 0; i < 4; ++i) ps.add(numbered("small", i), {64, 64});
  ps.add("huge", {256, 256});
  for (int i = 4; i < 8; ++i) ps.add(numbered("small", i), {64, 64});
  const ParamAndGradBuffer b = whole_params(ps.list(), 2, 0);
  expect_whole_params(b, ps);
  // The huge one (65536 elements) exceeds 1.3 x the even share (1.3 x 49152) on any shard:
  // it goes to shard 0 (lowest cursor, lowest index); the smalls then fit only on shard 1.
  const std::vector<int64_t> want = {1, 1, 1, 1, 0, 1, 1, 1, 1};
  EXPECT_EQ(owners(b), want);
  EXPECT_EQ(b.shard_numel(0), 65536);
}

TEST(LayerWiseBuffer, CostOrdersTheParamsAndLoadsCarryOverBuckets) {
  SCOPED_TRACE(test_seed());
  Params ps;
  Param* y = ps.add("y", {64, 64});
  Param* x = ps.add("x", {64, 64});
  Param* a = ps.add("a", {128, 128});  // cost 128^3 = 2^21
  Param* c = ps.add("c", {64, 256});   // as many elements, half the cost (256 x 64^2)
  // Walk: c, a (32768 elements, the bucket size; x would not fit its padding), then x, y.
  const ParamAndGradBuffer b = whole_params(ps.list(), 2, 32768);
  expect_whole_params(b, ps);
  ASSERT_EQ(b.buckets().size(), 2u);
  EXPECT_EQ(b.buckets()[0].params, (std::vector<Param*>{a, c}));
  // a, costlier though walked second, is placed first, on shard 0; c on shard 1.
  EXPECT_EQ(b.owner_shard(a), 0);
  EXPECT_EQ(b.owner_shard(c), 1);
  // Shard 1 carries less cost into the next bucket: x (walked first) goes there, y, which
  // would pass 1.3 x the even share on shard 1, to shard 0.
  EXPECT_EQ(b.owner_shard(x), 1);
  EXPECT_EQ(b.owner_shard(y), 0);
  EXPECT_EQ(b.buckets()[1].begin, 32768);
  EXPECT_EQ(b.shard_numel(1), 4096);
}

TEST(LayerWiseBuffer, ABucketTakesWhatFitsItsPadding) {
  SCOPED_TRACE(test_seed());
  Params ps;
  for (int i = 0; i < 6; ++i) ps.add(numbered("m", i), {64, 64});
  // Bucket size: three params. After three, the shards hold two and one: the fourth fills
  // the second shard's padding (Megatron's absorption) and joins; the fifth would grow the
  // bucket and starts the next.
  const ParamAndGradBuffer b = whole_params(ps.list(), 2, 3 * 4096);
  expect_whole_params(b, ps);
  ASSERT_EQ(b.buckets().size(), 2u);
  EXPECT_EQ(b.buckets()[0].params.size(), 4u);
  EXPECT_EQ(b.buckets()[1].params.size(), 2u);
  EXPECT_EQ(b.buckets()[0].numel(), 4 * 4096);  // no padding either
  EXPECT_EQ(b.buckets()[1].numel(), 2 * 4096);
}

TEST(LayerWiseBuffer, RandomShapesKeepEveryParamWholeAndTheLayoutIsDeterministic) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 gen(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  };
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE(trial);
    Params ps;
    const int64_t n = uniform(1, 24);
    for (int64_t i = 0; i < n; ++i) {
      const std::string name = numbered("p", i);
      if (uniform(0, 3) == 0)
        ps.add(name, {uniform(1, 300)});
      else
        ps.add(name, {uniform(1, 96), uniform(1, 96)});
    }
    const int64_t shards = uniform(1, 4);
    const int64_t bucket_size = uniform(0, 2) == 0 ? 0 : uniform(1, 20000);
    const ParamAndGradBuffer b = whole_params(ps.list(), shards, bucket_size);
    expect_whole_params(b, ps);
    // The same params again (fresh copies): the same layout.
    Params again;
    for (const auto& p : ps.owned) again.add(p->name, p->weight.shape());
    const ParamAndGradBuffer b2 = whole_params(again.list(), shards, bucket_size);
    ASSERT_EQ(b2.numel(), b.numel());
    for (size_t i = 0; i < size_t(n); ++i) EXPECT_EQ(b2.offset(i), b.offset(i));
  }
}

// whole_params_layout, the function of sizes alone that the memory plan calls
// (train/memory_plan_optimizer.cpp), is the buffer's layout: the same offsets, owners and
// buckets for random shapes; newton_schulz_cost is max(m, n) min(m, n)^2, numel otherwise.
TEST(LayerWiseBuffer, TheLayoutOfSizesAloneIsTheBuffers) {
  EXPECT_EQ(newton_schulz_cost({768, 256}), 768 * 256 * 256);
  EXPECT_EQ(newton_schulz_cost({256, 1024}), 1024 * 256 * 256);
  EXPECT_EQ(newton_schulz_cost({300}), 300);
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 gen(seed + 1);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  };
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE(trial);
    Params ps;
    std::vector<int64_t> numels, costs;
    const int64_t n = uniform(1, 24);
    for (int64_t i = 0; i < n; ++i) {
      const Shape shape =
          uniform(0, 3) == 0 ? Shape{uniform(1, 300)} : Shape{uniform(1, 96), uniform(1, 96)};
      ps.add(numbered("p", i), shape);
      numels.push_back(ps.owned.back()->weight.numel());
      costs.push_back(newton_schulz_cost(shape));
    }
    const int64_t shards = uniform(1, 4);
    const int64_t bucket_size = uniform(0, 2) == 0 ? 0 : uniform(1, 20000);
    const ParamAndGradBuffer b = whole_params(ps.list(), shards, bucket_size);
    const WholeParamsLayout layout = whole_params_layout(numels, costs, shards, bucket_size);
    ASSERT_EQ(layout.numel, b.numel());
    ASSERT_EQ(layout.buckets.size(), b.buckets().size());
    for (size_t i = 0; i < size_t(n); ++i) {
      EXPECT_EQ(layout.offsets[i], b.offset(i));
      EXPECT_EQ(layout.shards[i], b.owner_shard(b.params()[i]));
    }
    for (size_t k = 0; k < layout.buckets.size(); ++k) {
      EXPECT_EQ(layout.buckets[k].begin, b.buckets()[k].begin);
      EXPECT_EQ(layout.buckets[k].end, b.buckets()[k].end);
      EXPECT_EQ(layout.buckets[k].shard_numel, b.shard_numel(k));
      ASSERT_EQ(layout.buckets[k].params.size(), b.buckets()[k].params.size());
      for (size_t j = 0; j < layout.buckets[k].params.size(); ++j)
        EXPECT_EQ(b.params()[layout.buckets[k].params[j]], b.buckets()[k].params[j]);
    }
  }
}

TEST(LayerWiseBuffer, RefusesWhatItCannotLayOut) {
  Params ps;
  Param* m = ps.add("m", {64, 64});
  Param* v = ps.add("v", {64});
  const std::vector<Param*> list = ps.list();
  const auto whole = BufferLayout::WholeParams;
  EXPECT_THROW(ParamAndGradBuffer(list, 2, false, 0, {}, DType::F32, {0, 1}, {}, whole),
               InternalError);
  EXPECT_THROW(ParamAndGradBuffer(list, 2, false, 0, {m}, DType::F32, {}, {}, whole),
               InternalError);
  EXPECT_THROW(
      ParamAndGradBuffer(list, 2, false, 0, {}, DType::F32, {},
                         BufferSharding{ShardingStrategy::OptimGrads, 0, DType::F32}, whole),
      InternalError);
  for (Param* p : list) p->fp8_param = true;
  EXPECT_THROW(ParamAndGradBuffer(list, 2, false, 0, {}, DType::F32, {}, {}, whole), InternalError);
  (void)v;
}

TEST(LayerWiseBuffer, FlatBuffersReportStraddlingParams) {
  Params ps;
  Param* a = ps.add("a", {100});
  Param* b = ps.add("b", {100});
  // Flat, one bucket over two shards of 128: b at [0, 128) on shard 0, a at [128, 228).
  const ParamAndGradBuffer flat(ps.list(), 2, false);
  EXPECT_EQ(flat.owner_shard(b), 0);
  EXPECT_EQ(flat.owner_shard(a), 1);
  Params more;
  Param* c = more.add("c", {100});
  Param* d = more.add("d", {200});
  // d at [0, 256), c at [256, 356) of 384: shards of 192; d straddles, c does not.
  const ParamAndGradBuffer straddling(more.list(), 2, false);
  EXPECT_EQ(straddling.owner_shard(d), -1);
  EXPECT_EQ(straddling.owner_shard(c), 1);
  EXPECT_THROW(straddling.owner_shard(a), InternalError);  // not in this buffer
}

// GPTModel: with layer_wise and sharded buffers the Muon params (muon_param) are in
// WholeParams buffers, dense and expert apart, and nowhere else; without, no such buffer.
TEST(LayerWiseBuffer, GptModelRoutesMuonParamsToWholeParamBuffers) {
  testing::TinyGptVariant variant;
  for (const testing::TinyGptVariant& v : testing::tiny_gpt_variants())
    if (v.name == "moe_rope_rmsnorm_swiglu_gqa_untied") variant = v;
  ASSERT_TRUE(variant.moe);
  const GPTConfig cfg = testing::tiny_gpt_config(variant);
  ChunkSharding layer_wise;
  layer_wise.layer_wise = true;
  for (const bool on : {false, true}) {
    SCOPED_TRACE(on);
    GPTModel model(cfg, test_seed(), {}, 2, 2, {}, 0, on ? layer_wise : ChunkSharding{});
    std::map<const Param*, int> buffers_of;
    int whole = 0;
    for (ParamAndGradBuffer& b : model.buffers()) {
      whole += b.layout() == BufferLayout::WholeParams;
      for (const Param* p : b.params()) {
        ++buffers_of[p];
        EXPECT_EQ(b.is_expert(), p->is_expert) << p->name;
        // Whole-parameter buffers hold exactly the Muon params (with layer_wise).
        EXPECT_EQ(b.layout() == BufferLayout::WholeParams, on && muon_param(*p)) << p->name;
        if (b.layout() == BufferLayout::WholeParams) {
          EXPECT_GE(b.owner_shard(p), 0) << p->name;
        }
      }
    }
    EXPECT_EQ(whole, on ? 2 : 0);
    EXPECT_EQ(buffers_of.size(), model.params().size());
    for (const auto& [p, n] : buffers_of) EXPECT_EQ(n, 1) << p->name;
  }
  // One shard everywhere: nothing to own, the flat buffers as without layer_wise.
  GPTModel unsharded(cfg, test_seed(), {}, 1, 1, {}, 0, layer_wise);
  for (ParamAndGradBuffer& b : unsharded.buffers()) EXPECT_EQ(b.layout(), BufferLayout::Flat);
}

}  // namespace
}  // namespace megaton
