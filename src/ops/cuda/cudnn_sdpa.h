// What the cuDNN fused-attention ops share (ops/cuda/attention.cpp, the dense [B, S, H, D]
// op, and ops/cuda/attention_varlen.cpp, packed sequences): the cuDNN frontend include, one
// cudnnHandle on the compute stream, the lock, the workspace, the dropout seed buffer and
// small graph-building helpers. Host code only (the frontend is slow to push through nvcc).
// Internal to ops/cuda.
#pragma once
#include <cudnn.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wall"
#pragma GCC diagnostic ignored "-Wextra"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wunused-variable"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include "core/error.h"
#include "core/tensor.h"

// MEGATON_CUDNN_CHECK(cudnnSetStream(...)): throws InternalError naming the call, the file
// and line, and cuDNN's status string.
#define MEGATON_CUDNN_CHECK(call)                                                     \
  do {                                                                                \
    cudnnStatus_t megaton_status_ = (call);                                           \
    if (megaton_status_ != CUDNN_STATUS_SUCCESS) {                                    \
      throw ::megaton::InternalError(                                                 \
          ::fmt::format("{}:{}: {} failed: {} ({})", __FILE__, __LINE__, #call,       \
                        cudnnGetErrorString(megaton_status_), int(megaton_status_))); \
    }                                                                                 \
  } while (0)

namespace megaton::ops::cuda::sdpa {

namespace fe = cudnn_frontend;
using TensorAttr = std::shared_ptr<fe::graph::Tensor_attributes>;

// The process's cuDNN handle, bound to megaton::cuda::stream() (every Megaton kernel runs on
// the one compute stream; so do cuDNN's).
cudnnHandle_t handle();

// Guards graph building, the caches and the shared buffers below: they are not reentrant
// (the training step is single-threaded; the lock makes that safe to forget).
std::mutex& state_mutex();

// The workspace, grown to the largest need seen and never shrunk. Reuse is safe without
// events: every use is ordered on the single compute stream. Caller holds state_mutex().
void* workspace(int64_t bytes);

// [seed, offset] as two int64 on the device for cuDNN's Philox dropout, rewritten in stream
// order before every dropout launch. cuDNN's Philox takes a 64-bit seed and a 64-bit offset
// (a position in the counter sequence). Mapping our `stream` to the offset would make stream
// s+1 a shifted copy of stream s (correlated masks between the layers that use consecutive
// streams), so the stream is folded into the seed instead: cudnn_seed = Philox(seed) drawn
// at counter (the last low word, which no element index of another draw reaches, stream),
// offset 0. Distinct (seed, stream) pairs get unrelated keys. Caller holds state_mutex().
int64_t* dropout_seed_offset(uint64_t seed, uint64_t stream);

// Throws InternalError naming the frontend step, `what` (the problem) and cuDNN's message.
void check_fe(fe::error_t status, const char* step, const std::string& what);

// A graph with `dtype` (BF16 or F16) inputs and outputs and fp32 intermediates and compute.
std::shared_ptr<fe::graph::Graph> new_graph(DType dtype);

// A [1, 1, 1, 1] INT64 device tensor (the dropout seed and offset).
TensorAttr scalar_int64_tensor(fe::graph::Graph& graph, const char* name);

// Builds the plan (heuristics mode A) and reads its workspace size into workspace_bytes.
void build(fe::graph::Graph& graph, int64_t& workspace_bytes, const std::string& what);

// The bits of a float, for graph-cache keys (a scale or dropout probability is a
// compile-time attribute of a graph).
uint32_t float_bits(float x);

// InternalError unless t is an allocated CUDA tensor with a 16-byte aligned pointer (cuDNN's
// SDPA kernels load with 16-byte vectors and TMA; the frontend also checks this at execute,
// but here the message names the tensor). `op` names the op in the message.
void check_device_tensor(const Tensor& t, const char* op, const char* name);

// ---- one SDPA problem (ops/cuda/attention.cpp), shared by the dense op and the block op ----

// The mask of an SDPA problem: none, causal with the diagonal at the top left (query i sees
// keys j <= i) or at the bottom right (query i sees keys j <= i + Skv - Sq).
enum class Mask { None, CausalTopLeft, CausalBottomRight };

// q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], out [B, Sq, Hq, Dv] (token-major,
// contiguous) and stats [B, Hq, Sq] F32 (packed: the only Stats layout cuDNN below 9.26 reads
// back correctly in backward). scale: the scores' scale (already resolved).
struct Problem {
  int64_t B, Sq, Skv, Hq, Hkv, D, Dv;
  float scale;
  Mask mask;
};

// InternalError, naming `op`, unless the head dims suit cuDNN's fused kernels.
void check_head_dims(const Problem& d, const char* op);

// The cached graph of d (built on first use) run on the compute stream. The caller checks
// the tensors (BF16 or F16 alike, F32 stats, shapes as Problem says); out and stats are
// overwritten. Dropout as ops::attention_forward on the GPU (dropout_seed_offset).
void forward(const Problem& d, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
             Tensor& stats, float dropout_p, uint64_t seed, uint64_t stream);
// dq, dk, dv (q's, k's and v's shapes and dtype) overwritten; out, stats: the forward's.
void backward(const Problem& d, const Tensor& dout, const Tensor& q, const Tensor& k,
              const Tensor& v, const Tensor& out, const Tensor& stats, Tensor& dq, Tensor& dk,
              Tensor& dv, float dropout_p, uint64_t seed, uint64_t stream);

}  // namespace megaton::ops::cuda::sdpa
