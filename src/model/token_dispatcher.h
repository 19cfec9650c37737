// MoE token dispatchers: route token copies to the ranks that hold their experts and back
// (Megatron's MoEAlltoAllTokenDispatcher and MoEAllGatherTokenDispatcher).
//
// Vocabulary: T = this rank's tokens (under sequence parallelism, its sequence shard), H =
// hidden size, k = router top-k, E = experts in the layer, L = E / ep local experts of this
// rank (global indices ep_rank * L .. ep_rank * L + L - 1). A "copy" is one (token, choice)
// pair, T * k per rank. The expert input ("dispatched" rows) holds every copy, from any rank,
// routed to one of this rank's local experts, grouped by local expert in expert order; under
// expert tensor parallelism (etp > 1) it also holds the copies of the other ranks of this
// rank's ETP group, since each of them computes only a slice of the expert.
//
// Token dropping: a copy the router dropped by capacity has index E (router.h) and
// probability 0. It is permuted into an extra group E, sorted after every expert's, and
// goes to no expert: it is not exchanged, not counted in tokens_per_local_expert() and not
// computed, so the expert input holds the kept copies only. In combine its expert output is
// a zero row, and in backward its gradients are zero. Without dropping the extra group is
// empty and the results are those of a dispatch over E groups.
//
// Routing probabilities travel with the copies (Megatron's dispatchers permute and send the
// probs alongside the hidden states): dispatch hands the experts each row's probability,
// which they apply after their activation (MoELayer, Megatron's TEGroupedMLP), and combine
// adds the experts' outputs unweighted, keeping nothing for backward but its index map.
// The probabilities' gradient comes back from the experts by row and returns to [T, k]
// order the way the rows came (probs_backward).
//
// Each dispatcher runs one micro-batch at a time: dispatch, combine, then in backward
// combine_backward, probs_backward and dispatch_backward, all with the state the forward
// calls saved (its
// `Saved saved_`, which take_saved / restore_saved move out and back so a pipeline can keep
// several micro-batches in flight). Every rank of the expert groups must make the same calls
// in the same order, also when none of its local experts receives a copy (its expert input
// then has 0 rows).
#pragma once
#include <any>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/parallel.h"

namespace megaton {

class MoETokenDispatcher {
 public:
  // Work to run while the token rows' exchange of a call is in flight (Megatron's
  // --moe-shared-expert-overlap: the shared expert's halves beside dispatch and combine,
  // and beside their backward exchanges). dispatch, combine, combine_backward and
  // dispatch_backward given one start that exchange asynchronously (Comm's *_async: on the
  // GPU over the expert group's communication stream), call it on the compute stream, then
  // wait; the results are those of the call without it. It is called exactly once, also
  // when there is nothing to exchange (one expert rank), and must not touch the call's
  // tensors. The all-gather dispatcher calls it first, without overlap.
  using Beside = std::function<void()>;

  MoETokenDispatcher(int64_t num_experts, const ModelParallel& mp);
  virtual ~MoETokenDispatcher() = default;

  // x [T, H] (compute dtype), probs [T, k] fp32, indices [T, k] int32 global expert ids in
  // [0, E], E marking a dropped copy (whose probability must be 0), all on the model's
  // device. Returns the expert input [R, H] (x's dtype): rows grouped by local expert,
  // tokens_per_local_expert()[l] rows for local expert l, R their sum; writes expert_probs
  // [R] fp32 (allocated here), the probability of each of those rows' copies. Saves the
  // routing for the other calls. Collective over the expert groups (ep, etp).
  virtual Tensor dispatch(const Tensor& x, const Tensor& probs, const Tensor& indices,
                          Tensor& expert_probs, const Beside& beside = {}) = 0;
  // expert_out [R, H] (the expert output of the dispatched rows, already weighted by their
  // probabilities; with etp > 1 this rank's partial sum, its slice of the row-parallel fc2)
  // -> out [T, H]: out[t] = sum_j (expert output of copy (t, j), summed over ETP), added in
  // j order. Keeps nothing for backward beyond dispatch's index map.
  virtual Tensor combine(const Tensor& expert_out, const Beside& beside = {}) = 0;
  // dout [T, H] (gradient of combine's output) -> gradient of expert_out [R, H]: each row
  // its token's dout.
  virtual Tensor combine_backward(const Tensor& dout, const Beside& beside = {}) = 0;
  // dexpert_probs [R] fp32 (gradient of dispatch's expert_probs; with etp > 1 this rank's
  // partial sums, which are summed over ETP here) -> dprobs [T, k] fp32 (gradient of
  // dispatch's probs; 0 for a dropped copy). Between combine_backward and
  // dispatch_backward. Collective over the expert groups.
  virtual Tensor probs_backward(const Tensor& dexpert_probs) = 0;
  // dexpert_in [R, H] (gradient of dispatch's result; with etp > 1 this rank's partial
  // sum) -> dx [T, H] (gradient of dispatch's x, without the router's part).
  virtual Tensor dispatch_backward(const Tensor& dexpert_in, const Beside& beside = {}) = 0;
  // A new uninitialised tensor (`shape`, `dtype`, on `device`) for rows that the next
  // exchange sends: from the MoE layer, combine's expert_out or dispatch_backward's
  // dexpert_in [R, H], handed over whole and unchanged in size. A dispatcher whose exchange
  // reads its input in place (Comm::pull_input) returns that buffer; here, Tensor::empty.
  // Collective over the expert groups like the calls themselves.
  virtual Tensor new_exchanged_rows(const Shape& shape, DType dtype, Device device);

  // Rows of the last dispatch for each local expert [L] (host counts; kept copies only).
  // Empty when the counts stay on the device (below).
  virtual const std::vector<int64_t>& tokens_per_local_expert() const = 0;
  // Device counts: with one rank in the expert-model-parallel group (ep x etp = 1) and no
  // copy dropped by capacity (no index E), dispatch can leave the counts where
  // moe_permute writes them, on the device, with no host synchronization: the expert
  // input is then all T k copies, and tokens_per_local_expert_device() [L] int64 holds
  // the rows per local expert (tokens_per_local_expert() is empty). The MoE layer turns
  // it on when its experts take device counts (MoELayer). InternalError when asked with
  // more than one expert rank.
  void set_device_counts(bool on);
  bool device_counts() const { return device_counts_; }
  virtual const Tensor& tokens_per_local_expert_device() const = 0;
  int64_t num_local_experts() const { return num_local_experts_; }
  // Global index of local expert 0.
  int64_t first_local_expert() const { return first_local_expert_; }

  // Moves the state the forward calls saved (this dispatcher's Saved, opaque to the
  // caller) out, leaving none, and back in. restore_saved throws InternalError on a state
  // another kind of dispatcher took.
  virtual std::any take_saved() = 0;
  virtual void restore_saved(std::any&& saved) = 0;
  // Calls fn on each tensor slot of a state taken by take_saved from a dispatcher of this
  // kind (defined or not, in a fixed order; model/saved_tensors.h), so the MoE layer can
  // offer it to activation offloading without knowing its layout. InternalError on
  // another kind's state.
  virtual void for_each_saved_tensor(std::any& saved,
                                     const std::function<void(Tensor&)>& fn) const = 0;

 protected:
  int64_t num_experts_, num_local_experts_, first_local_expert_;
  ModelParallel mp_;
  bool device_counts_ = false;
};

// Megatron's MoEAlltoAllTokenDispatcher: permute the local copies by global expert, exchange
// the per-(rank, expert) counts over the expert-model-parallel group (etp x ep), send each
// EP rank the copies of its experts (uneven all-to-all over ep), all-gather them over etp
// when etp > 1, and regroup the received chunks (ordered by ETP member, EP member, local
// expert) by local expert. combine and the backward run the exact reverse (chunks ungrouped,
// reduce-scatter over etp, the all-to-all back, unpermute: a sum over each token's copies).
// The probabilities take the same way as [rows, 1] fp32 tensors, always through the
// all-to-all (a pulling exchange reads only its rows' buffer). Dropped copies (the last rows
// of the permuted order) are left out of every exchange.
// With etp 1 the exchange may instead pull (mp.alltoall_exchange; by default where the EP
// group has peer memory): each rank reads the chunks of its experts out of the other
// ranks' permuted copies straight into expert order, and back (Comm::pull_rows), so there
// is no regrouping copy.
class MoEAlltoAllTokenDispatcher : public MoETokenDispatcher {
 public:
  MoEAlltoAllTokenDispatcher(int64_t num_experts, const ModelParallel& mp);
  Tensor dispatch(const Tensor& x, const Tensor& probs, const Tensor& indices, Tensor& expert_probs,
                  const Beside& beside = {}) override;
  Tensor combine(const Tensor& expert_out, const Beside& beside = {}) override;
  Tensor combine_backward(const Tensor& dout, const Beside& beside = {}) override;
  Tensor probs_backward(const Tensor& dexpert_probs) override;
  Tensor dispatch_backward(const Tensor& dexpert_in, const Beside& beside = {}) override;
  // When pulling: the slot of Comm::pull_input, which the exchange reads in place (also
  // used here for the rows that dispatch and combine_backward send).
  Tensor new_exchanged_rows(const Shape& shape, DType dtype, Device device) override;
  const std::vector<int64_t>& tokens_per_local_expert() const override {
    return saved_.tokens_per_local_expert;
  }
  const Tensor& tokens_per_local_expert_device() const override { return saved_.device_counts; }
  std::any take_saved() override;
  void restore_saved(std::any&& saved) override;
  void for_each_saved_tensor(std::any& saved,
                             const std::function<void(Tensor&)>& fn) const override;

  struct Saved {
    int64_t tokens = 0, topk = 0;  // T, k
    Tensor row_id_map;             // [T k] int32 (moe_permute's map)
    Tensor device_counts;          // [L] int64 on the device (device counts only)
    // When pulling (etp 1, ep > 1; empty otherwise), the transfers of each direction:
    // to_experts_runs fill the expert input (chunk (EP member i, local expert l) from the
    // kept copies of member i), from_experts_runs fill this rank's kept copies (chunk
    // (member i, its local expert l) from member i's expert rows).
    std::vector<dist::PullRun> to_experts_runs, from_experts_runs;
    bool pull = false;  // whether this micro-batch's exchanges pull (the runs above)
    // Per EP member: rows sent / received (kept copies; their sum sent: the kept copies).
    std::vector<int64_t> send_rows, recv_rows;
    std::vector<int64_t> etp_rows;  // per ETP member: rows after the all-to-all
    // Chunk (etp member t, ep member i, local expert l) has chunk_rows[(t ep + i) L + l] rows.
    std::vector<int64_t> chunk_rows;
    std::vector<int64_t> tokens_per_local_expert;  // [L]
  };

 private:
  // The kept local copies sorted by global expert [sum(send_rows), H] -> the expert input
  // [R, H] (all-to-all over ep, all-gather over etp, chunks grouped by local expert), and
  // back (chunks ungrouped, sum over etp, all-to-all back) to all local copies [T k, H],
  // the dropped ones' rows zeros, with the counts of the last dispatch. pull: by the pulling
  // exchange (rows in Comm::pull_input's buffer), else all-to-all and regrouping. beside
  // (Beside above): run while the rows are exchanged.
  Tensor to_experts(const Tensor& permuted, bool pull, const Beside& beside = {}) const;
  Tensor from_experts(const Tensor& rows, bool pull, const Beside& beside = {}) const;
  // The gradient of all local copies [T k, H] -> dx [T, H]; ends the micro-batch's routing.
  Tensor permute_backward(const Tensor& dpermuted);
  // A new [T k, H] buffer (like's dtype and device) for rows by local copy, the kept
  // copies' rows (the first sum(send_rows)) uninitialised, the dropped copies' zero.
  Tensor local_copies_buffer(const Tensor& like) const;

  // Whether the exchanges pull (mp.alltoall_exchange resolved at the first dispatch, when
  // Auto asks the Comm collectively whether the EP group has peer memory).
  bool pulls();

  Saved saved_;
  int pulls_ = -1;  // pulls(): -1 until resolved, then 0 or 1
};

// Megatron's MoEAllGatherTokenDispatcher: all-gather the tokens and their routing over the
// expert-model-parallel group (etp x ep), keep the copies routed to the local experts (and
// their probabilities), and after the experts scatter their outputs back to the gathered
// token rows and reduce-scatter them (a sum) to each rank's tokens. Dropped copies are no
// local expert's: they get zero rows like the other ranks' copies.
class MoEAllGatherTokenDispatcher : public MoETokenDispatcher {
 public:
  MoEAllGatherTokenDispatcher(int64_t num_experts, const ModelParallel& mp);
  Tensor dispatch(const Tensor& x, const Tensor& probs, const Tensor& indices, Tensor& expert_probs,
                  const Beside& beside = {}) override;
  Tensor combine(const Tensor& expert_out, const Beside& beside = {}) override;
  Tensor combine_backward(const Tensor& dout, const Beside& beside = {}) override;
  Tensor probs_backward(const Tensor& dexpert_probs) override;
  Tensor dispatch_backward(const Tensor& dexpert_in, const Beside& beside = {}) override;
  const std::vector<int64_t>& tokens_per_local_expert() const override {
    return saved_.tokens_per_local_expert;
  }
  const Tensor& tokens_per_local_expert_device() const override { return saved_.device_counts; }
  std::any take_saved() override;
  void restore_saved(std::any&& saved) override;
  void for_each_saved_tensor(std::any& saved,
                             const std::function<void(Tensor&)>& fn) const override;

  struct Saved {
    int64_t tokens = 0, topk = 0;  // T of this rank, k
    Tensor device_counts;          // [L] int64 on the device (device counts only)
    // The local experts' copies are rows [first_row, first_row + local_rows) of the
    // gathered copies sorted by expert.
    int64_t first_row = 0, local_rows = 0;
    Tensor row_id_map;  // [G T k] int32 (moe_permute's map of the gathered copies)
    std::vector<int64_t> tokens_per_local_expert;  // [L]
  };

 private:
  // [G T k, W] with `rows` [local rows, W] at the local experts' copies and zeros elsewhere
  // (rows itself when the local experts are all experts).
  Tensor scatter_local(const Tensor& rows) const;

  Saved saved_;
};

// MEGATON_MOE_ALLTOALL_EXCHANGE: unset, "" or "auto" Auto, "regroup" Regroup, "pull" Pull.
// Throws megaton::Error naming the variable for any other value.
AlltoAllExchange alltoall_exchange_from_env();

// What the all-to-all dispatcher's exchange will be under mp, in words, e.g. "NCCL
// all-to-all over 4 EP ranks, chunks regrouped by local expert" (the flex dispatcher's
// notice).
// Collective over mp's EP group the first time (Comm::peer_memory).
std::string describe_alltoall_exchange(const ModelParallel& mp);

// The dispatcher mp.dispatcher names, for a layer of num_experts experts (divisible by ep).
std::unique_ptr<MoETokenDispatcher> make_token_dispatcher(int64_t num_experts,
                                                          const ModelParallel& mp);

}  // namespace megaton
