// Grid: Megatron's parallel_state. World ranks -> tensor, context, data, pipeline and
// expert parallel groups, and the checks that reject impossible layouts.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace megaton::dist {

// Parallel sizes of a run, named as Megatron's flags: tp = --tensor-model-parallel-size,
// cp = --context-parallel-size, ep = --expert-model-parallel-size, etp =
// --expert-tensor-parallel-size, pp = --pipeline-model-parallel-size, vpp = model chunks
// per pipeline rank (interleaved schedule). dp, edp and world are derived by
// resolve_parallel_sizes.
struct ParallelSizes {
  int64_t tp = 1;
  int64_t cp = 1;
  int64_t ep = 1;
  int64_t etp = 0;  // 0: tp (Megatron's default)
  int64_t pp = 1;
  std::optional<int64_t> vpp;  // unset: no interleaving

  // Derived.
  int64_t world = 0;
  int64_t dp = 0;   // world / (tp x cp x pp)
  int64_t edp = 0;  // world / (etp x ep x pp)
};

// Fills etp (when 0), world, dp and edp. Throws megaton::Error with one line naming the
// clashing numbers when a size is not positive or world_size is not divisible by
// tp x cp x pp or by etp x ep x pp, e.g. "world size (6) is not divisible by
// tensor-model-parallel-size (4) x context-parallel-size (1) x
// pipeline-model-parallel-size (1) = 4".
ParallelSizes resolve_parallel_sizes(ParallelSizes sizes, int64_t world_size);

// Everything the layout checks need: the flags and the few model numbers they divide.
// Optional layer counts use 0 for "not set".
struct LayoutRequest {
  ParallelSizes sizes;  // tp, cp, ep, etp, pp as given (vpp is derived here)
  int64_t world_size = 1;
  bool sequence_parallel = false;
  int64_t num_layers_per_virtual_pipeline_stage = 0;  // 0: no interleaving
  int64_t decoder_first_pipeline_num_layers = 0;      // 0: an even share
  int64_t decoder_last_pipeline_num_layers = 0;       // 0: an even share
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;  // = num_attention_heads without grouped-query attention
  int64_t num_experts = 0;       // 0: dense model
  // A hybrid pattern's '|' segments (layers of each; GPTConfig::hybrid_segment_layers):
  // with more than one and pp > 1, segment i is pipeline stage i (Megatron's explicit
  // pipeline layout). Empty, one, or pp 1 (the whole model on one stage): num_layers is
  // split as above.
  std::vector<int64_t> pipeline_segment_layers;
};

struct ValidatedLayout {
  ParallelSizes sizes;                    // resolved (etp, world, dp, edp, vpp)
  bool sequence_parallel = false;         // turned off when tp == 1
  std::vector<int64_t> layers_per_stage;  // transformer layers of each pipeline stage [pp]
  std::vector<std::string> warnings;      // one line each, for rank 0 to print
};

// Megatron's layout checks (arguments.py, TransformerConfig), run before anything is
// allocated. Throws megaton::Error with one line naming the clashing numbers when:
// - a size is not positive, or the world is not divisible (resolve_parallel_sizes);
// - num-experts is not divisible by expert-model-parallel-size, or ep > 1 on a dense model;
// - num-attention-heads or num-query-groups is not divisible by tensor-model-parallel-size;
// - num-layers cannot be split among the pipeline stages (with the first/last stage
//   overrides), or a stage's layers among num-layers-per-virtual-pipeline-stage chunks;
// - a hybrid pattern's '|' segments are not one per pipeline stage, or come with the
//   first/last stage overrides or virtual pipeline stages (Megatron refuses those too;
//   its several segments per stage, flexible VPP, are not supported);
// - MoE with ep > 1 and tp > 1 without sequence-parallel (Megatron requires it).
// --sequence-parallel with tp == 1 is turned off with a warning, as Megatron does.
ValidatedLayout validate_layout(const LayoutRequest& request);

// The process groups a rank belongs to. Dense layers use Megatron's order tp-cp-ep-dp-pp
// with ep folded to 1; expert layers the grid etp-ep-edp-pp. tp (etp) varies fastest.
enum class GroupKind {
  World,
  TP,         // tensor parallel
  CP,         // context parallel
  DP,         // data parallel (without cp)
  PP,         // pipeline parallel
  DP_CP,      // data x context parallel: gradient reduction of dense parameters
  TP_CP,      // tensor x context parallel: MoE aux-loss token counts
  TP_DP_CP,   // tensor x data x context: expert-bias token counts, global aux loss
  MP,         // model parallel: tensor x pipeline
  Embedding,  // first and last pipeline stage (tied embedding gradients)
  EP,         // expert parallel
  ETP,        // expert tensor parallel
  EDP,        // expert data parallel: gradient reduction of expert parameters
  ExpertMP,   // expert model parallel: etp x ep
};
inline constexpr int kNumGroupKinds = 14;

// Short lower-case name used in messages and logs: "tp", "dp_cp", "expert_mp", ...
const char* group_kind_name(GroupKind kind);

// One process group: its world ranks in ascending order and this rank's index in them.
// A rank outside every group of a kind (the embedding group of a middle pipeline stage)
// gets an empty Group with rank -1.
struct Group {
  std::string name;
  std::vector<int> ranks;  // world ranks, ascending
  int rank = -1;           // index of this process in `ranks`; -1: not a member

  int size() const { return static_cast<int>(ranks.size()); }
  bool is_member() const { return rank >= 0; }
  // "dp (ranks 0,2)"; long lists are shortened to their first and last ranks.
  std::string describe() const;
};

class Grid {
 public:
  // sizes: as for resolve_parallel_sizes (called here, so it throws the same errors);
  // world_rank in [0, world_size).
  Grid(const ParallelSizes& sizes, int64_t world_size, int world_rank);

  const ParallelSizes& sizes() const { return sizes_; }
  int world_size() const { return static_cast<int>(sizes_.world); }
  int world_rank() const { return world_rank_; }

  const Group& group(GroupKind kind) const { return groups_[static_cast<int>(kind)]; }
  const Group& world() const { return group(GroupKind::World); }
  const Group& tp() const { return group(GroupKind::TP); }
  const Group& cp() const { return group(GroupKind::CP); }
  const Group& dp() const { return group(GroupKind::DP); }
  const Group& pp() const { return group(GroupKind::PP); }
  const Group& dp_cp() const { return group(GroupKind::DP_CP); }
  const Group& tp_cp() const { return group(GroupKind::TP_CP); }
  const Group& tp_dp_cp() const { return group(GroupKind::TP_DP_CP); }
  const Group& mp() const { return group(GroupKind::MP); }
  const Group& embedding() const { return group(GroupKind::Embedding); }
  const Group& ep() const { return group(GroupKind::EP); }
  const Group& etp() const { return group(GroupKind::ETP); }
  const Group& edp() const { return group(GroupKind::EDP); }
  const Group& expert_mp() const { return group(GroupKind::ExpertMP); }
  const std::vector<Group>& groups() const { return groups_; }  // indexed by GroupKind

  bool is_pipeline_first_stage() const { return pp().rank == 0; }
  bool is_pipeline_last_stage() const { return pp().rank == pp().size() - 1; }

  // The grid of this process, set once after validation. current() throws
  // InternalError when none was set.
  static const Grid& current();
  static void set_current(const Grid& grid);

 private:
  ParallelSizes sizes_;
  int world_rank_ = 0;
  std::vector<Group> groups_;
};

}  // namespace megaton::dist
