// Comm: collectives and point-to-point transfers over a Group, with a deadline on each.
#pragma once
#include <memory>
#include <source_location>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/grid.h"

namespace megaton::dist {

enum class ReduceOp { Sum, Max };

// A collective that did not finish before its deadline, or a transport that failed
// mid-operation. The message names the collective, the group and the world rank, e.g.
// "all_reduce on group dp (ranks 0,2) timed out after 300 s at world rank 2". The
// communicator of that group is unusable afterwards (every later call on it throws);
// the process is expected to exit (non-zero, which makes mpirun end the other ranks).
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A collective started by one of Comm's *_async calls, running while the caller goes
// on (Megatron's overlapped gradient reduce-scatter and parameter all-gather). Until
// wait() the tensors given to the call must not be written, nor its output read (its
// input may be read: the tensor-parallel overlap multiplies a block while it is gathered).
class CommWork {
 public:
  virtual ~CommWork() = default;
  // CPU (MPI): blocks until the operation has finished or its deadline passes (CommError).
  // GPU (NCCL): orders all later work on megaton::cuda::stream() after the operation; the
  // host does not wait (the watchdog keeps the deadline). A second call does nothing.
  // Destroying a work that was never waited for waits for it.
  virtual void wait() = 0;
};

// A run of consecutive rows of a tensor (indices along dim 0): [first, first + count).
struct RowRun {
  int64_t first = 0, count = 0;
};
// Row runs per group member (all_to_allv_rows).
using RowRuns = std::vector<std::vector<RowRun>>;

// One transfer of pull_rows: rows [src_first, src_first + count) of member `member`'s
// input (member: an index into the group) land in rows [dst_first, dst_first + count) of
// the caller's output.
struct PullRun {
  int member = 0;
  int64_t src_first = 0, dst_first = 0, count = 0;
};

// Elements per row of t (per index of dim 0: the product of the other dims; t has rank >= 1).
inline int64_t row_numel(const Tensor& t) {
  int64_t n = 1;
  for (size_t d = 1; d < t.shape().size(); ++d) n *= t.shape()[d];
  return n;
}

// The training iteration a timeout message names (the trainer sets it each step; -1: none).
void set_comm_iteration(int64_t iteration);

// Seconds one operation may take: MEGATON_COMM_TIMEOUT_S when set (a positive number;
// anything else throws megaton::Error naming the variable), else 300.
double default_timeout_s();

// Every call blocks until the operation has finished on this rank (for the GPU: until
// the NCCL kernel on megaton::cuda::stream() has completed) or its deadline passes.
// All members of the group must make the same calls in the same order, with matching
// sizes. Tensors are contiguous views: fp32, bf16, fp16, fp8 (moved as bytes), int32,
// int64, on the Comm's device.
//
// Argument mistakes (wrong device, dtype or size, a peer or root outside the group, a
// group this rank is not in) throw InternalError before anything is sent. Timeouts and
// transport failures throw CommError.
//
// Groups of size 1 never reach the transport: the operations reduce to copies, so a
// single process runs without MPI.
class Comm {
 public:
  explicit Comm(double timeout_s = default_timeout_s());
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  virtual Device device() const = 0;
  double timeout_s() const { return timeout_s_; }
  void set_timeout_s(double seconds);

  // Creates now the communicators of all of this rank's groups in `grid`, so no later
  // call creates one (creation has no deadline). Collective over the world: every rank
  // calls it with a grid of the same layout. Otherwise a group's communicator is created
  // on its first use, collectively over that group.
  void prepare(const Grid& grid);

  // In place: t = op over the group of every member's t. Sum: fp32, bf16, int32, int64.
  // Max: fp32, int32, int64.
  void all_reduce(Tensor& t, const Group& g, ReduceOp op = ReduceOp::Sum,
                  std::source_location site = std::source_location::current());
  // in: numel g.size() x n, out: numel n (same dtype). out = sum over members m of
  // chunk g.rank of m's in, chunk i being elements [i n, (i + 1) n). fp32, bf16.
  void reduce_scatter(const Tensor& in, Tensor& out, const Group& g,
                      std::source_location site = std::source_location::current());
  // in: numel n, out: numel g.size() x n. Chunk i of out = member i's in. Any dtype.
  // in may be this member's chunk of out (gathered in place, no copy).
  void all_gather(const Tensor& in, Tensor& out, const Group& g,
                  std::source_location site = std::source_location::current());
  // The same three collectives, started and left running (see CommWork). On the GPU they
  // run on a communication stream of their group's own, after everything queued so far on
  // the compute stream, over a second communicator per group, so they overlap the compute
  // that follows and never interleave with the blocking calls. Operations on one group
  // must still be started in the same order on every member.
  std::unique_ptr<CommWork> all_reduce_async(
      Tensor& t, const Group& g, std::source_location site = std::source_location::current());
  std::unique_ptr<CommWork> reduce_scatter_async(
      const Tensor& in, Tensor& out, const Group& g,
      std::source_location site = std::source_location::current());
  std::unique_ptr<CommWork> all_gather_async(
      const Tensor& in, Tensor& out, const Group& g,
      std::source_location site = std::source_location::current());
  // Uneven all-to-all. send_counts[i] (elements) of in go to member i, taken from in in
  // member order; recv_counts[i] elements come from member i, stored in out in member
  // order. Both spans have g.size() entries, counts may be 0, sum(send_counts) =
  // in.numel(), sum(recv_counts) = out.numel(); member j's send_counts[i] must equal
  // member i's recv_counts[j]. Any dtype.
  void all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                   std::span<const int64_t> recv_counts, const Group& g,
                   std::source_location site = std::source_location::current());
  // all_to_allv started and left running (CommWork; on the GPU over the group's second
  // communicator and stream, as the *_async collectives): the MoE dispatcher's exchange
  // beside the shared expert (--moe-shared-expert-overlap).
  std::unique_ptr<CommWork> all_to_allv_async(
      const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
      std::span<const int64_t> recv_counts, const Group& g,
      std::source_location site = std::source_location::current());
  // Equal chunks: in and out have numel g.size() x n; chunk i of in goes to member i,
  // chunk i of out comes from member i.
  void all_to_all(const Tensor& in, Tensor& out, const Group& g,
                  std::source_location site = std::source_location::current());
  // Uneven all-to-all of row runs, scattered on both sides: an all_to_allv whose chunks
  // are regrouped in flight (Megatron's all-to-all followed by sort_chunks_by_idxs,
  // without the copy). in and out have rank >= 1, the same dtype and the same row size
  // (elements per index of dim 0). send[i] lists the runs of in's rows that go to member
  // i, in order; recv[i] the runs of out's rows that member i's runs fill, in order. Runs
  // of 0 rows are skipped; the others of member j's send[i] and of member i's recv[j]
  // pair up in order and must have equal lengths. Both lists have g.size() entries, every
  // run lies inside its tensor, and runs of out must not overlap (rows of out in no run
  // are left as they are).
  void all_to_allv_rows(const Tensor& in, const RowRuns& send, Tensor& out, const RowRuns& recv,
                        const Group& g,
                        std::source_location site = std::source_location::current());
  // An all-to-all in which only the receiver names the transfers: each member copies the
  // runs it lists out of the members' inputs (its own included) into its output. in and
  // out have rank >= 1, the same dtype and the same row size; in's row count may differ
  // between members. Every run's member is in the group and its rows lie inside that
  // member's in and this member's out; runs of out must not overlap; runs of 0 rows are
  // skipped. Every member must call it (also with no runs). in must not be written until
  // every member has returned from the call (GPU: until the next collective on g).
  // Through peer memory (peer_memory(g)) the rows are read straight from the other GPUs;
  // otherwise the run lists are exchanged first and the rows move by all_to_allv_rows.
  // Used by the MoE all-to-all dispatcher, whose routing counts tell every member where
  // the others keep the rows it needs (Megatron's all-to-all + sort_chunks_by_idxs in one
  // step).
  void pull_rows(const Tensor& in, std::span<const PullRun> runs, Tensor& out, const Group& g,
                 std::source_location site = std::source_location::current());
  // pull_rows started and left running (CommWork): through peer memory its
  // synchronisation and copy kernel run on the group's communication stream after the
  // compute stream's work so far; otherwise it runs to completion here (the run lists'
  // exchange needs the host). Until the work is waited for, no pull_input or pull_rows on g
  // may come (the pull's slot and its peers' stay in use).
  std::unique_ptr<CommWork> pull_rows_async(
      const Tensor& in, std::span<const PullRun> runs, Tensor& out, const Group& g,
      std::source_location site = std::source_location::current());
  // A new uninitialised tensor (shape[0] rows, which may differ between members) to fill
  // and pass, whole or as its first rows, as the input of the next pull_rows on g. Through
  // peer memory it is this member's slot for that pull, read in place (no staging copy),
  // and valid only until that pull_rows returns; otherwise an ordinary tensor. Collective
  // over g; no other pull_input or pull_rows on g may come between it and its pull_rows.
  Tensor pull_input(const Shape& shape, DType dtype, const Group& g);
  // Whether pull_rows on g reads the other members' memory directly: GPUs of one node that
  // can map each other's memory (CUDA IPC). Collective over g the first time it is asked
  // for g; false for a group of one and for the CPU.
  bool peer_memory(const Group& g);
  // Point to point (pipeline stages); peer is an index into g.ranks, not this rank.
  // The receiver's t has the sender's numel and dtype.
  void send(const Tensor& t, int peer, const Group& g,
            std::source_location site = std::source_location::current());
  void recv(Tensor& t, int peer, const Group& g,
            std::source_location site = std::source_location::current());
  // Both at once (a ring step or a pipeline exchange without ordering deadlocks).
  void send_recv(const Tensor& send_t, int send_peer, Tensor& recv_t, int recv_peer, const Group& g,
                 std::source_location site = std::source_location::current());
  // send_recv, send or recv started and left running (CommWork): send_t or recv_t may be
  // null (a one-sided transfer; its peer is then ignored), not both. On the GPU over the
  // group's second communicator and stream, as the *_async collectives (the pipeline's
  // --overlap-p2p-comm); on CPU ranks MPI_Isend / MPI_Irecv. The two ends must start
  // their transfers on g in the same order.
  std::unique_ptr<CommWork> send_recv_async(
      const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer, const Group& g,
      std::source_location site = std::source_location::current());
  // t on every member = t of member `root` (an index into g.ranks).
  void broadcast(Tensor& t, int root, const Group& g,
                 std::source_location site = std::source_location::current());
  void barrier(const Group& g, std::source_location site = std::source_location::current());

 protected:
  // The transport; called only for groups of size > 1 with checked arguments.
  virtual void prepare_group(const Group& g) = 0;
  virtual void do_all_reduce(Tensor& t, const Group& g, ReduceOp op) = 0;
  virtual void do_reduce_scatter(const Tensor& in, Tensor& out, const Group& g) = 0;
  virtual void do_all_gather(const Tensor& in, Tensor& out, const Group& g) = 0;
  virtual std::unique_ptr<CommWork> do_all_reduce_async(Tensor& t, const Group& g) = 0;
  virtual std::unique_ptr<CommWork> do_reduce_scatter_async(const Tensor& in, Tensor& out,
                                                            const Group& g) = 0;
  virtual std::unique_ptr<CommWork> do_all_gather_async(const Tensor& in, Tensor& out,
                                                        const Group& g) = 0;
  virtual void do_all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                              std::span<const int64_t> recv_counts, const Group& g) = 0;
  // Default: do_all_to_allv, finished when it returns.
  virtual std::unique_ptr<CommWork> do_all_to_allv_async(const Tensor& in,
                                                         std::span<const int64_t> send_counts,
                                                         Tensor& out,
                                                         std::span<const int64_t> recv_counts,
                                                         const Group& g);
  // Default: the runs packed into one buffer per direction around do_all_to_allv.
  virtual void do_all_to_allv_rows(const Tensor& in, const RowRuns& send, Tensor& out,
                                   const RowRuns& recv, const Group& g);
  // Default: the run lists exchanged (all_to_allv of their lengths, then of the runs), the
  // rows by all_to_allv_rows.
  virtual void do_pull_rows(const Tensor& in, std::span<const PullRun> runs, Tensor& out,
                            const Group& g);
  // Default: do_pull_rows, finished when it returns.
  virtual std::unique_ptr<CommWork> do_pull_rows_async(const Tensor& in,
                                                       std::span<const PullRun> runs, Tensor& out,
                                                       const Group& g);
  // Default: false (no peer memory).
  virtual bool do_peer_memory(const Group& g);
  // Default: Tensor::empty on this Comm's device.
  virtual Tensor do_pull_input(const Shape& shape, DType dtype, const Group& g);
  // send_t or recv_t may be undefined (a one-sided transfer); the peer is then ignored.
  virtual void do_send_recv(const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer,
                            const Group& g) = 0;
  // Default: do_send_recv, finished before it returns.
  virtual std::unique_ptr<CommWork> do_send_recv_async(const Tensor* send_t, int send_peer,
                                                       Tensor* recv_t, int recv_peer,
                                                       const Group& g);
  virtual void do_broadcast(Tensor& t, int root, const Group& g) = 0;
  virtual void do_barrier(const Group& g) = 0;

  // "all_reduce on group dp (ranks 0,2) timed out after 300 s at world rank 2, called from
  // src/train/trainer.cpp:391 in iteration 17": the call site is the last public call's
  // (site_), the iteration set_comm_iteration's.
  std::string timeout_message(const char* op, const Group& g) const;
  // Where the operation in progress was called from (each public call records its caller).
  std::source_location site_;

 private:
  void check_tensor(const Tensor& t, const char* op, const char* what) const;
  // Argument checks of the collectives; false when the transport is not needed (a group
  // of one, whose result is then already in place, or nothing to move).
  bool check_all_reduce(Tensor& t, const Group& g, ReduceOp op) const;
  bool check_reduce_scatter(const Tensor& in, Tensor& out, const Group& g) const;
  bool check_all_gather(const Tensor& in, Tensor& out, const Group& g) const;
  // This rank is in g; in and out are defined tensors on this Comm's device, of one dtype,
  // with rank >= 1 and the same row size (all_to_allv_rows, pull_rows).
  void check_row_exchange(const Tensor& in, const Tensor& out, const Group& g,
                          const char* op) const;
  bool check_all_to_allv_rows(const Tensor& in, const RowRuns& send, Tensor& out,
                              const RowRuns& recv, const Group& g) const;
  bool check_all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                         std::span<const int64_t> recv_counts, const Group& g) const;
  bool check_pull_rows(const Tensor& in, std::span<const PullRun> runs, Tensor& out,
                       const Group& g) const;
  double timeout_s_;
};

// The Comm for tensors on `device`: MPI for the CPU, NCCL for CUDA (CUDA builds only;
// otherwise throws megaton::Error). Under mpirun call dist::init() first.
std::unique_ptr<Comm> make_comm(Device device);

// Sums `tensors` (one dtype and device, any shapes; each contiguous, possibly a view) over
// g in one all-reduce: packed into one buffer, reduced, written back (Megatron's
// coalesced all-reduce of many small gradients). Nothing for an empty list; InternalError
// on mixed dtypes. Collective over g.
void all_reduce_coalesced(Comm& comm, std::span<Tensor> tensors, const Group& g);

namespace detail {
// Defined in comm_mpi.cpp and cuda/comm_nccl.cpp.
std::unique_ptr<Comm> make_mpi_comm();
std::unique_ptr<Comm> make_nccl_comm();
}  // namespace detail

}  // namespace megaton::dist
