// Context parallelism over packed documents: the document starts of a micro-batch and the
// blocks cut at document boundaries (model/context_parallel_documents.h).
#include "model/context_parallel_documents.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "core/error.h"
#include "model/context_parallel.h"
#include "ops/attention_block.h"

namespace megaton {

std::vector<int32_t> cp_document_starts(const std::vector<int32_t>& cu_seqlens, int64_t batch,
                                        int64_t seq) {
  const int64_t T = batch * seq;
  MEGATON_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == T,
                "cp_document_starts: boundaries must run from 0 to {}", T);
  std::vector<int32_t> out(size_t(T), 0);
  for (size_t n = 0; n + 1 < cu_seqlens.size(); ++n) {
    const int64_t first = cu_seqlens[n], end = cu_seqlens[n + 1];
    MEGATON_CHECK(first < end && first / seq == (end - 1) / seq,
                  "cp_document_starts: document [{}, {}) is empty or crosses a sample's end", first,
                  end);
    for (int64_t t = first; t < end; ++t) out[size_t(t)] = int32_t(first % seq);
  }
  return out;
}

namespace cp_detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A run of queries of one document and the keys of that document they can see in a block.
struct DocumentPiece {
  int64_t first, count;        // query rows of the block
  int64_t kv_first, kv_count;  // key rows of the block (count 0: none visible)
};

// nq queries at positions [q_pos, q_pos + nq) against nkv keys at [kv_pos, kv_pos + nkv),
// cut where the queries' document changes. A piece's keys: those of its document at or
// before its last query; each query's own causal bound is the block op's mask.
std::vector<DocumentPiece> document_pieces(int64_t q_pos, int64_t nq, int64_t kv_pos, int64_t nkv,
                                           const int32_t* starts) {
  std::vector<DocumentPiece> out;
  for (int64_t i = 0; i < nq;) {
    const int32_t start = starts[q_pos + i];
    int64_t end = i + 1;
    while (end < nq && starts[q_pos + end] == start) ++end;
    const int64_t kv_first = std::max<int64_t>(start, kv_pos) - kv_pos;
    const int64_t kv_end = std::min<int64_t>(kv_pos + nkv, q_pos + end) - kv_pos;
    out.push_back({i, end - i, kv_first, std::max<int64_t>(kv_end - kv_first, 0)});
    i = end;
  }
  return out;
}

// The pieces of a block that see keys, as one ops::attention_pieces call (one cuDNN call on
// the GPU) takes them, and whether they are causal. Keys wholly before the queries: every
// key of a piece's document visible, no mask. Otherwise the block's keys reach the queries'
// end (the chunk pairs and gathered prefixes this file makes), so each piece's keys end
// with its queries: causal at the bottom right.
struct DocumentCall {
  std::vector<ops::AttentionPiece> pieces;
  std::vector<DocumentPiece> empty;  // runs of queries whose document has no key here
  bool causal = false;
};
DocumentCall document_call(int64_t q_pos, int64_t nq, int64_t kv_pos, int64_t nkv,
                           const int32_t* starts) {
  DocumentCall call;
  call.causal = kv_pos + nkv > q_pos;
  for (const DocumentPiece& d : document_pieces(q_pos, nq, kv_pos, nkv, starts)) {
    if (d.kv_count == 0) {
      call.empty.push_back(d);
      continue;
    }
    MEGATON_CHECK(!call.causal || kv_pos + d.kv_first + d.kv_count == q_pos + d.first + d.count,
                  "cp attention: keys [{}, +{}) do not end with queries [{}, +{})",
                  kv_pos + d.kv_first, d.kv_count, q_pos + d.first, d.count);
    call.pieces.push_back({d.first, d.count, d.kv_first, d.kv_count});
  }
  return call;
}

}  // namespace

void document_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t q_pos,
                            int64_t kv_pos, const int32_t* starts, Tensor& out, Tensor& lse,
                            float scale) {
  const DocumentCall call = document_call(q_pos, q.dim(0), kv_pos, k.dim(0), starts);
  for (const DocumentPiece& d : call.empty) {
    out.rows(d.first, d.count).zero();
    lse.rows(d.first, d.count).fill(kNegInf);
  }
  ops::attention_pieces_forward(q, k, v, call.pieces, call.causal, out, lse, scale);
}

void document_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, int64_t q_pos, int64_t kv_pos,
                             const int32_t* starts, Tensor& dq, Tensor& dk, Tensor& dv,
                             float scale) {
  const DocumentCall call = document_call(q_pos, q.dim(0), kv_pos, k.dim(0), starts);
  ops::attention_pieces_backward(dout, q, k, v, out, lse, call.pieces, call.causal, dq, dk, dv,
                                 scale);
}

}  // namespace cp_detail
}  // namespace megaton
