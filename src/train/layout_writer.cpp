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
  r.pipeline_segment_layers = cfg.hybrid_segment_layers;
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
  TensorSource source;
  for (const auto& [name, t] : tensors) source.names.push_back(name);
  source.make = [&tensors](const std::string& name) { return tensors.at(name); };
  write_checkpoint_for_layout(save_dir, iteration, source, cfg, layout, run_metadata_json);
}

void write_checkpoint_for_layout(const std::string& save_dir, int64_t iteration,
                                 const TensorSource& tensors, const GPTConfig& cfg,
                                 const dist::ValidatedLayout& layout,
                                 const std::string& run_metadata_json) {
  const std::vector<ParamSpec> specs = model_param_specs(cfg);
  const std::set<std::string> available(tensors.names.begin(), tensors.names.end());
  std::set<std::string> expected;
  for (const ParamSpec& s : specs) {
    if (!available.count(s.name)) fail("the converted model has no tensor '{}'", s.name);
    expected.insert(s.name);
    if (s.tp_split_dim < 0) continue;
    const int64_t size = s.is_expert ? layout.sizes.etp : layout.sizes.tp;
    bool splits = s.full_shape[size_t(s.tp_split_dim)] % size == 0;
    for (int64_t block : s.tp_blocks) splits = splits && block % size == 0;
    if (!splits)
      fail("tensor '{}' ({}) does not split into {} {}tensor-parallel slices{}", s.name,
           shape_str(s.full_shape), size, s.is_expert ? "expert-" : "",
           s.tp_blocks.empty() ? "" : " of each stacked block");
  }
  for (const std::string& name : tensors.names)
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
    // This rank's slice of the tensor last made: the pieces of one tensor are consecutive.
    std::string held_name;
    Tensor held;
    auto slice_of = [&](const ParamSpec& s) -> const Tensor& {
      if (held_name == s.name) return held;
      held = Tensor();
      // The caching host allocator would keep every size it saw: give the last tensor's
      // blocks back, so the writer holds one tensor at a time (it is not a training loop).
      empty_host_cache();
      Tensor full = tensors.make(s.name);
      if (full.shape() != s.full_shape)
        fail("tensor '{}' is {}, the model's flags make it {}", s.name, shape_str(full.shape()),
             shape_str(s.full_shape));
      held = s.router_state ? full : tensor_parallel_slice(full, s.as_param(), mp);
      held = held.view({held.numel()});
      held_name = s.name;
      return held;
    };
    std::vector<ckpt::ShardedPiece> pieces;
    for (const ParamSpec& s : specs) {
      if (!holds(s, grid, first_layer, cfg)) continue;
      const std::vector<int64_t> full(s.full_shape.begin(), s.full_shape.end());
      std::vector<SliceBox> boxes;
      if (s.router_state) {
        boxes.push_back({std::vector<int64_t>(full.size(), 0), full});
      } else {
        const Param p = s.as_param();
        // A replicated tensor is written by tensor-parallel rank 0 of its group.
        if (p.tp_split_dim < 0 && tensor_parallel_group(p, mp).rank != 0) continue;
        boxes = tensor_parallel_boxes(p, mp);
      }
      int64_t start = 0;  // the box's first element in the slice
      for (const SliceBox& b : boxes) {
        int64_t numel = 1;
        for (int64_t d : b.shape) numel *= d;
        ckpt::ShardedPiece piece;
        piece.name = "model." + s.name;
        piece.global_shape = full;
        piece.offsets = b.offsets;
        piece.box_shape = b.shape;
        piece.dtype = DType::F32;
        piece.produce = [&slice_of, &s, start, numel] {
          return slice_of(s).rows(start, numel).to(DType::F32);
        };
        pieces.push_back(std::move(piece));
        start += numel;
      }
    }
    records.push_back(ckpt::write_rank_shard(tmp, int(rank), pieces));
  }
  ckpt::commit_sharded_checkpoint(save_dir, iteration, tmp, records, run_metadata_json);
}

}  // namespace megaton
