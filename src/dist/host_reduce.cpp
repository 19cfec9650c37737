// sum_over: deterministic fp64 sums of host values.
#include "dist/host_reduce.h"

#include <bit>
#include <cstring>

namespace megaton::dist {

std::vector<double> sum_over(Comm& comm, const Group& g, const std::vector<double>& values) {
  if (g.size() <= 1 || values.empty()) return values;
  const int64_t n = int64_t(values.size());
  Tensor mine = Tensor::empty({n}, DType::I64);
  for (int64_t i = 0; i < n; ++i) mine.i64()[i] = std::bit_cast<int64_t>(values[i]);
  Tensor all = Tensor::empty({n * g.size()}, DType::I64, comm.device());
  comm.all_gather(mine.to(comm.device()), all, g);
  Tensor host = all.to(Device::CPU);
  std::vector<double> out(values.size(), 0.0);
  for (int member = 0; member < g.size(); ++member)
    for (int64_t i = 0; i < n; ++i) out[i] += std::bit_cast<double>(host.i64()[member * n + i]);
  return out;
}

}  // namespace megaton::dist
