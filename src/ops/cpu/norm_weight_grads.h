// The norms' weight and bias gradients on the CPU, shared by the norm ops (norm.cpp) and
// the fused QK-norm ops (qkv_norm.cpp).
#pragma once
#include <algorithm>
#include <cstdint>

namespace megaton::ops::norm_math {

// dweight[j] += sum_t dy[t, j] * xhat[t, j] and dbias[j] += sum_t dy[t, j], with
// xhat = (x - mean) * rstd (mean == nullptr: RMSNorm, no centring). Threads own column
// blocks and sum tokens in order, so the result does not depend on the thread count.
inline void weight_grads(const float* dy, const float* x, const float* mean,
                         const float* rstd, float* dweight, float* dbias, int64_t rows,
                         int64_t cols) {
  constexpr int64_t kBlock = 32;
  int64_t blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t(1) << 14))
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int64_t j0 = blk * kBlock, j1 = std::min(cols, j0 + kBlock);
    double dw[kBlock] = {}, db[kBlock] = {};
    for (int64_t t = 0; t < rows; ++t) {
      const float* dyr = dy + t * cols;
      const float* xr = x + t * cols;
      double mu = mean ? mean[t] : 0.0, r = rstd[t];
      for (int64_t j = j0; j < j1; ++j) {
        dw[j - j0] += double(dyr[j]) * ((xr[j] - mu) * r);
        db[j - j0] += dyr[j];
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      dweight[j] += float(dw[j - j0]);
      if (dbias) dbias[j] += float(db[j - j0]);
    }
  }
}

}  // namespace megaton::ops::norm_math
