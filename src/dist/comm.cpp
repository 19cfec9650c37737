// Comm's argument checks, the size-1 shortcuts and the choice of transport.
#include "dist/comm.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <numeric>
#include <string_view>

#include "core/error.h"

namespace megaton::dist {

double default_timeout_s() {
  const char* env = std::getenv("MEGATON_COMM_TIMEOUT_S");
  if (!env) return 300.0;
  char* end = nullptr;
  double seconds = std::strtod(env, &end);
  if (*env == '\0' || *end != '\0' || !(seconds > 0))
    fail(
        "environment variable MEGATON_COMM_TIMEOUT_S must be a positive number of seconds "
        "(got '{}')",
        env);
  return seconds;
}

Comm::Comm(double timeout_s) { set_timeout_s(timeout_s); }

void Comm::set_timeout_s(double seconds) {
  MEGATON_CHECK(seconds > 0, "communication timeout must be positive (got {})", seconds);
  timeout_s_ = seconds;
}

namespace {
std::atomic<int64_t> g_comm_iteration{-1};

// "src/model/router.cpp:117": the path from the source tree's src/ (or tests/) on.
std::string site_name(const std::source_location& site) {
  std::string_view file = site.file_name();
  size_t at = std::string_view::npos;
  for (std::string_view dir : {"/src/", "/tests/"})
    if (const size_t p = file.rfind(dir); p != std::string_view::npos)
      at = at == std::string_view::npos ? p : std::max(at, p);
  if (at != std::string_view::npos) file.remove_prefix(at + 1);
  return fmt::format("{}:{}", file, site.line());
}
}  // namespace

void set_comm_iteration(int64_t iteration) { g_comm_iteration.store(iteration); }

std::string Comm::timeout_message(const char* op, const Group& g) const {
  const int64_t iteration = g_comm_iteration.load();
  return fmt::format("{} on group {} timed out after {:g} s at world rank {}, called from {}{}", op,
                     g.describe(), timeout_s_, g.ranks.at(g.rank), site_name(site_),
                     iteration >= 0 ? fmt::format(" in iteration {}", iteration) : "");
}

void Comm::check_tensor(const Tensor& t, const char* op, const char* what) const {
  MEGATON_CHECK(t.defined(), "{}: {} is not defined", op, what);
  MEGATON_CHECK(t.device() == device(), "{}: {} is on the {} but this Comm is for the {}", op, what,
                t.device() == Device::CPU ? "CPU" : "GPU", device() == Device::CPU ? "CPU" : "GPU");
}

namespace {
void check_member(const Group& g, const char* op) {
  MEGATON_CHECK(g.is_member() && g.rank < g.size(), "{} on group {}: this rank is not a member", op,
                g.describe());
}
void check_index(int index, const Group& g, const char* op, const char* what) {
  MEGATON_CHECK(index >= 0 && index < g.size(), "{} on group {}: {} {} is outside the group", op,
                g.describe(), what, index);
}
}  // namespace

void Comm::prepare(const Grid& grid) {
  for (const Group& g : grid.groups())
    if (g.is_member() && g.size() > 1) prepare_group(g);
}

bool Comm::check_all_reduce(Tensor& t, const Group& g, ReduceOp op) const {
  check_member(g, "all_reduce");
  check_tensor(t, "all_reduce", "tensor");
  const DType d = t.dtype();
  if (op == ReduceOp::Sum)
    MEGATON_CHECK(d == DType::F32 || d == DType::BF16 || d == DType::F16 || d == DType::I32 ||
                      d == DType::I64,
                  "all_reduce sum of {} is not supported", dtype_name(d));
  else
    MEGATON_CHECK(d == DType::F32 || d == DType::I32 || d == DType::I64,
                  "all_reduce max of {} is not supported", dtype_name(d));
  return g.size() > 1 && t.numel() > 0;
}

bool Comm::check_reduce_scatter(const Tensor& in, Tensor& out, const Group& g) const {
  check_member(g, "reduce_scatter");
  check_tensor(in, "reduce_scatter", "input");
  check_tensor(out, "reduce_scatter", "output");
  MEGATON_CHECK(
      in.dtype() == out.dtype() &&
          (in.dtype() == DType::F32 || in.dtype() == DType::BF16 || in.dtype() == DType::F16),
      "reduce_scatter of {} into {}: fp32, bf16 or fp16 for both", dtype_name(in.dtype()),
      dtype_name(out.dtype()));
  MEGATON_CHECK(in.numel() == out.numel() * g.size(),
                "reduce_scatter on group {}: input has {} elements, output {} (needs {} x output)",
                g.describe(), in.numel(), out.numel(), g.size());
  if (g.size() == 1) {
    if (out.raw() != in.raw()) out.copy_from(in);
    return false;
  }
  return out.numel() > 0;
}

bool Comm::check_all_gather(const Tensor& in, Tensor& out, const Group& g) const {
  check_member(g, "all_gather");
  check_tensor(in, "all_gather", "input");
  check_tensor(out, "all_gather", "output");
  MEGATON_CHECK(in.dtype() == out.dtype(), "all_gather of {} into {}", dtype_name(in.dtype()),
                dtype_name(out.dtype()));
  MEGATON_CHECK(out.numel() == in.numel() * g.size(),
                "all_gather on group {}: input has {} elements, output {} (needs {} x input)",
                g.describe(), in.numel(), out.numel(), g.size());
  if (g.size() == 1) {
    if (out.raw() != in.raw()) out.copy_from(in);
    return false;
  }
  return in.numel() > 0;
}

void Comm::all_reduce(Tensor& t, const Group& g, ReduceOp op, std::source_location site) {
  site_ = site;
  if (check_all_reduce(t, g, op)) do_all_reduce(t, g, op);
}

void Comm::reduce_scatter(const Tensor& in, Tensor& out, const Group& g,
                          std::source_location site) {
  site_ = site;
  if (check_reduce_scatter(in, out, g)) do_reduce_scatter(in, out, g);
}

void Comm::all_gather(const Tensor& in, Tensor& out, const Group& g, std::source_location site) {
  site_ = site;
  if (check_all_gather(in, out, g)) do_all_gather(in, out, g);
}

namespace {
// The work of an operation that needed no transport: finished when started.
class FinishedWork final : public CommWork {
 public:
  void wait() override {}
};
}  // namespace

std::unique_ptr<CommWork> Comm::all_reduce_async(Tensor& t, const Group& g,
                                                 std::source_location site) {
  site_ = site;
  if (!check_all_reduce(t, g, ReduceOp::Sum)) return std::make_unique<FinishedWork>();
  return do_all_reduce_async(t, g);
}

std::unique_ptr<CommWork> Comm::reduce_scatter_async(const Tensor& in, Tensor& out, const Group& g,
                                                     std::source_location site) {
  site_ = site;
  if (!check_reduce_scatter(in, out, g)) return std::make_unique<FinishedWork>();
  return do_reduce_scatter_async(in, out, g);
}

std::unique_ptr<CommWork> Comm::all_gather_async(const Tensor& in, Tensor& out, const Group& g,
                                                 std::source_location site) {
  site_ = site;
  if (!check_all_gather(in, out, g)) return std::make_unique<FinishedWork>();
  return do_all_gather_async(in, out, g);
}

bool Comm::check_all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                             std::span<const int64_t> recv_counts, const Group& g) const {
  check_member(g, "all_to_allv");
  check_tensor(in, "all_to_allv", "input");
  check_tensor(out, "all_to_allv", "output");
  MEGATON_CHECK(in.dtype() == out.dtype(), "all_to_allv of {} into {}", dtype_name(in.dtype()),
                dtype_name(out.dtype()));
  MEGATON_CHECK(static_cast<int>(send_counts.size()) == g.size() &&
                    static_cast<int>(recv_counts.size()) == g.size(),
                "all_to_allv on group {}: {} send and {} receive counts for {} members",
                g.describe(), send_counts.size(), recv_counts.size(), g.size());
  for (int i = 0; i < g.size(); ++i)
    MEGATON_CHECK(send_counts[i] >= 0 && recv_counts[i] >= 0,
                  "all_to_allv on group {}: negative count for member {}", g.describe(), i);
  const int64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), int64_t(0));
  const int64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t(0));
  MEGATON_CHECK(sent == in.numel() && received == out.numel(),
                "all_to_allv on group {}: counts add up to {} sent and {} received, tensors hold "
                "{} and {} elements",
                g.describe(), sent, received, in.numel(), out.numel());
  if (g.size() > 1) return true;
  MEGATON_CHECK(sent == received, "all_to_allv to itself: {} sent, {} received", sent, received);
  out.copy_from(in);
  return false;
}

void Comm::all_to_allv(const Tensor& in, std::span<const int64_t> send_counts, Tensor& out,
                       std::span<const int64_t> recv_counts, const Group& g,
                       std::source_location site) {
  site_ = site;
  if (check_all_to_allv(in, send_counts, out, recv_counts, g))
    do_all_to_allv(in, send_counts, out, recv_counts, g);
}

std::unique_ptr<CommWork> Comm::all_to_allv_async(const Tensor& in,
                                                  std::span<const int64_t> send_counts, Tensor& out,
                                                  std::span<const int64_t> recv_counts,
                                                  const Group& g, std::source_location site) {
  site_ = site;
  if (!check_all_to_allv(in, send_counts, out, recv_counts, g))
    return std::make_unique<FinishedWork>();
  return do_all_to_allv_async(in, send_counts, out, recv_counts, g);
}

std::unique_ptr<CommWork> Comm::do_all_to_allv_async(const Tensor& in,
                                                     std::span<const int64_t> send_counts,
                                                     Tensor& out,
                                                     std::span<const int64_t> recv_counts,
                                                     const Group& g) {
  do_all_to_allv(in, send_counts, out, recv_counts, g);
  return std::make_unique<FinishedWork>();
}

void Comm::all_to_all(const Tensor& in, Tensor& out, const Group& g, std::source_location site) {
  site_ = site;
  check_member(g, "all_to_all");
  MEGATON_CHECK(in.numel() == out.numel() && in.numel() % g.size() == 0,
                "all_to_all on group {}: {} and {} elements, need equal multiples of {}",
                g.describe(), in.numel(), out.numel(), g.size());
  std::vector<int64_t> counts(g.size(), in.numel() / g.size());
  all_to_allv(in, counts, out, counts, g, site);
}

namespace {
// The lengths of a run list without its empty runs (those are skipped on both sides).
std::vector<int64_t> nonempty_lengths(const std::vector<RowRun>& runs) {
  std::vector<int64_t> out;
  for (const RowRun& r : runs)
    if (r.count > 0) out.push_back(r.count);
  return out;
}

int64_t total_rows(const std::vector<RowRun>& runs) {
  int64_t n = 0;
  for (const RowRun& r : runs) n += r.count;
  return n;
}

// t's shape with `rows` rows.
Shape with_rows(const Tensor& t, int64_t rows) {
  Shape shape = t.shape();
  shape[0] = rows;
  return shape;
}
}  // namespace

void Comm::check_row_exchange(const Tensor& in, const Tensor& out, const Group& g,
                              const char* op) const {
  check_member(g, op);
  check_tensor(in, op, "input");
  check_tensor(out, op, "output");
  MEGATON_CHECK(in.dtype() == out.dtype(), "{} of {} into {}", op, dtype_name(in.dtype()),
                dtype_name(out.dtype()));
  MEGATON_CHECK(in.shape().size() >= 1 && out.shape().size() == in.shape().size() &&
                    std::equal(in.shape().begin() + 1, in.shape().end(), out.shape().begin() + 1),
                "{}: rows of input {} and output {} differ", op, shape_str(in.shape()),
                shape_str(out.shape()));
}

bool Comm::check_all_to_allv_rows(const Tensor& in, const RowRuns& send, Tensor& out,
                                  const RowRuns& recv, const Group& g) const {
  const char* op = "all_to_allv_rows";
  check_row_exchange(in, out, g, op);
  MEGATON_CHECK(int(send.size()) == g.size() && int(recv.size()) == g.size(),
                "{} on group {}: {} send and {} receive run lists for {} members", op, g.describe(),
                send.size(), recv.size(), g.size());
  auto check_runs = [&](const RowRuns& runs, int64_t rows, const char* what) {
    for (int m = 0; m < g.size(); ++m)
      for (const RowRun& r : runs[m])
        MEGATON_CHECK(r.first >= 0 && r.count >= 0 && r.first + r.count <= rows,
                      "{} on group {}: {} run [{}, +{}) for member {} outside {} rows", op,
                      g.describe(), what, r.first, r.count, m, rows);
  };
  check_runs(send, in.dim(0), "send");
  check_runs(recv, out.dim(0), "receive");
  // What this member sends itself is what it receives from itself.
  MEGATON_CHECK(nonempty_lengths(send[g.rank]) == nonempty_lengths(recv[g.rank]),
                "{} on group {}: the runs to and from this member differ", op, g.describe());
  if (g.size() > 1) return true;
  const std::vector<RowRun>& from = send[0];
  const std::vector<RowRun>& to = recv[0];
  for (size_t i = 0, j = 0;; ++i, ++j) {
    while (i < from.size() && from[i].count == 0) ++i;
    while (j < to.size() && to[j].count == 0) ++j;
    if (i == from.size()) break;
    out.rows(to[j].first, to[j].count).copy_from(in.rows(from[i].first, from[i].count));
  }
  return false;
}

void Comm::all_to_allv_rows(const Tensor& in, const RowRuns& send, Tensor& out, const RowRuns& recv,
                            const Group& g, std::source_location site) {
  site_ = site;
  if (check_all_to_allv_rows(in, send, out, recv, g)) do_all_to_allv_rows(in, send, out, recv, g);
}

void Comm::do_all_to_allv_rows(const Tensor& in, const RowRuns& send, Tensor& out,
                               const RowRuns& recv, const Group& g) {
  const int n = g.size();
  const int64_t row_size = row_numel(in);
  std::vector<int64_t> send_counts(n), recv_counts(n);
  int64_t send_rows = 0, recv_rows = 0;
  for (int m = 0; m < n; ++m) {
    const int64_t to_m = total_rows(send[m]), from_m = total_rows(recv[m]);
    send_counts[m] = to_m * row_size;
    recv_counts[m] = from_m * row_size;
    send_rows += to_m;
    recv_rows += from_m;
  }
  Tensor packed = Tensor::empty(with_rows(in, send_rows), in.dtype(), in.device());
  int64_t at = 0;
  for (int m = 0; m < n; ++m)
    for (const RowRun& r : send[m]) {
      if (r.count > 0) packed.rows(at, r.count).copy_from(in.rows(r.first, r.count));
      at += r.count;
    }
  Tensor received = Tensor::empty(with_rows(out, recv_rows), out.dtype(), out.device());
  do_all_to_allv(packed, send_counts, received, recv_counts, g);
  at = 0;
  for (int m = 0; m < n; ++m)
    for (const RowRun& r : recv[m]) {
      if (r.count > 0) out.rows(r.first, r.count).copy_from(received.rows(at, r.count));
      at += r.count;
    }
}

bool Comm::check_pull_rows(const Tensor& in, std::span<const PullRun> runs, Tensor& out,
                           const Group& g) const {
  const char* op = "pull_rows";
  check_row_exchange(in, out, g, op);
  for (const PullRun& r : runs) {
    check_index(r.member, g, op, "run member");
    MEGATON_CHECK(r.count >= 0 && r.src_first >= 0 && r.dst_first >= 0 &&
                      r.dst_first + r.count <= out.dim(0) &&
                      (r.member != g.rank || r.src_first + r.count <= in.dim(0)),
                  "{} on group {}: run of {} rows from row {} of member {} to row {} outside "
                  "input {} / output {} rows",
                  op, g.describe(), r.count, r.src_first, r.member, r.dst_first, in.dim(0),
                  out.dim(0));
  }
  if (g.size() > 1) return true;
  for (const PullRun& r : runs)
    if (r.count > 0) out.rows(r.dst_first, r.count).copy_from(in.rows(r.src_first, r.count));
  return false;
}

void Comm::pull_rows(const Tensor& in, std::span<const PullRun> runs, Tensor& out, const Group& g,
                     std::source_location site) {
  site_ = site;
  if (check_pull_rows(in, runs, out, g)) do_pull_rows(in, runs, out, g);
}

std::unique_ptr<CommWork> Comm::pull_rows_async(const Tensor& in, std::span<const PullRun> runs,
                                                Tensor& out, const Group& g,
                                                std::source_location site) {
  site_ = site;
  if (!check_pull_rows(in, runs, out, g)) return std::make_unique<FinishedWork>();
  return do_pull_rows_async(in, runs, out, g);
}

std::unique_ptr<CommWork> Comm::do_pull_rows_async(const Tensor& in, std::span<const PullRun> runs,
                                                   Tensor& out, const Group& g) {
  do_pull_rows(in, runs, out, g);
  return std::make_unique<FinishedWork>();
}

bool Comm::peer_memory(const Group& g) {
  check_member(g, "peer_memory");
  return g.size() > 1 && do_peer_memory(g);
}

bool Comm::do_peer_memory(const Group&) { return false; }

Tensor Comm::pull_input(const Shape& shape, DType dtype, const Group& g) {
  check_member(g, "pull_input");
  MEGATON_CHECK(!shape.empty() && shape[0] >= 0, "pull_input: shape {} has no rows",
                shape_str(shape));
  if (g.size() == 1) return Tensor::empty(shape, dtype, device());
  return do_pull_input(shape, dtype, g);
}

Tensor Comm::do_pull_input(const Shape& shape, DType dtype, const Group&) {
  return Tensor::empty(shape, dtype, device());
}

void Comm::do_pull_rows(const Tensor& in, std::span<const PullRun> runs, Tensor& out,
                        const Group& g) {
  const int n = g.size();
  // What this member asks of member m, in list order: the rows' place here (recv[m]) and
  // their place there (wanted[m], sent to m as (first, count) pairs).
  RowRuns recv(n), send(n);
  std::vector<std::vector<int64_t>> wanted(n);
  for (const PullRun& r : runs) {
    if (r.count == 0) continue;
    recv[r.member].push_back({r.dst_first, r.count});
    wanted[r.member].insert(wanted[r.member].end(), {r.src_first, r.count});
  }
  auto to_device = [&](const std::vector<int64_t>& v) {
    Tensor host = Tensor::empty({int64_t(v.size())}, DType::I64);
    std::copy(v.begin(), v.end(), host.i64());
    return host.to(device());
  };
  std::vector<int64_t> asked_of(n), flat;
  for (int m = 0; m < n; ++m) {
    asked_of[m] = int64_t(wanted[m].size());
    flat.insert(flat.end(), wanted[m].begin(), wanted[m].end());
  }
  Tensor asked_by = Tensor::empty({n}, DType::I64, device());
  all_to_all(to_device(asked_of), asked_by, g);
  const Tensor asked_by_host = asked_by.to(Device::CPU);
  const std::vector<int64_t> asked_by_counts(asked_by_host.i64(), asked_by_host.i64() + n);
  int64_t total = 0;
  for (int64_t c : asked_by_counts) total += c;
  Tensor requests = Tensor::empty({total}, DType::I64, device());
  all_to_allv(to_device(flat), asked_of, requests, asked_by_counts, g, site_);
  const Tensor host = requests.to(Device::CPU);
  int64_t at = 0;
  for (int m = 0; m < n; ++m)
    for (int64_t i = 0; i < asked_by_counts[m]; i += 2, at += 2)
      send[m].push_back({host.i64()[at], host.i64()[at + 1]});
  all_to_allv_rows(in, send, out, recv, g, site_);
}

void Comm::send(const Tensor& t, int peer, const Group& g, std::source_location site) {
  site_ = site;
  check_member(g, "send");
  check_tensor(t, "send", "tensor");
  check_index(peer, g, "send", "peer");
  MEGATON_CHECK(peer != g.rank, "send on group {}: peer is this rank", g.describe());
  do_send_recv(&t, peer, nullptr, -1, g);
}

void Comm::recv(Tensor& t, int peer, const Group& g, std::source_location site) {
  site_ = site;
  check_member(g, "recv");
  check_tensor(t, "recv", "tensor");
  check_index(peer, g, "recv", "peer");
  MEGATON_CHECK(peer != g.rank, "recv on group {}: peer is this rank", g.describe());
  do_send_recv(nullptr, -1, &t, peer, g);
}

void Comm::send_recv(const Tensor& send_t, int send_peer, Tensor& recv_t, int recv_peer,
                     const Group& g, std::source_location site) {
  site_ = site;
  check_member(g, "send_recv");
  check_tensor(send_t, "send_recv", "send tensor");
  check_tensor(recv_t, "send_recv", "receive tensor");
  check_index(send_peer, g, "send_recv", "send peer");
  check_index(recv_peer, g, "send_recv", "receive peer");
  if (send_peer == g.rank || recv_peer == g.rank) {  // a ring of one
    MEGATON_CHECK(send_peer == g.rank && recv_peer == g.rank,
                  "send_recv on group {}: only one of the peers is this rank", g.describe());
    return recv_t.copy_from(send_t);
  }
  do_send_recv(&send_t, send_peer, &recv_t, recv_peer, g);
}

std::unique_ptr<CommWork> Comm::send_recv_async(const Tensor* send_t, int send_peer, Tensor* recv_t,
                                                int recv_peer, const Group& g,
                                                std::source_location site) {
  site_ = site;
  check_member(g, "send_recv_async");
  MEGATON_CHECK(send_t || recv_t, "send_recv_async on group {}: nothing to send or receive",
                g.describe());
  if (send_t) {
    check_tensor(*send_t, "send_recv_async", "send tensor");
    check_index(send_peer, g, "send_recv_async", "send peer");
    MEGATON_CHECK(send_peer != g.rank, "send_recv_async on group {}: send peer is this rank",
                  g.describe());
  }
  if (recv_t) {
    check_tensor(*recv_t, "send_recv_async", "receive tensor");
    check_index(recv_peer, g, "send_recv_async", "receive peer");
    MEGATON_CHECK(recv_peer != g.rank, "send_recv_async on group {}: receive peer is this rank",
                  g.describe());
  }
  return do_send_recv_async(send_t, send_peer, recv_t, recv_peer, g);
}

std::unique_ptr<CommWork> Comm::do_send_recv_async(const Tensor* send_t, int send_peer,
                                                   Tensor* recv_t, int recv_peer, const Group& g) {
  do_send_recv(send_t, send_peer, recv_t, recv_peer, g);
  return std::make_unique<FinishedWork>();
}

void Comm::broadcast(Tensor& t, int root, const Group& g, std::source_location site) {
  site_ = site;
  check_member(g, "broadcast");
  check_tensor(t, "broadcast", "tensor");
  check_index(root, g, "broadcast", "root");
  if (g.size() == 1 || t.numel() == 0) return;
  do_broadcast(t, root, g);
}

void Comm::barrier(const Group& g, std::source_location site) {
  site_ = site;
  check_member(g, "barrier");
  if (g.size() == 1) return;
  do_barrier(g);
}

std::unique_ptr<Comm> make_comm(Device device) {
  if (device == Device::CPU) return detail::make_mpi_comm();
#ifdef MEGATON_WITH_CUDA
  return detail::make_nccl_comm();
#else
  fail("a GPU communicator was requested, but this build has no CUDA backend");
#endif
}

void all_reduce_coalesced(Comm& comm, std::span<Tensor> tensors, const Group& g) {
  if (tensors.empty()) return;
  const DType dtype = tensors[0].dtype();
  int64_t total = 0;
  for (const Tensor& t : tensors) {
    MEGATON_CHECK(t.dtype() == dtype, "all_reduce_coalesced: {} beside {}", dtype_name(t.dtype()),
                  dtype_name(dtype));
    total += t.numel();
  }
  Tensor flat = Tensor::empty({total}, dtype, tensors[0].device());
  int64_t at = 0;
  for (const Tensor& t : tensors) {
    flat.rows(at, t.numel()).copy_from(t.view({t.numel()}));
    at += t.numel();
  }
  comm.all_reduce(flat, g);
  at = 0;
  for (Tensor& t : tensors) {
    t.view({t.numel()}).copy_from(flat.rows(at, t.numel()));
    at += t.numel();
  }
}

}  // namespace megaton::dist
