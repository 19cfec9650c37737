// ModelParallel: the process groups and communicator a model is built for.
#pragma once
#include "dist/comm.h"
#include "dist/grid.h"

namespace megaton {

// Megatron's --moe-token-dispatcher-type.
enum class TokenDispatcher { AllGather, AllToAll };

// How the all-to-all dispatcher moves tokens when experts are not tensor-parallel (etp 1),
// chosen by MEGATON_MOE_ALLTOALL_EXCHANGE (alltoall_exchange_from_env). The results are
// the same; only the copies differ.
enum class AlltoAllExchange {
  Auto,     // "auto", the default: Pull where the EP group has peer memory (GPUs of one
            // node, Comm::peer_memory), else Regroup
  Regroup,  // "regroup": one all-to-all, then the received chunks regrouped by local
            // expert with one copy per chunk (Megatron's sort_chunks_by_idxs)
  Pull,     // "pull": each rank pulls the chunks it needs straight into expert order
            // (Comm::pull_rows), no regrouping
};

// Where a model runs: its grid (Megatron's parallel_state) and the Comm for its device.
// The default is one rank: no grid, no comm, every group of size one, and layers never
// communicate (unit tests, generation, single-process training).
struct ModelParallel {
  const dist::Grid* grid = nullptr;
  dist::Comm* comm = nullptr;
  bool sequence_parallel = false;  // --sequence-parallel (only with tp > 1)
  // --tp-comm-overlap (with sequence parallelism): the linears' sequence all-gathers and
  // reduce-scatters run beside their GEMMs (model/tp_comm_overlap.h).
  bool tp_comm_overlap = false;
  TokenDispatcher dispatcher = TokenDispatcher::AllToAll;
  AlltoAllExchange alltoall_exchange = AlltoAllExchange::Auto;

  bool single() const { return grid == nullptr; }
  // A group of this rank (a one-member group when single()).
  const dist::Group& group(dist::GroupKind kind) const {
    static const dist::Group one{"single", {0}, 0};
    return grid ? grid->group(kind) : one;
  }
  const dist::Group& tp() const { return group(dist::GroupKind::TP); }
  const dist::Group& ep() const { return group(dist::GroupKind::EP); }
  const dist::Group& etp() const { return group(dist::GroupKind::ETP); }
  const dist::Group& tp_cp() const { return group(dist::GroupKind::TP_CP); }
  const dist::Group& pp() const { return group(dist::GroupKind::PP); }
  int tp_size() const { return tp().size(); }
  int tp_rank() const { return tp().rank; }
  int ep_size() const { return ep().size(); }
  int ep_rank() const { return ep().rank; }
  int etp_size() const { return etp().size(); }
  int etp_rank() const { return etp().rank; }
};

}  // namespace megaton
