// Layout checks and process groups (Megatron-LM parallel_state.py's RankGenerator).
#include "dist/grid.h"

#include <array>
#include <memory>

#include "core/error.h"

namespace megaton::dist {

ParallelSizes resolve_parallel_sizes(ParallelSizes s, int64_t world_size) {
  if (world_size <= 0) fail("world size must be positive (got {})", world_size);
  if (s.etp == 0) s.etp = s.tp;
  const std::array<std::pair<const char*, int64_t>, 5> named = {{
      {"tensor-model-parallel-size", s.tp},
      {"context-parallel-size", s.cp},
      {"expert-model-parallel-size", s.ep},
      {"expert-tensor-parallel-size", s.etp},
      {"pipeline-model-parallel-size", s.pp},
  }};
  for (const auto& [name, value] : named)
    if (value <= 0) fail("{} must be positive (got {})", name, value);
  int64_t dense = s.tp * s.cp * s.pp;
  if (world_size % dense != 0)
    fail(
        "world size ({}) is not divisible by tensor-model-parallel-size ({}) x "
        "context-parallel-size ({}) x pipeline-model-parallel-size ({}) = {}",
        world_size, s.tp, s.cp, s.pp, dense);
  int64_t expert = s.etp * s.ep * s.pp;
  if (world_size % expert != 0)
    fail(
        "world size ({}) is not divisible by expert-tensor-parallel-size ({}) x "
        "expert-model-parallel-size ({}) x pipeline-model-parallel-size ({}) = {}",
        world_size, s.etp, s.ep, s.pp, expert);
  s.world = world_size;
  s.dp = world_size / dense;
  s.edp = world_size / expert;
  return s;
}

namespace {

// "decoder-first-pipeline-num-layers (3) and decoder-last-pipeline-num-layers (2)", or
// the one of them that is set.
std::string stage_overrides(int64_t first, int64_t last) {
  std::string out;
  if (first) out = fmt::format("decoder-first-pipeline-num-layers ({})", first);
  if (last) {
    if (!out.empty()) out += " and ";
    out += fmt::format("decoder-last-pipeline-num-layers ({})", last);
  }
  return out;
}

// Megatron's split of the decoder layers over pipeline stages: an even share, or the
// first and/or last stage overridden and the rest shared evenly by the middle stages.
std::vector<int64_t> split_layers(const LayoutRequest& r, int64_t pp) {
  const int64_t layers = r.num_layers;
  const int64_t first = r.decoder_first_pipeline_num_layers;
  const int64_t last = r.decoder_last_pipeline_num_layers;
  if (first < 0) fail("decoder-first-pipeline-num-layers must be positive (got {})", first);
  if (last < 0) fail("decoder-last-pipeline-num-layers must be positive (got {})", last);
  if (!first && !last) {
    if (layers % pp != 0)
      fail("num-layers ({}) is not divisible by pipeline-model-parallel-size ({})", layers, pp);
    return std::vector<int64_t>(pp, layers / pp);
  }
  if (pp == 1)
    fail("{} needs pipeline-model-parallel-size > 1 (got 1)", stage_overrides(first, last));
  const int64_t middle_stages = pp - (first ? 1 : 0) - (last ? 1 : 0);
  const int64_t remaining = layers - first - last;
  if (remaining < 0) fail("{} exceed num-layers ({})", stage_overrides(first, last), layers);
  if (middle_stages == 0 && remaining != 0)
    fail("{} do not add up to num-layers ({}) with pipeline-model-parallel-size ({})",
         stage_overrides(first, last), layers, pp);
  if (middle_stages > 0 && (remaining == 0 || remaining % middle_stages != 0))
    fail(
        "num-layers ({}) minus {} leaves {} layers, which do not split evenly among the {} "
        "other pipeline stages",
        layers, stage_overrides(first, last), remaining, middle_stages);
  std::vector<int64_t> stages(pp, middle_stages ? remaining / middle_stages : 0);
  if (first) stages.front() = first;
  if (last) stages.back() = last;
  return stages;
}

// Virtual pipeline chunks per rank from --num-layers-per-virtual-pipeline-stage: a middle
// (not overridden) stage's layers / layers per chunk; every stage then needs a multiple
// of that many layers (Megatron's TransformerConfig checks).
int64_t virtual_stages(const LayoutRequest& r, const std::vector<int64_t>& stages) {
  const int64_t per_chunk = r.num_layers_per_virtual_pipeline_stage;
  if (per_chunk < 0)
    fail("num-layers-per-virtual-pipeline-stage must be positive (got {})", per_chunk);
  const int64_t pp = static_cast<int64_t>(stages.size());
  if (pp == 1)
    fail(
        "num-layers-per-virtual-pipeline-stage ({}) needs pipeline-model-parallel-size > 1 "
        "(got 1)",
        per_chunk);
  size_t reference = r.decoder_first_pipeline_num_layers ? 1 : 0;
  if (reference >= stages.size() ||
      (reference == stages.size() - 1 && r.decoder_last_pipeline_num_layers))
    reference = 0;  // every stage overridden (pp 2): the first stage sets the chunk count
  if (stages[reference] % per_chunk != 0)
    fail(
        "layers per pipeline stage ({}) is not divisible by "
        "num-layers-per-virtual-pipeline-stage ({})",
        stages[reference], per_chunk);
  const int64_t vpp = stages[reference] / per_chunk;
  if (r.decoder_first_pipeline_num_layers && stages.front() % vpp != 0)
    fail(
        "decoder-first-pipeline-num-layers ({}) is not divisible by the {} virtual pipeline "
        "stages per rank",
        stages.front(), vpp);
  if (r.decoder_last_pipeline_num_layers && stages.back() % vpp != 0)
    fail(
        "decoder-last-pipeline-num-layers ({}) is not divisible by the {} virtual pipeline "
        "stages per rank",
        stages.back(), vpp);
  return vpp;
}

}  // namespace

ValidatedLayout validate_layout(const LayoutRequest& r) {
  ValidatedLayout out;
  ParallelSizes s = resolve_parallel_sizes(r.sizes, r.world_size);
  if (r.num_experts > 0 && r.num_experts % s.ep != 0)
    fail("num-experts ({}) is not divisible by expert-model-parallel-size ({})", r.num_experts,
         s.ep);
  if (r.num_experts == 0 && s.ep > 1)
    fail("expert-model-parallel-size ({}) needs an MoE model (num-experts is 0)", s.ep);
  if (r.num_attention_heads % s.tp != 0)
    fail("num-attention-heads ({}) is not divisible by tensor-model-parallel-size ({})",
         r.num_attention_heads, s.tp);
  if (r.num_query_groups % s.tp != 0)
    fail("num-query-groups ({}) is not divisible by tensor-model-parallel-size ({})",
         r.num_query_groups, s.tp);
  const std::vector<int64_t>& segments = r.pipeline_segment_layers;
  if (segments.size() > 1 && s.pp > 1) {
    if (r.decoder_first_pipeline_num_layers || r.decoder_last_pipeline_num_layers ||
        r.num_layers_per_virtual_pipeline_stage)
      fail(
          "hybrid-layer-pattern with '|' sets the pipeline stages; it does not take "
          "decoder-first/last-pipeline-num-layers or num-layers-per-virtual-pipeline-stage");
    if (int64_t(segments.size()) != s.pp)
      fail(
          "hybrid-layer-pattern has {} '|' segments for pipeline-model-parallel-size {}: give "
          "one per stage (several per stage, Megatron's flexible VPP, are not supported)",
          segments.size(), s.pp);
    out.layers_per_stage = segments;
  } else {
    out.layers_per_stage = split_layers(r, s.pp);
  }
  if (r.num_layers_per_virtual_pipeline_stage) s.vpp = virtual_stages(r, out.layers_per_stage);
  out.sequence_parallel = r.sequence_parallel;
  if (r.sequence_parallel && s.tp == 1) {
    out.sequence_parallel = false;
    out.warnings.push_back(
        "sequence-parallel is turned off: it needs tensor-model-parallel-size > 1 (got 1)");
  }
  if (r.num_experts > 0 && s.ep > 1 && s.tp > 1 && !out.sequence_parallel)
    fail(
        "expert-model-parallel-size ({}) with tensor-model-parallel-size ({}) needs "
        "sequence-parallel",
        s.ep, s.tp);
  out.sizes = s;
  return out;
}

const char* group_kind_name(GroupKind kind) {
  static constexpr std::array<const char*, kNumGroupKinds> names = {
      "world",    "tp", "cp",        "dp", "pp",  "dp_cp", "tp_cp",
      "tp_dp_cp", "mp", "embedding", "ep", "etp", "edp",   "expert_mp"};
  return names[static_cast<int>(kind)];
}

std::string Group::describe() const {
  std::string list;
  const size_t n = ranks.size();
  constexpr size_t kShown = 8;
  for (size_t i = 0; i < n; ++i) {
    if (n > kShown + 1 && i == kShown - 1) {  // 0,1,...,6,...,last
      list += fmt::format(",...,{}", ranks.back());
      break;
    }
    list += fmt::format("{}{}", i ? "," : "", ranks[i]);
  }
  if (n > kShown + 1) return fmt::format("{} (ranks {}; {} ranks)", name, list, n);
  return fmt::format("{} (ranks {})", name, list);
}

namespace {

// A rank's coordinates in one of the two grids, fastest-varying first: dense
// [tp, cp, dp, pp] (ep folded to 1), expert [etp, ep, edp, pp].
constexpr int kDims = 4;
using Coords = std::array<int64_t, kDims>;

Coords coords_of(int64_t rank, const std::array<int64_t, kDims>& dims) {
  Coords c{};
  for (int d = 0; d < kDims; ++d) {
    c[d] = rank % dims[d];
    rank /= dims[d];
  }
  return c;
}

// Megatron's masked orthogonal groups: the ranks that share this rank's coordinates on
// every dimension outside `mask`. Scanning ranks upwards yields them in ascending order,
// the order Megatron's generator lists them in (its strides grow with the dimension).
Group group_of(const char* name, int world_rank, int64_t world,
               const std::array<int64_t, kDims>& dims, const std::array<bool, kDims>& mask) {
  Group g;
  g.name = name;
  const Coords mine = coords_of(world_rank, dims);
  for (int64_t r = 0; r < world; ++r) {
    const Coords c = coords_of(r, dims);
    bool same = true;
    for (int d = 0; d < kDims; ++d) same = same && (mask[d] || c[d] == mine[d]);
    if (!same) continue;
    if (r == world_rank) g.rank = g.size();
    g.ranks.push_back(static_cast<int>(r));
  }
  return g;
}

}  // namespace

Grid::Grid(const ParallelSizes& sizes, int64_t world_size, int world_rank)
    : sizes_(resolve_parallel_sizes(sizes, world_size)), world_rank_(world_rank) {
  MEGATON_CHECK(world_rank >= 0 && world_rank < world_size, "world rank {} of {}", world_rank,
                world_size);
  const ParallelSizes& s = sizes_;
  const std::array<int64_t, kDims> dense = {s.tp, s.cp, s.dp, s.pp};
  const std::array<int64_t, kDims> expert = {s.etp, s.ep, s.edp, s.pp};
  enum { A = 0, B = 1, C = 2, P = 3 };  // dense: tp cp dp pp; expert: etp ep edp pp
  auto masked = [](std::initializer_list<int> dims) {
    std::array<bool, kDims> m{};
    for (int d : dims) m[d] = true;
    return m;
  };
  groups_.resize(kNumGroupKinds);
  auto set = [&](GroupKind kind, const std::array<int64_t, kDims>& grid,
                 std::initializer_list<int> dims) {
    groups_[static_cast<int>(kind)] =
        group_of(group_kind_name(kind), world_rank, s.world, grid, masked(dims));
  };
  set(GroupKind::World, dense, {A, B, C, P});
  set(GroupKind::TP, dense, {A});
  set(GroupKind::CP, dense, {B});
  set(GroupKind::DP, dense, {C});
  set(GroupKind::PP, dense, {P});
  set(GroupKind::DP_CP, dense, {B, C});
  set(GroupKind::TP_CP, dense, {A, B});
  set(GroupKind::TP_DP_CP, dense, {A, B, C});
  set(GroupKind::MP, dense, {A, P});
  set(GroupKind::EP, expert, {B});
  set(GroupKind::ETP, expert, {A});
  set(GroupKind::EDP, expert, {C});
  set(GroupKind::ExpertMP, expert, {A, B});

  // Megatron's embedding group: the first and last rank of each pipeline group (the
  // whole group when pp == 1). Middle stages are in none.
  Group& emb = groups_[static_cast<int>(GroupKind::Embedding)];
  emb.name = group_kind_name(GroupKind::Embedding);
  const Group& pipe = pp();
  if (pipe.size() == 1) {
    emb.ranks = pipe.ranks;
    emb.rank = 0;
  } else if (is_pipeline_first_stage() || is_pipeline_last_stage()) {
    emb.ranks = {pipe.ranks.front(), pipe.ranks.back()};
    emb.rank = is_pipeline_first_stage() ? 0 : 1;
  }
}

namespace {
std::unique_ptr<Grid>& current_grid() {
  static std::unique_ptr<Grid> grid;
  return grid;
}
}  // namespace

const Grid& Grid::current() {
  MEGATON_CHECK(current_grid() != nullptr, "Grid::current() called before Grid::set_current()");
  return *current_grid();
}

void Grid::set_current(const Grid& grid) { current_grid() = std::make_unique<Grid>(grid); }

}  // namespace megaton::dist
