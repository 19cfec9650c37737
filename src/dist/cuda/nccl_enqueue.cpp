// NCCL enqueue helpers of NcclComm (nccl_enqueue.h).
#include "dist/cuda/nccl_enqueue.h"

#include "core/error.h"

namespace megaton::dist::detail {

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::F8E4M3:
    case DType::F8E5M2:
      return ncclUint8;  // moved, never reduced
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
  }
  MEGATON_CHECK(false, "no NCCL type for dtype {}", int(d));
  return ncclUint8;
}

// One ncclSend and one ncclRecv per member with a non-zero count, in one group. Zero
// counts are skipped on both sides: member j's send count to i is i's receive count
// from j, so the pairs still match.
ncclResult_t enqueue_all_to_allv(const Tensor& src, std::span<const int64_t> send_counts,
                                 Tensor& out, std::span<const int64_t> recv_counts, int members,
                                 ncclComm_t c, cudaStream_t s) {
  const size_t elem = dtype_size(src.dtype());
  ncclResult_t rc = ncclGroupStart();
  if (rc != ncclSuccess) return rc;
  size_t send_off = 0, recv_off = 0;
  for (int peer = 0; peer < members; ++peer) {
    const size_t send_bytes = size_t(send_counts[peer]) * elem;
    const size_t recv_bytes = size_t(recv_counts[peer]) * elem;
    if (send_bytes) rc = ncclSend(byte_ptr(src) + send_off, send_bytes, ncclUint8, peer, c, s);
    if (rc != ncclSuccess && rc != ncclInProgress) break;
    if (recv_bytes)
      rc = ncclRecv(static_cast<char*>(out.raw()) + recv_off, recv_bytes, ncclUint8, peer, c, s);
    if (rc != ncclSuccess && rc != ncclInProgress) break;
    send_off += send_bytes;
    recv_off += recv_bytes;
  }
  ncclResult_t end = ncclGroupEnd();
  return rc != ncclSuccess && rc != ncclInProgress ? rc : end;
}

// One ncclSend per non-empty send run and one ncclRecv per non-empty receive run, in
// list order, in one group: NCCL pairs the transfers between two ranks in the order
// they were issued, and both sides skip the same empty runs.
ncclResult_t enqueue_row_runs(const Tensor& in, const RowRuns& send, Tensor& out,
                              const RowRuns& recv, ncclComm_t c, cudaStream_t s) {
  const size_t row_bytes = dtype_size(in.dtype()) * size_t(row_numel(in));
  ncclResult_t rc = ncclGroupStart();
  if (rc != ncclSuccess) return rc;
  auto ok = [&] { return rc == ncclSuccess || rc == ncclInProgress; };
  for (size_t peer = 0; peer < send.size() && ok(); ++peer) {
    for (const RowRun& r : send[peer])
      if (r.count > 0 && ok())
        rc = ncclSend(byte_ptr(in) + size_t(r.first) * row_bytes, size_t(r.count) * row_bytes,
                      ncclUint8, int(peer), c, s);
    for (const RowRun& r : recv[peer])
      if (r.count > 0 && ok())
        rc = ncclRecv(static_cast<char*>(out.raw()) + size_t(r.first) * row_bytes,
                      size_t(r.count) * row_bytes, ncclUint8, int(peer), c, s);
  }
  ncclResult_t end = ncclGroupEnd();
  return ok() ? end : rc;
}

ncclResult_t enqueue_send_recv(const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer,
                               ncclComm_t c, cudaStream_t s) {
  ncclResult_t rc = ncclGroupStart();
  if (rc != ncclSuccess) return rc;
  if (send_t) rc = ncclSend(send_t->raw(), send_t->nbytes(), ncclUint8, send_peer, c, s);
  if (recv_t && (rc == ncclSuccess || rc == ncclInProgress))
    rc = ncclRecv(recv_t->raw(), recv_t->nbytes(), ncclUint8, recv_peer, c, s);
  ncclResult_t end = ncclGroupEnd();
  return rc != ncclSuccess && rc != ncclInProgress ? rc : end;
}

}  // namespace megaton::dist::detail
