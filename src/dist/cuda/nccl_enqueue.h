// The NCCL calls of NcclComm's operations (comm_nccl.cpp): each enqueues one operation on
// (communicator c, stream s) and returns NCCL's result (ncclInProgress from a
// non-blocking communicator), for NcclComm to check and wait for.
#pragma once
#include <nccl.h>

#include <cstdint>
#include <span>

#include "core/tensor.h"
#include "dist/comm.h"

namespace megaton::dist::detail {

// The NCCL type a tensor of dtype d moves as (FP8: bytes, never reduced); InternalError
// for a dtype NCCL has none for.
ncclDataType_t nccl_type(DType d);
inline const char* byte_ptr(const Tensor& t) { return static_cast<const char*>(t.raw()); }

// Comm::all_to_allv: send_counts[i] / recv_counts[i] elements to / from member i of
// `members`, in member order in src / out.
ncclResult_t enqueue_all_to_allv(const Tensor& src, std::span<const int64_t> send_counts,
                                 Tensor& out, std::span<const int64_t> recv_counts, int members,
                                 ncclComm_t c, cudaStream_t s);
// Comm::all_to_allv_rows: the runs of in's rows to each peer, into out's runs.
ncclResult_t enqueue_row_runs(const Tensor& in, const RowRuns& send, Tensor& out,
                              const RowRuns& recv, ncclComm_t c, cudaStream_t s);
// A send and / or a receive (either may be null), as one group.
ncclResult_t enqueue_send_recv(const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer,
                               ncclComm_t c, cudaStream_t s);

}  // namespace megaton::dist::detail
