// Grid: every rank's groups against Megatron's RankGenerator rule (computed here the way
// Megatron computes it, independently of grid.cpp), hand-written 8-rank layouts, groups
// partitioning the world, and the message of every rejected layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/error.h"
#include "dist/grid.h"

namespace megaton::dist {
namespace {

using Ranks = std::vector<int>;

// Megatron's generate_masked_orthogonal_rank_groups: dimension sizes in order (fastest
// first), a mask of the dimensions a group spans. The group index is decomposed over the
// unmasked dimensions, the index inside the group over the masked ones, and a rank is
// the inner product of those digits with the global strides.
std::vector<Ranks> megatron_groups(int64_t world, const std::vector<int64_t>& sizes,
                                   const std::vector<bool>& mask) {
  std::vector<int64_t> stride(sizes.size());
  int64_t product = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    stride[d] = product;
    product *= sizes[d];
  }
  std::vector<int64_t> masked_size, masked_stride, other_size, other_stride;
  for (size_t d = 0; d < sizes.size(); ++d) {
    (mask[d] ? masked_size : other_size).push_back(sizes[d]);
    (mask[d] ? masked_stride : other_stride).push_back(stride[d]);
  }
  auto offset = [](int64_t index, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides) {
    int64_t rank = 0;
    for (size_t d = 0; d < shape.size(); ++d) {
      rank += (index % shape[d]) * strides[d];
      index /= shape[d];
    }
    return rank;
  };
  int64_t group_size = 1;
  for (int64_t s : masked_size) group_size *= s;
  std::vector<Ranks> groups;
  for (int64_t gi = 0; gi < world / group_size; ++gi) {
    Ranks g;
    for (int64_t ri = 0; ri < group_size; ++ri)
      g.push_back(
          int(offset(ri, masked_size, masked_stride) + offset(gi, other_size, other_stride)));
    groups.push_back(g);
  }
  return groups;
}

struct Layout {
  int64_t world, tp, cp, ep, etp, pp;
};

// Megatron's two RankGenerators with order "tp-cp-ep-dp-pp": the dense one with ep = 1,
// the expert one with tp = etp, cp = 1, dp = edp. Tokens name the masked dimensions.
std::vector<Ranks> reference(const Layout& l, GroupKind kind) {
  const int64_t etp = l.etp ? l.etp : l.tp;
  const int64_t dp = l.world / (l.tp * l.cp * l.pp);
  const int64_t edp = l.world / (etp * l.ep * l.pp);
  const std::vector<int64_t> dense = {l.tp, l.cp, 1, dp, l.pp};
  const std::vector<int64_t> expert = {etp, 1, l.ep, edp, l.pp};
  //                    tp     cp     ep     dp     pp
  auto m = [](bool tp, bool cp, bool ep, bool dp, bool pp) {
    return std::vector<bool>{tp, cp, ep, dp, pp};
  };
  switch (kind) {
    case GroupKind::World:
      return megatron_groups(l.world, dense, m(1, 1, 1, 1, 1));
    case GroupKind::TP:
      return megatron_groups(l.world, dense, m(1, 0, 0, 0, 0));
    case GroupKind::CP:
      return megatron_groups(l.world, dense, m(0, 1, 0, 0, 0));
    case GroupKind::DP:
      return megatron_groups(l.world, dense, m(0, 0, 0, 1, 0));
    case GroupKind::PP:
      return megatron_groups(l.world, dense, m(0, 0, 0, 0, 1));
    case GroupKind::DP_CP:
      return megatron_groups(l.world, dense, m(0, 1, 0, 1, 0));
    case GroupKind::TP_CP:
      return megatron_groups(l.world, dense, m(1, 1, 0, 0, 0));
    case GroupKind::TP_DP_CP:
      return megatron_groups(l.world, dense, m(1, 1, 0, 1, 0));
    case GroupKind::MP:
      return megatron_groups(l.world, dense, m(1, 0, 0, 0, 1));
    case GroupKind::Embedding: {
      std::vector<Ranks> out;
      for (const Ranks& p : megatron_groups(l.world, dense, m(0, 0, 0, 0, 1)))
        out.push_back(p.size() > 1 ? Ranks{p.front(), p.back()} : p);
      return out;
    }
    case GroupKind::EP:
      return megatron_groups(l.world, expert, m(0, 0, 1, 0, 0));
    case GroupKind::ETP:
      return megatron_groups(l.world, expert, m(1, 0, 0, 0, 0));
    case GroupKind::EDP:
      return megatron_groups(l.world, expert, m(0, 0, 0, 1, 0));
    case GroupKind::ExpertMP:
      return megatron_groups(l.world, expert, m(1, 0, 1, 0, 0));
  }
  return {};
}

Grid make_grid(const Layout& l, int rank) {
  ParallelSizes s;
  s.tp = l.tp;
  s.cp = l.cp;
  s.ep = l.ep;
  s.etp = l.etp;
  s.pp = l.pp;
  return Grid(s, l.world, rank);
}

const std::vector<Layout> kLayouts = {
    {1, 1, 1, 1, 0, 1},  {8, 2, 1, 1, 0, 2},  {8, 2, 1, 2, 1, 2},
    {8, 1, 1, 8, 1, 1},  {12, 3, 1, 2, 1, 2}, {16, 2, 2, 2, 2, 2},
    {24, 2, 3, 4, 1, 2}, {32, 4, 1, 8, 2, 1}, {16, 1, 1, 1, 0, 4},
};

std::string layout_str(const Layout& l) {
  return fmt::format("world {} tp {} cp {} ep {} etp {} pp {}", l.world, l.tp, l.cp, l.ep, l.etp,
                     l.pp);
}

TEST(Grid, GroupsMatchMegatronRankGenerator) {
  for (const Layout& l : kLayouts) {
    SCOPED_TRACE(layout_str(l));
    for (int k = 0; k < kNumGroupKinds; ++k) {
      const auto kind = static_cast<GroupKind>(k);
      SCOPED_TRACE(group_kind_name(kind));
      const std::vector<Ranks> expected = reference(l, kind);
      for (int r = 0; r < l.world; ++r) {
        const Grid grid = make_grid(l, r);
        const Group& g = grid.group(kind);
        EXPECT_EQ(g.name, group_kind_name(kind));
        const Ranks* mine = nullptr;
        for (const Ranks& e : expected)
          if (std::find(e.begin(), e.end(), r) != e.end()) mine = &e;
        if (!mine) {  // only a middle pipeline stage is outside every embedding group
          EXPECT_EQ(kind, GroupKind::Embedding) << "rank " << r;
          EXPECT_FALSE(g.is_member());
          EXPECT_TRUE(g.ranks.empty());
          continue;
        }
        EXPECT_EQ(g.ranks, *mine) << "rank " << r;
        ASSERT_TRUE(g.is_member()) << "rank " << r;
        EXPECT_EQ(g.ranks[g.rank], r);
      }
    }
  }
}

TEST(Grid, GroupsPartitionTheWorld) {
  for (const Layout& l : kLayouts) {
    SCOPED_TRACE(layout_str(l));
    for (int k = 0; k < kNumGroupKinds; ++k) {
      const auto kind = static_cast<GroupKind>(k);
      if (kind == GroupKind::Embedding) continue;
      SCOPED_TRACE(group_kind_name(kind));
      std::set<Ranks> distinct;
      for (int r = 0; r < l.world; ++r) distinct.insert(make_grid(l, r).group(kind).ranks);
      std::vector<int> seen(l.world, 0);
      for (const Ranks& g : distinct) {
        EXPECT_EQ(g.size(), distinct.begin()->size());
        EXPECT_TRUE(std::is_sorted(g.begin(), g.end()));
        for (int r : g) ++seen[r];
      }
      for (int r = 0; r < l.world; ++r) EXPECT_EQ(seen[r], 1) << "rank " << r;
    }
  }
}

TEST(Grid, Dense8RanksTp2Pp2Dp2ByHand) {
  // rank = tp + 2 dp + 4 pp.
  const Layout l{8, 2, 1, 1, 0, 2};
  const std::map<GroupKind, std::vector<Ranks>> expected = {
      {GroupKind::TP, {{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}}},
      {GroupKind::DP, {{0, 2}, {1, 3}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {4, 6}, {5, 7}}},
      {GroupKind::PP, {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {0, 4}, {1, 5}, {2, 6}, {3, 7}}},
      {GroupKind::CP, {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
      {GroupKind::DP_CP, {{0, 2}, {1, 3}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {4, 6}, {5, 7}}},
      {GroupKind::TP_DP_CP,
       {{0, 1, 2, 3},
        {0, 1, 2, 3},
        {0, 1, 2, 3},
        {0, 1, 2, 3},
        {4, 5, 6, 7},
        {4, 5, 6, 7},
        {4, 5, 6, 7},
        {4, 5, 6, 7}}},
      {GroupKind::MP,
       {{0, 1, 4, 5},
        {0, 1, 4, 5},
        {2, 3, 6, 7},
        {2, 3, 6, 7},
        {0, 1, 4, 5},
        {0, 1, 4, 5},
        {2, 3, 6, 7},
        {2, 3, 6, 7}}},
      {GroupKind::Embedding, {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {0, 4}, {1, 5}, {2, 6}, {3, 7}}},
      // etp = tp = 2, ep = 1: edp = 2, the expert grid equals the dense one.
      {GroupKind::ETP, {{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}}},
      {GroupKind::EDP, {{0, 2}, {1, 3}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {4, 6}, {5, 7}}},
  };
  for (int r = 0; r < 8; ++r) {
    Grid g = make_grid(l, r);
    EXPECT_EQ(g.sizes().dp, 2);
    EXPECT_EQ(g.is_pipeline_first_stage(), r < 4);
    EXPECT_EQ(g.is_pipeline_last_stage(), r >= 4);
    for (const auto& [kind, groups] : expected)
      EXPECT_EQ(g.group(kind).ranks, groups[r]) << group_kind_name(kind) << " of rank " << r;
  }
}

TEST(Grid, Expert8RanksEp2Etp1ByHand) {
  // Dense: tp 2, pp 2, dp 2. Expert: etp 1, ep 2, pp 2, edp 2: rank = ep + 2 edp + 4 pp.
  const Layout l{8, 2, 1, 2, 1, 2};
  const std::map<GroupKind, std::vector<Ranks>> expected = {
      {GroupKind::EP, {{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}}},
      {GroupKind::EDP, {{0, 2}, {1, 3}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {4, 6}, {5, 7}}},
      {GroupKind::ETP, {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
      {GroupKind::ExpertMP, {{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}}},
      {GroupKind::TP_CP, {{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}}},
  };
  for (int r = 0; r < 8; ++r) {
    Grid g = make_grid(l, r);
    EXPECT_EQ(g.sizes().edp, 2);
    EXPECT_EQ(g.sizes().etp, 1);
    for (const auto& [kind, groups] : expected)
      EXPECT_EQ(g.group(kind).ranks, groups[r]) << group_kind_name(kind) << " of rank " << r;
  }
}

TEST(Grid, EmbeddingGroupIsFirstAndLastStage) {
  const Layout l{16, 1, 1, 1, 0, 4};  // pp groups {r, r+4, r+8, r+12}
  EXPECT_EQ(make_grid(l, 1).embedding().ranks, (Ranks{1, 13}));
  EXPECT_EQ(make_grid(l, 1).embedding().rank, 0);
  EXPECT_EQ(make_grid(l, 13).embedding().rank, 1);
  EXPECT_FALSE(make_grid(l, 5).embedding().is_member());
  EXPECT_FALSE(make_grid(l, 9).embedding().is_member());
}

TEST(Grid, ExpertTensorParallelDefaultsToTp) {
  ParallelSizes s;
  s.tp = 4;
  ParallelSizes r = resolve_parallel_sizes(s, 8);
  EXPECT_EQ(r.etp, 4);
  EXPECT_EQ(r.dp, 2);
  EXPECT_EQ(r.edp, 2);
}

TEST(Grid, Describe) {
  Group g{"dp", {0, 2}, 1};
  EXPECT_EQ(g.describe(), "dp (ranks 0,2)");
  Group big{"world", {}, 0};
  for (int r = 0; r < 64; ++r) big.ranks.push_back(r);
  EXPECT_EQ(big.describe(), "world (ranks 0,1,2,3,4,5,6,...,63; 64 ranks)");
}

TEST(Grid, CurrentNeedsSetCurrent) {
  EXPECT_THROW(Grid::current(), InternalError);
  Grid::set_current(make_grid({8, 2, 1, 1, 0, 2}, 3));
  EXPECT_EQ(Grid::current().world_rank(), 3);
  EXPECT_EQ(Grid::current().tp().ranks, (Ranks{2, 3}));
}

// A valid MoE model on 8 ranks; each test changes what it rejects.
LayoutRequest base_request() {
  LayoutRequest r;
  r.world_size = 8;
  r.num_layers = 8;
  r.num_attention_heads = 8;
  r.num_query_groups = 4;
  r.num_experts = 8;
  return r;
}

std::string rejection(const LayoutRequest& r) {
  try {
    validate_layout(r);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(Layout, RejectsWorldNotDivisibleByDenseGrid) {
  LayoutRequest r = base_request();
  r.world_size = 6;
  r.sizes.tp = 4;
  EXPECT_EQ(rejection(r),
            "world size (6) is not divisible by tensor-model-parallel-size (4) x "
            "context-parallel-size (1) x pipeline-model-parallel-size (1) = 4");
  r.world_size = 8;
  r.sizes.tp = 1;
  r.sizes.pp = 3;
  EXPECT_EQ(rejection(r),
            "world size (8) is not divisible by tensor-model-parallel-size (1) x "
            "context-parallel-size (1) x pipeline-model-parallel-size (3) = 3");
}

TEST(Layout, RejectsWorldNotDivisibleByExpertGrid) {
  LayoutRequest r = base_request();
  r.num_experts = 12;
  r.sizes.ep = 3;
  r.sizes.etp = 1;
  EXPECT_EQ(rejection(r),
            "world size (8) is not divisible by expert-tensor-parallel-size (1) x "
            "expert-model-parallel-size (3) x pipeline-model-parallel-size (1) = 3");
  // etp defaults to tp: tp 2 x ep 2 x pp 2 = 8 does not divide 4.
  r.sizes = {};
  r.sizes.tp = 2;
  r.sizes.ep = 2;
  r.sizes.pp = 2;
  r.world_size = 4;
  EXPECT_EQ(rejection(r),
            "world size (4) is not divisible by expert-tensor-parallel-size (2) x "
            "expert-model-parallel-size (2) x pipeline-model-parallel-size (2) = 8");
}

TEST(Layout, RejectsNonPositiveSizes) {
  LayoutRequest r = base_request();
  r.sizes.tp = 0;
  EXPECT_EQ(rejection(r), "tensor-model-parallel-size must be positive (got 0)");
  r.sizes.tp = 1;
  r.sizes.pp = -2;
  EXPECT_EQ(rejection(r), "pipeline-model-parallel-size must be positive (got -2)");
}

TEST(Layout, ContextParallelTakesItsShareOfTheWorld) {
  LayoutRequest r = base_request();
  r.sizes.cp = 2;
  r.sizes.tp = 2;
  const ValidatedLayout layout = validate_layout(r);
  EXPECT_EQ(layout.sizes.cp, 2);
  EXPECT_EQ(layout.sizes.dp, 2);  // 8 / (tp 2 x cp 2)
  r.sizes.cp = 3;
  EXPECT_EQ(rejection(r),
            "world size (8) is not divisible by tensor-model-parallel-size (2) x "
            "context-parallel-size (3) x pipeline-model-parallel-size (1) = 6");
}

TEST(Layout, RejectsExpertsNotDivisibleByEp) {
  LayoutRequest r = base_request();
  r.num_experts = 6;
  r.sizes.ep = 4;
  EXPECT_EQ(rejection(r), "num-experts (6) is not divisible by expert-model-parallel-size (4)");
  r.num_experts = 0;
  EXPECT_EQ(rejection(r), "expert-model-parallel-size (4) needs an MoE model (num-experts is 0)");
}

TEST(Layout, RejectsHeadsOrGroupsNotDivisibleByTp) {
  LayoutRequest r = base_request();
  r.num_experts = 0;
  r.sizes.tp = 4;
  r.num_attention_heads = 6;
  r.num_query_groups = 6;
  EXPECT_EQ(rejection(r),
            "num-attention-heads (6) is not divisible by tensor-model-parallel-size (4)");
  r.num_attention_heads = 8;
  r.num_query_groups = 2;
  EXPECT_EQ(rejection(r),
            "num-query-groups (2) is not divisible by tensor-model-parallel-size (4)");
}

TEST(Layout, RejectsLayersNotDivisibleAmongStages) {
  LayoutRequest r = base_request();
  r.world_size = 4;
  r.sizes.pp = 4;
  r.num_layers = 6;
  EXPECT_EQ(rejection(r), "num-layers (6) is not divisible by pipeline-model-parallel-size (4)");
}

TEST(Layout, FirstAndLastStageOverrides) {
  LayoutRequest r = base_request();
  r.world_size = 4;
  r.sizes.pp = 4;
  r.num_layers = 10;
  r.decoder_first_pipeline_num_layers = 2;
  r.decoder_last_pipeline_num_layers = 2;
  EXPECT_EQ(validate_layout(r).layers_per_stage, (std::vector<int64_t>{2, 3, 3, 2}));
  r.decoder_first_pipeline_num_layers = 3;
  EXPECT_EQ(rejection(r),
            "num-layers (10) minus decoder-first-pipeline-num-layers (3) and "
            "decoder-last-pipeline-num-layers (2) leaves 5 layers, which do not split evenly "
            "among the 2 other pipeline stages");
  r.decoder_last_pipeline_num_layers = 0;  // first only: 7 layers over 3 stages
  EXPECT_EQ(rejection(r),
            "num-layers (10) minus decoder-first-pipeline-num-layers (3) leaves 7 layers, which "
            "do not split evenly among the 3 other pipeline stages");
  r.decoder_first_pipeline_num_layers = 12;
  EXPECT_EQ(rejection(r), "decoder-first-pipeline-num-layers (12) exceed num-layers (10)");
  r.sizes.pp = 2;
  r.world_size = 2;
  r.decoder_first_pipeline_num_layers = 4;
  r.decoder_last_pipeline_num_layers = 5;
  EXPECT_EQ(rejection(r),
            "decoder-first-pipeline-num-layers (4) and decoder-last-pipeline-num-layers (5) do "
            "not add up to num-layers (10) with pipeline-model-parallel-size (2)");
  r.sizes.pp = 1;
  r.world_size = 1;
  r.decoder_last_pipeline_num_layers = 0;
  EXPECT_EQ(rejection(r),
            "decoder-first-pipeline-num-layers (4) needs pipeline-model-parallel-size > 1 (got 1)");
}

TEST(Layout, VirtualPipelineStages) {
  LayoutRequest r = base_request();
  r.world_size = 2;
  r.sizes.pp = 2;
  r.num_layers = 16;
  r.num_layers_per_virtual_pipeline_stage = 2;
  EXPECT_EQ(validate_layout(r).sizes.vpp, 4);
  r.num_layers_per_virtual_pipeline_stage = 3;
  EXPECT_EQ(rejection(r),
            "layers per pipeline stage (8) is not divisible by "
            "num-layers-per-virtual-pipeline-stage (3)");
  // Uneven stages: middle stages of 4 layers in chunks of 2 -> 2 chunks per rank; the
  // first stage's 3 layers do not split into 2 chunks.
  r.world_size = 4;
  r.sizes.pp = 4;
  r.num_layers = 15;
  r.decoder_first_pipeline_num_layers = 3;
  r.decoder_last_pipeline_num_layers = 4;
  r.num_layers_per_virtual_pipeline_stage = 2;
  EXPECT_EQ(rejection(r),
            "decoder-first-pipeline-num-layers (3) is not divisible by the 2 virtual pipeline "
            "stages per rank");
  r.num_layers = 14;
  r.decoder_first_pipeline_num_layers = 2;
  ValidatedLayout v = validate_layout(r);
  EXPECT_EQ(v.sizes.vpp, 2);
  EXPECT_EQ(v.layers_per_stage, (std::vector<int64_t>{2, 4, 4, 4}));
  r = base_request();
  r.num_layers_per_virtual_pipeline_stage = 2;
  EXPECT_EQ(rejection(r),
            "num-layers-per-virtual-pipeline-stage (2) needs pipeline-model-parallel-size > 1 "
            "(got 1)");
}

TEST(Layout, SequenceParallel) {
  LayoutRequest r = base_request();
  r.sequence_parallel = true;
  ValidatedLayout v = validate_layout(r);  // tp 1: turned off with a warning
  EXPECT_FALSE(v.sequence_parallel);
  ASSERT_EQ(v.warnings.size(), 1u);
  EXPECT_EQ(v.warnings[0],
            "sequence-parallel is turned off: it needs tensor-model-parallel-size > 1 (got 1)");
  r.sizes.tp = 2;
  v = validate_layout(r);
  EXPECT_TRUE(v.sequence_parallel);
  EXPECT_TRUE(v.warnings.empty());
  // MoE with ep and tp needs it (Megatron).
  r.sizes.ep = 2;
  r.sizes.etp = 1;
  r.sequence_parallel = false;
  EXPECT_EQ(rejection(r),
            "expert-model-parallel-size (2) with tensor-model-parallel-size (2) needs "
            "sequence-parallel");
}

TEST(Layout, AcceptsValidLayout) {
  LayoutRequest r = base_request();
  r.sizes.tp = 2;
  r.sizes.pp = 2;
  r.sizes.ep = 4;
  r.sizes.etp = 1;
  r.sequence_parallel = true;
  ValidatedLayout v = validate_layout(r);
  EXPECT_EQ(v.sizes.dp, 2);
  EXPECT_EQ(v.sizes.edp, 1);
  EXPECT_EQ(v.layers_per_stage, (std::vector<int64_t>{4, 4}));
  EXPECT_FALSE(v.sizes.vpp.has_value());
}

}  // namespace
}  // namespace megaton::dist
