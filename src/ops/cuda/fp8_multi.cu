// The multi-tensor FP8 ops of ops/fp8.h on the GPU: amax, scale update, delayed scaling
// and the per-tensor cast (+ transpose, + amax) of n tensors, one kernel launch per op for
// all entries (up to kMaxEntries per launch). The MoE layer quantizes each local expert's
// operand with its own scale; one launch per expert cost ~26 ms per step.
//
// Layout: the entries' pointers and sizes travel in a __grid_constant__ struct of arrays
// (under the 4 KB kernel-parameter limit: kMaxEntries entries; longer lists are launched
// in chunks of kMaxEntries, in order, on the one stream). The grid is the concatenation
// of the entries' CTAs: entry e owns CTAs first_block[e] .. first_block[e + 1] - 1 (a
// prefix sum made on the host), and a CTA finds its entry by binary search. Each CTA then
// runs the single-tensor kernels' own bodies (ops/cuda/fp8_util.cuh) on its entry:
//   amax / cast without out_t: the grid-stride body over the entry's CTAs only;
//   cast with out_t: one 128 x 128 tile per CTA, the tile body of fp8_quantize (so out_t
//     is exactly the transpose of out, and the vector/scalar choice per entry is the one
//     fp8_quantize makes);
//   delayed scaling: one CTA per entry.
// So entry i's outputs are the single-tensor op's, bit for bit.
//
// Amax across the CTAs of an entry: the single-tensor ops zero amax with a memset and
// atomicMax into it; here the amaxes are n separate [1] tensors, and n memsets are what
// the op exists to avoid. Instead each CTA atomicMaxes its max (abs_bits: NaN-propagating,
// exact, order-independent) into a per-entry slot of a device-global scratch and counts
// itself done; the entry's last CTA reads the slot into amax and resets slot and counter
// to 0 for the next launch (CUDA's threadFenceReduction pattern). The scratch is shared
// by every launch of this file, which is safe because they all run on the one compute
// stream (megaton::cuda::stream()), each launch after the previous has finished.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/fp8_util.cuh"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/fp8.h"

namespace megaton::ops::cuda {
namespace {

using detail::compute_stream;
using detail::is_aligned;

// Entries per launch: QuantizeMultiArgs, the largest struct, is 3848 bytes at 64.
constexpr int kMaxEntries = 64;
// Grid-stride work per thread of the amax and flat-cast CTAs (8-element packs, or
// elements on the scalar path): 4, the unroll of amax_bits, so that a thread's loads are
// all in flight at once.
constexpr int64_t kItemsPerThread = 4;
// Bound on an entry's grid-stride CTAs (its loop covers any size), so that 64 entries
// stay far below the grid's 2^31 - 1 CTAs.
constexpr int64_t kMaxStrideBlocks = int64_t(1) << 20;

// Per-entry amax scratch (see the header comment): zero between launches.
__device__ unsigned int g_amax_bits[kMaxEntries];
__device__ unsigned int g_blocks_done[kMaxEntries];

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Entry e owns CTAs first_block[e] .. first_block[e + 1] - 1 of the grid.
struct EntryBlocks {
  int count;
  uint32_t first_block[kMaxEntries + 1];
};

// The entry owning CTA `block`: the last e with first_block[e] <= block (entries with no
// CTAs share their first_block with the next entry, so they are never chosen).
__device__ __forceinline__ int find_entry(const EntryBlocks& blocks, uint32_t block) {
  int lo = 0, hi = blocks.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (blocks.first_block[mid] <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// CTA `block` of the entry's `blocks` has reduced its max to `m` (valid in thread 0):
// the entry's amax is written by its last CTA.
__device__ __forceinline__ void finish_amax(uint32_t m, int entry, uint32_t blocks, float* amax) {
  if (threadIdx.x != 0) return;
  atomicMax(&g_amax_bits[entry], m);
  __threadfence();  // the max above is visible before this CTA counts as done
  if (atomicAdd(&g_blocks_done[entry], 1u) + 1 != blocks) return;
  __threadfence();
  *amax = __uint_as_float(atomicExch(&g_amax_bits[entry], 0u));
  atomicExch(&g_blocks_done[entry], 0u);
}

// ---- amax ----

struct AmaxMultiArgs {
  EntryBlocks blocks;
  const void* x[kMaxEntries];
  float* amax[kMaxEntries];
  int64_t numel[kMaxEntries];
  bool bf16[kMaxEntries];  // else F32
};
static_assert(sizeof(AmaxMultiArgs) <= 4096, "kernel parameters are limited to 4 KB");

// As fp8_amax's choice: the vector body when x is 16-byte aligned.
template <typename T>
__device__ __forceinline__ uint32_t amax_of(const void* x_raw, int64_t n, int64_t thread,
                                            int64_t threads) {
  const T* x = static_cast<const T*>(x_raw);
  return aligned_to(x, 16) ? amax_bits<T, true>(x, n, thread, threads)
                           : amax_bits<T, false>(x, n, thread, threads);
}

__global__ void __launch_bounds__(kThreads)
    amax_multi_kernel(const __grid_constant__ AmaxMultiArgs args) {
  const int e = find_entry(args.blocks, blockIdx.x);
  const uint32_t block = blockIdx.x - args.blocks.first_block[e];
  const uint32_t blocks = args.blocks.first_block[e + 1] - args.blocks.first_block[e];
  const int64_t thread = int64_t(block) * kThreads + threadIdx.x;
  const int64_t threads = int64_t(blocks) * kThreads;
  const uint32_t m = args.bf16[e]
                         ? amax_of<__nv_bfloat16>(args.x[e], args.numel[e], thread, threads)
                         : amax_of<float>(args.x[e], args.numel[e], thread, threads);
  finish_amax(block_max(m), e, blocks, args.amax[e]);
}

// ---- scale updates ----

struct ScaleMultiArgs {
  int count;
  ScaleRule rule;
  const float* amax[kMaxEntries];
  float* scale[kMaxEntries];
  float* scale_inv[kMaxEntries];
};
static_assert(sizeof(ScaleMultiArgs) <= 4096, "kernel parameters are limited to 4 KB");

// scale, scale_inv from amax by the rule, left as they are when amax gives none (as
// fp8.cu's update_scale_kernel).
__device__ __forceinline__ void update_scale(float amax, const ScaleRule& rule, float* scale,
                                             float* scale_inv) {
  if (!scale_valid(amax)) return;
  const float s = scale_from_amax(amax, 1.0f, rule);
  *scale = s;
  *scale_inv = __fdiv_rn(1.0f, s);
}

// One thread per entry.
__global__ void __launch_bounds__(kMaxEntries)
    update_scale_multi_kernel(const __grid_constant__ ScaleMultiArgs args) {
  const int e = threadIdx.x;
  if (e < args.count) update_scale(*args.amax[e], args.rule, args.scale[e], args.scale_inv[e]);
}

struct DelayedMultiArgs {
  int count;
  bool max_algo;
  int64_t length;  // L, every entry
  ScaleRule rule;
  float* history[kMaxEntries];
  float* scale[kMaxEntries];
  float* scale_inv[kMaxEntries];
};
static_assert(sizeof(DelayedMultiArgs) <= 4096, "kernel parameters are limited to 4 KB");

// One CTA per entry: amax = max |h| over the L rows (max_algo) or row 0, the scale update,
// and the roll new[i] = old[(i + 1) % L], new[0] = 0 (as fp8.cu's delayed_scaling_kernel).
// The roll is a shift down by one done in place, kThreads rows at a time in increasing
// order: a round reads old rows base + 1 .. base + kThreads, then (after a barrier)
// writes rows base .. base + kThreads - 1, none of which a later round reads; old row 0,
// which the last row takes, is read by every thread before the first write. No staging
// buffer, so any L.
__global__ void __launch_bounds__(kThreads)
    delayed_scaling_multi_kernel(const __grid_constant__ DelayedMultiArgs args) {
  const int e = blockIdx.x;
  float* history = args.history[e];
  const int64_t length = args.length;
  const float old0 = history[0];
  __syncthreads();
  uint32_t m = 0;
  for (int64_t base = 0; base < length; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    float next = 0.0f;
    if (i < length) {
      const float old = i + 1 < length ? history[i + 1] : old0;  // old[(i + 1) % L]
      m = max(m, abs_bits(old));
      next = i == 0 ? 0.0f : old;
    }
    __syncthreads();
    if (i < length) history[i] = next;
  }
  m = block_max(m);
  if (threadIdx.x == 0)
    update_scale(args.max_algo ? __uint_as_float(m) : old0, args.rule, args.scale[e],
                 args.scale_inv[e]);
}

// ---- per-tensor cast (+ transpose, + amax) ----

struct QuantizeMultiArgs {
  EntryBlocks blocks;
  const void* x[kMaxEntries];  // [rows, cols]
  const float* scale[kMaxEntries];
  uint8_t* out[kMaxEntries];    // [rows, cols]
  uint8_t* out_t[kMaxEntries];  // [cols, rows], or nullptr: the flat cast
  float* amax[kMaxEntries];     // or nullptr
  int64_t rows[kMaxEntries], cols[kMaxEntries];
};
static_assert(sizeof(QuantizeMultiArgs) <= 4096, "kernel parameters are limited to 4 KB");
static_assert(kThreads == kTileThreads, "flat and tile CTAs share one launch");

// kTiles: some entry of the launch has out_t. The kernel then holds both the tile and the
// flat bodies, each in a vector and a scalar variant, and its registers are the most any
// of them needs (~128: 2 CTAs per SM); 3 CTAs per SM cap them at 80 with a few bytes
// spilled (on the scalar paths; fp8_quantize's vector tile kernel needs 55). Without
// kTiles the kernel is the flat body alone, as light as fp8_quantize's flat kernel.
template <typename T, bool kE4M3, bool kTiles>
__global__ void __launch_bounds__(kThreads, kTiles ? 3 : 1)
    quantize_multi_kernel(const __grid_constant__ QuantizeMultiArgs args) {
  // The tile CTAs' transposed tile.
  __shared__ __align__(16) uint2 tile_t[kTiles ? kTileShared : 2];
  const int e = find_entry(args.blocks, blockIdx.x);
  const uint32_t block = blockIdx.x - args.blocks.first_block[e];
  const uint32_t blocks = args.blocks.first_block[e + 1] - args.blocks.first_block[e];
  const int64_t rows = args.rows[e], cols = args.cols[e], n = rows * cols;
  const T* x = static_cast<const T*>(args.x[e]);
  uint8_t* out = args.out[e];
  uint8_t* out_t = args.out_t[e];
  float* amax = args.amax[e];
  if (kTiles && n > 0 && out_t != nullptr) {  // one 128 x 128 tile, as fp8_quantize with out_t
    TileArgs tile{};
    tile.x = x;
    tile.rows = rows;
    tile.cols = cols;
    tile.tiles_r = (rows + kTile - 1) / kTile;
    tile.tiles_c = (cols + kTile - 1) / kTile;
    tile.out = out;
    tile.out_t = out_t;
    tile.scale = args.scale[e];
    tile.amax = amax;
    // fp8_quantize's launch_tile condition.
    const bool vector = cols % 8 == 0 && rows % 16 == 0 && aligned_to(x, 16) &&
                        aligned_to(out, 8) && aligned_to(out_t, 16);
    const auto sink = [&](uint32_t tile_max) { finish_amax(tile_max, e, blocks, amax); };
    if (vector)
      quantize_tile<T, kE4M3, TileMode::PerTensor, true, true>(tile, block, tile_t, sink);
    else
      quantize_tile<T, kE4M3, TileMode::PerTensor, true, false>(tile, block, tile_t, sink);
    return;
  }
  // The flat grid-stride cast over the entry's CTAs, as fp8_quantize without out_t; an
  // empty entry has one CTA when it has an amax to write (0), else none.
  uint32_t m = 0;
  if (n > 0) {
    const float scale = *args.scale[e];
    const int64_t thread = int64_t(block) * kThreads + threadIdx.x;
    const int64_t threads = int64_t(blocks) * kThreads;
    m = aligned_to(x, 16) && aligned_to(out, 8)
            ? quantize_flat<T, kE4M3, true>(x, scale, out, n, thread, threads)
            : quantize_flat<T, kE4M3, false>(x, scale, out, n, thread, threads);
  }
  if (amax != nullptr) finish_amax(block_max(m), e, blocks, amax);
}

// ---- host ----

// CTAs of a grid-stride entry over `items` work items (0 when there is nothing to do
// and no amax to write).
int64_t stride_blocks(int64_t items, bool writes_amax) {
  const int64_t per_block = kThreads * kItemsPerThread;
  const int64_t wanted = std::min((items + per_block - 1) / per_block, kMaxStrideBlocks);
  return std::max(wanted, int64_t(writes_amax ? 1 : 0));
}

// Fills first_block from per-entry CTA counts; returns the grid size.
unsigned fill_blocks(EntryBlocks& blocks, const std::vector<int64_t>& counts) {
  blocks.count = int(counts.size());
  int64_t total = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    blocks.first_block[e] = uint32_t(total);
    total += counts[e];
    MEGATON_CHECK(total <= INT32_MAX, "fp8 multi-tensor op: {} CTAs exceed the grid limit", total);
  }
  blocks.first_block[counts.size()] = uint32_t(total);
  return unsigned(total);
}

float* optional_f32(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

// Calls f(begin, end) for each chunk of at most kMaxEntries of n entries.
template <typename F>
void for_each_chunk(size_t n, F&& f) {
  for (size_t begin = 0; begin < n; begin += kMaxEntries)
    f(begin, std::min(n, begin + kMaxEntries));
}

}  // namespace

void fp8_amax_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& amax) {
  for_each_chunk(x.size(), [&](size_t begin, size_t end) {
    AmaxMultiArgs args{};
    std::vector<int64_t> counts;
    for (size_t i = begin; i < end; ++i) {
      const int e = int(i - begin);
      const int64_t n = x[i].numel();
      args.x[e] = x[i].raw();
      args.amax[e] = amax[i].f32();
      args.numel[e] = n;
      args.bf16[e] = x[i].dtype() == DType::BF16;
      // Every entry gets a CTA: its amax is written even when x is empty (0).
      counts.push_back(stride_blocks(is_aligned(args.x[e], 16) ? n / 8 + 1 : n, true));
    }
    const unsigned grid = fill_blocks(args.blocks, counts);
    amax_multi_kernel<<<grid, kThreads, 0, compute_stream()>>>(args);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void fp8_update_scale_multi(const std::vector<Tensor>& amax, const Fp8ScaleRule& rule,
                            const std::vector<Tensor>& scale,
                            const std::vector<Tensor>& scale_inv) {
  const ScaleRule device_rule = make_rule(rule);
  for_each_chunk(amax.size(), [&](size_t begin, size_t end) {
    ScaleMultiArgs args{};
    args.count = int(end - begin);
    args.rule = device_rule;
    for (size_t i = begin; i < end; ++i) {
      args.amax[i - begin] = amax[i].f32();
      args.scale[i - begin] = scale[i].f32();
      args.scale_inv[i - begin] = scale_inv[i].f32();
    }
    update_scale_multi_kernel<<<1, kMaxEntries, 0, compute_stream()>>>(args);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void fp8_delayed_scaling_update_multi(const std::vector<Tensor>& amax_history,
                                      const Fp8ScaleRule& rule, bool max_algo,
                                      const std::vector<Tensor>& scale,
                                      const std::vector<Tensor>& scale_inv) {
  if (amax_history.empty()) return;
  const ScaleRule device_rule = make_rule(rule);
  const int64_t length = amax_history[0].numel();
  for_each_chunk(amax_history.size(), [&](size_t begin, size_t end) {
    DelayedMultiArgs args{};
    args.count = int(end - begin);
    args.max_algo = max_algo;
    args.length = length;
    args.rule = device_rule;
    for (size_t i = begin; i < end; ++i) {
      args.history[i - begin] = amax_history[i].f32();
      args.scale[i - begin] = scale[i].f32();
      args.scale_inv[i - begin] = scale_inv[i].f32();
    }
    delayed_scaling_multi_kernel<<<unsigned(args.count), kThreads, 0, compute_stream()>>>(args);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void fp8_quantize_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& scale,
                        const std::vector<Tensor>& out, const std::vector<Tensor>& out_t,
                        const std::vector<Tensor>& amax) {
  if (x.empty()) return;
  const DType input = x[0].dtype(), fp8 = out[0].dtype();
  for_each_chunk(x.size(), [&](size_t begin, size_t end) {
    QuantizeMultiArgs args{};
    std::vector<int64_t> counts;
    bool tiles = false;
    for (size_t i = begin; i < end; ++i) {
      const int e = int(i - begin);
      const int64_t n = x[i].numel();
      const int64_t cols = x[i].ndim() ? x[i].dim(-1) : 1;
      const int64_t rows = cols ? n / cols : 0;
      args.x[e] = x[i].raw();
      args.scale[e] = scale[i].f32();
      args.out[e] = static_cast<uint8_t*>(out[i].raw());
      args.out_t[e] = out_t[i].defined() ? static_cast<uint8_t*>(out_t[i].raw()) : nullptr;
      args.amax[e] = optional_f32(amax[i]);
      args.rows[e] = rows;
      args.cols[e] = cols;
      const bool writes_amax = args.amax[e] != nullptr;
      if (n == 0) {
        counts.push_back(writes_amax ? 1 : 0);
      } else if (args.out_t[e] != nullptr) {  // one CTA per 128 x 128 tile
        counts.push_back(((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile));
        tiles = true;
      } else {  // fp8_quantize's flat grid-stride items
        const bool vector = is_aligned(args.x[e], 16) && is_aligned(args.out[e], 8);
        counts.push_back(stride_blocks(vector ? n / 8 + 1 : n, writes_amax));
      }
    }
    const unsigned grid = fill_blocks(args.blocks, counts);
    if (grid == 0) return;
    detail::dispatch_f32_bf16(input, [&](auto t) {
      using T = decltype(t);
      dispatch_fp8(fp8, [&](auto e4m3) {
        dispatch_bool(tiles, [&](auto with_tiles) {
          quantize_multi_kernel<T, decltype(e4m3)::value, decltype(with_tiles)::value>
              <<<grid, kThreads, 0, compute_stream()>>>(args);
          MEGATON_CUDA_CHECK_LAUNCH();
        });
      });
    });
  });
}

}  // namespace megaton::ops::cuda
