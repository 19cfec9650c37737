// MoE token dispatchers: the base, the all-to-all dispatcher, forward and backward (the
// all-gather one: token_dispatcher_allgather.cpp).
#include "model/token_dispatcher.h"

#include <cstdlib>
#include <numeric>
#include <span>
#include <string>
#include <utility>

#include "core/error.h"
#include "model/token_dispatcher_detail.h"
#include "ops/ops.h"

namespace megaton {

using namespace token_dispatcher_detail;

namespace {

std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

// Uneven all-gather of rows over g: x [rows[g.rank], H] -> [sum(rows), H], member m's rows
// in member order (Megatron's gather_from_sequence_parallel_region with output splits).
// Comm's all_gather needs equal chunks, so this is an all-to-all sending x to every member.
Tensor all_gather_rows(dist::Comm& comm, const Tensor& x, const std::vector<int64_t>& rows,
                       const dist::Group& g) {
  const int64_t mine = x.dim(0), width = x.dim(1), n = g.size();
  MEGATON_CHECK(rows[g.rank] == mine, "all_gather_rows: {} rows, the counts say {}", mine,
                rows[g.rank]);
  Tensor send = Tensor::empty({n * mine, width}, x.dtype(), x.device());
  for (int64_t m = 0; m < n; ++m) send.rows(m * mine, mine).copy_from(x);
  Tensor out = Tensor::empty({sum_of(rows), width}, x.dtype(), x.device());
  comm.all_to_allv(send, std::vector<int64_t>(n, mine * width), out, times(rows, width), g);
  return out;
}

// Uneven reduce-scatter of rows over g: x [sum(rows), H] (member m's block of rows[m] rows in
// member order) -> [rows[g.rank], H], the sum over members of their block g.rank, added in
// member order (Megatron's reduce_scatter_to_sequence_parallel_region with input splits).
Tensor reduce_scatter_rows(dist::Comm& comm, const Tensor& x, const std::vector<int64_t>& rows,
                           const dist::Group& g) {
  const int64_t mine = rows[g.rank], width = x.dim(1), n = g.size();
  Tensor recv = Tensor::empty({n * mine, width}, x.dtype(), x.device());
  comm.all_to_allv(x, times(rows, width), recv, std::vector<int64_t>(n, mine * width), g);
  Tensor out = recv.rows(0, mine).clone();
  if (mine > 0)
    for (int64_t m = 1; m < n; ++m) ops::add_(out, recv.rows(m * mine, mine));
  return out;
}

// Rows of src regrouped by chunks: src is chunks of chunk_rows[c] rows in chunk order; the
// result holds chunks order[0], order[1], ... (Megatron's sort_chunks_by_idxs).
Tensor reorder_chunks(const Tensor& src, const std::vector<int64_t>& chunk_rows,
                      const std::vector<int64_t>& order) {
  Tensor out = Tensor::empty(src.shape(), src.dtype(), src.device());
  ops::moe_sort_chunks(src, chunk_rows, order, out);
  return out;
}

// The exchanges with their beside work (MoETokenDispatcher::Beside): without beside the
// blocking call; with it the call started, beside run meanwhile, then waited for.
void all_to_allv_beside(const MoETokenDispatcher::Beside& beside, dist::Comm& comm,
                        const Tensor& in, const std::vector<int64_t>& send, Tensor& out,
                        const std::vector<int64_t>& recv, const dist::Group& g) {
  if (!beside) return comm.all_to_allv(in, send, out, recv, g);
  const std::unique_ptr<dist::CommWork> work = comm.all_to_allv_async(in, send, out, recv, g);
  beside();
  work->wait();
}

void pull_rows_beside(const MoETokenDispatcher::Beside& beside, dist::Comm& comm, const Tensor& in,
                      std::span<const dist::PullRun> runs, Tensor& out, const dist::Group& g) {
  if (!beside) return comm.pull_rows(in, runs, out, g);
  const std::unique_ptr<dist::CommWork> work = comm.pull_rows_async(in, runs, out, g);
  beside();
  work->wait();
}

}  // namespace

MoETokenDispatcher::MoETokenDispatcher(int64_t num_experts, const ModelParallel& mp)
    : num_experts_(num_experts), mp_(mp) {
  const int ep = mp.ep_size();
  MEGATON_CHECK(num_experts > 0 && num_experts % ep == 0,
                "MoE token dispatcher: {} experts over expert-model-parallel size {}", num_experts,
                ep);
  num_local_experts_ = num_experts / ep;
  first_local_expert_ = int64_t(mp.ep_rank()) * num_local_experts_;
  // The expert-model-parallel group (etp x ep) lists its ranks with etp varying fastest:
  // member etp_rank + etp * ep_rank (the counts exchange relies on it).
  const dist::Group& expert_mp = mp.group(dist::GroupKind::ExpertMP);
  MEGATON_CHECK(expert_mp.size() == mp.etp_size() * ep &&
                    expert_mp.rank == mp.etp_rank() + mp.etp_size() * mp.ep_rank(),
                "expert-model-parallel group {} does not match etp {} x ep {} (ranks {}, {})",
                expert_mp.describe(), mp.etp_size(), ep, mp.etp_rank(), mp.ep_rank());
  MEGATON_CHECK(expert_mp.size() == 1 || mp.comm != nullptr,
                "MoE token dispatcher: {} expert ranks but no Comm", expert_mp.size());
}

Tensor MoETokenDispatcher::new_exchanged_rows(const Shape& shape, DType dtype, Device device) {
  return Tensor::empty(shape, dtype, device);
}

void MoETokenDispatcher::set_device_counts(bool on) {
  MEGATON_CHECK(!on || mp_.group(dist::GroupKind::ExpertMP).size() == 1,
                "MoE token dispatcher: device counts need one expert rank, the group has {}",
                mp_.group(dist::GroupKind::ExpertMP).size());
  device_counts_ = on;
}

// ---- all-to-all ----

MoEAlltoAllTokenDispatcher::MoEAlltoAllTokenDispatcher(int64_t num_experts, const ModelParallel& mp)
    : MoETokenDispatcher(num_experts, mp) {}

Tensor MoEAlltoAllTokenDispatcher::dispatch(const Tensor& x, const Tensor& probs,
                                            const Tensor& indices, Tensor& expert_probs,
                                            const Beside& beside) {
  const int64_t tokens = x.dim(0), hidden = x.dim(1), k = indices.dim(1);
  const int64_t E = num_experts_, L = num_local_experts_;
  const int ep = mp_.ep_size(), etp = mp_.etp_size();
  const int ep_rank = mp_.ep_rank(), etp_rank = mp_.etp_rank();
  saved_.tokens = tokens;
  saved_.topk = k;
  saved_.pull = ep > 1 && etp == 1 && pulls();
  // When pulling, moe_permute writes straight into the buffer the other ranks read (as do
  // combine's and the backward's producers: new_exchanged_rows).
  Tensor permuted = new_exchanged_rows({tokens * k, hidden}, x.dtype(), x.device());
  saved_.row_id_map = Tensor::empty({tokens * k}, DType::I32, x.device());
  // Group E holds the copies dropped by capacity (index E): sorted after every expert's,
  // neither counted nor sent.
  Tensor counts = Tensor::empty({E + 1}, DType::I64, x.device());
  ops::moe_permute(x, indices, int(E + 1), permuted, saved_.row_id_map, counts);
  // The copies' probabilities in the same order (probs viewed [T k, 1]: copy c's is row c).
  Tensor permuted_probs = Tensor::empty({tokens * k, 1}, DType::F32, x.device());
  ops::moe_permute_rows(probs.view({tokens * k, 1}), saved_.row_id_map, 1, permuted_probs);
  const Tensor expert_counts = counts.rows(0, E);
  if (device_counts_) {
    expert_probs = permuted_probs.view({tokens * k});
    // One expert rank, nothing dropped: every copy is kept and stays where moe_permute
    // put it; the counts stay on the device.
    saved_.device_counts = expert_counts;
    saved_.send_rows = saved_.recv_rows = saved_.etp_rows = {tokens * k};
    saved_.chunk_rows.clear();
    saved_.tokens_per_local_expert.clear();
    saved_.to_experts_runs.clear();
    saved_.from_experts_runs.clear();
    run_beside(beside);
    return permuted;
  }
  saved_.device_counts = Tensor();

  // Every member's copies per global expert: counts_all[m * E + e], member m = etp rank +
  // etp * ep rank of the expert-model-parallel group (Megatron gathers the same matrix
  // over its tp_ep group). The expert GEMMs need the sizes on the host anyway.
  const dist::Group& expert_mp = mp_.group(dist::GroupKind::ExpertMP);
  std::vector<int64_t> counts_all;
  if (expert_mp.size() == 1) {
    counts_all = host_i64(expert_counts);
  } else {
    Tensor gathered = Tensor::empty({expert_mp.size() * E}, DType::I64, x.device());
    mp_.comm->all_gather(expert_counts, gathered, expert_mp);
    counts_all = host_i64(gathered);
  }
  auto count = [&](int t, int i, int64_t e) { return counts_all[(t + etp * i) * E + e]; };
  saved_.send_rows.assign(ep, 0);
  saved_.recv_rows.assign(ep, 0);
  saved_.etp_rows.assign(etp, 0);
  saved_.chunk_rows.assign(size_t(etp) * ep * L, 0);
  saved_.tokens_per_local_expert.assign(L, 0);
  for (int i = 0; i < ep; ++i)
    for (int64_t l = 0; l < L; ++l) {
      saved_.send_rows[i] += count(etp_rank, ep_rank, i * L + l);
      saved_.recv_rows[i] += count(etp_rank, i, first_local_expert_ + l);
    }
  for (int t = 0; t < etp; ++t)
    for (int i = 0; i < ep; ++i)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t n = count(t, i, first_local_expert_ + l);
        saved_.chunk_rows[(t * ep + i) * L + l] = n;
        saved_.etp_rows[t] += n;
        saved_.tokens_per_local_expert[l] += n;
      }
  saved_.to_experts_runs.clear();
  saved_.from_experts_runs.clear();
  if (saved_.pull) {
    // Where member i keeps its kept copies of global expert e (sorted by expert):
    // copies_first[i E + e].
    std::vector<int64_t> copies_first(size_t(ep) * E);
    for (int i = 0; i < ep; ++i)
      for (int64_t e = 0, at = 0; e < E; at += count(0, i, e), ++e) copies_first[i * E + e] = at;
    // Where member j keeps the rows of its local expert l that came from member i (its
    // expert input, by local expert, then by member): rows_first[(j L + l) ep + i].
    std::vector<int64_t> rows_first(size_t(ep) * L * ep);
    for (int j = 0; j < ep; ++j) {
      int64_t at = 0;
      for (int64_t l = 0; l < L; ++l)
        for (int i = 0; i < ep; ++i) {
          rows_first[(j * L + l) * ep + i] = at;
          at += count(0, i, j * L + l);
        }
    }
    for (int64_t l = 0; l < L; ++l)
      for (int i = 0; i < ep; ++i) {
        const int64_t e = first_local_expert_ + l, n = count(0, i, e);
        if (n > 0)
          saved_.to_experts_runs.push_back(
              {i, copies_first[i * E + e], rows_first[(ep_rank * L + l) * ep + i], n});
      }
    for (int j = 0; j < ep; ++j)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t e = j * L + l, n = count(0, ep_rank, e);
        if (n > 0)
          saved_.from_experts_runs.push_back(
              {j, rows_first[e * ep + ep_rank], copies_first[ep_rank * E + e], n});
      }
  }
  // The kept copies: the first rows of permuted (all of them without dropping).
  const int64_t kept = sum_of(saved_.send_rows);
  Tensor probs_in = to_experts(permuted_probs.rows(0, kept), false);
  expert_probs = probs_in.view({probs_in.dim(0)});
  return to_experts(permuted.rows(0, kept), saved_.pull, beside);
}

Tensor MoEAlltoAllTokenDispatcher::to_experts(const Tensor& permuted, bool pull,
                                              const Beside& beside) const {
  const int ep = mp_.ep_size(), etp = mp_.etp_size();
  const int64_t L = num_local_experts_;
  if (pull) {  // the chunks land in their groups
    Tensor grouped = empty_as(permuted, {sum_of(saved_.recv_rows), permuted.dim(1)});
    pull_rows_beside(beside, *mp_.comm, permuted, saved_.to_experts_runs, grouped, mp_.ep());
    return grouped;
  }
  Tensor rows = permuted;
  if (ep > 1) {
    Tensor received = empty_as(permuted, {sum_of(saved_.recv_rows), permuted.dim(1)});
    all_to_allv_beside(beside, *mp_.comm, permuted, times(saved_.send_rows, permuted.dim(1)),
                       received, times(saved_.recv_rows, permuted.dim(1)), mp_.ep());
    rows = received;
  } else {
    run_beside(beside);
  }
  if (etp > 1) rows = all_gather_rows(*mp_.comm, rows, saved_.etp_rows, mp_.etp());
  if (ep * etp > 1 && L > 1) {
    // Received by (ETP member, EP member, local expert); the GEMMs want local expert first.
    std::vector<int64_t> order;
    for (int64_t l = 0; l < L; ++l)
      for (int t = 0; t < etp; ++t)
        for (int i = 0; i < ep; ++i) order.push_back((t * ep + i) * L + l);
    rows = reorder_chunks(rows, saved_.chunk_rows, order);
  }
  return rows;
}

Tensor MoEAlltoAllTokenDispatcher::from_experts(const Tensor& grouped, bool pull,
                                                const Beside& beside) const {
  const int ep = mp_.ep_size(), etp = mp_.etp_size();
  const int64_t L = num_local_experts_;
  if (pull) {  // each chunk comes back from its group
    Tensor back = local_copies_buffer(grouped);
    pull_rows_beside(beside, *mp_.comm, grouped, saved_.from_experts_runs, back, mp_.ep());
    return back;
  }
  Tensor rows = grouped;
  if (ep * etp > 1 && L > 1) {
    // The inverse of to_experts' regrouping: chunk (l, t, i) back to position (t, i, l).
    std::vector<int64_t> grouped_rows, order(saved_.chunk_rows.size());
    for (int64_t l = 0; l < L; ++l)
      for (int t = 0; t < etp; ++t)
        for (int i = 0; i < ep; ++i) {
          order[(t * ep + i) * L + l] = int64_t(grouped_rows.size());
          grouped_rows.push_back(saved_.chunk_rows[(t * ep + i) * L + l]);
        }
    rows = reorder_chunks(rows, grouped_rows, order);
  }
  if (etp > 1) rows = reduce_scatter_rows(*mp_.comm, rows, saved_.etp_rows, mp_.etp());
  const int64_t kept = sum_of(saved_.send_rows);
  if (ep == 1 && kept == saved_.row_id_map.dim(0)) {
    run_beside(beside);
    return rows;
  }
  Tensor back = local_copies_buffer(rows);
  Tensor back_kept = back.rows(0, kept);
  if (ep > 1) {
    all_to_allv_beside(beside, *mp_.comm, rows, times(saved_.recv_rows, rows.dim(1)), back_kept,
                       times(saved_.send_rows, rows.dim(1)), mp_.ep());
  } else {
    back_kept.copy_from(rows);
    run_beside(beside);
  }
  return back;
}

Tensor MoEAlltoAllTokenDispatcher::local_copies_buffer(const Tensor& like) const {
  const int64_t kept = sum_of(saved_.send_rows), copies = saved_.row_id_map.dim(0);
  Tensor buffer = empty_as(like, {copies, like.dim(1)});
  // Unpermute and permute_backward add the dropped copies' rows: zeros.
  buffer.rows(kept, copies - kept).zero();
  return buffer;
}

Tensor MoEAlltoAllTokenDispatcher::combine(const Tensor& expert_out, const Beside& beside) {
  const Tensor by_copy = from_experts(expert_out, saved_.pull, beside);
  Tensor out = empty_as(expert_out, {saved_.tokens, expert_out.dim(1)});
  // Unweighted: the experts applied the probabilities (Megatron's unpermute without probs).
  ops::moe_permute_backward(by_copy, saved_.row_id_map, int(saved_.topk), out);
  return out;
}

Tensor MoEAlltoAllTokenDispatcher::combine_backward(const Tensor& dout, const Beside& beside) {
  const int64_t copies = saved_.tokens * saved_.topk;
  Tensor dcombined = new_exchanged_rows({copies, dout.dim(1)}, dout.dtype(), dout.device());
  ops::moe_permute_rows(dout, saved_.row_id_map, int(saved_.topk), dcombined);
  // The kept copies.
  return to_experts(dcombined.rows(0, sum_of(saved_.send_rows)), saved_.pull, beside);
}

Tensor MoEAlltoAllTokenDispatcher::probs_backward(const Tensor& dexpert_probs) {
  // Back the way the probabilities came, the partial sums over etp added on the way.
  const Tensor by_copy = from_experts(dexpert_probs.view({dexpert_probs.numel(), 1}), false);
  Tensor dprobs = Tensor::empty({saved_.tokens, saved_.topk}, DType::F32, dexpert_probs.device());
  Tensor dprobs_by_copy = dprobs.view({saved_.tokens * saved_.topk, 1});
  ops::moe_permute_backward(by_copy, saved_.row_id_map, 1, dprobs_by_copy);
  return dprobs;
}

Tensor MoEAlltoAllTokenDispatcher::dispatch_backward(const Tensor& dexpert_in,
                                                     const Beside& beside) {
  return permute_backward(from_experts(dexpert_in, saved_.pull, beside));
}

Tensor MoEAlltoAllTokenDispatcher::permute_backward(const Tensor& dpermuted) {
  Tensor dx = empty_as(dpermuted, {saved_.tokens, dpermuted.dim(1)});
  ops::moe_permute_backward(dpermuted, saved_.row_id_map, int(saved_.topk), dx);
  saved_ = {};  // the micro-batch's routing is used up
  return dx;
}

Tensor MoEAlltoAllTokenDispatcher::new_exchanged_rows(const Shape& shape, DType dtype,
                                                      Device device) {
  if (!saved_.pull) return Tensor::empty(shape, dtype, device);
  return mp_.comm->pull_input(shape, dtype, mp_.ep());
}

bool MoEAlltoAllTokenDispatcher::pulls() {
  if (pulls_ < 0) {
    const bool can = mp_.ep_size() > 1 && mp_.etp_size() == 1;
    switch (mp_.alltoall_exchange) {
      case AlltoAllExchange::Regroup:
        pulls_ = 0;
        break;
      case AlltoAllExchange::Pull:
        pulls_ = can;
        break;
      case AlltoAllExchange::Auto:
        pulls_ = can && mp_.comm->peer_memory(mp_.ep());
        break;
    }
  }
  return pulls_ == 1;
}

std::any MoEAlltoAllTokenDispatcher::take_saved() { return std::exchange(saved_, {}); }

void MoEAlltoAllTokenDispatcher::restore_saved(std::any&& saved) {
  saved_ = std::move(saved_of<Saved>(saved, "all-to-all"));
}

void MoEAlltoAllTokenDispatcher::for_each_saved_tensor(
    std::any& saved, const std::function<void(Tensor&)>& fn) const {
  Saved& s = saved_of<Saved>(saved, "all-to-all");
  for (Tensor* slot : {&s.row_id_map, &s.device_counts}) fn(*slot);
}

AlltoAllExchange alltoall_exchange_from_env() {
  const char* env = std::getenv("MEGATON_MOE_ALLTOALL_EXCHANGE");
  const std::string value = env ? env : "";
  if (value.empty() || value == "auto") return AlltoAllExchange::Auto;
  if (value == "regroup") return AlltoAllExchange::Regroup;
  if (value == "pull") return AlltoAllExchange::Pull;
  fail(
      "environment variable MEGATON_MOE_ALLTOALL_EXCHANGE must be auto, regroup or pull (got '{}')",
      value);
}

std::string describe_alltoall_exchange(const ModelParallel& mp) {
  const int ep = mp.ep_size(), etp = mp.etp_size();
  if (ep * etp == 1) return "one expert rank, nothing to exchange";
  const char* transport = mp.comm->device() == Device::CUDA ? "NCCL" : "MPI";
  bool pull = false;
  if (ep > 1 && etp == 1) {
    switch (mp.alltoall_exchange) {
      case AlltoAllExchange::Regroup:
        break;
      case AlltoAllExchange::Pull:
      case AlltoAllExchange::Auto:
        pull = mp.comm->peer_memory(mp.ep()) || mp.alltoall_exchange == AlltoAllExchange::Pull;
        break;
    }
  }
  if (pull && mp.comm->peer_memory(mp.ep()))
    return fmt::format(
        "each of the {} EP ranks pulls its experts' rows straight out of the others' GPU "
        "memory (peer memory within the node), no regrouping copy",
        ep);
  if (pull)
    return fmt::format("pulls over {} EP ranks by {} (run lists exchanged first, no peer memory)",
                       ep, transport);
  std::string out = fmt::format("{} all-to-all over {} EP ranks", transport, ep);
  if (etp > 1) out += fmt::format(", all-gather and reduce-scatter over {} ETP ranks", etp);
  return out + ", chunks regrouped by local expert";
}

std::unique_ptr<MoETokenDispatcher> make_token_dispatcher(int64_t num_experts,
                                                          const ModelParallel& mp) {
  if (mp.dispatcher == TokenDispatcher::AllGather)
    return std::make_unique<MoEAllGatherTokenDispatcher>(num_experts, mp);
  return std::make_unique<MoEAlltoAllTokenDispatcher>(num_experts, mp);
}

}  // namespace megaton
