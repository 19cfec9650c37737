// MoE all-gather token dispatcher (token_dispatcher.h): forward and backward.
#include <utility>

#include "core/error.h"
#include "model/token_dispatcher.h"
#include "model/token_dispatcher_detail.h"
#include "ops/ops.h"

namespace megaton {

using namespace token_dispatcher_detail;

MoEAllGatherTokenDispatcher::MoEAllGatherTokenDispatcher(int64_t num_experts,
                                                         const ModelParallel& mp)
    : MoETokenDispatcher(num_experts, mp) {}

namespace {
// x [n, ...] -> [size n, ...] gathered over g (x itself for a group of one).
Tensor gather_rows(const ModelParallel& mp, const Tensor& x, const dist::Group& g) {
  if (g.size() == 1) return x;
  Shape shape = x.shape();
  shape[0] *= g.size();
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  mp.comm->all_gather(x, out, g);
  return out;
}
// x [size n, ...] -> [n, ...]: the sum over g of block g.rank (x itself for a group of one).
Tensor reduce_scatter_blocks(const ModelParallel& mp, const Tensor& x, const dist::Group& g) {
  if (g.size() == 1) return x;
  Shape shape = x.shape();
  shape[0] /= g.size();
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  mp.comm->reduce_scatter(x, out, g);
  return out;
}
}  // namespace

Tensor MoEAllGatherTokenDispatcher::dispatch(const Tensor& x, const Tensor& probs,
                                             const Tensor& indices, Tensor& expert_probs,
                                             const Beside& beside) {
  run_beside(beside);  // no overlap (Beside)
  const dist::Group& g = mp_.group(dist::GroupKind::ExpertMP);
  saved_.tokens = x.dim(0);
  saved_.topk = indices.dim(1);
  const int64_t k = indices.dim(1), rows = g.size() * saved_.tokens * k;
  Tensor x_all = gather_rows(mp_, x, g);
  Tensor indices_all = gather_rows(mp_, indices, g);
  const Tensor probs_all = gather_rows(mp_, probs, g);
  // Every gathered copy is sorted by expert; the local experts' copies are one block. Group
  // E holds the copies dropped by capacity (index E), after every expert's: never local.
  Tensor permuted = empty_as(x, {rows, x.dim(1)});
  saved_.row_id_map = Tensor::empty({rows}, DType::I32, x.device());
  Tensor counts = Tensor::empty({num_experts_ + 1}, DType::I64, x.device());
  ops::moe_permute(x_all, indices_all, int(num_experts_ + 1), permuted, saved_.row_id_map, counts);
  // The gathered copies' probabilities in the same order ([G T k, 1]: copy c's is row c).
  Tensor permuted_probs = Tensor::empty({rows, 1}, DType::F32, x.device());
  ops::moe_permute_rows(probs_all.view({rows, 1}), saved_.row_id_map, 1, permuted_probs);
  if (device_counts_) {  // one expert rank, nothing dropped: all copies, counts on the device
    saved_.device_counts = counts.rows(0, num_experts_);
    saved_.first_row = 0;
    saved_.local_rows = rows;
    saved_.tokens_per_local_expert.clear();
    expert_probs = permuted_probs.view({rows});
    return permuted;
  }
  saved_.device_counts = Tensor();
  const std::vector<int64_t> host = host_i64(counts);
  saved_.first_row = std::accumulate(host.begin(), host.begin() + first_local_expert_, int64_t(0));
  saved_.tokens_per_local_expert.assign(host.begin() + first_local_expert_,
                                        host.begin() + first_local_expert_ + num_local_experts_);
  saved_.local_rows = sum_of(saved_.tokens_per_local_expert);
  if (saved_.local_rows == rows) {
    expert_probs = permuted_probs.view({rows});
    return permuted;
  }
  expert_probs =
      permuted_probs.rows(saved_.first_row, saved_.local_rows).clone().view({saved_.local_rows});
  return permuted.rows(saved_.first_row, saved_.local_rows).clone();
}

Tensor MoEAllGatherTokenDispatcher::scatter_local(const Tensor& local) const {
  const int64_t rows = saved_.row_id_map.dim(0);
  MEGATON_CHECK(local.dim(0) == saved_.local_rows,
                "MoE all-gather dispatcher: {} expert rows, {} routed", local.dim(0),
                saved_.local_rows);
  if (saved_.local_rows == rows) return local;
  Tensor all = Tensor::zeros({rows, local.dim(1)}, local.dtype(), local.device());
  if (saved_.local_rows > 0) all.rows(saved_.first_row, saved_.local_rows).copy_from(local);
  return all;
}

Tensor MoEAllGatherTokenDispatcher::combine(const Tensor& expert_out, const Beside& beside) {
  run_beside(beside);
  const dist::Group& g = mp_.group(dist::GroupKind::ExpertMP);
  // Copies of other ranks' experts contribute zeros here; the reduce-scatter adds them in.
  const Tensor expert_out_all = scatter_local(expert_out);
  Tensor out_all = empty_as(expert_out, {g.size() * saved_.tokens, expert_out.dim(1)});
  // Unweighted: the experts applied the probabilities (Megatron's unpermute without probs).
  ops::moe_permute_backward(expert_out_all, saved_.row_id_map, int(saved_.topk), out_all);
  return reduce_scatter_blocks(mp_, out_all, g);
}

Tensor MoEAllGatherTokenDispatcher::combine_backward(const Tensor& dout, const Beside& beside) {
  run_beside(beside);
  const dist::Group& g = mp_.group(dist::GroupKind::ExpertMP);
  const int64_t rows = saved_.row_id_map.dim(0);
  Tensor dout_all = gather_rows(mp_, dout, g);
  Tensor dexpert_out_all = empty_as(dout, {rows, dout.dim(1)});
  ops::moe_permute_rows(dout_all, saved_.row_id_map, int(saved_.topk), dexpert_out_all);
  if (saved_.local_rows == rows) return dexpert_out_all;
  return dexpert_out_all.rows(saved_.first_row, saved_.local_rows).clone();
}

Tensor MoEAllGatherTokenDispatcher::probs_backward(const Tensor& dexpert_probs) {
  const dist::Group& g = mp_.group(dist::GroupKind::ExpertMP);
  const int64_t rows = saved_.row_id_map.dim(0);
  const Tensor dpermuted = scatter_local(dexpert_probs.view({dexpert_probs.numel(), 1}));
  Tensor dprobs_all =
      Tensor::empty({g.size() * saved_.tokens, saved_.topk}, DType::F32, dexpert_probs.device());
  Tensor dprobs_by_copy = dprobs_all.view({rows, 1});
  ops::moe_permute_backward(dpermuted, saved_.row_id_map, 1, dprobs_by_copy);
  // A copy's gradient is nonzero only on the ranks of its expert (partial sums under etp):
  // the sum over the group, each rank's block.
  return reduce_scatter_blocks(mp_, dprobs_all, g);
}

Tensor MoEAllGatherTokenDispatcher::dispatch_backward(const Tensor& dexpert_in,
                                                      const Beside& beside) {
  run_beside(beside);
  const dist::Group& g = mp_.group(dist::GroupKind::ExpertMP);
  const int64_t k = saved_.topk;
  Tensor dpermuted = scatter_local(dexpert_in);
  Tensor dx_all = empty_as(dexpert_in, {g.size() * saved_.tokens, dexpert_in.dim(1)});
  ops::moe_permute_backward(dpermuted, saved_.row_id_map, int(k), dx_all);
  saved_ = {};  // the micro-batch's routing is used up
  return reduce_scatter_blocks(mp_, dx_all, g);
}

std::any MoEAllGatherTokenDispatcher::take_saved() { return std::exchange(saved_, {}); }

void MoEAllGatherTokenDispatcher::restore_saved(std::any&& saved) {
  saved_ = std::move(saved_of<Saved>(saved, "all-gather"));
}

void MoEAllGatherTokenDispatcher::for_each_saved_tensor(
    std::any& saved, const std::function<void(Tensor&)>& fn) const {
  Saved& s = saved_of<Saved>(saved, "all-gather");
  for (Tensor* slot : {&s.device_counts, &s.row_id_map}) fn(*slot);
}

}  // namespace megaton
