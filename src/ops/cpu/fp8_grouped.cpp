// ops::fp8_grouped_gemm (ops/fp8.h): the door checks, the CUDA dispatch, and the CPU
// reference, which is ops::fp8_gemm per group (so the grouped GEMM and the single one
// agree bit for bit on the CPU).
#include <cstddef>
#include <vector>

#include "ops/dispatch.h"
#include "ops/cpu/fp8_checks.h"
#include "ops/fp8.h"

namespace megaton::ops {
namespace {

const char* device_name(Device d) { return d == Device::CPU ? "CPU" : "CUDA"; }

// Every entry of `list` defined, on `device`.
void check_entries(const std::vector<Tensor>& list, const char* name, Device device) {
  const char* op = "fp8_grouped_gemm";
  for (size_t g = 0; g < list.size(); ++g) {
    MEGATON_CHECK(list[g].defined(), "{}: {}[{}] is undefined", op, name, g);
    MEGATON_CHECK(list[g].device() == device, "{}: {}[{}] is on {}, a[0] on {} (one device)", op,
                  name, g, device_name(list[g].device()), device_name(device));
  }
}

void check_scale(const Tensor& s, const char* name, size_t g) {
  MEGATON_CHECK(s.dtype() == DType::F32 && s.shape() == Shape{1},
                "fp8_grouped_gemm: {}[{}] must be F32 [1] (per-tensor), got {} {}", name, g,
                dtype_name(s.dtype()), shape_str(s.shape()));
}

}  // namespace

void fp8_grouped_gemm(const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv,
                      const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv,
                      const std::vector<Tensor>& c, float alpha, float beta,
                      bool fast_accumulation) {
  const char* op = "fp8_grouped_gemm";
  const size_t groups = a.size();
  MEGATON_CHECK(a_scale_inv.size() == groups && b.size() == groups &&
                    b_scale_inv.size() == groups && c.size() == groups,
                "{}: list lengths differ: a {}, a_scale_inv {}, b {}, b_scale_inv {}, c {}", op,
                groups, a_scale_inv.size(), b.size(), b_scale_inv.size(), c.size());
  if (groups == 0) return;
  MEGATON_CHECK(a[0].defined(), "{}: a[0] is undefined", op);
  const Device device = a[0].device();
  for (const auto* list : {&a, &a_scale_inv, &b, &b_scale_inv, &c}) {
    const char* name = list == &a             ? "a"
                       : list == &a_scale_inv ? "a_scale_inv"
                       : list == &b           ? "b"
                       : list == &b_scale_inv ? "b_scale_inv"
                                              : "c";
    check_entries(*list, name, device);
  }
  const DType a_dtype = a[0].dtype(), b_dtype = b[0].dtype(), c_dtype = c[0].dtype();
  MEGATON_CHECK(fp8_checks::is_fp8(a_dtype) && fp8_checks::is_fp8(b_dtype),
                "{}: a and b must be F8E4M3 or F8E5M2, got a[0] {}, b[0] {}", op,
                dtype_name(a_dtype), dtype_name(b_dtype));
  MEGATON_CHECK(!(a_dtype == DType::F8E5M2 && b_dtype == DType::F8E5M2),
                "{}: a and b cannot both be F8E5M2 (no E5M2 x E5M2 FP8 GEMM)", op);
  MEGATON_CHECK(c_dtype == DType::F32 || c_dtype == DType::BF16,
                "{}: c must be F32 or BF16, got c[0] {}", op, dtype_name(c_dtype));
  for (size_t g = 0; g < groups; ++g) {
    MEGATON_CHECK(a[g].dtype() == a_dtype && b[g].dtype() == b_dtype && c[g].dtype() == c_dtype,
                  "{}: group {} has a {}, b {}, c {}; group 0 a {}, b {}, c {} (one dtype per "
                  "list)",
                  op, g, dtype_name(a[g].dtype()), dtype_name(b[g].dtype()),
                  dtype_name(c[g].dtype()), dtype_name(a_dtype), dtype_name(b_dtype),
                  dtype_name(c_dtype));
    MEGATON_CHECK(a[g].ndim() == 2 && b[g].ndim() == 2 && c[g].ndim() == 2 &&
                      a[g].dim(1) == b[g].dim(1) && c[g].dim(0) == a[g].dim(0) &&
                      c[g].dim(1) == b[g].dim(0),
                  "{}: group {}: a {} [M, K], b {} [N, K], c {} [M, N] do not match", op, g,
                  shape_str(a[g].shape()), shape_str(b[g].shape()), shape_str(c[g].shape()));
    const int64_t m = a[g].dim(0), n = b[g].dim(0), k = a[g].dim(1);
    MEGATON_CHECK(m % 16 == 0 && n % 16 == 0 && k % 16 == 0,
                  "{}: group {}: M={} N={} K={} must be multiples of 16 (FP8 tensor cores' TMA "
                  "rows)",
                  op, g, m, n, k);
    check_scale(a_scale_inv[g], "a_scale_inv", g);
    check_scale(b_scale_inv[g], "b_scale_inv", g);
  }
  MEGATON_CUDA_DISPATCH(a[0], cuda::fp8_grouped_gemm(a, a_scale_inv, b, b_scale_inv, c, alpha, beta,
                                                     fast_accumulation));
  MEGATON_CHECK(device == Device::CPU, "{}: no CUDA backend in this build", op);
  for (size_t g = 0; g < groups; ++g) {
    if (a[g].dim(0) == 0 || b[g].dim(0) == 0 || a[g].dim(1) == 0) continue;  // c[g] untouched
    Tensor c_g = c[g];  // shares c[g]'s storage
    fp8_gemm(a[g], a_scale_inv[g], b[g], b_scale_inv[g], c_g, alpha, beta, fast_accumulation);
  }
}

}  // namespace megaton::ops
