// --init-model-with-meta-device: a parameter made without values draws, on demand, exactly
// the values make_param / make_param_sharded give it (initial_values), and an FSDP buffer
// of such parameters stores the same own shard as one made from whole parameters, without
// ever holding the rest.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/layers.h"
#include "model/param_buffer.h"

namespace megaton {
namespace {

constexpr uint64_t kSeed = 1234;
const Placement kWhole{Device::CPU, DType::F32, false};
const Placement kMeta{Device::CPU, DType::F32, true};

// Elements [offset, offset + n) of t, flattened.
std::vector<float> range_of(const Tensor& t, int64_t offset, int64_t n) {
  const std::vector<float> all = t.to_vector();
  return {all.begin() + offset, all.begin() + offset + n};
}

struct Split {
  int dim;  // -1: not split
  bool blocked;  // stacked blocks of different sizes (Param::tp_blocks)
  std::vector<int64_t> blocks() const {
    return blocked ? std::vector<int64_t>{8, 4, 4, 4, 4} : std::vector<int64_t>{};
  }
};

TEST(MetaDeviceInit, InitialValuesEqualTheSliceMakeParamDrew) {
  const Shape full = {24, 20};
  for (const Split split : {Split{-1, false}, Split{0, false}, Split{1, false}, Split{0, true}})
    for (int size : {1, 2, 4})
      for (int rank = 0; rank < size; ++rank) {
        SCOPED_TRACE("dim " + std::to_string(split.dim) + (split.blocked ? " blocks" : "") +
                     " rank " + std::to_string(rank) + " of " + std::to_string(size));
        const int dim = split.dim < 0 ? 0 : split.dim;
        const int tp = split.dim < 0 ? 1 : size;
        const int r = split.dim < 0 ? 0 : rank;
        const Param whole =
            make_param_sharded("w", full, 0.5f, kSeed, kWhole, dim, r, tp, split.blocks());
        const Param meta =
            make_param_sharded("w", full, 0.5f, kSeed, kMeta, dim, r, tp, split.blocks());
        ASSERT_EQ(meta.weight.shape(), whole.weight.shape());
        EXPECT_TRUE(meta.weight.storage_released());
        EXPECT_TRUE(meta.main_param.same_data(meta.weight));  // fp32: one tensor
        const int64_t n = whole.weight.numel();
        for (const auto [offset, count] : std::vector<std::pair<int64_t, int64_t>>{
                 {0, n}, {0, 1}, {n - 1, 1}, {7, 33}, {n / 3, n / 2}}) {
          EXPECT_EQ(initial_values(meta, offset, count).to_vector(),
                    range_of(whole.main_param, offset, count))
              << "elements [" << offset << ", " << offset + count << ")";
          EXPECT_EQ(initial_values(whole, offset, count).to_vector(),
                    range_of(whole.main_param, offset, count));
        }
      }
}

TEST(MetaDeviceInit, ConstantParamsAndBadRanges) {
  const Param ones = make_constant_param("norm.weight", {10}, 1.0f, true, kMeta);
  EXPECT_TRUE(ones.weight.storage_released());
  EXPECT_EQ(initial_values(ones, 3, 4).to_vector(), std::vector<float>(4, 1.0f));
  EXPECT_THROW(initial_values(ones, 8, 3), InternalError);
  Param none;
  none.name = "made elsewhere";
  none.weight = Tensor::zeros({4});
  EXPECT_THROW(initial_values(none, 0, 1), InternalError);
}

// Three params, as FSDP lays them out: one unit each, so one bucket each.
std::vector<Param> make_params(Placement where) {
  std::vector<Param> ps;
  ps.push_back(make_param_sharded("a", {16, 12}, 0.02f, kSeed, where, 1, 1, 2));
  ps.push_back(make_constant_param("b", {70}, 1.0f, true, where));
  ps.push_back(make_param("c", {9, 30}, 0.02f, kSeed, where));
  return ps;
}

ParamAndGradBuffer make_buffer(std::vector<Param>& ps, ShardingStrategy strategy) {
  std::vector<Param*> ptrs;
  for (Param& p : ps) ptrs.push_back(&p);
  BufferSharding sharding;
  sharding.strategy = strategy;
  sharding.shard_index = 1;
  return ParamAndGradBuffer(ptrs, 2, false, 0, {}, DType::F32, {0, 1, 2}, sharding);
}

TEST(MetaDeviceInit, FsdpBufferDrawsOnlyItsOwnShard) {
  std::vector<Param> whole = make_params(kWhole), meta = make_params(kMeta);
  ParamAndGradBuffer a = make_buffer(whole, ShardingStrategy::OptimGradsParams);
  ParamAndGradBuffer b = make_buffer(meta, ShardingStrategy::OptimGradsParams);
  ASSERT_EQ(a.buckets().size(), 3u);
  for (size_t k = 0; k < a.buckets().size(); ++k) {
    EXPECT_EQ(b.own_weight_shard(k).to_vector(), a.own_weight_shard(k).to_vector()) << k;
    EXPECT_FALSE(b.weights_live(k)) << "bucket " << k << " holds whole weights";
  }
  for (const Param& p : meta) EXPECT_TRUE(p.weight.storage_released()) << p.name;
}

TEST(MetaDeviceInit, UnshardedWeightsAreDrawnWhole) {
  std::vector<Param> whole = make_params(kWhole), meta = make_params(kMeta);
  ParamAndGradBuffer a = make_buffer(whole, ShardingStrategy::OptimGrads);
  ParamAndGradBuffer b = make_buffer(meta, ShardingStrategy::OptimGrads);
  EXPECT_EQ(b.weights().to_vector(), a.weights().to_vector());
  for (size_t i = 0; i < meta.size(); ++i) {
    EXPECT_TRUE(meta[i].main_param.same_data(meta[i].weight)) << meta[i].name;
    EXPECT_EQ(meta[i].weight.to_vector(), whole[i].weight.to_vector()) << meta[i].name;
  }
}

TEST(MetaDeviceInit, MainParamValuesDrawForParamsWithoutValues) {
  const Param whole = make_param("w", {5, 8}, 0.1f, kSeed, {Device::CPU, DType::F32, false});
  Param meta = make_param("w", {5, 8}, 0.1f, kSeed, kMeta);
  EXPECT_EQ(main_param_values(meta, 6, 20).to_vector(), range_of(whole.main_param, 6, 20));
  EXPECT_EQ(main_param_values(whole, 6, 20).to_vector(), range_of(whole.main_param, 6, 20));
}

}  // namespace
}  // namespace megaton
