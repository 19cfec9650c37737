// Causal attention over packed sequences on the GPU (ops/attention_varlen.h): cuDNN's fused
// flash attention with ragged (THD) tensors, through frontend SDPA graphs.
//
// Layout. q [T, Hq, D] is cuDNN's [batch, Hq, S, D] with strides {S*Hq*D, D, Hq*D, 1} and a
// ragged offset tensor: entry b starts at element offset[b] = start_b * Hq * D, so rows are
// read in place (as the dense op reads [B, S, H, D]); likewise k, v, out, dout, dq, dk, dv.
// lse [T, Hq] is the Stats tensor [batch, Hq, S, 1] with strides {S*Hq, 1, Hq, 1} and
// offsets start_b * Hq: the ragged Stats layout of the frontend's tests, read back in
// backward on Hopper (the frontend refuses ragged Stats in backward on SM8x/SM12x only).
// Ragged offsets need the padding mask and per-entry lengths (seq_len_q = seq_len_kv, I32
// [batch, 1, 1, 1]); causal is top-left per sequence (set_causal_mask), which for equal q and
// kv lengths is query i sees keys j <= i of its own sequence. The pieces op
// (ops::attention_pieces_*, end of file) generalises this: separate query and key lengths and
// offsets (uploaded from the host per call), S and S_kv bucketed apart, and the bottom-right
// causal mask or none; its graph key adds S_kv, the key side's backward total and the mask.
// Everything else (scale, GQA, Dqk != Dv, Stats in natural log, dropout seeding, determinism) is as
// the dense op's file comment (ops/cuda/attention.cpp) says.
//
// No host synchronization. cu_seqlens stays on the device: a small kernel
// (attention_varlen_offsets.cu) writes the lengths and the five offset arrays into a buffer
// this file owns, in stream order before each execute, so the op can be captured in a CUDA
// graph (with N and max_seqlen then frozen, as every host value is).
//
// Graph caching. A cuDNN graph fixes batch and S, and a plan build costs up to seconds, while
// N and the longest sequence change with every micro-batch. So both are bucketed: the graph's
// batch is N rounded up to a power of two (entries past N are empty sequences at row T,
// which cuDNN skips), its S is max_seqlen rounded up to a power of two, at least 64 and at
// most T rounded up to 64 (S bounds the lengths only; rows are found through the offsets).
// A run at sequence length 4096 then builds at most ~13 x 7 graphs per direction, in
// practice a handful. The backward also sets max_total_seq_len_q/kv to T rounded up to 128,
// so that its fp32 dq accumulator and softmax sums are packed [T, H, D] workspaces rather
// than [batch, H, S, D] ones (the frontend drops this, and so takes the larger workspace,
// when Dqk or Dv is not a multiple of 16). The key: (batch, S, that total, Hq, Hkv, D, Dv,
// scale, dtype, dropout_p, direction, deterministic).
//
// GCC 12's bogus -Wstringop-overflow in the frontend is silenced as in ops/cuda/attention.cpp.
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#include "ops/cuda/attention_varlen.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "ops/cuda/attention_block.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/cudnn_sdpa.h"
#include "ops/determinism.h"

namespace megaton::ops::cuda {
namespace {

namespace fe = sdpa::fe;
using sdpa::TensorAttr;

constexpr const char* kOp = "cuda attention_varlen";

// ---- argument checks -------------------------------------------------------------------

struct VarlenDims {
  int64_t T, Hq, Hkv, D, Dv;  // D: q and k head dim; Dv: v and out head dim
  int64_t num_sequences;      // N
  float scale;                // the scores' scale
  int64_t Tkv = -1;           // k and v rows (the pieces op; -1: T, as q's)
  int64_t kv_rows() const { return Tkv < 0 ? T : Tkv; }
};

void check_half_tensor(const Tensor& t, DType dtype, const char* name) {
  sdpa::check_device_tensor(t, kOp, name);
  MEGATON_CHECK(t.dtype() == dtype, "{}: {} must be {} like q, got {}", kOp, name,
                dtype_name(dtype), dtype_name(t.dtype()));
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  MEGATON_CHECK(t.shape() == want, "{}: {} has shape {}, expected {}", kOp, name,
                shape_str(t.shape()), shape_str(want));
}

VarlenDims check_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                      const Tensor& cu_seqlens, int64_t max_seqlen, float dropout_p,
                      float softmax_scale) {
  sdpa::check_device_tensor(q, kOp, "q");
  MEGATON_CHECK(q.dtype() == DType::BF16 || q.dtype() == DType::F16,
                "{}: q must be BF16 or F16 (cuDNN fused attention), got {}", kOp,
                dtype_name(q.dtype()));
  check_half_tensor(k, q.dtype(), "k");
  check_half_tensor(v, q.dtype(), "v");
  MEGATON_CHECK(q.ndim() == 3, "{}: q must be [T, Hq, Dqk], got {}", kOp, shape_str(q.shape()));
  MEGATON_CHECK(k.ndim() == 3, "{}: k must be [T, Hkv, Dqk], got {}", kOp, shape_str(k.shape()));
  MEGATON_CHECK(v.ndim() == 3, "{}: v must be [T, Hkv, Dv], got {}", kOp, shape_str(v.shape()));
  VarlenDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2), 0, 0.0f};
  d.scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  MEGATON_CHECK(d.Hq > 0 && d.D > 0 && d.Dv > 0,
                "{}: q {} or v {} has no heads or an empty head dim", kOp, shape_str(q.shape()),
                shape_str(v.shape()));
  MEGATON_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "{}: query heads {} must be a multiple of key/value heads {}", kOp, d.Hq, d.Hkv);
  check_shape(k, {d.T, d.Hkv, d.D}, "k");
  check_shape(v, {d.T, d.Hkv, d.Dv}, "v");
  // cuDNN's fused kernels: head dims multiples of 8 (16-byte rows), at most 256 on Hopper;
  // the frontend reports the exact limit when building.
  MEGATON_CHECK(d.D % 8 == 0 && d.Dv % 8 == 0,
                "{}: head dims {} and {} must be multiples of 8 for cuDNN", kOp, d.D, d.Dv);
  MEGATON_CHECK(dropout_p >= 0.0f && dropout_p < 1.0f, "{}: dropout_p {} must be in [0, 1)", kOp,
                dropout_p);
  sdpa::check_device_tensor(lse, kOp, "lse");
  MEGATON_CHECK(lse.dtype() == DType::F32, "{}: lse must be F32, got {}", kOp,
                dtype_name(lse.dtype()));
  check_shape(lse, {d.T, d.Hq}, "lse");
  MEGATON_CHECK(cu_seqlens.defined() && cu_seqlens.device() == Device::CUDA,
                "{}: cu_seqlens must be an allocated CUDA tensor like q", kOp);
  MEGATON_CHECK(
      cu_seqlens.dtype() == DType::I32 && cu_seqlens.ndim() == 1 && cu_seqlens.dim(0) >= 2,
      "{}: cu_seqlens must be I32 [N + 1] with N >= 1, got {} {}", kOp,
      dtype_name(cu_seqlens.dtype()), shape_str(cu_seqlens.shape()));
  MEGATON_CHECK(d.T == 0 || max_seqlen >= 1, "{}: max_seqlen {} must be at least 1", kOp,
                max_seqlen);
  MEGATON_CHECK(d.T <= INT32_MAX, "{}: T = {} tokens exceed cuDNN's int32 lengths", kOp, d.T);
  d.num_sequences = cu_seqlens.dim(0) - 1;
  return d;
}

// ---- buckets -----------------------------------------------------------------------------

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

int64_t power_of_two_at_least(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// The graph's problem: see the file comment's "Graph caching".
struct VarlenProblem {
  VarlenDims d;
  int64_t batch;      // graph batch: N rounded up to a power of two
  int64_t S;          // graph sequence dim: the bound on every entry's length
  int64_t max_total;  // backward's max_total_seq_len_q/kv; 0 in the forward
  // The pieces op: the key side's bound and backward total, and the mask (the sequences
  // op: S, max_total and causal top-left).
  int64_t S_kv = 0, max_total_kv = 0;
  sdpa::Mask mask = sdpa::Mask::CausalTopLeft;
};

// S bucket of entries up to `longest` rows in a tensor of `rows` rows.
int64_t seq_bucket(int64_t longest, int64_t rows) {
  return std::min(power_of_two_at_least(std::max<int64_t>(longest, 64)), round_up(rows, 64));
}

VarlenProblem problem(const VarlenDims& d, int64_t max_seqlen, bool backward) {
  VarlenProblem p{d, power_of_two_at_least(d.num_sequences), 0, 0};
  p.S = seq_bucket(max_seqlen, d.T);
  if (backward) p.max_total = round_up(d.T, 128);
  p.S_kv = p.S;
  p.max_total_kv = p.max_total;
  return p;
}

// ---- graphs ------------------------------------------------------------------------------

struct VarlenGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorAttr q, k, v, o, stats, seed, offset;  // forward and backward
  TensorAttr dout, dq, dk, dv;                 // backward only
  TensorAttr seq_len_q, seq_len_kv, q_offsets, k_offsets, v_offsets, o_offsets, stats_offsets;
  int64_t workspace_bytes = 0;
};

// (batch, S, max_total, S_kv, max_total_kv, mask, Hq, Hkv, D, Dv, scale bits, dtype,
// dropout_p bits, backward, deterministic)
using GraphKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int64_t, int64_t,
                            int64_t, int64_t, uint32_t, int, uint32_t, bool, bool>;

GraphKey make_key(const VarlenProblem& p, DType dtype, float dropout_p, bool backward) {
  const VarlenDims& d = p.d;
  const bool deterministic_backward = backward && deterministic();
  return GraphKey(p.batch, p.S, p.max_total, p.S_kv, p.max_total_kv, int(p.mask), d.Hq, d.Hkv, d.D,
                  d.Dv, sdpa::float_bits(d.scale), int(dtype), sdpa::float_bits(dropout_p),
                  backward, deterministic_backward);
}

std::string describe(const VarlenProblem& p, DType dtype, float dropout_p, bool backward) {
  const VarlenDims& d = p.d;
  return fmt::format(
      "attention_varlen {}{} T={} N={} (graph batch {}) S={} Tkv={} Skv={} mask={} Hq={} Hkv={} "
      "D={} Dv={} scale={} {} dropout_p={}",
      backward ? "backward" : "forward", backward && deterministic() ? " (deterministic)" : "", d.T,
      d.num_sequences, p.batch, p.S, d.kv_rows(), p.S_kv, int(p.mask), d.Hq, d.Hkv, d.D, d.Dv,
      d.scale, dtype_name(dtype), dropout_p);
}

TensorAttr index_tensor(fe::graph::Graph& graph, const char* name, int64_t entries,
                        fe::DataType_t type) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_dim({entries, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(type));
}

// A [T, heads, head_dim] ragged tensor as cuDNN's [batch, H, S, D]; `t` is either a new
// input (graph tensor) or an output to describe.
// kv: the key side's sequence bound (k, v, dk, dv).
void describe_thd(fe::graph::Tensor_attributes& t, const VarlenProblem& p, int64_t heads,
                  int64_t head_dim, const TensorAttr& offsets, bool kv = false) {
  const int64_t S = kv ? p.S_kv : p.S;
  t.set_dim({p.batch, heads, S, head_dim})
      .set_stride({S * heads * head_dim, head_dim, heads * head_dim, 1})
      .set_ragged_offset(offsets);
}

TensorAttr thd_input(fe::graph::Graph& graph, const char* name, const VarlenProblem& p,
                     int64_t heads, int64_t head_dim, const TensorAttr& offsets, bool kv = false) {
  fe::graph::Tensor_attributes t;
  t.set_name(name);
  describe_thd(t, p, heads, head_dim, offsets, kv);
  return graph.tensor(t);
}

// lse [T, Hq] as the ragged Stats [batch, Hq, S, 1].
void describe_stats(fe::graph::Tensor_attributes& t, const VarlenProblem& p,
                    const TensorAttr& offsets) {
  t.set_dim({p.batch, p.d.Hq, p.S, 1})
      .set_stride({p.S * p.d.Hq, 1, p.d.Hq, 1})
      .set_data_type(fe::DataType_t::FLOAT)
      .set_ragged_offset(offsets);
}

// The index tensors every graph has, and the q, k, v inputs.
void add_common_inputs(VarlenGraph& g, const VarlenProblem& p) {
  fe::graph::Graph& graph = *g.graph;
  g.seq_len_q = index_tensor(graph, "seq_len_q", p.batch, fe::DataType_t::INT32);
  g.seq_len_kv = index_tensor(graph, "seq_len_kv", p.batch, fe::DataType_t::INT32);
  g.q_offsets = index_tensor(graph, "q_offsets", p.batch + 1, fe::DataType_t::INT64);
  g.k_offsets = index_tensor(graph, "k_offsets", p.batch + 1, fe::DataType_t::INT64);
  g.v_offsets = index_tensor(graph, "v_offsets", p.batch + 1, fe::DataType_t::INT64);
  g.o_offsets = index_tensor(graph, "o_offsets", p.batch + 1, fe::DataType_t::INT64);
  g.stats_offsets = index_tensor(graph, "lse_offsets", p.batch + 1, fe::DataType_t::INT64);
  g.q = thd_input(graph, "q", p, p.d.Hq, p.d.D, g.q_offsets);
  g.k = thd_input(graph, "k", p, p.d.Hkv, p.d.D, g.k_offsets, /*kv=*/true);
  g.v = thd_input(graph, "v", p, p.d.Hkv, p.d.Dv, g.v_offsets, /*kv=*/true);
}

template <typename Attributes>
void set_common_attributes(Attributes& attributes, VarlenGraph& g, const VarlenProblem& p,
                           float dropout_p) {
  if (p.mask == sdpa::Mask::CausalTopLeft) attributes.set_causal_mask(true);
  if (p.mask == sdpa::Mask::CausalBottomRight) attributes.set_causal_mask_bottom_right(true);
  attributes.set_attn_scale(p.d.scale)
      .set_padding_mask(true)
      .set_seq_len_q(g.seq_len_q)
      .set_seq_len_kv(g.seq_len_kv);
  if (dropout_p > 0.0f) {
    g.seed = sdpa::scalar_int64_tensor(*g.graph, "dropout_seed");
    g.offset = sdpa::scalar_int64_tensor(*g.graph, "dropout_offset");
    attributes.set_dropout(dropout_p, g.seed, g.offset);
  }
}

std::unique_ptr<VarlenGraph> build_forward(const VarlenProblem& p, DType dtype, float dropout_p,
                                           const std::string& what) {
  auto g = std::make_unique<VarlenGraph>();
  g->graph = sdpa::new_graph(dtype);
  add_common_inputs(*g, p);
  auto attributes =
      fe::graph::SDPA_attributes().set_name("attention_varlen_forward").set_generate_stats(true);
  set_common_attributes(attributes, *g, p, dropout_p);
  auto [o, stats] = g->graph->sdpa(g->q, g->k, g->v, attributes);
  o->set_output(true);
  describe_thd(*o, p, p.d.Hq, p.d.Dv, g->o_offsets);
  stats->set_output(true);
  describe_stats(*stats, p, g->stats_offsets);
  g->o = o;
  g->stats = stats;
  sdpa::build(*g->graph, g->workspace_bytes, what);
  return g;
}

std::unique_ptr<VarlenGraph> build_backward(const VarlenProblem& p, DType dtype, float dropout_p,
                                            const std::string& what) {
  auto g = std::make_unique<VarlenGraph>();
  g->graph = sdpa::new_graph(dtype);
  fe::graph::Graph& graph = *g->graph;
  add_common_inputs(*g, p);
  g->o = thd_input(graph, "out", p, p.d.Hq, p.d.Dv, g->o_offsets);
  g->dout = thd_input(graph, "dout", p, p.d.Hq, p.d.Dv, g->o_offsets);
  fe::graph::Tensor_attributes stats;
  stats.set_name("lse");
  describe_stats(stats, p, g->stats_offsets);
  g->stats = graph.tensor(stats);
  auto attributes = fe::graph::SDPA_backward_attributes()
                        .set_name("attention_varlen_backward")
                        .set_max_total_seq_len_q(p.max_total)
                        .set_max_total_seq_len_kv(p.max_total_kv);
  set_common_attributes(attributes, *g, p, dropout_p);
  if (deterministic()) attributes.set_deterministic_algorithm(true);
  auto [dq, dk, dv] = graph.sdpa_backward(g->q, g->k, g->v, g->o, g->dout, g->stats, attributes);
  dq->set_output(true);
  describe_thd(*dq, p, p.d.Hq, p.d.D, g->q_offsets);
  dk->set_output(true);
  describe_thd(*dk, p, p.d.Hkv, p.d.D, g->k_offsets, /*kv=*/true);
  dv->set_output(true);
  describe_thd(*dv, p, p.d.Hkv, p.d.Dv, g->v_offsets, /*kv=*/true);
  g->dq = dq;
  g->dk = dk;
  g->dv = dv;
  sdpa::build(graph, g->workspace_bytes, what);
  return g;
}

// The cached graph for this call, built on first use. Caller holds sdpa::state_mutex().
const VarlenGraph& cached_graph(const VarlenProblem& p, DType dtype, float dropout_p,
                                bool backward) {
  // Never destroyed: destroying cuDNN descriptors during static teardown, after the CUDA
  // runtime may have shut down, can fail or crash at exit.
  static auto* cache = new std::map<GraphKey, std::unique_ptr<VarlenGraph>>();
  const GraphKey key = make_key(p, dtype, dropout_p, backward);
  auto it = cache->find(key);
  if (it == cache->end()) {
    const std::string what = describe(p, dtype, dropout_p, backward);
    auto g = backward ? build_backward(p, dtype, dropout_p, what)
                      : build_forward(p, dtype, dropout_p, what);
    it = cache->emplace(key, std::move(g)).first;
  }
  return *it->second;
}

// The device buffer for the ragged offsets and lengths, grown as needed and reused by every
// call (rewritten in stream order, like the workspace). Caller holds sdpa::state_mutex().
void* ragged_buffer(int64_t bytes) {
  static void* ptr = nullptr;
  static size_t capacity = 0;
  if (size_t(bytes) > capacity) {
    if (ptr) ::megaton::cuda::device_free(ptr, capacity);
    ptr = ::megaton::cuda::device_allocate(size_t(bytes));
    capacity = size_t(bytes);
  }
  return ptr;
}

// Writes the ragged description of cu_seqlens for problem p and adds it to the pack.
void add_ragged_description(const VarlenGraph& g, const VarlenProblem& p, const Tensor& cu_seqlens,
                            std::unordered_map<TensorAttr, void*>& pack) {
  const VarlenDims& d = p.d;
  const detail::VarlenRaggedOffsets offsets = detail::carve_varlen_ragged_offsets(
      ragged_buffer(detail::varlen_ragged_offsets_bytes(p.batch)), p.batch);
  const detail::VarlenRowElements rows{d.Hq * d.D, d.Hkv * d.D, d.Hkv * d.Dv, d.Hq * d.Dv, d.Hq};
  detail::varlen_ragged_offsets(cu_seqlens.i32(), d.num_sequences, p.batch, d.T, p.S, rows,
                                offsets);
  pack[g.seq_len_q] = offsets.seq_len;
  pack[g.seq_len_kv] = offsets.seq_len;
  pack[g.q_offsets] = offsets.q;
  pack[g.k_offsets] = offsets.k;
  pack[g.v_offsets] = offsets.v;
  pack[g.o_offsets] = offsets.o;
  pack[g.stats_offsets] = offsets.stats;
}

void execute(const VarlenGraph& g, std::unordered_map<TensorAttr, void*>& pack,
             const VarlenProblem& p, DType dtype, float dropout_p, uint64_t seed, uint64_t stream,
             bool backward) {
  if (dropout_p > 0.0f) {
    int64_t* words = sdpa::dropout_seed_offset(seed, stream);
    pack[g.seed] = words;
    pack[g.offset] = words + 1;
  }
  void* ws = sdpa::workspace(g.workspace_bytes);
  fe::error_t status = g.graph->execute(sdpa::handle(), pack, ws);
  if (status.is_bad()) sdpa::check_fe(status, "execute", describe(p, dtype, dropout_p, backward));
}

// ---- pieces (ops::attention_pieces_*) ---------------------------------------------------

VarlenDims check_pieces(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const std::vector<AttentionPiece>& pieces, bool causal,
                        float softmax_scale) {
  constexpr const char* op = "cuda attention_pieces";
  sdpa::check_device_tensor(q, op, "q");
  MEGATON_CHECK(q.dtype() == DType::BF16 || q.dtype() == DType::F16,
                "{}: q must be BF16 or F16 (cuDNN fused attention), got {}", op,
                dtype_name(q.dtype()));
  for (const auto& [t, name] :
       {std::pair<const Tensor*, const char*>{&k, "k"}, {&v, "v"}, {&out, "out"}})
    check_half_tensor(*t, q.dtype(), name);
  MEGATON_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && out.ndim() == 3,
                "{}: q, k, v, out must be [rows, heads, D]", op);
  VarlenDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2), int64_t(pieces.size()),
               0.0f,     k.dim(0)};
  d.scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  MEGATON_CHECK(
      d.Hkv > 0 && d.Hq % d.Hkv == 0 && d.D % 8 == 0 && d.Dv % 8 == 0 && v.dim(0) == d.kv_rows() &&
          v.dim(1) == d.Hkv && k.dim(2) == d.D && out.shape() == (Shape{d.T, d.Hq, d.Dv}),
      "{}: q {}, k {}, v {}, out {} do not fit (GQA, head dims multiples of 8)", op,
      shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()), shape_str(out.shape()));
  MEGATON_CHECK(lse.defined() && lse.device() == Device::CUDA && lse.dtype() == DType::F32 &&
                    lse.shape() == (Shape{d.T, d.Hq}),
                "{}: lse must be F32 [{}, {}] on the GPU", op, d.T, d.Hq);
  MEGATON_CHECK(d.T <= INT32_MAX && d.kv_rows() <= INT32_MAX, "{}: too many rows for cuDNN", op);
  for (const AttentionPiece& p : pieces)
    MEGATON_CHECK(p.q_first >= 0 && p.q_count >= 1 && p.q_first + p.q_count <= d.T &&
                      p.kv_first >= 0 && p.kv_count >= 1 &&
                      p.kv_first + p.kv_count <= d.kv_rows() &&
                      (!causal || p.kv_count >= p.q_count),
                  "{}: piece of queries [{}, +{}) and keys [{}, +{}) does not fit", op, p.q_first,
                  p.q_count, p.kv_first, p.kv_count);
  return d;
}

// The graph's problem for the pieces: batch the pieces' count rounded up to a power of two,
// S and S_kv bucketed from the longest piece on each side, the mask bottom-right or none.
VarlenProblem pieces_problem(const VarlenDims& d, const std::vector<AttentionPiece>& pieces,
                             bool causal, bool backward) {
  int64_t longest_q = 1, longest_kv = 1;
  for (const AttentionPiece& p : pieces) {
    longest_q = std::max(longest_q, p.q_count);
    longest_kv = std::max(longest_kv, p.kv_count);
  }
  VarlenProblem p{d, power_of_two_at_least(d.num_sequences), seq_bucket(longest_q, d.T), 0};
  p.S_kv = seq_bucket(longest_kv, d.kv_rows());
  if (backward) {
    p.max_total = round_up(d.T, 128);
    p.max_total_kv = round_up(d.kv_rows(), 128);
  }
  p.mask = causal ? sdpa::Mask::CausalBottomRight : sdpa::Mask::None;
  return p;
}

// Uploads the pieces' lengths and offsets (entries past the pieces: empty, at the end rows)
// and adds them to the pack. Caller holds sdpa::state_mutex().
void add_pieces_description(const VarlenGraph& g, const VarlenProblem& p,
                            const std::vector<AttentionPiece>& pieces,
                            std::unordered_map<TensorAttr, void*>& pack) {
  const VarlenDims& d = p.d;
  const int64_t B = p.batch, n = int64_t(pieces.size());
  // Five [B + 1] I64 offset arrays, then two [B] I32 length arrays.
  std::vector<int64_t> offsets(size_t(5 * (B + 1)));
  std::vector<int32_t> lengths(size_t(2 * B), 0);
  for (int64_t b = 0; b <= B; ++b) {
    const bool real = b < n;
    const int64_t qr = real ? pieces[size_t(b)].q_first : d.T;
    const int64_t kr = real ? pieces[size_t(b)].kv_first : d.kv_rows();
    offsets[size_t(0 * (B + 1) + b)] = qr * d.Hq * d.D;    // q
    offsets[size_t(1 * (B + 1) + b)] = kr * d.Hkv * d.D;   // k
    offsets[size_t(2 * (B + 1) + b)] = kr * d.Hkv * d.Dv;  // v
    offsets[size_t(3 * (B + 1) + b)] = qr * d.Hq * d.Dv;   // out, dout
    offsets[size_t(4 * (B + 1) + b)] = qr * d.Hq;          // lse
    if (real && b < B) {
      lengths[size_t(b)] = int32_t(pieces[size_t(b)].q_count);
      lengths[size_t(B + b)] = int32_t(pieces[size_t(b)].kv_count);
    }
  }
  const size_t offset_bytes = offsets.size() * sizeof(int64_t);
  auto* buffer =
      static_cast<char*>(ragged_buffer(int64_t(offset_bytes + lengths.size() * sizeof(int32_t))));
  // In stream order, without waiting for the stream (kernel parameters or a pinned block).
  ::megaton::cuda::upload(buffer, offsets.data(), offset_bytes);
  ::megaton::cuda::upload(buffer + offset_bytes, lengths.data(), lengths.size() * sizeof(int32_t));
  auto* off = reinterpret_cast<int64_t*>(buffer);
  auto* len = reinterpret_cast<int32_t*>(buffer + offset_bytes);
  pack[g.q_offsets] = off;
  pack[g.k_offsets] = off + (B + 1);
  pack[g.v_offsets] = off + 2 * (B + 1);
  pack[g.o_offsets] = off + 3 * (B + 1);
  pack[g.stats_offsets] = off + 4 * (B + 1);
  pack[g.seq_len_q] = len;
  pack[g.seq_len_kv] = len + B;
}

}  // namespace

void attention_pieces_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::vector<AttentionPiece>& pieces, bool causal, Tensor& out,
                              Tensor& lse, float softmax_scale) {
  const VarlenDims d = check_pieces(q, k, v, out, lse, pieces, causal, softmax_scale);
  if (pieces.empty()) return;
  const VarlenProblem p = pieces_problem(d, pieces, causal, /*backward=*/false);
  std::lock_guard<std::mutex> lock(sdpa::state_mutex());
  const VarlenGraph& g = cached_graph(p, q.dtype(), 0.0f, /*backward=*/false);
  std::unordered_map<TensorAttr, void*> pack = {
      {g.q, q.raw()}, {g.k, k.raw()}, {g.v, v.raw()}, {g.o, out.raw()}, {g.stats, lse.raw()}};
  add_pieces_description(g, p, pieces, pack);
  execute(g, pack, p, q.dtype(), 0.0f, 0, 0, /*backward=*/false);
}

void attention_pieces_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const std::vector<AttentionPiece>& pieces, bool causal, Tensor& dq,
                               Tensor& dk, Tensor& dv, float softmax_scale) {
  const VarlenDims d = check_pieces(q, k, v, out, lse, pieces, causal, softmax_scale);
  check_half_tensor(dout, q.dtype(), "dout");
  check_shape(dout, out.shape(), "dout");
  for (const auto& [t, like] : {std::pair<Tensor*, const Tensor*>{&dq, &q}, {&dk, &k}, {&dv, &v}})
    MEGATON_CHECK(t->defined() && t->device() == Device::CUDA && t->shape() == like->shape(),
                  "cuda attention_pieces: a gradient of shape {} for {}", shape_str(t->shape()),
                  shape_str(like->shape()));
  if (pieces.empty()) return;
  // cuDNN writes the pieces' rows only: scratch gradients start at zero and are added whole.
  Tensor bq = Tensor::zeros(q.shape(), q.dtype(), Device::CUDA),
         bk = Tensor::zeros(k.shape(), q.dtype(), Device::CUDA),
         bv = Tensor::zeros(v.shape(), q.dtype(), Device::CUDA);
  {
    const VarlenProblem p = pieces_problem(d, pieces, causal, /*backward=*/true);
    std::lock_guard<std::mutex> lock(sdpa::state_mutex());
    const VarlenGraph& g = cached_graph(p, q.dtype(), 0.0f, /*backward=*/true);
    std::unordered_map<TensorAttr, void*> pack = {
        {g.q, q.raw()},   {g.k, k.raw()},       {g.v, v.raw()},
        {g.o, out.raw()}, {g.dout, dout.raw()}, {g.stats, lse.raw()},
        {g.dq, bq.raw()}, {g.dk, bk.raw()},     {g.dv, bv.raw()}};
    add_pieces_description(g, p, pieces, pack);
    execute(g, pack, p, q.dtype(), 0.0f, 0, 0, /*backward=*/true);
  }
  add_(dq, bq, 1.0f);
  add_(dk, bk, 1.0f);
  add_(dv, bv, 1.0f);
}

void attention_varlen_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                              Tensor& lse, const Tensor& cu_seqlens, int64_t max_seqlen,
                              float dropout_p, uint64_t seed, uint64_t stream,
                              float softmax_scale) {
  const VarlenDims d = check_args(q, k, v, lse, cu_seqlens, max_seqlen, dropout_p, softmax_scale);
  check_half_tensor(out, q.dtype(), "out");
  check_shape(out, {d.T, d.Hq, d.Dv}, "out");
  if (d.T == 0) return;

  const VarlenProblem p = problem(d, max_seqlen, /*backward=*/false);
  std::lock_guard<std::mutex> lock(sdpa::state_mutex());
  const VarlenGraph& g = cached_graph(p, q.dtype(), dropout_p, /*backward=*/false);
  std::unordered_map<TensorAttr, void*> pack = {
      {g.q, q.raw()}, {g.k, k.raw()}, {g.v, v.raw()}, {g.o, out.raw()}, {g.stats, lse.raw()}};
  add_ragged_description(g, p, cu_seqlens, pack);
  execute(g, pack, p, q.dtype(), dropout_p, seed, stream, /*backward=*/false);
}

void attention_varlen_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const Tensor& cu_seqlens, int64_t max_seqlen, Tensor& dq, Tensor& dk,
                               Tensor& dv, float dropout_p, uint64_t seed, uint64_t stream,
                               float softmax_scale) {
  const VarlenDims d = check_args(q, k, v, lse, cu_seqlens, max_seqlen, dropout_p, softmax_scale);
  check_half_tensor(dout, q.dtype(), "dout");
  check_half_tensor(out, q.dtype(), "out");
  check_half_tensor(dq, q.dtype(), "dq");
  check_half_tensor(dk, q.dtype(), "dk");
  check_half_tensor(dv, q.dtype(), "dv");
  check_shape(dout, {d.T, d.Hq, d.Dv}, "dout");
  check_shape(out, {d.T, d.Hq, d.Dv}, "out");
  check_shape(dq, q.shape(), "dq");
  check_shape(dk, k.shape(), "dk");
  check_shape(dv, v.shape(), "dv");
  if (d.T == 0) return;

  const VarlenProblem p = problem(d, max_seqlen, /*backward=*/true);
  std::lock_guard<std::mutex> lock(sdpa::state_mutex());
  const VarlenGraph& g = cached_graph(p, q.dtype(), dropout_p, /*backward=*/true);
  std::unordered_map<TensorAttr, void*> pack = {
      {g.q, q.raw()},   {g.k, k.raw()},       {g.v, v.raw()},
      {g.o, out.raw()}, {g.dout, dout.raw()}, {g.stats, lse.raw()},
      {g.dq, dq.raw()}, {g.dk, dk.raw()},     {g.dv, dv.raw()}};
  add_ragged_description(g, p, cu_seqlens, pack);
  execute(g, pack, p, q.dtype(), dropout_p, seed, stream, /*backward=*/true);
}

}  // namespace megaton::ops::cuda
