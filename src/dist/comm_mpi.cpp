// MpiComm: Comm for CPU tensors over MPI. Every operation is a nonblocking MPI call
// polled with MPI_Testall until it completes or its deadline passes.
//
// bf16 sums are computed in fp32: the tensor is widened, reduced as MPI_FLOAT and
// rounded back once. A custom MPI_Op summing bf16 pairs would round after every
// addition, so the result would depend on the reduction tree; widening costs twice the
// bytes, which matters little on CPU ranks (the reference backend), and gives the sum
// that a one-rank fp32 accumulation rounds to bf16.
#include <chrono>
#include <climits>
#include <functional>
#include <set>
#include <thread>

#include "dist/comm.h"
#include "dist/mpi_util.h"

namespace megaton::dist {
namespace detail {

bool mpi_running() {
  int initialized = 0, finalized = 0;
  MEGATON_MPI_CHECK(MPI_Initialized(&initialized));
  MEGATON_MPI_CHECK(MPI_Finalized(&finalized));
  return initialized && !finalized;
}

MPI_Comm MpiGroups::get(const Group& g) {
  auto it = comms_.find(g.ranks);
  if (it != comms_.end()) return it->second;
  MEGATON_CHECK(mpi_running(),
                "group {} has {} ranks but MPI is not running (launch with mpirun; the "
                "program must call dist::init)",
                g.describe(), g.size());
  MEGATON_CHECK(g.is_member(), "group {}: this rank is not a member", g.describe());
  int world = 0;
  MEGATON_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  for (int r : g.ranks)
    MEGATON_CHECK(r >= 0 && r < world, "group {}: rank {} outside a world of {}", g.describe(), r,
                  world);
  // The tag tells apart creations that overlap in time on the same ranks; any value up
  // to 32767 is valid everywhere.
  const int tag = static_cast<int>(std::hash<std::string>{}(g.describe()) % 32768);
  MPI_Group world_group, group;
  MPI_Comm comm;
  MEGATON_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  MEGATON_MPI_CHECK(MPI_Group_incl(world_group, g.size(), g.ranks.data(), &group));
  MEGATON_MPI_CHECK(MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &comm));
  MEGATON_MPI_CHECK(MPI_Group_free(&group));
  MEGATON_MPI_CHECK(MPI_Group_free(&world_group));
  MEGATON_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  MEGATON_MPI_CHECK(MPI_Comm_set_name(comm, g.name.c_str()));
  int rank = -1;
  MEGATON_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MEGATON_CHECK(rank == g.rank, "group {}: MPI rank {} but index {}", g.describe(), rank, g.rank);
  comms_.emplace(g.ranks, comm);
  return comm;
}

}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::BF16:
    case DType::F16:
      return MPI_UINT16_T;  // moved, never reduced (bf16 sums go through fp32)
    case DType::F8E4M3:
    case DType::F8E5M2:
      return MPI_UINT8_T;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
  }
  MEGATON_CHECK(false, "no MPI type for dtype {}", int(d));
  return MPI_DATATYPE_NULL;
}

// MPI counts and displacements are int.
int mpi_count(int64_t n) {
  MEGATON_CHECK(n >= 0 && n <= INT_MAX, "{} elements exceed MPI's int counts", n);
  return static_cast<int>(n);
}

bool overlaps(const Tensor& a, const Tensor& b) {
  auto lo_a = static_cast<const char*>(a.raw()), lo_b = static_cast<const char*>(b.raw());
  return lo_a < lo_b + b.nbytes() && lo_b < lo_a + a.nbytes();
}

// An operation in flight: its requests and everything MPI reads or writes until it
// completes (tensors hold their storage alive, count arrays their memory).
struct Pending {
  std::vector<MPI_Request> requests;
  std::vector<Tensor> buffers;
  std::vector<std::vector<int>> arrays;
};

class MpiComm final : public Comm {
 public:
  ~MpiComm() override {
    // An operation abandoned after a timeout may still complete and write its buffers;
    // keep those alive for the rest of the process unless it has finished.
    // A destructor must not throw: MPI's own results are only looked at here.
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (abandoned_.empty() || !initialized || finalized) return;
    bool all_done = true;
    for (Pending& p : abandoned_) {
      int done = 0;
      if (MPI_Testall(int(p.requests.size()), p.requests.data(), &done, MPI_STATUSES_IGNORE) !=
              MPI_SUCCESS ||
          !done)
        all_done = false;
    }
    if (!all_done) new std::vector<Pending>(std::move(abandoned_));  // deliberately leaked
  }

  Device device() const override { return Device::CPU; }

 protected:
  void prepare_group(const Group& g) override { groups_.get(g); }

  void do_all_reduce(Tensor& t, const Group& g, ReduceOp op) override {
    start_all_reduce(t, g, op)->wait();
  }
  void do_reduce_scatter(const Tensor& in, Tensor& out, const Group& g) override {
    start_reduce_scatter(in, out, g)->wait();
  }
  void do_all_gather(const Tensor& in, Tensor& out, const Group& g) override {
    start_all_gather(in, out, g)->wait();
  }
  std::unique_ptr<CommWork> do_all_reduce_async(Tensor& t, const Group& g) override {
    return start_all_reduce(t, g, ReduceOp::Sum);
  }
  std::unique_ptr<CommWork> do_reduce_scatter_async(const Tensor& in, Tensor& out,
                                                    const Group& g) override {
    return start_reduce_scatter(in, out, g);
  }
  std::unique_ptr<CommWork> do_all_gather_async(const Tensor& in, Tensor& out,
                                                const Group& g) override {
    return start_all_gather(in, out, g);
  }

  void do_all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                      std::span<const int64_t> recv_counts, const Group& g) override {
    Pending p = start_all_to_allv(in, send_counts, out, recv_counts, g);
    wait(p, "all_to_allv", g);
  }

  std::unique_ptr<CommWork> do_all_to_allv_async(const Tensor& in,
                                                 std::span<const int64_t> send_counts, Tensor& out,
                                                 std::span<const int64_t> recv_counts,
                                                 const Group& g) override {
    return std::make_unique<MpiWork>(*this, start_all_to_allv(in, send_counts, out, recv_counts, g),
                                     "all_to_allv", g, nullptr);
  }

  void do_send_recv(const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer,
                    const Group& g) override {
    const char* op = send_recv_name(send_t, recv_t);
    Pending p = start_send_recv(send_t, send_peer, recv_t, recv_peer, g, op);
    wait(p, op, g);
  }

  std::unique_ptr<CommWork> do_send_recv_async(const Tensor* send_t, int send_peer, Tensor* recv_t,
                                               int recv_peer, const Group& g) override {
    const char* op = send_recv_name(send_t, recv_t);
    return std::make_unique<MpiWork>(
        *this, start_send_recv(send_t, send_peer, recv_t, recv_peer, g, op), op, g, nullptr);
  }

  void do_broadcast(Tensor& t, int root, const Group& g) override {
    MPI_Comm comm = comm_of(g, "broadcast");
    Pending p{{MPI_REQUEST_NULL}, {t}, {}};
    MEGATON_MPI_CHECK(
        MPI_Ibcast(t.raw(), mpi_count(t.numel()), mpi_type(t.dtype()), root, comm, &p.requests[0]));
    wait(p, "broadcast", g);
  }

  void do_barrier(const Group& g) override {
    MPI_Comm comm = comm_of(g, "barrier");
    Pending p{{MPI_REQUEST_NULL}, {}, {}};
    MEGATON_MPI_CHECK(MPI_Ibarrier(comm, &p.requests[0]));
    wait(p, "barrier", g);
  }

 private:
  static const char* send_recv_name(const Tensor* send_t, const Tensor* recv_t) {
    return send_t && recv_t ? "send_recv" : send_t ? "send" : "recv";
  }

  // The MPI_Ialltoallv of an all_to_allv, started.
  Pending start_all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                            std::span<const int64_t> recv_counts, const Group& g) {
    MPI_Comm comm = comm_of(g, "all_to_allv");
    const int n = g.size();
    std::vector<int> scounts(n), sdispls(n), rcounts(n), rdispls(n);
    int64_t soff = 0, roff = 0;
    for (int i = 0; i < n; ++i) {
      scounts[i] = mpi_count(send_counts[i]);
      rcounts[i] = mpi_count(recv_counts[i]);
      sdispls[i] = mpi_count(soff);
      rdispls[i] = mpi_count(roff);
      soff += send_counts[i];
      roff += recv_counts[i];
    }
    const MPI_Datatype type = mpi_type(in.dtype());
    Tensor src = overlaps(in, out) ? in.clone() : in;
    Pending p{{MPI_REQUEST_NULL}, {src, out}, {}};
    p.arrays = {std::move(scounts), std::move(sdispls), std::move(rcounts), std::move(rdispls)};
    MEGATON_MPI_CHECK(MPI_Ialltoallv(src.raw(), p.arrays[0].data(), p.arrays[1].data(), type,
                                     out.raw(), p.arrays[2].data(), p.arrays[3].data(), type, comm,
                                     &p.requests[0]));
    return p;
  }

  // The MPI_Irecv and MPI_Isend of a send_recv, started.
  Pending start_send_recv(const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer,
                          const Group& g, const char* op) {
    MPI_Comm comm = comm_of(g, op);
    constexpr int kTag = 0;  // messages between two ranks on one communicator stay in order
    Pending p;
    if (recv_t) {
      p.requests.push_back(MPI_REQUEST_NULL);
      p.buffers.push_back(*recv_t);
      MEGATON_MPI_CHECK(MPI_Irecv(recv_t->raw(), mpi_count(recv_t->numel()),
                                  mpi_type(recv_t->dtype()), recv_peer, kTag, comm,
                                  &p.requests.back()));
    }
    if (send_t) {
      p.requests.push_back(MPI_REQUEST_NULL);
      p.buffers.push_back(*send_t);
      MEGATON_MPI_CHECK(MPI_Isend(send_t->raw(), mpi_count(send_t->numel()),
                                  mpi_type(send_t->dtype()), send_peer, kTag, comm,
                                  &p.requests.back()));
    }
    return p;
  }

  // A started operation; wait() polls it to completion, then runs `finish` (copying a
  // widened bf16 result back).
  class MpiWork final : public CommWork {
   public:
    // The call site of the public call that started it (Comm::site_ now), which a timeout
    // in wait() names, whatever was called since.
    MpiWork(MpiComm& comm, Pending pending, const char* op, Group g, std::function<void()> finish)
        : comm_(comm),
          pending_(std::move(pending)),
          op_(op),
          group_(std::move(g)),
          finish_(std::move(finish)),
          site_(comm.site_) {}
    ~MpiWork() override {
      if (waited_) return;
      try {
        wait();
      } catch (...) {  // a destructor must not throw; the error was the caller's to see
      }
    }
    void wait() override {
      if (waited_) return;
      waited_ = true;
      comm_.site_ = site_;
      comm_.wait(pending_, op_, group_);
      if (finish_) finish_();
    }

   private:
    MpiComm& comm_;
    Pending pending_;
    const char* op_;
    Group group_;
    std::function<void()> finish_;
    std::source_location site_;
    bool waited_ = false;
  };

  std::unique_ptr<CommWork> start_all_reduce(Tensor& t, const Group& g, ReduceOp op) {
    MPI_Comm comm = comm_of(g, "all_reduce");
    // 16-bit floats are summed in fp32 (MPI has no bf16 or fp16 sum).
    const DType dtype = t.dtype();
    const bool widen = dtype == DType::BF16 || dtype == DType::F16;
    Tensor buf = widen ? t.to(DType::F32) : t;
    Pending p{{MPI_REQUEST_NULL}, {buf}, {}};
    MEGATON_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf.raw(), mpi_count(buf.numel()),
                                     mpi_type(buf.dtype()), op == ReduceOp::Sum ? MPI_SUM : MPI_MAX,
                                     comm, &p.requests[0]));
    std::function<void()> finish;
    if (widen) finish = [t, buf, dtype]() mutable { t.copy_from(buf.to(dtype)); };
    return std::make_unique<MpiWork>(*this, std::move(p), "all_reduce", g, std::move(finish));
  }

  std::unique_ptr<CommWork> start_reduce_scatter(const Tensor& in, Tensor& out, const Group& g) {
    MPI_Comm comm = comm_of(g, "reduce_scatter");
    const DType dtype = in.dtype();
    const bool widen = dtype == DType::BF16 || dtype == DType::F16;
    Tensor src = widen ? in.to(DType::F32) : (overlaps(in, out) ? in.clone() : in);
    Tensor dst = widen ? Tensor::empty(out.shape(), DType::F32) : out;
    Pending p{{MPI_REQUEST_NULL}, {src, dst}, {}};
    MEGATON_MPI_CHECK(MPI_Ireduce_scatter_block(src.raw(), dst.raw(), mpi_count(dst.numel()),
                                                MPI_FLOAT, MPI_SUM, comm, &p.requests[0]));
    std::function<void()> finish;
    if (widen) finish = [out, dst, dtype]() mutable { out.copy_from(dst.to(dtype)); };
    return std::make_unique<MpiWork>(*this, std::move(p), "reduce_scatter", g, std::move(finish));
  }

  std::unique_ptr<CommWork> start_all_gather(const Tensor& in, Tensor& out, const Group& g) {
    MPI_Comm comm = comm_of(g, "all_gather");
    const int n = mpi_count(in.numel());
    const MPI_Datatype type = mpi_type(in.dtype());
    mpi_count(out.numel());
    // This rank's input may already be its chunk of the output (Megatron gathers
    // parameter shards in place); any other overlap is copied away first.
    const bool in_place =
        in.raw() == static_cast<char*>(out.raw()) + int64_t(g.rank) * int64_t(in.nbytes());
    Tensor src = !in_place && overlaps(in, out) ? in.clone() : in;
    Pending p{{MPI_REQUEST_NULL}, {src, out}, {}};
    MEGATON_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : src.raw(), n, type, out.raw(), n,
                                     type, comm, &p.requests[0]));
    return std::make_unique<MpiWork>(*this, std::move(p), "all_gather", g, nullptr);
  }

  MPI_Comm comm_of(const Group& g, const char* op) {
    if (broken_.count(g.ranks))
      throw CommError(fmt::format(
          "{} on group {} at world rank {}: the group's communicator is unusable after an "
          "earlier timeout",
          op, g.describe(), g.ranks[g.rank]));
    return groups_.get(g);
  }

  // Polls until every request of p has completed. Hot (yielding) for the first
  // millisecond, since a training step's collectives are short, then in short sleeps so
  // a waiting rank leaves the cores to ranks still computing (CPU ranks are often
  // oversubscribed), and in 1 ms sleeps after a second. MPI_Testall also drives MPI's
  // progress, which nonblocking collectives need.
  void wait(Pending& p, const char* op, const Group& g) {
    const Clock::time_point start = Clock::now();
    const Clock::time_point deadline = start + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(timeout_s()));
    for (;;) {
      int done = 0;
      MEGATON_MPI_CHECK(
          MPI_Testall(int(p.requests.size()), p.requests.data(), &done, MPI_STATUSES_IGNORE));
      if (done) return;
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        // A started collective cannot be cancelled: keep its buffers and mark the
        // communicator broken so no later call mixes with it.
        broken_.insert(g.ranks);
        abandoned_.push_back(std::move(p));
        throw CommError(timeout_message(op, g));
      }
      const auto waited = now - start;
      if (waited < std::chrono::milliseconds(1))
        std::this_thread::yield();
      else if (waited < std::chrono::seconds(1))
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  detail::MpiGroups groups_;
  std::set<std::vector<int>> broken_;
  std::vector<Pending> abandoned_;
};

}  // namespace

namespace detail {
std::unique_ptr<Comm> make_mpi_comm() { return std::make_unique<MpiComm>(); }
}  // namespace detail

}  // namespace megaton::dist
