// MoE token permutation on the GPU: group token copies by expert and gather them back.
//
// Copy c = t * k + j is token t's j-th routing choice. moe_permute sorts copies by expert,
// stable in copy order (the CPU twin's counting sort, ops/cpu/moe_permute.cpp), in three
// steps: per-block expert histograms of the copies, one exclusive scan over them laid out
// expert-major (so each (expert, block) learns its first permuted row), and a stable
// scatter that ranks each copy among its block's earlier copies of the same expert. Every
// count is an integer, so the result is deterministic and equal to the CPU's.
//
// The other ops invert row_id_map (copy -> permuted row) and gather: each output row is
// written by one warp, summing its inputs in j order, with no atomics. The padding ops
// (a fixed capacity per expert, or each expert's rows rounded up to a GEMM tile) move each
// expert's rows into or out of its block of padded rows, one warp per padded row, the
// groups' starts passed by value.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

constexpr int kCopiesPerBlock = 1024;  // threads of the histogram and scatter kernels
constexpr int kScanThreads = 1024;
constexpr int kWarpsPerBlock = 8;  // rows per block of the gather kernels
constexpr int kMaxExperts = 8192;  // per-block expert counters live in shared memory

// ---- host: door checks and dispatch ----

void check_on_gpu(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "moe_permute: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CUDA, "moe_permute: {} must be on the GPU", name);
}

void check_dtype(const Tensor& t, DType want, const char* name) {
  check_on_gpu(t, name);
  MEGATON_CHECK(t.dtype() == want, "moe_permute: {} must be {}, got {}", name, dtype_name(want),
                dtype_name(t.dtype()));
}

// Activations: F32, BF16 or F16.
void check_float(const Tensor& t, const char* name) {
  check_on_gpu(t, name);
  MEGATON_CHECK(detail::is_cuda_float(t.dtype()),
                "moe_permute: {} must be F32, BF16 or F16, got {}", name, dtype_name(t.dtype()));
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  MEGATON_CHECK(t.shape() == want, "moe_permute: {} has shape {}, expected {}", name,
                shape_str(t.shape()), shape_str(want));
}

void check_copies(int64_t copies) {
  MEGATON_CHECK(copies <= INT32_MAX, "moe_permute: {} token copies overflow the int32 row_id_map",
                copies);
}

unsigned row_blocks(int64_t rows) { return unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(T{}, std::integral_constant<int, kN>{}) with T = float, __nv_bfloat16 or __half for
// `dtype`, and kN = elements per 16-byte pack when rows of H elements starting at every
// pointer in ptrs allow it, else kN = 1.
template <typename F>
void dispatch_rows(DType dtype, int64_t H, std::initializer_list<const void*> ptrs, F&& f) {
  bool packed = (H * int64_t(dtype_size(dtype))) % 16 == 0;
  for (const void* p : ptrs) packed = packed && aligned16(p);
  auto with_type = [&](auto tag) {
    using T = decltype(tag);
    if (packed)
      f(T{}, std::integral_constant<int, int(16 / sizeof(T))>{});
    else
      f(T{}, std::integral_constant<int, 1>{});
  };
  detail::dispatch_float(dtype, with_type);
}

// ---- device ----

using detail::from_float;  // round-to-nearest-even, as the CPU's float_to_bf16 / float_to_fp16
using detail::to_float;

// kN consecutive elements moved as one aligned load/store.
template <typename T, int kN>
struct alignas(sizeof(T) * kN) Pack {
  T v[kN];
};

template <typename T, int kN>
__device__ __forceinline__ void load_floats(const T* row, int64_t pack, float (&out)[kN]) {
  const Pack<T, kN> p = reinterpret_cast<const Pack<T, kN>*>(row)[pack];
#pragma unroll
  for (int i = 0; i < kN; ++i) out[i] = to_float(p.v[i]);
}

template <typename T, int kN>
__device__ __forceinline__ void store_floats(T* row, int64_t pack, const float (&in)[kN]) {
  Pack<T, kN> p;
#pragma unroll
  for (int i = 0; i < kN; ++i) p.v[i] = from_float<T>(in[i]);
  reinterpret_cast<Pack<T, kN>*>(row)[pack] = p;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// block_counts[e * blocks + b] = copies of block b (copies [b * kCopiesPerBlock, ...))
// routed to expert e. An expert index outside [0, E) is a broken invariant of the router:
// the kernel traps (the CUDA context reports an error at the next synchronisation).
__global__ void permute_histogram_kernel(const int32_t* __restrict__ indices, int64_t copies, int E,
                                         int32_t* __restrict__ block_counts) {
  extern __shared__ int32_t counts[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t c = int64_t(blockIdx.x) * kCopiesPerBlock + threadIdx.x;
  if (c < copies) {
    const int32_t e = indices[c];
    if (e < 0 || e >= E) {
      printf("moe_permute: expert index %d of copy %lld not in [0, %d)\n", e, (long long)c, E);
      __trap();
    }
    atomicAdd(counts + e, 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    block_counts[int64_t(e) * gridDim.x + blockIdx.x] = counts[e];
}

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32, <= 1024).
__device__ int32_t block_exclusive_scan(int32_t v) {
  __shared__ int32_t warp_totals[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t inclusive = v;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int32_t other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    int32_t total = lane < warps ? warp_totals[lane] : 0;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int32_t other = __shfl_up_sync(0xffffffffu, total, offset);
      if (lane >= offset) total += other;
    }
    warp_totals[lane] = total;  // inclusive over warps
  }
  __syncthreads();
  return inclusive - v + (warp > 0 ? warp_totals[warp - 1] : 0);
}

// One block: first_row = exclusive scan of block_counts [E, blocks] (expert-major), so
// first_row[e * blocks + b] is the permuted row of block b's first copy of expert e; then
// tokens_per_expert[e] = rows of expert e.
__global__ void permute_scan_kernel(const int32_t* __restrict__ block_counts, int blocks, int E,
                                    int64_t copies, int32_t* __restrict__ first_row,
                                    int64_t* __restrict__ tokens_per_expert) {
  const int64_t n = int64_t(E) * blocks;
  const int64_t per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int64_t begin = min(n, threadIdx.x * per_thread), end = min(n, begin + per_thread);
  int32_t local = 0;
  for (int64_t i = begin; i < end; ++i) local += block_counts[i];
  int32_t running = block_exclusive_scan(local);
  for (int64_t i = begin; i < end; ++i) {
    first_row[i] = running;
    running += block_counts[i];
  }
  __syncthreads();  // first_row is read across threads below
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int64_t start = first_row[int64_t(e) * blocks];
    const int64_t stop = e + 1 < E ? first_row[int64_t(e + 1) * blocks] : copies;
    tokens_per_expert[e] = stop - start;
  }
}

// row_id_map[row] = c for every copy c of the block, row = first_row of (its expert, this
// block) + its rank among the block's earlier copies of that expert. Warps take turns in
// copy order; inside a warp, lanes with the same expert rank by lane (__match_any_sync).
__global__ void permute_scatter_kernel(const int32_t* __restrict__ indices, int64_t copies, int E,
                                       const int32_t* __restrict__ first_row,
                                       int32_t* __restrict__ row_id_map) {
  extern __shared__ int32_t next_row[];
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    next_row[e] = first_row[int64_t(e) * gridDim.x + blockIdx.x];
  __syncthreads();
  const int64_t c = int64_t(blockIdx.x) * kCopiesPerBlock + threadIdx.x;
  const bool valid = c < copies;
  const int32_t e = valid ? indices[c] : -1;  // checked by the histogram kernel
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  const bool leader = rank == 0;
  for (int turn = 0; turn < int(blockDim.x / 32); ++turn) {
    if (warp == turn) {
      const int32_t base = valid ? next_row[e] : 0;
      __syncwarp();  // every lane has read next_row before the leaders advance it
      if (valid) {
        row_id_map[base + rank] = int32_t(c);
        if (leader) next_row[e] = base + __popc(peers);
      }
    }
    __syncthreads();
  }
}

// permuted[r, :] = x[row_id_map[r] / k, :].
template <typename T, int kN>
__global__ void permute_rows_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_id_map,
                                    int64_t rows, int64_t H, int k, T* __restrict__ permuted) {
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const auto* src = reinterpret_cast<const Pack<T, kN>*>(x + int64_t(row_id_map[r] / k) * H);
  auto* dst = reinterpret_cast<Pack<T, kN>*>(permuted + r * H);
  for (int64_t i = lane; i < H / kN; i += 32) dst[i] = src[i];
}

// row_of_copy[row_id_map[r]] = r, with row_of_copy preset to -1. A map that is not a
// permutation of [0, copies) is a broken invariant: the kernel traps.
__global__ void invert_row_id_map_kernel(const int32_t* __restrict__ row_id_map, int64_t copies,
                                         int32_t* __restrict__ row_of_copy) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= copies) return;
  const int32_t c = row_id_map[r];
  if (c < 0 || c >= copies || atomicExch(row_of_copy + c, int32_t(r)) != -1) {
    printf("moe_permute: row_id_map[%lld] = %d is out of range or repeated (%lld copies)\n",
           (long long)r, c, (long long)copies);
    __trap();
  }
}

// out[t, :] = sum_j w_j * rows[row_of_copy[t * k + j], :] in j order, w_j = probs[t, j]
// (kWeighted) or 1. One warp per token.
template <typename T, int kN, bool kWeighted>
__global__ void gather_tokens_kernel(const T* __restrict__ rows,
                                     const int32_t* __restrict__ row_of_copy,
                                     const float* __restrict__ probs, int64_t T_tokens, int64_t H,
                                     int k, T* __restrict__ out) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T_tokens) return;
  T* out_row = out + t * H;
  for (int64_t i = lane; i < H / kN; i += 32) {
    float acc[kN];
#pragma unroll
    for (int n = 0; n < kN; ++n) acc[n] = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t c = t * k + j;
      float v[kN];
      load_floats<T, kN>(rows + int64_t(row_of_copy[c]) * H, i, v);
      if constexpr (kWeighted) {
        const float w = probs[c];
#pragma unroll
        for (int n = 0; n < kN; ++n) acc[n] += w * v[n];
      } else {
#pragma unroll
        for (int n = 0; n < kN; ++n) acc[n] += v[n];
      }
    }
    store_floats<T, kN>(out_row, i, acc);
  }
}

// For copy c = t * k + j in permuted row r: dexpert_out[r, :] = probs[c] * dout[t, :] and
// dprobs[c] = <dout[t, :], expert_out[r, :]>. One warp per copy.
template <typename T, int kN>
__global__ void unpermute_backward_kernel(const T* __restrict__ dout,
                                          const T* __restrict__ expert_out,
                                          const int32_t* __restrict__ row_of_copy,
                                          const float* __restrict__ probs, int64_t copies,
                                          int64_t H, int k, T* __restrict__ dexpert_out,
                                          float* __restrict__ dprobs) {
  const int64_t c = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (c >= copies) return;
  const int64_t t = c / k, r = row_of_copy[c];
  const float w = probs[c];
  const T* g_row = dout + t * H;
  const T* eo_row = expert_out + r * H;
  T* deo_row = dexpert_out + r * H;
  float dot = 0.0f;
  for (int64_t i = lane; i < H / kN; i += 32) {
    float g[kN], eo[kN], d[kN];
    load_floats<T, kN>(g_row, i, g);
    load_floats<T, kN>(eo_row, i, eo);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      d[n] = w * g[n];
      dot += g[n] * eo[n];
    }
    store_floats<T, kN>(deo_row, i, d);
  }
  dot = warp_sum(dot);
  if (lane == 0) dprobs[c] = dot;
}

// Groups of one padding launch (moe_pad_rows): their first rows in the unpadded rows and in
// this launch's padded rows, passed by value as a __grid_constant__ parameter under the
// classic 4 KB limit, so the host counts reach the kernel without a copy or a
// synchronization.
constexpr int kMaxPadGroups = 480;
struct PadGroups {
  int32_t row_start[kMaxPadGroups + 1];     // group g's rows: [row_start[g], row_start[g + 1])
  int32_t padded_start[kMaxPadGroups + 1];  // its padded rows, from the launch's first
  int32_t groups;
};
static_assert(sizeof(PadGroups) + 2 * sizeof(int64_t) + 2 * sizeof(void*) <= 4096,
              "PadGroups must fit the 4 KB kernel parameter limit");

// Padded row p (of this launch) in group g, padded_start[g] <= p < padded_start[g + 1], is
// rows[row_start[g] + i], i = p - padded_start[g], when i is below group g's rows (kUnpad:
// copied the other way), else zeros (padding only). One warp per padded row; g by binary
// search over the padded starts (uniform across the warp, so the parameter reads broadcast),
// groups without padded rows never matching.
template <typename T, int kN, bool kUnpad>
__global__ void pad_rows_kernel(const __grid_constant__ PadGroups groups, T* __restrict__ rows,
                                T* __restrict__ padded, int64_t padded_rows, int64_t H) {
  const int64_t p = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (p >= padded_rows) return;
  // The last g in [0, groups) with padded_start[g] <= p: the first j in [1, groups] with
  // padded_start[j] > p, less one.
  int lo = 1, hi = groups.groups;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (groups.padded_start[mid] > p)
      hi = mid;
    else
      lo = mid + 1;
  }
  const int g = lo - 1;
  const int64_t i = p - groups.padded_start[g];
  const int64_t row = int64_t(groups.row_start[g]) + i;
  auto* padded_row = reinterpret_cast<Pack<T, kN>*>(padded + p * H);
  if (row < groups.row_start[g + 1]) {
    auto* rows_row = reinterpret_cast<Pack<T, kN>*>(rows + row * H);
    for (int64_t n = lane; n < H / kN; n += 32) {
      if constexpr (kUnpad)
        rows_row[n] = padded_row[n];
      else
        padded_row[n] = rows_row[n];
    }
  } else if (!kUnpad) {
    const float zeros[kN] = {};
    for (int64_t n = lane; n < H / kN; n += 32) store_floats<T, kN>(padded + p * H, n, zeros);
  }
}

// Both padding ops: door checks, then one launch per kMaxPadGroups groups.
void pad_rows(const Tensor& rows, const std::vector<int64_t>& group_rows,
              const std::vector<int64_t>& padded_rows, const Tensor& padded, bool unpad) {
  const char* op = unpad ? "moe_unpad_rows" : "moe_pad_rows";
  check_float(rows, "rows");
  check_dtype(padded, rows.dtype(), "padded");
  MEGATON_CHECK(rows.ndim() == 2, "{}: rows must be [R, H], got {}", op, shape_str(rows.shape()));
  MEGATON_CHECK(padded_rows.size() == group_rows.size(), "{}: {} padded row counts for {} groups",
                op, padded_rows.size(), group_rows.size());
  const int64_t num_groups = int64_t(group_rows.size()), H = rows.dim(1);
  std::vector<int64_t> row_start(num_groups + 1, 0), padded_start(num_groups + 1, 0);
  for (int64_t g = 0; g < num_groups; ++g) {
    MEGATON_CHECK(group_rows[g] >= 0 && group_rows[g] <= padded_rows[g],
                  "{}: group {} has {} rows, not in [0, its padded rows {}]", op, g, group_rows[g],
                  padded_rows[g]);
    row_start[g + 1] = row_start[g] + group_rows[g];
    padded_start[g + 1] = padded_start[g] + padded_rows[g];
  }
  MEGATON_CHECK(row_start.back() == rows.dim(0), "{}: rows has {} rows, the groups sum to {}", op,
                rows.dim(0), row_start.back());
  MEGATON_CHECK(row_start.back() <= INT32_MAX && padded_start.back() <= INT32_MAX,
                "{}: {} rows or {} padded rows overflow the int32 group starts", op,
                row_start.back(), padded_start.back());
  MEGATON_CHECK(padded.shape() == Shape({padded_start.back(), H}),
                "{}: padded has shape {}, expected [{}, {}]", op, shape_str(padded.shape()),
                padded_start.back(), H);
  if (H == 0) return;
  const size_t elem = dtype_size(rows.dtype());
  for (int64_t first = 0; first < num_groups; first += kMaxPadGroups) {
    PadGroups launch;
    launch.groups = int32_t(std::min<int64_t>(kMaxPadGroups, num_groups - first));
    for (int32_t g = 0; g <= launch.groups; ++g) {
      launch.row_start[g] = int32_t(row_start[first + g]);
      launch.padded_start[g] = int32_t(padded_start[first + g] - padded_start[first]);
    }
    const int64_t launch_padded_rows = launch.padded_start[launch.groups];
    if (launch_padded_rows == 0) continue;
    char* padded_at = static_cast<char*>(padded.raw()) + size_t(padded_start[first] * H) * elem;
    dispatch_rows(rows.dtype(), H, {rows.raw(), padded_at}, [&](auto tag, auto pack) {
      using T_ = decltype(tag);
      auto* rows_ptr = static_cast<T_*>(rows.raw());
      auto* padded_ptr = reinterpret_cast<T_*>(padded_at);
      const unsigned blocks = row_blocks(launch_padded_rows);
      if (unpad)
        pad_rows_kernel<T_, decltype(pack)::value, true>
            <<<blocks, kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
                launch, rows_ptr, padded_ptr, launch_padded_rows, H);
      else
        pad_rows_kernel<T_, decltype(pack)::value, false>
            <<<blocks, kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
                launch, rows_ptr, padded_ptr, launch_padded_rows, H);
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  }
}

// row_of_copy [copies] on the GPU, the inverse of row_id_map.
Tensor invert_row_id_map(const Tensor& row_id_map, int64_t copies) {
  check_dtype(row_id_map, DType::I32, "row_id_map");
  check_shape(row_id_map, {copies}, "row_id_map");
  Tensor row_of_copy = Tensor::empty({copies}, DType::I32, Device::CUDA);
  if (copies == 0) return row_of_copy;
  cudaStream_t stream = ::megaton::cuda::stream();
  MEGATON_CUDA_CHECK(cudaMemsetAsync(row_of_copy.raw(), 0xFF, row_of_copy.nbytes(), stream));
  const int threads = 256;
  invert_row_id_map_kernel<<<unsigned((copies + threads - 1) / threads), threads, 0, stream>>>(
      row_id_map.i32(), copies, row_of_copy.i32());
  MEGATON_CUDA_CHECK_LAUNCH();
  return row_of_copy;
}

}  // namespace

void moe_permute(const Tensor& x, const Tensor& indices, int num_experts, Tensor& permuted,
                 Tensor& row_id_map, Tensor& tokens_per_expert) {
  check_float(x, "x");
  MEGATON_CHECK(x.ndim() == 2, "moe_permute: x must be [T, H], got {}", shape_str(x.shape()));
  check_dtype(indices, DType::I32, "indices");
  const int64_t T = x.dim(0), H = x.dim(1);
  MEGATON_CHECK(indices.ndim() == 2 && indices.dim(0) == T,
                "moe_permute: indices {} must be [T = {}, k]", shape_str(indices.shape()), T);
  MEGATON_CHECK(num_experts >= 1 && num_experts <= kMaxExperts,
                "moe_permute: num_experts {} must be in [1, {}]", num_experts, kMaxExperts);
  const int64_t k = indices.dim(1), copies = T * k;
  check_copies(copies);
  check_dtype(permuted, x.dtype(), "permuted");
  check_shape(permuted, {copies, H}, "permuted");
  check_dtype(row_id_map, DType::I32, "row_id_map");
  check_shape(row_id_map, {copies}, "row_id_map");
  check_dtype(tokens_per_expert, DType::I64, "tokens_per_expert");
  check_shape(tokens_per_expert, {num_experts}, "tokens_per_expert");
  if (copies == 0) {
    tokens_per_expert.zero();
    return;
  }
  cudaStream_t stream = ::megaton::cuda::stream();
  const int E = num_experts;
  const int blocks = int((copies + kCopiesPerBlock - 1) / kCopiesPerBlock);
  const size_t counter_bytes = sizeof(int32_t) * size_t(E);
  Tensor block_counts = Tensor::empty({E, blocks}, DType::I32, Device::CUDA);
  Tensor first_row = Tensor::empty({E, blocks}, DType::I32, Device::CUDA);

  permute_histogram_kernel<<<blocks, kCopiesPerBlock, counter_bytes, stream>>>(
      indices.i32(), copies, E, block_counts.i32());
  MEGATON_CUDA_CHECK_LAUNCH();
  permute_scan_kernel<<<1, kScanThreads, 0, stream>>>(block_counts.i32(), blocks, E, copies,
                                                      first_row.i32(), tokens_per_expert.i64());
  MEGATON_CUDA_CHECK_LAUNCH();
  permute_scatter_kernel<<<blocks, kCopiesPerBlock, counter_bytes, stream>>>(
      indices.i32(), copies, E, first_row.i32(), row_id_map.i32());
  MEGATON_CUDA_CHECK_LAUNCH();
  if (H == 0) return;
  dispatch_rows(x.dtype(), H, {x.raw(), permuted.raw()}, [&](auto tag, auto pack) {
    using T_ = decltype(tag);
    permute_rows_kernel<T_, decltype(pack)::value>
        <<<row_blocks(copies), kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const T_*>(x.raw()), row_id_map.i32(), copies, H, int(k),
            static_cast<T_*>(permuted.raw()));
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void moe_permute_rows(const Tensor& x, const Tensor& row_id_map, int k, Tensor& permuted) {
  check_float(x, "x");
  check_dtype(permuted, x.dtype(), "permuted");
  MEGATON_CHECK(k >= 1, "moe_permute: k {} must be >= 1", k);
  MEGATON_CHECK(x.ndim() == 2, "moe_permute: x must be [T, H], got {}", shape_str(x.shape()));
  const int64_t T = x.dim(0), H = x.dim(1), copies = T * k;
  check_copies(copies);
  check_shape(permuted, {copies, H}, "permuted");
  check_dtype(row_id_map, DType::I32, "row_id_map");
  check_shape(row_id_map, {copies}, "row_id_map");
  if (copies == 0 || H == 0) return;
  dispatch_rows(x.dtype(), H, {x.raw(), permuted.raw()}, [&](auto tag, auto pack) {
    using T_ = decltype(tag);
    permute_rows_kernel<T_, decltype(pack)::value>
        <<<row_blocks(copies), kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
            static_cast<const T_*>(x.raw()), row_id_map.i32(), copies, H, k,
            static_cast<T_*>(permuted.raw()));
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_id_map, int k, Tensor& dx) {
  check_float(dx, "dx");
  check_dtype(dpermuted, dx.dtype(), "dpermuted");
  MEGATON_CHECK(k >= 1, "moe_permute: k {} must be >= 1", k);
  MEGATON_CHECK(dx.ndim() == 2, "moe_permute: dx must be [T, H], got {}", shape_str(dx.shape()));
  const int64_t T = dx.dim(0), H = dx.dim(1), copies = T * k;
  check_copies(copies);
  check_shape(dpermuted, {copies, H}, "dpermuted");
  const Tensor row_of_copy = invert_row_id_map(row_id_map, copies);
  if (T == 0 || H == 0) return;
  dispatch_rows(dx.dtype(), H, {dpermuted.raw(), dx.raw()}, [&](auto tag, auto pack) {
    using T_ = decltype(tag);
    gather_tokens_kernel<T_, decltype(pack)::value, false>
        <<<row_blocks(T), kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
            static_cast<const T_*>(dpermuted.raw()), row_of_copy.i32(), nullptr, T, H, k,
            static_cast<T_*>(dx.raw()));
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void moe_unpermute(const Tensor& expert_out, const Tensor& row_id_map, const Tensor& probs,
                   Tensor& out) {
  check_float(out, "out");
  check_dtype(expert_out, out.dtype(), "expert_out");
  check_dtype(probs, DType::F32, "probs");
  MEGATON_CHECK(probs.ndim() == 2, "moe_permute: probs must be [T, k], got {}",
                shape_str(probs.shape()));
  MEGATON_CHECK(out.ndim() == 2, "moe_permute: out must be [T, H], got {}", shape_str(out.shape()));
  const int64_t T = probs.dim(0), k = probs.dim(1), H = out.dim(1), copies = T * k;
  check_copies(copies);
  check_shape(out, {T, H}, "out");
  check_shape(expert_out, {copies, H}, "expert_out");
  const Tensor row_of_copy = invert_row_id_map(row_id_map, copies);
  if (T == 0 || H == 0) return;
  // k == 0 leaves nothing to gather: out is all zeros.
  dispatch_rows(out.dtype(), H, {expert_out.raw(), out.raw()}, [&](auto tag, auto pack) {
    using T_ = decltype(tag);
    gather_tokens_kernel<T_, decltype(pack)::value, true>
        <<<row_blocks(T), kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
            static_cast<const T_*>(expert_out.raw()), row_of_copy.i32(), probs.f32(), T, H, int(k),
            static_cast<T_*>(out.raw()));
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void moe_unpermute_backward(const Tensor& dout, const Tensor& expert_out, const Tensor& row_id_map,
                            const Tensor& probs, Tensor& dexpert_out, Tensor& dprobs) {
  check_float(dout, "dout");
  check_dtype(expert_out, dout.dtype(), "expert_out");
  check_dtype(dexpert_out, dout.dtype(), "dexpert_out");
  check_dtype(probs, DType::F32, "probs");
  check_dtype(dprobs, DType::F32, "dprobs");
  MEGATON_CHECK(probs.ndim() == 2, "moe_permute: probs must be [T, k], got {}",
                shape_str(probs.shape()));
  MEGATON_CHECK(dout.ndim() == 2, "moe_permute: dout must be [T, H], got {}",
                shape_str(dout.shape()));
  const int64_t T = probs.dim(0), k = probs.dim(1), H = dout.dim(1), copies = T * k;
  check_copies(copies);
  check_shape(dout, {T, H}, "dout");
  check_shape(expert_out, {copies, H}, "expert_out");
  check_shape(dexpert_out, {copies, H}, "dexpert_out");
  check_shape(dprobs, {T, k}, "dprobs");
  const Tensor row_of_copy = invert_row_id_map(row_id_map, copies);
  if (copies == 0) return;
  // H == 0 still writes dprobs (empty dot products are 0).
  dispatch_rows(dout.dtype(), H, {dout.raw(), expert_out.raw(), dexpert_out.raw()},
                [&](auto tag, auto pack) {
                  using T_ = decltype(tag);
                  unpermute_backward_kernel<T_, decltype(pack)::value>
                      <<<row_blocks(copies), kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
                          static_cast<const T_*>(dout.raw()),
                          static_cast<const T_*>(expert_out.raw()), row_of_copy.i32(), probs.f32(),
                          copies, H, int(k), static_cast<T_*>(dexpert_out.raw()), dprobs.f32());
                  MEGATON_CUDA_CHECK_LAUNCH();
                });
}

void moe_pad_rows(const Tensor& rows, const std::vector<int64_t>& group_rows,
                  const std::vector<int64_t>& padded_rows, Tensor& padded) {
  pad_rows(rows, group_rows, padded_rows, padded, false);
}

void moe_unpad_rows(const Tensor& padded, const std::vector<int64_t>& group_rows,
                    const std::vector<int64_t>& padded_rows, Tensor& rows) {
  pad_rows(rows, group_rows, padded_rows, padded, true);
}

}  // namespace megaton::ops::cuda
