// Tensor-parallel all-gather and reduce-scatter overlapped with the GEMMs around them.
#include "model/tp_comm_overlap.h"

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"

namespace megaton {

void gemm_all_gathered_rows(const Tensor& x, Tensor& x_full, Tensor& out, const RowGemm& gemm,
                            const ModelParallel& mp) {
  const int tp = mp.tp_size(), r = mp.tp_rank();
  const int64_t rows = x.dim(0);
  MEGATON_CHECK(x_full.dim(0) == rows * tp && out.dim(0) == rows * tp,
                "gemm_all_gathered_rows: x {} rows, x_full {}, out {} (tp {})", rows, x_full.dim(0),
                out.dim(0), tp);
  if (tp == 1) {
    x_full.copy_from(x);
    gemm(x, out);
    return;
  }
  std::unique_ptr<dist::CommWork> gathered = mp.comm->all_gather_async(x, x_full, mp.tp());
  Tensor own = out.rows(int64_t(r) * rows, rows);
  gemm(x, own);
  gathered->wait();
  if (r > 0) {
    Tensor before = out.rows(0, int64_t(r) * rows);
    gemm(x_full.rows(0, int64_t(r) * rows), before);
  }
  if (r + 1 < tp) {
    const int64_t first = int64_t(r + 1) * rows, count = int64_t(tp - r - 1) * rows;
    Tensor after = out.rows(first, count);
    gemm(x_full.rows(first, count), after);
  }
}

Tensor gemm_reduce_scattered_rows(const Tensor& x, int64_t n, const RowGemm& gemm,
                                  const ModelParallel& mp, int splits) {
  const int tp = mp.tp_size();
  const int64_t total = x.dim(0);
  MEGATON_CHECK(total % tp == 0,
                "sequence parallel: {} token rows are not divisible by tensor-parallel size {}",
                total, tp);
  const int64_t block = total / tp;  // each rank's rows of the result
  splits = std::max(1, splits);
  while (splits > 1 && block % splits != 0) --splits;
  const int64_t sub = block / splits;
  Tensor y = Tensor::empty({total, n}, x.dtype(), x.device());
  Tensor out = Tensor::empty({block, n}, x.dtype(), x.device());
  std::vector<std::unique_ptr<dist::CommWork>> pending;
  for (int c = 0; c < splits; ++c) {
    // Chunk c of y: sub-block c of rank 0's block, then of rank 1's, ... (tp x sub rows).
    Tensor chunk = y.rows(int64_t(c) * tp * sub, tp * sub);
    for (int j = 0; j < tp; ++j) {
      Tensor dst = chunk.rows(int64_t(j) * sub, sub);
      gemm(x.rows(int64_t(j) * block + int64_t(c) * sub, sub), dst);
    }
    Tensor dst = out.rows(int64_t(c) * sub, sub);
    if (tp == 1)
      dst.copy_from(chunk);
    else
      pending.push_back(mp.comm->reduce_scatter_async(chunk, dst, mp.tp()));
  }
  for (auto& work : pending) work->wait();
  return out;
}

int tp_comm_overlap_splits() {
  // Read once: every row-parallel forward under the overlap asks.
  static const int splits = [] {
    const char* v = std::getenv("MEGATON_TP_COMM_OVERLAP_SPLITS");
    if (!v || !*v) return 2;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end != '\0' || n < 1 || n > 64)
      throw Error("MEGATON_TP_COMM_OVERLAP_SPLITS '" + std::string(v) +
                  "' is not an integer from 1 to 64");
    return int(n);
  }();
  return splits;
}

}  // namespace megaton
