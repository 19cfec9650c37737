// NcclComm: Comm for GPU tensors over NCCL, on megaton::cuda::stream().
//
// Communicators are bootstrapped through MPI (the group's first rank makes the unique
// id, MPI_Bcast over the group's MPI communicator) and created non-blocking
// (ncclConfig_t::blocking = 0), so this thread never sits inside NCCL.
//
// Operations are stream-ordered on the compute stream and the host does not wait for
// them (a wait per collective would drain the GPU's queue each time: every later kernel
// launch would then be exposed). Their deadlines are kept by a watchdog thread
// (dist/cuda/nccl_watchdog.h). Every NCCL call on a communicator holds nccl_mu_: the
// watchdog polls beside this thread, and communicators are not thread-safe. Host code that reads a
// result (Tensor::to(CPU)) synchronizes with the stream as usual. barrier() alone waits on the
// host.
//
// The *_async operations run on a communication stream of their own (non-blocking, high
// priority), after an event recorded on the compute stream, over a second communicator
// per group kind and ranks: NCCL operations on one communicator must not run concurrently from two
// streams in different orders on different ranks, and the blocking calls of the
// forward and backward keep using the first. CommWork::wait makes the compute stream wait
// for an event recorded after the operation.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "core/cuda/cuda_check.h"
#include "dist/comm.h"
#include "dist/cuda/nccl_enqueue.h"
#include "dist/cuda/nccl_watchdog.h"
#include "dist/cuda/peer_memory.h"
#include "dist/mpi_util.h"
#include "ops/cuda/copy_chunks.h"
#include "ops/profiler.h"

// MEGATON_NCCL_CHECK(ncclGetUniqueId(&id)): throws InternalError naming the call, the
// file and line, and NCCL's error string and code. ncclInProgress (a non-blocking
// communicator still working) is not an error; callers wait for it.
#define MEGATON_NCCL_CHECK(call)                                                       \
  do {                                                                                 \
    ncclResult_t megaton_nccl_rc_ = (call);                                            \
    if (megaton_nccl_rc_ != ncclSuccess && megaton_nccl_rc_ != ncclInProgress) {       \
      throw ::megaton::InternalError(                                                  \
          ::fmt::format("{}:{}: {} failed: {} ({})", __FILE__, __LINE__, #call,        \
                        ncclGetErrorString(megaton_nccl_rc_), int(megaton_nccl_rc_))); \
    }                                                                                  \
  } while (0)

namespace megaton::dist {
namespace {

using detail::byte_ptr;
using detail::enqueue_all_to_allv;
using detail::enqueue_row_runs;
using detail::enqueue_send_recv;
using detail::nccl_type;

using Clock = std::chrono::steady_clock;

bool overlaps(const Tensor& a, const Tensor& b) {
  return byte_ptr(a) < byte_ptr(b) + b.nbytes() && byte_ptr(b) < byte_ptr(a) + a.nbytes();
}

class NcclComm final : public Comm {
 public:
  ~NcclComm() override {
    cudaStreamSynchronize(::megaton::cuda::stream());  // everything queued completes
    for (auto& [ranks, entry] : async_comms_)
      if (entry.stream) cudaStreamSynchronize(entry.stream);
    watchdog_.stop();
    // Best effort at exit: finalize (flushes pending work) and destroy; errors here are
    // not worth a crash while the process ends.
    for (auto* map : {&comms_, &async_comms_})
      for (auto& [ranks, entry] : *map) {
        if (entry.broken) continue;
        if (ncclCommFinalize(entry.comm) == ncclInProgress) {
          ncclResult_t state = ncclInProgress;
          const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
          while (state == ncclInProgress && Clock::now() < deadline)
            ncclCommGetAsyncError(entry.comm, &state);
        }
        ncclCommDestroy(entry.comm);
      }
    for (auto& [ranks, entry] : async_comms_)
      if (entry.stream) cudaStreamDestroy(entry.stream);
  }

  Device device() const override { return Device::CUDA; }

 protected:
  void prepare_group(const Group& g) override { comm_of(g, "communicator setup"); }

  void do_all_reduce(Tensor& t, const Group& g, ReduceOp op) override {
    run(g, "all_reduce", [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t.dtype()),
                           op == ReduceOp::Sum ? ncclSum : ncclMax, c, s);
    });
  }

  // NCCL works in place only when out is this rank's chunk of in (reduce-scatter) or in
  // is this rank's chunk of out (all-gather); other overlaps are copied away first.
  void do_reduce_scatter(const Tensor& in, Tensor& out, const Group& g) override {
    const bool in_place = byte_ptr(out) == byte_ptr(in) + size_t(g.rank) * out.nbytes();
    const Tensor src = !in_place && overlaps(in, out) ? in.clone() : in;
    run(g, "reduce_scatter", [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(src.raw(), out.raw(), size_t(out.numel()), nccl_type(in.dtype()),
                               ncclSum, c, s);
    });
  }

  void do_all_gather(const Tensor& in, Tensor& out, const Group& g) override {
    const bool in_place = byte_ptr(in) == byte_ptr(out) + size_t(g.rank) * in.nbytes();
    const Tensor src = !in_place && overlaps(in, out) ? in.clone() : in;
    // Bytes: every dtype moves the same way.
    run(g, "all_gather", [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(src.raw(), out.raw(), in.nbytes(), ncclUint8, c, s);
    });
  }

  std::unique_ptr<CommWork> do_all_reduce_async(Tensor& t, const Group& g) override {
    return run_async(g, "all_reduce", {t}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t.dtype()), ncclSum, c,
                           s);
    });
  }

  std::unique_ptr<CommWork> do_reduce_scatter_async(const Tensor& in, Tensor& out,
                                                    const Group& g) override {
    const bool in_place = byte_ptr(out) == byte_ptr(in) + size_t(g.rank) * out.nbytes();
    const Tensor src = !in_place && overlaps(in, out) ? in.clone() : in;
    return run_async(g, "reduce_scatter", {src, out}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(src.raw(), out.raw(), size_t(out.numel()), nccl_type(in.dtype()),
                               ncclSum, c, s);
    });
  }

  std::unique_ptr<CommWork> do_all_gather_async(const Tensor& in, Tensor& out,
                                                const Group& g) override {
    const bool in_place = byte_ptr(in) == byte_ptr(out) + size_t(g.rank) * in.nbytes();
    const Tensor src = !in_place && overlaps(in, out) ? in.clone() : in;
    return run_async(g, "all_gather", {src, out}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(src.raw(), out.raw(), in.nbytes(), ncclUint8, c, s);
    });
  }

  void do_all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                      std::span<const int64_t> recv_counts, const Group& g) override {
    const Tensor src = overlaps(in, out) ? in.clone() : in;
    run(g, "all_to_allv", [&](ncclComm_t c, cudaStream_t s) {
      return enqueue_all_to_allv(src, send_counts, out, recv_counts, g.size(), c, s);
    });
  }

  std::unique_ptr<CommWork> do_all_to_allv_async(const Tensor& in,
                                                 std::span<const int64_t> send_counts, Tensor& out,
                                                 std::span<const int64_t> recv_counts,
                                                 const Group& g) override {
    const Tensor src = overlaps(in, out) ? in.clone() : in;
    return run_async(g, "all_to_allv", {src, out}, [&](ncclComm_t c, cudaStream_t s) {
      return enqueue_all_to_allv(src, send_counts, out, recv_counts, g.size(), c, s);
    });
  }

  void do_all_to_allv_rows(const Tensor& in, const RowRuns& send, Tensor& out, const RowRuns& recv,
                           const Group& g) override {
    const Tensor src = overlaps(in, out) ? in.clone() : in;
    run(g, "all_to_allv_rows",
        [&](ncclComm_t c, cudaStream_t s) { return enqueue_row_runs(src, send, out, recv, c, s); });
  }

  // Through peer memory (peer_memory.h): the input in this member's slot (written there by
  // its producer after pull_input, or staged now), a one-integer all-reduce so that every
  // member's slot is written, then one copy kernel reading the runs out of the members'
  // slots. Without peer memory, Comm's exchange of run lists and all_to_allv_rows.
  void do_pull_rows(const Tensor& in, std::span<const PullRun> runs, Tensor& out,
                    const Group& g) override {
    detail::PeerMemory* peers = peer_memory_of(g);
    if (!peers) return Comm::do_pull_rows(in, runs, out, g);
    const std::vector<ops::cuda::ByteCopy> copies = pull_copies(*peers, in, runs, out, g);
    if (!barrier_scratch_.defined())
      barrier_scratch_ = Tensor::zeros({1}, DType::I32, Device::CUDA);
    run(g, "pull_rows_sync", [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(barrier_scratch_.raw(), barrier_scratch_.raw(), 1, ncclInt32, ncclMax, c,
                           s);
    });
    const ops::OpProfileScope profile_scope("pull_rows");
    ops::cuda::copy_chunks(copies, ::megaton::cuda::stream());
  }

  // The same on the group's communication stream: its synchronisation over the second
  // communicator, then the copy kernel, both after the compute stream's work so far.
  std::unique_ptr<CommWork> do_pull_rows_async(const Tensor& in, std::span<const PullRun> runs,
                                               Tensor& out, const Group& g) override {
    detail::PeerMemory* peers = peer_memory_of(g);
    if (!peers) return Comm::do_pull_rows_async(in, runs, out, g);
    const std::vector<ops::cuda::ByteCopy> copies = pull_copies(*peers, in, runs, out, g);
    if (!async_barrier_scratch_.defined())
      async_barrier_scratch_ = Tensor::zeros({1}, DType::I32, Device::CUDA);
    return run_async(
        g, "pull_rows_sync", {in, out},
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclAllReduce(async_barrier_scratch_.raw(), async_barrier_scratch_.raw(), 1,
                               ncclInt32, ncclMax, c, s);
        },
        [&](cudaStream_t s) { ops::cuda::copy_chunks(copies, s); });
  }

  // The copies of one pull: takes the slot of pull_input's tensor (in), or stages in into a
  // new slot on the compute stream; checks each run against its member's input rows.
  std::vector<ops::cuda::ByteCopy> pull_copies(detail::PeerMemory& peers, const Tensor& in,
                                               std::span<const PullRun> runs, Tensor& out,
                                               const Group& g) {
    const size_t row_bytes = dtype_size(in.dtype()) * size_t(row_numel(in));
    SlotUse use;
    auto pending = pending_inputs_.find(g.ranks);
    if (pending != pending_inputs_.end()) {  // in is (the first rows of) pull_input's tensor
      use = std::move(pending->second);
      pending_inputs_.erase(pending);
      MEGATON_CHECK(byte_ptr(in) == peers.slot(g.rank, use.slot) &&
                        in.nbytes() <= size_t(use.rows[g.rank]) * row_bytes,
                    "pull_rows on group {}: the input is not the tensor pull_input gave",
                    g.describe());
    } else {
      use = reserve_slot(peers, in.dim(0), row_bytes, g);
      const ops::OpProfileScope profile_scope("pull_rows_stage");
      if (in.nbytes() > 0)
        MEGATON_CUDA_CHECK(cudaMemcpyAsync(peers.slot(g.rank, use.slot), in.raw(), in.nbytes(),
                                           cudaMemcpyDeviceToDevice, ::megaton::cuda::stream()));
    }
    for (const PullRun& r : runs)
      MEGATON_CHECK(r.src_first + r.count <= use.rows[r.member],
                    "pull_rows on group {}: run of {} rows from row {} of member {}, whose "
                    "input has {} rows",
                    g.describe(), r.count, r.src_first, r.member, use.rows[r.member]);
    const int n = g.size();
    std::vector<ops::cuda::ByteCopy> copies;
    copies.reserve(runs.size());
    // Members read from member + 1, + 2, ... first, so they do not all start on one GPU.
    for (int step = 1; step <= n; ++step) {
      const int member = (g.rank + step) % n;
      for (const PullRun& r : runs)
        if (r.member == member && r.count > 0)
          copies.push_back({peers.slot(member, use.slot) + size_t(r.src_first) * row_bytes,
                            static_cast<char*>(out.raw()) + size_t(r.dst_first) * row_bytes,
                            int64_t(size_t(r.count) * row_bytes)});
    }
    return copies;
  }

  Tensor do_pull_input(const Shape& shape, DType dtype, const Group& g) override {
    detail::PeerMemory* peers = peer_memory_of(g);
    if (!peers) return Tensor::empty(shape, dtype, Device::CUDA);
    MEGATON_CHECK(!pending_inputs_.count(g.ranks),
                  "pull_input on group {}: the previous pull_input's pull_rows has not run",
                  g.describe());
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    SlotUse use = reserve_slot(*peers, shape[0], dtype_size(dtype) * size_t(row_numel), g);
    char* at = peers->slot(g.rank, use.slot);
    pending_inputs_[g.ranks] = std::move(use);
    return Tensor::borrow(at, shape, dtype, Device::CUDA);
  }
  bool do_peer_memory(const Group& g) override { return peer_memory_of(g) != nullptr; }

  void do_send_recv(const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer,
                    const Group& g) override {
    run(g, send_recv_name(send_t, recv_t), [&](ncclComm_t c, cudaStream_t s) {
      return enqueue_send_recv(send_t, send_peer, recv_t, recv_peer, c, s);
    });
  }

  std::unique_ptr<CommWork> do_send_recv_async(const Tensor* send_t, int send_peer, Tensor* recv_t,
                                               int recv_peer, const Group& g) override {
    std::vector<Tensor> keep;
    if (send_t) keep.push_back(*send_t);
    if (recv_t) keep.push_back(*recv_t);
    return run_async(g, send_recv_name(send_t, recv_t), std::move(keep),
                     [&](ncclComm_t c, cudaStream_t s) {
                       return enqueue_send_recv(send_t, send_peer, recv_t, recv_peer, c, s);
                     });
  }

  static const char* send_recv_name(const Tensor* send_t, const Tensor* recv_t) {
    return send_t && recv_t ? "send_recv" : send_t ? "send" : "recv";
  }

  void do_broadcast(Tensor& t, int root, const Group& g) override {
    run(g, "broadcast", [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(t.raw(), t.raw(), t.nbytes(), ncclUint8, root, c, s);
    });
  }

  void do_barrier(const Group& g) override {
    // NCCL has no barrier: an all-reduce of one int on the stream, waited for.
    if (!barrier_scratch_.defined())
      barrier_scratch_ = Tensor::zeros({1}, DType::I32, Device::CUDA);
    run(
        g, "barrier",
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclAllReduce(barrier_scratch_.raw(), barrier_scratch_.raw(), 1, ncclInt32,
                               ncclSum, c, s);
        },
        /*wait_host=*/true);
  }

 private:
  struct Entry {
    ncclComm_t comm = nullptr;
    bool broken = false;
    // The communication stream of an async communicator: one per group (kind and ranks),
    // so that the operations of one group (a tensor-parallel all-gather, an EP exchange)
    // never queue behind another's (a data-parallel gradient reduce-scatter), also where
    // the two groups have the same ranks.
    cudaStream_t stream = nullptr;
  };

  Clock::time_point deadline_from_now() const {
    return Clock::now() +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s()));
  }

  // Aborts the communicator and throws CommError with `message`. The abort's own result
  // is not checked: the error being reported is the one that matters.
  // Holds nccl_mu_ (recursive: callers may hold it already) and drops the watchdog's
  // entries of the communicator first, so that the watchdog never touches it again.
  [[noreturn]] void abort_and_throw(Entry& e, const std::string& message) {
    std::lock_guard<detail::NcclMutex> nccl(nccl_mu_);
    e.broken = true;
    watchdog_.forget(e.comm);
    (void)ncclCommAbort(e.comm);
    throw CommError(message);
  }

  // Waits until the communicator is no longer ncclInProgress (setup or an enqueue).
  void wait_ready(Entry& e, const char* op, const Group& g, Clock::time_point deadline) {
    for (;;) {
      ncclResult_t state = ncclInProgress;
      MEGATON_NCCL_CHECK(ncclCommGetAsyncError(e.comm, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress)
        abort_and_throw(
            e, fmt::format("{} on group {} failed at world rank {}: {} ({})", op, g.describe(),
                           g.ranks[g.rank], ncclGetErrorString(state), ncclGetLastError(e.comm)));
      if (Clock::now() >= deadline) abort_and_throw(e, timeout_message(op, g));
      std::this_thread::yield();
    }
  }

  // The group's communicator for blocking calls, or (async) the second one for the
  // *_async calls; created on first use, collectively over the group.
  Entry& comm_of(const Group& g, const char* op, bool async = false) {
    std::map<CommKey, Entry>& comms = async ? async_comms_ : comms_;
    const CommKey key{async ? g.name : std::string(), g.ranks};
    auto it = comms.find(key);
    if (it != comms.end()) {
      if (it->second.broken)
        throw CommError(fmt::format(
            "{} on group {} at world rank {}: the group's communicator is unusable after an "
            "earlier failure",
            op, g.describe(), g.ranks[g.rank]));
      return it->second;
    }
    ncclUniqueId id;
    if (g.rank == 0) MEGATON_NCCL_CHECK(ncclGetUniqueId(&id));
    MEGATON_MPI_CHECK(MPI_Bcast(&id, int(sizeof(id)), MPI_BYTE, 0, mpi_groups_.get(g)));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = g.name.c_str();
    Entry& e = comms[key];
    e.broken = true;  // until set up: a failed setup leaves nothing to finalize
    std::lock_guard<detail::NcclMutex> nccl(nccl_mu_);
    MEGATON_NCCL_CHECK(ncclCommInitRankConfig(&e.comm, g.size(), id, g.rank, &config));
    e.broken = false;
    wait_ready(e, "communicator setup", g, deadline_from_now());
    return e;
  }

  // Records the operation's completion event for the watchdog.
  void watch(Entry& e, const char* op, const Group& g, Clock::time_point deadline,
             cudaStream_t stream) {
    watchdog_.watch(
        e.comm, stream, deadline, timeout_message(op, g),
        fmt::format("{} on group {} failed at world rank {}", op, g.describe(), g.ranks[g.rank]),
        g.ranks[g.rank]);
  }

  // Calls enqueue(comm, stream) under nccl_mu_ and waits until the (non-blocking)
  // communicator has taken it; a failure aborts the communicator and throws CommError.
  template <typename Enqueue>
  void enqueue_ready(Entry& e, const char* op, const Group& g, cudaStream_t stream,
                     Clock::time_point deadline, Enqueue& enqueue) {
    std::lock_guard<detail::NcclMutex> nccl(nccl_mu_);
    ncclResult_t rc = enqueue(e.comm, stream);
    if (rc != ncclSuccess && rc != ncclInProgress)
      abort_and_throw(
          e, fmt::format("{} on group {} failed at world rank {}: {} ({})", op, g.describe(),
                         g.ranks[g.rank], ncclGetErrorString(rc), ncclGetLastError(e.comm)));
    wait_ready(e, op, g, deadline);  // the enqueue itself may still be in progress
  }

  // Enqueues an operation on the compute stream; the watchdog keeps its deadline, or,
  // wait_host, this thread waits for it to complete.
  template <typename Enqueue>
  void run(const Group& g, const char* op, Enqueue enqueue, bool wait_host = false) {
    Entry& e = comm_of(g, op);
    cudaStream_t stream = ::megaton::cuda::stream();
    const Clock::time_point deadline = deadline_from_now();
    // MEGATON_OP_PROFILE=1 times the collective on the compute stream under its name.
    const ops::OpProfileScope profile_scope(op);
    enqueue_ready(e, op, g, stream, deadline, enqueue);
    if (!wait_host) {
      watch(e, op, g, deadline, stream);
      return;
    }
    const Clock::time_point start = Clock::now();
    for (;;) {
      cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) MEGATON_CUDA_CHECK(q);
      {
        std::lock_guard<detail::NcclMutex> nccl(nccl_mu_);
        ncclResult_t state = ncclSuccess;
        MEGATON_NCCL_CHECK(ncclCommGetAsyncError(e.comm, &state));
        if (state != ncclSuccess && state != ncclInProgress)
          abort_and_throw(
              e, fmt::format("{} on group {} failed at world rank {}: {} ({})", op, g.describe(),
                             g.ranks[g.rank], ncclGetErrorString(state), ncclGetLastError(e.comm)));
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline) abort_and_throw(e, timeout_message(op, g));
      if (now - start < std::chrono::milliseconds(1))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // An operation on the communication stream; wait() orders the compute stream after it.
  class NcclWork final : public CommWork {
   public:
    NcclWork(cudaEvent_t done, std::vector<Tensor> keep) : done_(done), keep_(std::move(keep)) {}
    ~NcclWork() override {
      if (!waited_) cudaStreamWaitEvent(::megaton::cuda::stream(), done_, 0);
      cudaEventDestroy(done_);  // released by CUDA once the event has completed
    }
    void wait() override {
      if (waited_) return;
      MEGATON_CUDA_CHECK(cudaStreamWaitEvent(::megaton::cuda::stream(), done_, 0));
      waited_ = true;
      // The compute stream now runs after the operation: the caching allocator may hand
      // these tensors' memory to later compute-stream work.
      keep_.clear();
    }

   private:
    cudaEvent_t done_;
    std::vector<Tensor> keep_;  // the operation's tensors, alive until it is waited for
    bool waited_ = false;
  };

  cudaStream_t side_stream(Entry& e) {
    if (!e.stream) {
      int least = 0, greatest = 0;
      MEGATON_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      MEGATON_CUDA_CHECK(cudaStreamCreateWithPriority(&e.stream, cudaStreamNonBlocking, greatest));
    }
    return e.stream;
  }

  // Enqueues an operation on the communication stream after the compute stream's work so
  // far; the watchdog keeps its deadline.
  // then(stream), when given, queues more work on the communication stream after the
  // operation, before the work's completion event.
  template <typename Enqueue>
  std::unique_ptr<CommWork> run_async(const Group& g, const char* op, std::vector<Tensor> keep,
                                      Enqueue enqueue,
                                      const std::function<void(cudaStream_t)>& then = {}) {
    Entry& e = comm_of(g, op, /*async=*/true);
    cudaStream_t stream = side_stream(e);
    cudaEvent_t ready, done;
    MEGATON_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    MEGATON_CUDA_CHECK(cudaEventRecord(ready, ::megaton::cuda::stream()));
    MEGATON_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0));
    MEGATON_CUDA_CHECK(cudaEventDestroy(ready));
    const Clock::time_point deadline = deadline_from_now();
    enqueue_ready(e, op, g, stream, deadline, enqueue);
    watch(e, op, g, deadline, stream);
    if (then) then(stream);
    MEGATON_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    MEGATON_CUDA_CHECK(cudaEventRecord(done, stream));
    return std::make_unique<NcclWork>(done, std::move(keep));
  }

  // The slot of one pull_rows and every member's input rows (the bounds of their runs).
  struct SlotUse {
    int slot = 0;
    std::vector<int64_t> rows;
  };

  // Gathers every member's input rows, makes the slots hold the largest input and takes
  // the group's next slot (collective over g).
  SlotUse reserve_slot(detail::PeerMemory& peers, int64_t rows, size_t row_bytes, const Group& g) {
    SlotUse use;
    use.rows.resize(size_t(g.size()));
    MEGATON_MPI_CHECK(
        MPI_Allgather(&rows, 1, MPI_INT64_T, use.rows.data(), 1, MPI_INT64_T, mpi_groups_.get(g)));
    peers.reserve(size_t(*std::max_element(use.rows.begin(), use.rows.end())) * row_bytes,
                  ::megaton::cuda::stream());
    int& next = next_slot_[g.ranks];
    use.slot = next;
    next ^= 1;
    return use;
  }

  // The group's peer memory, or null where it has none; set up on first use (collective).
  detail::PeerMemory* peer_memory_of(const Group& g) {
    auto it = peer_memory_.find(g.ranks);
    if (it == peer_memory_.end()) {
      MPI_Comm comm = mpi_groups_.get(g);
      std::unique_ptr<detail::PeerMemory> made;
      if (detail::PeerMemory::available(comm)) made = std::make_unique<detail::PeerMemory>(comm);
      it = peer_memory_.emplace(g.ranks, std::move(made)).first;
    }
    return it->second.get();
  }

  detail::MpiGroups mpi_groups_;
  std::map<std::vector<int>, std::unique_ptr<detail::PeerMemory>> peer_memory_;
  std::map<std::vector<int>, int> next_slot_;           // the slot of the group's next pull_rows
  std::map<std::vector<int>, SlotUse> pending_inputs_;  // pull_input's, until its pull_rows
  // Communicators by (group name, ranks): the blocking ones by ranks alone (the name part
  // empty; groups of the same ranks share one), the asynchronous ones per group kind too,
  // so that, e.g., an EP exchange does not queue on the stream of a DP reduce-scatter whose
  // group has the same ranks.
  using CommKey = std::pair<std::string, std::vector<int>>;
  std::map<CommKey, Entry> comms_;
  std::map<CommKey, Entry> async_comms_;
  Tensor barrier_scratch_;
  Tensor async_barrier_scratch_;  // the same for pulls on the communication streams
  // Held by every NCCL call on a communicator in use (enqueues, progress polls); the
  // watchdog polls only when it can take it at once.
  detail::NcclMutex nccl_mu_;
  detail::NcclWatchdog watchdog_{nccl_mu_};
};

}  // namespace

namespace detail {
std::unique_ptr<Comm> make_nccl_comm() { return std::make_unique<NcclComm>(); }
}  // namespace detail

}  // namespace megaton::dist
