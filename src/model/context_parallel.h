// Context parallelism (Megatron's --context-parallel-size N, --cp-comm-type): each rank of a
// CP group holds 2 of the sequence's 2N chunks and the layers run on them as on a shorter
// sequence; only the core attention reaches across the group, for the keys and values of
// the other chunks. Megatron-LM d98e8a6 and Transformer Engine d0067d0, as read in
// docs/research/context-parallel.md (sections 1-3); the design in docs/design-notes.md
// "Context parallelism".
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/comm.h"

namespace megaton {

// --cp-comm-type: how the attention reaches the other chunks' keys and values.
enum class CpCommType {
  P2P,        // "p2p": the K/V blocks passed around the ring, one block merged per step
  AllGather,  // "all_gather": K/V all-gathered, each local chunk against its prefix
  A2A,        // "a2a": heads exchanged all-to-all (Ulysses), whole-sequence attention
};

// "p2p", "all_gather" (also Megatron's help-text spelling "allgather") or "a2a"; throws
// megaton::Error naming the value otherwise ("a2a+p2p" names hierarchical CP as not
// supported).
CpCommType parse_cp_comm_type(const std::string& value);
const char* cp_comm_type_name(CpCommType type);

// The load-balanced ("dual-chunk") split: with c = S / (2 cp), rank r holds chunk r,
// positions [r c, (r + 1) c), then chunk 2 cp - 1 - r, [(2 cp - 1 - r) c, (2 cp - r) c),
// so that under a causal mask every rank has the same work (Megatron's
// get_batch_on_this_cp_rank, utils.py). Returns the S / cp global positions of rank r's
// local rows, in order. InternalError unless S % (2 cp) == 0 and 0 <= r < cp.
std::vector<int64_t> cp_local_positions(int64_t seq_length, int cp, int rank);

// Rank r's local rows of x [B, S, ...] along dim 1 (tokens, labels, masks): a new tensor
// [B, S / cp, ...] of x's dtype on the host. InternalError as cp_local_positions.
Tensor cp_split_sequence(const Tensor& x, int cp, int rank);

// What the CP attention needs: the communicator, the CP group (this rank's position in it
// is the CP rank), the comm type, and the micro-batch's packed documents.
struct CpAttention {
  dist::Comm* comm = nullptr;
  const dist::Group* group = nullptr;
  CpCommType type = CpCommType::P2P;
  // --reset-attention-mask: for each sample b and global position p (0 <= p < S), the
  // position at which p's document starts, [B * S] (row b * S + p); a query then sees the
  // keys at or before it and at or after that start. Null: one document per sample.
  std::shared_ptr<const std::vector<int32_t>> document_starts;
};

// The document starts of B samples of S tokens from their documents' boundaries over the
// B * S rows (PackedSeqParams::cu_seqlens_host: 0 = c0 < ... < cN = B * S, every sample end
// among them): entry b * S + p = (the start row of the document holding row b * S + p) - b * S.
// InternalError on boundaries that are not increasing from 0 to B * S or that cross a
// sample's end.
std::vector<int32_t> cp_document_starts(const std::vector<int32_t>& cu_seqlens, int64_t batch,
                                        int64_t seq);

// Causal attention over the whole sequence of which this rank holds its two chunks:
// q [B, 2c, Hq, Dqk], k [B, 2c, Hkv, Dqk], v [B, 2c, Hkv, Dv] (this rank's rows, dual-chunk
// order, contiguous) -> out [B, 2c, Hq, Dv] and lse, both overwritten. lse has B * 2c * Hq
// F32 elements: token-major [B * 2c, Hq] for P2P and AllGather; for A2A this rank's head
// group over the whole sequence, [B, Hq / N, S] in the same memory (what its backward
// reads; nothing else should). Every member of the group calls it with the same shapes
// (collective). The result for this rank's queries equals the rows of ops::attention_forward on the
// whole sequence. P2P: N - 1 ring exchanges of K/V, the tiles of TE's AttnFuncWithCPAndKVP2P (own
// block causal; an earlier rank's block: first half only, unmasked; a later rank's: second-half
// queries only, unmasked), merged by log-sum-exp. AllGather: K/V gathered in natural order, each
// local chunk k against keys [0, (k + 1) c) causal by position. A2A: heads regrouped so each rank
// holds Hq / N (and Hkv / N) heads of the whole sequence, ops::attention_forward, regrouped back
// (needs Hkv % N == 0). No dropout.
// Packed documents (cp.document_starts): the same exchanges; each block of queries is cut at
// document boundaries and each piece attends to the keys of its document in the block
// (p2p: every pair of a query chunk and a key chunk that can see each other, all_gather and
// a2a: each chunk or sequence against its keys), the pieces of a block in one
// ops::attention_pieces call (on the GPU one ragged cuDNN call). For a2a the lse is then
// token-major [B * S, Hq / N].
// Devices: CPU F32; GPU BF16 or F16 through cuDNN (P2P and AllGather: ops::attention_block_*
// per block, the merged output and the summed gradients accumulated in F32 and rounded once;
// A2A: the dense op; with documents every type through ops::attention_pieces_*), the exchanges over
// NCCL. P2P starts each step's ring exchange (send_recv_async) before the step's tile and waits
// after it, so the next block travels while the current one is computed; in backward the block's
// gradient follows one step behind, beside the next tile. InternalError on shapes that do not fit.
void cp_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                          Tensor& lse, const CpAttention& cp, float softmax_scale = 0.0f);

// Its gradients, overwritten: dq, dk, dv of q's, k's and v's shapes (dk, dv: this rank's
// rows, the sums over every rank's queries that saw them). Collective as the forward.
void cp_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                           const CpAttention& cp, float softmax_scale = 0.0f);

}  // namespace megaton
