// A sharded checkpoint written for a parallel layout by one process (megaton convert).
#include "train/layout_writer.h"

#include <numeric>
#include <set>

#include "ckpt/sharded.h"
#include "core/error.h"
#include "train/param_layout.h"
#include "train/sharded_ckpt.h"
#include "train/tensor_parallel_ckpt.h"

namespace megaton {

dist::ValidatedLayout resolve_target_layout(const GPTConfig& cfg, const TargetLayout& t) {
  for (auto [flag, value] : {std::pair{"target-tensor-model-parallel-size", t.tp},
                             {"target-pipeline-model-parallel-size", t.pp},
                             {"target-expert-model-parallel-size", t.ep}})
    if (value < 1) fail("--{} must be >= 1 (got {})", flag, value);
  if (t.etp < 0) fail("--target-expert-tensor-parallel-size must be >= 1 (got {})", t.etp);
  const int64_t etp = t.etp > 0 ? t.etp : t.tp;
  dist::LayoutRequest r;
  r.sizes.tp = t.tp;
  r.sizes.pp = t.pp;
  r.sizes.ep = t.ep;
  r.sizes.etp = etp;
  const int64_t dp = std::lcm(t.tp, etp * t.ep) / t.tp;
  r.world_size = t.tp * t.pp * dp;
  r.sequence_parallel = t.tp > 1;
  r.num_layers = cfg.num_layers;
  r.num_attention_heads = cfg.num_attention_heads;
  r.num_query_groups = cfg.num_query_groups > 0 ? cfg.num_query_groups : cfg.num_attention_heads;
  r.num_experts = cfg.num_experts;
  return dist::validate_layout(r);
}

namespace {

// Whether this rank of the grid holds spec s: its pipeline stage, and for replicas over
// data parallelism (experts: expert data parallelism) the first one.
bool holds(const ParamSpec& s, const dist::Grid& grid, const std::vector<int64_t>& first_layer,
           const GPTConfig& cfg) {
  const int stage = grid.pp().rank, last = grid.pp().size() - 1;
  switch (s.stage) {
    case ParamSpec::Stage::First:
      if (stage != 0) return false;
      break;
    case ParamSpec::Stage::Last:
      if (stage != last) return false;
      break;
    case ParamSpec::Stage::Layer:
      if (s.layer < first_layer[size_t(stage)] || s.layer >= first_layer[size_t(stage) + 1])
        return false;
      break;
  }
  if (!s.is_expert) return grid.dp().rank == 0 && (!s.router_state || grid.tp().rank == 0);
  const int64_t per_rank = cfg.num_experts / grid.ep().size();
  return grid.edp().rank == 0 && s.expert / per_rank == grid.ep().rank;
}

}  // namespace

void write_checkpoint_for_layout(const std::string& save_dir, int64_t iteration,
                                 const std::map<std::string, Tensor>& tensors, const GPTConfig& cfg,
                                 const dist::ValidatedLayout& layout,
                                 const std::string& run_metadata_json) {
  const std::vector<ParamSpec> specs = model_param_specs(cfg);
  std::set<std::string> expected;
  for (const ParamSpec& s : specs) {
    auto it = tensors.find(s.name);
    if (it == tensors.end()) fail("the converted model has no tensor '{}'", s.name);
    if (it->second.shape() != s.full_shape)
      fail("tensor '{}' is {}, the model's flags make it {}", s.name, shape_str(it->second.shape()),
           shape_str(s.full_shape));
    expected.insert(s.name);
    if (s.tp_split_dim < 0) continue;
    const int64_t size = s.is_expert ? layout.sizes.etp : layout.sizes.tp;
    const int64_t parts = (s.swiglu_halves ? 2 : 1) * size;
    if (s.full_shape[size_t(s.tp_split_dim)] % parts != 0)
      fail("tensor '{}' ({}) does not split into {} {}tensor-parallel slices{}", s.name,
           shape_str(s.full_shape), size, s.is_expert ? "expert-" : "",
           s.swiglu_halves ? " of each SwiGLU half" : "");
  }
  for (const auto& [name, t] : tensors)
    if (!expected.count(name))
      fail("tensor '{}' is not part of the model its flags describe", name);
  std::vector<int64_t> first_layer = {0};
  for (int64_t n : layout.layers_per_stage) first_layer.push_back(first_layer.back() + n);
  const int64_t world = layout.sizes.world;
  const std::string tmp = ckpt::begin_sharded_save(save_dir, iteration);
  std::vector<ckpt::RankShardRecord> records;
  for (int64_t rank = 0; rank < world; ++rank) {
    const dist::Grid grid(layout.sizes, world, int(rank));
    ModelParallel mp;
    mp.grid = &grid;
    std::vector<ckpt::ShardedPiece> pieces;
    for (const ParamSpec& s : specs) {
      if (!holds(s, grid, first_layer, cfg)) continue;
      const Tensor& full = tensors.at(s.name);
      if (s.router_state) {
        for (auto& piece : sharded_pieces("model." + s.name, nullptr, full, 0, mp))
          pieces.push_back(std::move(piece));
        continue;
      }
      const Param p = s.as_param();
      const Tensor slice = tensor_parallel_slice(full, p, mp);
      for (auto& piece : sharded_pieces("model." + s.name, &p, slice, 0, mp))
        pieces.push_back(std::move(piece));
    }
    records.push_back(ckpt::write_rank_shard(tmp, int(rank), pieces));
  }
  ckpt::commit_sharded_checkpoint(save_dir, iteration, tmp, records, run_metadata_json);
}

}  // namespace megaton
