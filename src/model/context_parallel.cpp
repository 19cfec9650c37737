// Context parallelism: the dual-chunk split and the attention across a CP group
// (model/context_parallel.h).
#include "model/context_parallel.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "core/error.h"
#include "model/context_parallel_documents.h"
#include "ops/attention_block.h"
#include "ops/mla.h"
#include "ops/ops.h"

namespace megaton {

CpCommType parse_cp_comm_type(const std::string& value) {
  if (value == "p2p") return CpCommType::P2P;
  if (value == "all_gather" || value == "allgather") return CpCommType::AllGather;
  if (value == "a2a") return CpCommType::A2A;
  if (value == "a2a+p2p")
    fail(
        "cp-comm-type a2a+p2p (hierarchical context parallelism) is not supported; use p2p, "
        "all_gather or a2a");
  fail("cp-comm-type '{}' is not one of p2p, all_gather, a2a", value);
}

const char* cp_comm_type_name(CpCommType type) {
  switch (type) {
    case CpCommType::P2P:
      return "p2p";
    case CpCommType::AllGather:
      return "all_gather";
    case CpCommType::A2A:
      return "a2a";
  }
  return "?";
}

std::vector<int64_t> cp_local_positions(int64_t seq_length, int cp, int rank) {
  MEGATON_CHECK(cp >= 1 && rank >= 0 && rank < cp && seq_length % (2 * cp) == 0,
                "cp_local_positions: sequence {} over {} context-parallel ranks (rank {})",
                seq_length, cp, rank);
  const int64_t c = seq_length / (2 * cp);
  std::vector<int64_t> out;
  for (int64_t chunk : {int64_t(rank), int64_t(2 * cp - 1 - rank)})
    for (int64_t i = 0; i < c; ++i) out.push_back(chunk * c + i);
  return out;
}

Tensor cp_split_sequence(const Tensor& x, int cp, int rank) {
  MEGATON_CHECK(x.ndim() >= 2, "cp_split_sequence: expected [B, S, ...], got {}",
                shape_str(x.shape()));
  const Tensor host = x.device() == Device::CPU ? x : x.to(Device::CPU);
  const int64_t B = x.dim(0), S = x.dim(1);
  const std::vector<int64_t> rows = cp_local_positions(S, cp, rank);
  Shape shape = x.shape();
  shape[1] = int64_t(rows.size());
  Tensor out = Tensor::empty(shape, x.dtype());
  const size_t row_bytes = host.nbytes() / size_t(B * S);
  const auto* src = static_cast<const uint8_t*>(host.raw());
  auto* dst = static_cast<uint8_t*>(out.raw());
  for (int64_t b = 0; b < B; ++b)
    for (size_t i = 0; i < rows.size(); ++i)
      std::memcpy(dst + (size_t(b) * rows.size() + i) * row_bytes,
                  src + size_t(b * S + rows[i]) * row_bytes, row_bytes);
  return out;
}

namespace {

using cp_detail::document_block_backward;
using cp_detail::document_block_forward;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t B, L, c, Hq, Hkv, D, Dv;  // L = 2c local rows per sample
  int N, r;
};

Geometry geometry_of(const Tensor& q, const Tensor& k, const Tensor& v, const CpAttention& cp) {
  MEGATON_CHECK(cp.comm && cp.group && cp.group->is_member(),
                "cp attention: no context-parallel group");
  MEGATON_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4,
                "cp attention: q, k, v must be [B, S, heads, D], got {}, {}, {}",
                shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  Geometry g{q.dim(0), q.dim(1), q.dim(1) / 2,     q.dim(2),      k.dim(2),
             q.dim(3), v.dim(3), cp.group->size(), cp.group->rank};
  MEGATON_CHECK(g.L % 2 == 0 && k.dim(0) == g.B && k.dim(1) == g.L && v.dim(0) == g.B &&
                    v.dim(1) == g.L && v.dim(2) == g.Hkv && k.dim(3) == g.D,
                "cp attention: q {}, k {}, v {} do not fit two chunks of one sequence",
                shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  return g;
}

// Sample b's rows [first, first + count) of x [B, L, H, D] as [count, H, D] (a view).
Tensor rows_of(const Tensor& x, int64_t b, int64_t first, int64_t count) {
  return x.view({x.dim(0) * x.dim(1), x.dim(2), x.dim(3)}).rows(b * x.dim(1) + first, count);
}

// Sample b's natural-order sequence [S, H, D] from gathered [N, B, L, H, D]: chunk m is
// member m's first half (m < N) or member 2N-1-m's second half.
Tensor natural_sequence(const Tensor& gathered, const Geometry& g, int64_t b, int64_t H,
                        int64_t D) {
  const int64_t S = 2 * g.N * g.c;
  Tensor out = Tensor::empty({S, H, D}, gathered.dtype(), gathered.device());
  const Tensor rows = gathered.view({int64_t(g.N) * g.B * g.L, H, D});
  for (int64_t m = 0; m < 2 * g.N; ++m) {
    const int64_t owner = m < g.N ? m : 2 * g.N - 1 - m, half = m < g.N ? 0 : 1;
    out.rows(m * g.c, g.c).copy_from(rows.rows((owner * g.B + b) * g.L + half * g.c, g.c));
  }
  return out;
}

// The inverse: natural-order rows [S, H, D] of sample b written into [N, B, L, H, D].
void scatter_natural(const Tensor& natural, const Geometry& g, int64_t b, Tensor& gathered) {
  const int64_t H = natural.dim(1), D = natural.dim(2);
  Tensor rows = gathered.view({int64_t(g.N) * g.B * g.L, H, D});
  for (int64_t m = 0; m < 2 * g.N; ++m) {
    const int64_t owner = m < g.N ? m : 2 * g.N - 1 - m, half = m < g.N ? 0 : 1;
    Tensor dst = rows.rows((owner * g.B + b) * g.L + half * g.c, g.c);
    dst.copy_from(natural.rows(m * g.c, g.c));
  }
}

// The chunk index of local half h (0: chunk r, 1: chunk 2N-1-r).
int64_t chunk_of(const Geometry& g, int h) { return h == 0 ? g.r : 2 * g.N - 1 - g.r; }
// The chunk index of member j's half h.
int64_t chunk_of_member(const Geometry& g, int j, int h) { return h == 0 ? j : 2 * g.N - 1 - j; }

// ---- packed documents ------------------------------------------------------------------

// Sample b's document starts (S entries, by global position), or null without documents.
const int32_t* documents_of(const CpAttention& cp, const Geometry& g, int64_t b) {
  if (!cp.document_starts) return nullptr;
  const int64_t S = 2 * g.N * g.c;
  MEGATON_CHECK(int64_t(cp.document_starts->size()) == g.B * S,
                "cp attention: {} document starts for {} samples of {} tokens",
                cp.document_starts->size(), g.B, S);
  return cp.document_starts->data() + b * S;
}

// With documents the ring's tiles are cut into chunk pairs (local query half, block half)
// that can see each other: own block (0,0) (1,0) (1,1); an earlier member's (0,0) (1,0); a
// later member's (1,0) (1,1) (the chunk order of tile_of below).
std::vector<std::pair<int, int>> chunk_pairs(const Geometry& g, int j) {
  if (j == g.r) return {{0, 0}, {1, 0}, {1, 1}};
  if (j < g.r) return {{0, 0}, {1, 0}};
  return {{1, 0}, {1, 1}};
}

Tensor gather(const Tensor& x, const Geometry& g, const CpAttention& cp) {
  Tensor out =
      Tensor::empty({int64_t(g.N), x.dim(0), x.dim(1), x.dim(2), x.dim(3)}, x.dtype(), x.device());
  cp.comm->all_gather(x, out, *cp.group);
  return out;
}

// An F32 tensor of x's shape on x's device: the accumulators of merged outputs and summed
// gradients (on the GPU the blocks' results are BF16 / F16; summing them in that dtype would
// round at every step).
Tensor f32_like(const Tensor& x) { return Tensor::empty(x.shape(), DType::F32, x.device()); }
Tensor f32_zeros_like(const Tensor& x) { return Tensor::zeros(x.shape(), DType::F32, x.device()); }

// dst = acc, converted to dst's dtype (nothing when acc is dst).
void store(const Tensor& acc, Tensor& dst) {
  if (acc.raw() != dst.raw()) ops::cast(acc, dst);
}

// ---- all_gather ---------------------------------------------------------------------

void all_gather_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                        const Geometry& g, const CpAttention& cp, float scale) {
  const Tensor kg = gather(k, g, cp), vg = gather(v, g, cp);
  for (int64_t b = 0; b < g.B; ++b) {
    const Tensor kn = natural_sequence(kg, g, b, g.Hkv, g.D);
    const Tensor vn = natural_sequence(vg, g, b, g.Hkv, g.Dv);
    const int32_t* starts = documents_of(cp, g, b);
    for (int h = 0; h < 2; ++h) {
      const int64_t chunk = chunk_of(g, h), keys = (chunk + 1) * g.c;
      Tensor o = rows_of(out, b, h * g.c, g.c);
      Tensor l = lse.rows(b * g.L + h * g.c, g.c);
      if (starts)
        document_block_forward(rows_of(q, b, h * g.c, g.c), kn.rows(0, keys), vn.rows(0, keys),
                               chunk * g.c, 0, starts, o, l, scale);
      else
        ops::attention_block_forward(rows_of(q, b, h * g.c, g.c), kn.rows(0, keys),
                                     vn.rows(0, keys), chunk * g.c, 0, true, o, l, scale);
    }
  }
}

void all_gather_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                         const Geometry& g, const CpAttention& cp, float scale) {
  const Tensor kg = gather(k, g, cp), vg = gather(v, g, cp);
  Tensor dkg = f32_zeros_like(kg), dvg = f32_zeros_like(vg);
  dq.zero();  // each query row gets one block's gradient: no accumulator needed
  for (int64_t b = 0; b < g.B; ++b) {
    const Tensor kn = natural_sequence(kg, g, b, g.Hkv, g.D);
    const Tensor vn = natural_sequence(vg, g, b, g.Hkv, g.Dv);
    Tensor dkn = f32_zeros_like(kn), dvn = f32_zeros_like(vn);
    const int32_t* starts = documents_of(cp, g, b);
    for (int h = 0; h < 2; ++h) {
      const int64_t chunk = chunk_of(g, h), keys = (chunk + 1) * g.c;
      Tensor dqh = rows_of(dq, b, h * g.c, g.c), dkh = dkn.rows(0, keys), dvh = dvn.rows(0, keys);
      const Tensor dout_h = rows_of(dout, b, h * g.c, g.c), q_h = rows_of(q, b, h * g.c, g.c),
                   out_h = rows_of(out, b, h * g.c, g.c), lse_h = lse.rows(b * g.L + h * g.c, g.c);
      if (starts)
        document_block_backward(dout_h, q_h, kn.rows(0, keys), vn.rows(0, keys), out_h, lse_h,
                                chunk * g.c, 0, starts, dqh, dkh, dvh, scale);
      else
        ops::attention_block_backward(dout_h, q_h, kn.rows(0, keys), vn.rows(0, keys), out_h, lse_h,
                                      chunk * g.c, 0, true, dqh, dkh, dvh, scale);
    }
    scatter_natural(dkn, g, b, dkg);
    scatter_natural(dvn, g, b, dvg);
  }
  // Each rank's rows: the sum of every rank's contributions to them (in F32).
  Tensor dk_acc = dk.dtype() == DType::F32 ? dk : f32_like(dk),
         dv_acc = dv.dtype() == DType::F32 ? dv : f32_like(dv);
  cp.comm->reduce_scatter(dkg, dk_acc, *cp.group);
  cp.comm->reduce_scatter(dvg, dv_acc, *cp.group);
  store(dk_acc, dk);
  store(dv_acc, dv);
}

// ---- p2p ring -----------------------------------------------------------------------

// The tile of step i (TE's AttnFuncWithCPAndKVP2P): the block of rank j = r - i mod N.
struct Tile {
  int64_t q_first, q_rows;    // local query rows
  int64_t kv_first, kv_rows;  // rows of the block
  bool causal;
};
Tile tile_of(const Geometry& g, int j) {
  if (j == g.r) return {0, g.L, 0, g.L, true};  // own chunks: causal in local order
  if (j < g.r) return {0, g.L, 0, g.c, false};  // an earlier rank: its first chunk
  return {g.c, g.c, 0, g.L, false};             // a later rank: our second chunk only
}

// One ring step started: t goes to the next rank, the previous rank's arrives in the
// returned tensor once the work is waited for. Every rank starts its passes in the same
// order (the transfers pair up in that order).
std::unique_ptr<dist::CommWork> start_ring_pass(const Tensor& t, Tensor& next,
                                                const CpAttention& cp, const Geometry& g) {
  next = Tensor::empty(t.shape(), t.dtype(), t.device());
  return cp.comm->send_recv_async(&t, (g.r + 1) % g.N, &next, (g.r + g.N - 1) % g.N, *cp.group);
}

// The K/V block of the next step on its way while this step's tile runs (TE's ring: the
// exchange of step i + 1 overlapped with the attention of step i).
struct KvPass {
  Tensor k, v;
  std::unique_ptr<dist::CommWork> k_work, v_work;
  void start(const Tensor& kb, const Tensor& vb, const CpAttention& cp, const Geometry& g) {
    k_work = start_ring_pass(kb, k, cp, g);
    v_work = start_ring_pass(vb, v, cp, g);
  }
  // Waits and moves the arrived block into kb, vb (no-op when none was started).
  void finish(Tensor& kb, Tensor& vb) {
    if (!k_work) return;
    k_work->wait();
    v_work->wait();
    k_work.reset();
    v_work.reset();
    kb = k;
    vb = v;
  }
};

void p2p_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                 const Geometry& g, const CpAttention& cp, float scale) {
  Tensor acc = out.dtype() == DType::F32 ? out : f32_like(out);  // the merged output so far
  acc.zero();
  lse.fill(kNegInf);
  Tensor kb = k, vb = v;  // the block in hand (read only: sent on, never written)
  for (int i = 0; i < g.N; ++i) {
    const int j = (g.r - i + g.N) % g.N;
    const Tile t = tile_of(g, j);
    KvPass next;
    if (i + 1 < g.N) next.start(kb, vb, cp, g);
    for (int64_t b = 0; b < g.B; ++b) {
      if (const int32_t* starts = documents_of(cp, g, b)) {
        for (const auto& [hq, hk] : chunk_pairs(g, j)) {
          Tensor part = Tensor::empty({g.c, g.Hq, g.Dv}, q.dtype(), q.device()),
                 plse = Tensor::empty({g.c, g.Hq}, DType::F32, q.device());
          document_block_forward(rows_of(q, b, hq * g.c, g.c), rows_of(kb, b, hk * g.c, g.c),
                                 rows_of(vb, b, hk * g.c, g.c), chunk_of(g, hq) * g.c,
                                 chunk_of_member(g, j, hk) * g.c, starts, part, plse, scale);
          Tensor o = rows_of(acc, b, hq * g.c, g.c);
          Tensor l = lse.rows(b * g.L + hq * g.c, g.c);
          ops::attention_lse_merge(o, l, part, plse);
        }
        continue;
      }
      Tensor part = Tensor::empty({t.q_rows, g.Hq, g.Dv}, q.dtype(), q.device()),
             plse = Tensor::empty({t.q_rows, g.Hq}, DType::F32, q.device());
      ops::attention_block_forward(
          rows_of(q, b, t.q_first, t.q_rows), rows_of(kb, b, t.kv_first, t.kv_rows),
          rows_of(vb, b, t.kv_first, t.kv_rows), 0, 0, t.causal, part, plse, scale);
      Tensor o = rows_of(acc, b, t.q_first, t.q_rows);
      Tensor l = lse.rows(b * g.L + t.q_first, t.q_rows);
      ops::attention_lse_merge(o, l, part, plse);
    }
    next.finish(kb, vb);
  }
  store(acc, out);
}

void p2p_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                  const Geometry& g, const CpAttention& cp, float scale) {
  Tensor dq_acc = dq.dtype() == DType::F32 ? dq : f32_like(dq);
  dq_acc.zero();
  // The block's K/V and (in F32) its gradient so far travel the ring; the gradient one step
  // behind, so that its exchange runs beside the next tile. After the last step one more
  // pass brings every block's complete gradient back to its owner.
  Tensor kb = k, vb = v;
  Tensor dkb, dvb;  // the gradient of the block in hand so far, once its pass is waited for
  std::unique_ptr<dist::CommWork> dk_work, dv_work;
  for (int i = 0; i < g.N; ++i) {
    const int j = (g.r - i + g.N) % g.N;
    const Tile t = tile_of(g, j);
    KvPass next;
    if (i + 1 < g.N) next.start(kb, vb, cp, g);
    // This rank's share of the block's gradient.
    Tensor dkt = f32_zeros_like(k), dvt = f32_zeros_like(v);
    for (int64_t b = 0; b < g.B; ++b) {
      if (const int32_t* starts = documents_of(cp, g, b)) {
        for (const auto& [hq, hk] : chunk_pairs(g, j)) {
          Tensor dqp = rows_of(dq_acc, b, hq * g.c, g.c), dkp = rows_of(dkt, b, hk * g.c, g.c),
                 dvp = rows_of(dvt, b, hk * g.c, g.c);
          document_block_backward(rows_of(dout, b, hq * g.c, g.c), rows_of(q, b, hq * g.c, g.c),
                                  rows_of(kb, b, hk * g.c, g.c), rows_of(vb, b, hk * g.c, g.c),
                                  rows_of(out, b, hq * g.c, g.c), lse.rows(b * g.L + hq * g.c, g.c),
                                  chunk_of(g, hq) * g.c, chunk_of_member(g, j, hk) * g.c, starts,
                                  dqp, dkp, dvp, scale);
        }
        continue;
      }
      Tensor dqt = rows_of(dq_acc, b, t.q_first, t.q_rows);
      Tensor dkr = rows_of(dkt, b, t.kv_first, t.kv_rows),
             dvr = rows_of(dvt, b, t.kv_first, t.kv_rows);
      ops::attention_block_backward(
          rows_of(dout, b, t.q_first, t.q_rows), rows_of(q, b, t.q_first, t.q_rows),
          rows_of(kb, b, t.kv_first, t.kv_rows), rows_of(vb, b, t.kv_first, t.kv_rows),
          rows_of(out, b, t.q_first, t.q_rows), lse.rows(b * g.L + t.q_first, t.q_rows), 0, 0,
          t.causal, dqt, dkr, dvr, scale);
    }
    if (dk_work) {  // the earlier ranks' shares of this block, passed on from the previous rank
      dk_work->wait();
      dv_work->wait();
      ops::add_(dkt, dkb);
      ops::add_(dvt, dvb);
    }
    dk_work = start_ring_pass(dkt, dkb, cp, g);
    dv_work = start_ring_pass(dvt, dvb, cp, g);
    next.finish(kb, vb);
  }
  dk_work->wait();
  dv_work->wait();
  store(dq_acc, dq);
  ops::cast(dkb, dk);
  ops::cast(dvb, dv);
}

// ---- a2a (Ulysses) ------------------------------------------------------------------

// x [B, L, H, D] -> [N, B, L, H/N, D]: head group n first (the all-to-all's send layout);
// column blocks of the [B L, H D] rows (ops::split_columns: CPU and GPU).
Tensor heads_first(const Tensor& x, int N) {
  const int64_t rows = x.dim(0) * x.dim(1), width = x.dim(2) * x.dim(3) / N;
  Tensor out = Tensor::empty({int64_t(N), x.dim(0), x.dim(1), x.dim(2) / N, x.dim(3)}, x.dtype(),
                             x.device());
  std::vector<Tensor> parts;
  for (int n = 0; n < N; ++n) parts.push_back(out.view({N * rows, width}).rows(n * rows, rows));
  ops::split_columns(x.view({rows, N * width}), parts);
  return out;
}

// The inverse: [N, B, L, H/N, D] (chunk n: head group n) -> x [B, L, H, D].
void heads_back(const Tensor& grouped, Tensor& x, int N) {
  const int64_t rows = x.dim(0) * x.dim(1), width = x.dim(2) * x.dim(3) / N;
  std::vector<Tensor> parts;
  for (int n = 0; n < N; ++n) parts.push_back(grouped.view({N * rows, width}).rows(n * rows, rows));
  Tensor out = x.view({rows, N * width});
  ops::concat_columns(parts, out);
}

// This rank's head group of the whole sequence, natural order: [B, S, H/N, D].
Tensor to_whole_sequence(const Tensor& x, const Geometry& g, const CpAttention& cp) {
  const Tensor send = heads_first(x, g.N);
  // chunk m: member m's rows, my heads
  Tensor recv = Tensor::empty(send.shape(), send.dtype(), send.device());
  cp.comm->all_to_all(send, recv, *cp.group);
  const int64_t h = x.dim(2) / g.N, D = x.dim(3), S = 2 * g.N * g.c;
  Tensor out = Tensor::empty({g.B, S, h, D}, x.dtype(), x.device());
  for (int64_t b = 0; b < g.B; ++b) {
    Tensor natural = natural_sequence(recv, g, b, h, D);
    out.view({g.B * S, h, D}).rows(b * S, S).copy_from(natural);
  }
  return out;
}

// The inverse: [B, S, H/N, D] of this rank's heads -> this rank's rows, all heads.
void from_whole_sequence(const Tensor& whole, Tensor& x, const Geometry& g, const CpAttention& cp) {
  const int64_t h = whole.dim(2), D = whole.dim(3), S = whole.dim(1);
  Tensor send = Tensor::empty({int64_t(g.N), g.B, g.L, h, D}, whole.dtype(), whole.device());
  for (int64_t b = 0; b < g.B; ++b)
    scatter_natural(whole.view({g.B * S, h, D}).rows(b * S, S), g, b, send);
  // chunk n: head group n of my rows
  Tensor recv = Tensor::empty(send.shape(), send.dtype(), send.device());
  cp.comm->all_to_all(send, recv, *cp.group);
  heads_back(recv, x, g.N);
}

void a2a_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                 const Geometry& g, const CpAttention& cp, float scale) {
  const Tensor qw = to_whole_sequence(q, g, cp), kw = to_whole_sequence(k, g, cp),
               vw = to_whole_sequence(v, g, cp);
  const int64_t S = qw.dim(1), h = qw.dim(2);
  Tensor ow = Tensor::empty({g.B, S, h, g.Dv}, q.dtype(), q.device());
  if (cp.document_starts) {
    // Per sample, each document's queries against its keys; lse token-major [B * S, Hq/N].
    Tensor lw = lse.view({g.B * S, h});
    for (int64_t b = 0; b < g.B; ++b) {
      Tensor o = ow.view({g.B * S, h, g.Dv}).rows(b * S, S), l = lw.rows(b * S, S);
      auto whole = [&](const Tensor& x) {
        return x.view({g.B * S, x.dim(2), x.dim(3)}).rows(b * S, S);
      };
      document_block_forward(whole(qw), whole(kw), whole(vw), 0, 0, documents_of(cp, g, b), o, l,
                             scale);
    }
  } else {
    // The dense op's lse [B, Hq/N, S] has the numel of [B * 2c, Hq]: kept in lse's memory.
    Tensor lw = lse.view({g.B, h, S});
    ops::attention_forward(qw, kw, vw, ow, lw, 0.0f, 0, 0, scale);
  }
  from_whole_sequence(ow, out, g, cp);
}

void a2a_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                  const Geometry& g, const CpAttention& cp, float scale) {
  const Tensor qw = to_whole_sequence(q, g, cp), kw = to_whole_sequence(k, g, cp),
               vw = to_whole_sequence(v, g, cp), ow = to_whole_sequence(out, g, cp),
               dow = to_whole_sequence(dout, g, cp);
  const int64_t S = qw.dim(1), h = qw.dim(2);
  Tensor dqw = Tensor::empty(qw.shape(), qw.dtype(), qw.device()),
         dkw = Tensor::empty(kw.shape(), kw.dtype(), kw.device()),
         dvw = Tensor::empty(vw.shape(), vw.dtype(), vw.device());
  if (cp.document_starts) {
    // The block op adds: each row gets its one document's gradient, so q's dtype suffices.
    for (Tensor* t : {&dqw, &dkw, &dvw}) t->zero();
    const Tensor lw = lse.view({g.B * S, h});
    for (int64_t b = 0; b < g.B; ++b) {
      auto whole = [&](const Tensor& x) {
        return x.view({g.B * S, x.dim(2), x.dim(3)}).rows(b * S, S);
      };
      Tensor dqb = whole(dqw), dkb = whole(dkw), dvb = whole(dvw);
      document_block_backward(whole(dow), whole(qw), whole(kw), whole(vw), whole(ow),
                              lw.rows(b * S, S), 0, 0, documents_of(cp, g, b), dqb, dkb, dvb,
                              scale);
    }
  } else {
    ops::attention_backward(dow, qw, kw, vw, ow, lse.view({g.B, h, S}), dqw, dkw, dvw, 0.0f, 0, 0,
                            scale);
  }
  from_whole_sequence(dqw, dq, g, cp);
  from_whole_sequence(dkw, dk, g, cp);
  from_whole_sequence(dvw, dv, g, cp);
}

}  // namespace

void cp_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                          Tensor& lse, const CpAttention& cp, float softmax_scale) {
  const Geometry g = geometry_of(q, k, v, cp);
  MEGATON_CHECK(lse.numel() == g.B * g.L * g.Hq && out.numel() == g.B * g.L * g.Hq * g.Dv,
                "cp attention: out {} or lse {} do not fit q {}", shape_str(out.shape()),
                shape_str(lse.shape()), shape_str(q.shape()));
  Tensor lse_rows = lse.view({g.B * g.L, g.Hq});
  switch (cp.type) {
    case CpCommType::AllGather:
      return all_gather_forward(q, k, v, out, lse_rows, g, cp, softmax_scale);
    case CpCommType::P2P:
      return p2p_forward(q, k, v, out, lse_rows, g, cp, softmax_scale);
    case CpCommType::A2A:
      MEGATON_CHECK(g.Hq % g.N == 0 && g.Hkv % g.N == 0,
                    "cp attention a2a: {} query and {} key/value heads over {} ranks", g.Hq, g.Hkv,
                    g.N);
      return a2a_forward(q, k, v, out, lse_rows, g, cp, softmax_scale);
  }
}

void cp_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                           const CpAttention& cp, float softmax_scale) {
  const Geometry g = geometry_of(q, k, v, cp);
  const Tensor lse_rows = lse.view({g.B * g.L, g.Hq});
  switch (cp.type) {
    case CpCommType::AllGather:
      return all_gather_backward(dout, q, k, v, out, lse_rows, dq, dk, dv, g, cp, softmax_scale);
    case CpCommType::P2P:
      return p2p_backward(dout, q, k, v, out, lse_rows, dq, dk, dv, g, cp, softmax_scale);
    case CpCommType::A2A:
      return a2a_backward(dout, q, k, v, out, lse_rows, dq, dk, dv, g, cp, softmax_scale);
  }
}

}  // namespace megaton
