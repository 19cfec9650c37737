// MoE token permutation: group token copies by expert and scatter them back, CPU fp32 reference.
//
// Copy c = t * k + j is token t's j-th routing choice. moe_permute sorts copies by expert
// (stable, so within an expert copies stay in token order, as Megatron's
// moe_utils.permute with a routing map), and row_id_map records which copy each permuted
// row holds. The other ops invert that map once (copy -> row) so every output row is
// written by one iteration and the loops parallelise without atomics.
//
// moe_pad_rows / moe_unpad_rows copy each expert's rows of the expert input into, or out of,
// its block of padded rows (a fixed capacity, or its rows rounded up to a GEMM tile);
// moe_sort_chunks puts chunks of rows in a new order (any dtype, byte copies).
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

// Below this many elements a loop runs on the calling thread: waking an OpenMP team
// costs more than the work (and much more on a loaded machine).
constexpr int64_t kParallelMin = int64_t(1) << 15;

void check_f32_cpu(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "moe_permute: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CPU, "moe_permute: {}: only the CPU backend is built", name);
  MEGATON_CHECK(t.dtype() == DType::F32, "moe_permute: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
}

void check_i32_cpu(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined() && t.device() == Device::CPU && t.dtype() == DType::I32,
                "moe_permute: {} must be an allocated CPU I32 tensor", name);
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  MEGATON_CHECK(t.shape() == want, "moe_permute: {} has shape {}, expected {}", name,
                shape_str(t.shape()), shape_str(want));
}

// row_of_copy[c] = the permuted row holding copy c. Throws unless row_id_map [copies] is
// a permutation of [0, copies).
std::vector<int64_t> invert_row_id_map(const Tensor& row_id_map, int64_t copies) {
  check_i32_cpu(row_id_map, "row_id_map");
  check_shape(row_id_map, {copies}, "row_id_map");
  const int32_t* map = row_id_map.i32();
  std::vector<int64_t> row_of_copy(copies, -1);
  for (int64_t r = 0; r < copies; ++r) {
    const int32_t c = map[r];
    MEGATON_CHECK(c >= 0 && c < copies && row_of_copy[c] < 0,
                  "moe_permute: row_id_map[{}] = {} is out of range or repeated ({} copies)", r, c,
                  copies);
    row_of_copy[c] = r;
  }
  return row_of_copy;
}

}  // namespace

void moe_permute(const Tensor& x, const Tensor& indices, int num_experts, Tensor& permuted,
                 Tensor& row_id_map, Tensor& tokens_per_expert) {
  MEGATON_CUDA_DISPATCH(x, cuda::moe_permute(x, indices, num_experts, permuted, row_id_map, tokens_per_expert));
  check_f32_cpu(x, "x");
  MEGATON_CHECK(x.ndim() == 2, "moe_permute: x must be [T, H], got {}", shape_str(x.shape()));
  check_i32_cpu(indices, "indices");
  const int64_t T = x.dim(0), H = x.dim(1);
  MEGATON_CHECK(indices.ndim() == 2 && indices.dim(0) == T,
                "moe_permute: indices {} must be [T = {}, k]", shape_str(indices.shape()), T);
  MEGATON_CHECK(num_experts >= 1, "moe_permute: num_experts {} must be >= 1", num_experts);
  const int64_t k = indices.dim(1), copies = T * k;
  MEGATON_CHECK(copies <= INT32_MAX, "moe_permute: {} token copies overflow the int32 row_id_map",
                copies);
  check_f32_cpu(permuted, "permuted");
  check_shape(permuted, {copies, H}, "permuted");
  check_i32_cpu(row_id_map, "row_id_map");
  check_shape(row_id_map, {copies}, "row_id_map");
  MEGATON_CHECK(tokens_per_expert.defined() && tokens_per_expert.device() == Device::CPU &&
                    tokens_per_expert.dtype() == DType::I64,
                "moe_permute: tokens_per_expert must be an allocated CPU I64 tensor");
  check_shape(tokens_per_expert, {num_experts}, "tokens_per_expert");

  // Counting sort of the copies by expert: counts, exclusive prefix sums, then a scan in
  // copy order, which keeps each expert's copies in token order.
  const int32_t* idx = indices.i32();
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t c = 0; c < copies; ++c) {
    MEGATON_CHECK(idx[c] >= 0 && idx[c] < num_experts,
                  "moe_permute: expert index {} of copy {} not in [0, {})", idx[c], c, num_experts);
    ++counts[idx[c]];
  }
  std::vector<int64_t> next_row(num_experts, 0);
  for (int e = 1; e < num_experts; ++e) next_row[e] = next_row[e - 1] + counts[e - 1];
  int32_t* map = row_id_map.i32();
  for (int64_t c = 0; c < copies; ++c) map[next_row[idx[c]]++] = int32_t(c);
  for (int e = 0; e < num_experts; ++e) tokens_per_expert.i64()[e] = counts[e];

  const float* src = x.f32();
  float* dst = permuted.f32();
#pragma omp parallel for schedule(static) if (copies * H >= kParallelMin)
  for (int64_t r = 0; r < copies; ++r)
    std::memcpy(dst + r * H, src + (map[r] / k) * H, sizeof(float) * H);
}

void moe_permute_rows(const Tensor& x, const Tensor& row_id_map, int k, Tensor& permuted) {
  MEGATON_CUDA_DISPATCH(x, cuda::moe_permute_rows(x, row_id_map, k, permuted));
  check_f32_cpu(x, "x");
  check_f32_cpu(permuted, "permuted");
  MEGATON_CHECK(k >= 1, "moe_permute: k {} must be >= 1", k);
  MEGATON_CHECK(x.ndim() == 2, "moe_permute: x must be [T, H], got {}", shape_str(x.shape()));
  const int64_t T = x.dim(0), H = x.dim(1), copies = T * k;
  check_shape(permuted, {copies, H}, "permuted");
  check_i32_cpu(row_id_map, "row_id_map");
  check_shape(row_id_map, {copies}, "row_id_map");
  const int32_t* map = row_id_map.i32();
  for (int64_t r = 0; r < copies; ++r)
    MEGATON_CHECK(map[r] >= 0 && map[r] < copies,
                  "moe_permute: row_id_map[{}] = {} is out of range ({} copies)", r, map[r],
                  copies);
  const float* src = x.f32();
  float* dst = permuted.f32();
  if (H == 0) return;
#pragma omp parallel for schedule(static) if (copies * H >= kParallelMin)
  for (int64_t r = 0; r < copies; ++r)
    std::memcpy(dst + r * H, src + (map[r] / k) * H, sizeof(float) * H);
}

void moe_permute_backward(const Tensor& dpermuted, const Tensor& row_id_map, int k, Tensor& dx) {
  MEGATON_CUDA_DISPATCH(dpermuted, cuda::moe_permute_backward(dpermuted, row_id_map, k, dx));
  check_f32_cpu(dpermuted, "dpermuted");
  check_f32_cpu(dx, "dx");
  MEGATON_CHECK(k >= 1, "moe_permute: k {} must be >= 1", k);
  MEGATON_CHECK(dx.ndim() == 2, "moe_permute: dx must be [T, H], got {}", shape_str(dx.shape()));
  const int64_t T = dx.dim(0), H = dx.dim(1), copies = T * k;
  check_shape(dpermuted, {copies, H}, "dpermuted");
  const std::vector<int64_t> row_of_copy = invert_row_id_map(row_id_map, copies);
  const float* dp = dpermuted.f32();
  float* out = dx.f32();
#pragma omp parallel for schedule(static) if (copies * H >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    float* row = out + t * H;
    std::memcpy(row, dp + row_of_copy[t * k] * H, sizeof(float) * H);
    for (int64_t j = 1; j < k; ++j) {
      const float* src = dp + row_of_copy[t * k + j] * H;
      for (int64_t c = 0; c < H; ++c) row[c] += src[c];
    }
  }
}

void moe_unpermute(const Tensor& expert_out, const Tensor& row_id_map, const Tensor& probs,
                   Tensor& out) {
  MEGATON_CUDA_DISPATCH(expert_out, cuda::moe_unpermute(expert_out, row_id_map, probs, out));
  check_f32_cpu(expert_out, "expert_out");
  check_f32_cpu(probs, "probs");
  check_f32_cpu(out, "out");
  MEGATON_CHECK(probs.ndim() == 2, "moe_permute: probs must be [T, k], got {}",
                shape_str(probs.shape()));
  MEGATON_CHECK(out.ndim() == 2, "moe_permute: out must be [T, H], got {}", shape_str(out.shape()));
  const int64_t T = probs.dim(0), k = probs.dim(1), H = out.dim(1), copies = T * k;
  check_shape(out, {T, H}, "out");
  check_shape(expert_out, {copies, H}, "expert_out");
  const std::vector<int64_t> row_of_copy = invert_row_id_map(row_id_map, copies);
  const float *eo = expert_out.f32(), *p = probs.f32();
  float* o = out.f32();
#pragma omp parallel for schedule(static) if (copies * H >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    float* row = o + t * H;
    for (int64_t c = 0; c < H; ++c) row[c] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const float w = p[t * k + j];
      const float* src = eo + row_of_copy[t * k + j] * H;
      for (int64_t c = 0; c < H; ++c) row[c] += w * src[c];
    }
  }
}

void moe_unpermute_backward(const Tensor& dout, const Tensor& expert_out, const Tensor& row_id_map,
                            const Tensor& probs, Tensor& dexpert_out, Tensor& dprobs) {
  MEGATON_CUDA_DISPATCH(dout, cuda::moe_unpermute_backward(dout, expert_out, row_id_map, probs, dexpert_out, dprobs));
  check_f32_cpu(dout, "dout");
  check_f32_cpu(expert_out, "expert_out");
  check_f32_cpu(probs, "probs");
  check_f32_cpu(dexpert_out, "dexpert_out");
  check_f32_cpu(dprobs, "dprobs");
  MEGATON_CHECK(probs.ndim() == 2, "moe_permute: probs must be [T, k], got {}",
                shape_str(probs.shape()));
  MEGATON_CHECK(dout.ndim() == 2, "moe_permute: dout must be [T, H], got {}",
                shape_str(dout.shape()));
  const int64_t T = probs.dim(0), k = probs.dim(1), H = dout.dim(1), copies = T * k;
  check_shape(dout, {T, H}, "dout");
  check_shape(expert_out, {copies, H}, "expert_out");
  check_shape(dexpert_out, {copies, H}, "dexpert_out");
  check_shape(dprobs, {T, k}, "dprobs");
  const std::vector<int64_t> row_of_copy = invert_row_id_map(row_id_map, copies);
  const float *g = dout.f32(), *eo = expert_out.f32(), *p = probs.f32();
  float *deo = dexpert_out.f32(), *dp = dprobs.f32();
#pragma omp parallel for schedule(static) if (copies * H >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* g_row = g + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = row_of_copy[t * k + j];
      const float w = p[t * k + j];
      const float* eo_row = eo + r * H;
      float* deo_row = deo + r * H;
      double dot = 0;
      for (int64_t c = 0; c < H; ++c) {
        deo_row[c] = w * g_row[c];
        dot += double(g_row[c]) * eo_row[c];
      }
      dp[t * k + j] = float(dot);
    }
  }
}

namespace {

// Door checks shared by the padding ops: rows [R, H] and padded [P, H] F32 CPU tensors,
// R = sum(group_rows), P = sum(padded_rows), 0 <= group_rows[g] <= padded_rows[g].
struct PadStarts {
  std::vector<int64_t> row;     // group g's first row in rows
  std::vector<int64_t> padded;  // group g's first row in padded
};
PadStarts check_padding(const char* op, const Tensor& rows, const std::vector<int64_t>& group_rows,
                        const std::vector<int64_t>& padded_rows, const Tensor& padded) {
  check_f32_cpu(rows, "rows");
  check_f32_cpu(padded, "padded");
  MEGATON_CHECK(rows.ndim() == 2, "{}: rows must be [R, H], got {}", op, shape_str(rows.shape()));
  MEGATON_CHECK(padded_rows.size() == group_rows.size(), "{}: {} padded row counts for {} groups",
                op, padded_rows.size(), group_rows.size());
  const size_t groups = group_rows.size();
  PadStarts start{std::vector<int64_t>(groups + 1, 0), std::vector<int64_t>(groups + 1, 0)};
  for (size_t g = 0; g < groups; ++g) {
    MEGATON_CHECK(group_rows[g] >= 0 && group_rows[g] <= padded_rows[g],
                  "{}: group {} has {} rows, not in [0, its padded rows {}]", op, g, group_rows[g],
                  padded_rows[g]);
    start.row[g + 1] = start.row[g] + group_rows[g];
    start.padded[g + 1] = start.padded[g] + padded_rows[g];
  }
  MEGATON_CHECK(start.row.back() == rows.dim(0), "{}: rows has {} rows, the groups sum to {}", op,
                rows.dim(0), start.row.back());
  MEGATON_CHECK(padded.shape() == Shape({start.padded.back(), rows.dim(1)}),
                "{}: padded has shape {}, expected [{}, {}]", op, shape_str(padded.shape()),
                start.padded.back(), rows.dim(1));
  return start;
}

}  // namespace

void moe_pad_rows(const Tensor& rows, const std::vector<int64_t>& group_rows,
                  const std::vector<int64_t>& padded_rows, Tensor& padded) {
  MEGATON_CUDA_DISPATCH(rows, cuda::moe_pad_rows(rows, group_rows, padded_rows, padded));
  const PadStarts start = check_padding("moe_pad_rows", rows, group_rows, padded_rows, padded);
  const int64_t H = rows.dim(1);
  if (H == 0) return;
  const float* src = rows.f32();
  float* dst = padded.f32();
  for (size_t g = 0; g < group_rows.size(); ++g) {
    float* group = dst + start.padded[g] * H;
    const int64_t n = group_rows[g], padded_n = padded_rows[g];
    if (n > 0) std::memcpy(group, src + start.row[g] * H, sizeof(float) * n * H);
    if (n < padded_n) std::memset(group + n * H, 0, sizeof(float) * (padded_n - n) * H);  // +0.0f
  }
}

void moe_unpad_rows(const Tensor& padded, const std::vector<int64_t>& group_rows,
                    const std::vector<int64_t>& padded_rows, Tensor& rows) {
  MEGATON_CUDA_DISPATCH(padded, cuda::moe_unpad_rows(padded, group_rows, padded_rows, rows));
  const PadStarts start = check_padding("moe_unpad_rows", rows, group_rows, padded_rows, padded);
  const int64_t H = rows.dim(1);
  if (H == 0) return;
  const float* src = padded.f32();
  float* dst = rows.f32();
  for (size_t g = 0; g < group_rows.size(); ++g)
    if (group_rows[g] > 0)
      std::memcpy(dst + start.row[g] * H, src + start.padded[g] * H,
                  sizeof(float) * group_rows[g] * H);
}

void moe_sort_chunks(const Tensor& src, const std::vector<int64_t>& chunk_rows,
                     const std::vector<int64_t>& order, Tensor& dst) {
  const char* op = "moe_sort_chunks";
  MEGATON_CHECK(src.defined() && dst.defined() && src.ndim() >= 1, "{}: src and dst must be "
                "allocated tensors with rows", op);
  MEGATON_CHECK(src.shape() == dst.shape() && src.dtype() == dst.dtype() &&
                    src.device() == dst.device(),
                "{}: dst {} {} must match src {} {} (one device)", op, shape_str(dst.shape()),
                dtype_name(dst.dtype()), shape_str(src.shape()), dtype_name(src.dtype()));
  const size_t chunks = chunk_rows.size();
  MEGATON_CHECK(order.size() == chunks, "{}: {} chunks, order of {}", op, chunks, order.size());
  std::vector<int64_t> start(chunks + 1, 0);
  for (size_t c = 0; c < chunks; ++c) {
    MEGATON_CHECK(chunk_rows[c] >= 0, "{}: chunk {} has {} rows", op, c, chunk_rows[c]);
    start[c + 1] = start[c] + chunk_rows[c];
  }
  MEGATON_CHECK(start.back() == src.dim(0), "{}: src has {} rows, the chunks sum to {}", op,
                src.dim(0), start.back());
  // Output chunk j: chunk order[j], its first row in src and its length.
  std::vector<bool> seen(chunks, false);
  std::vector<int64_t> src_first(chunks), rows(chunks);
  for (size_t j = 0; j < chunks; ++j) {
    const int64_t c = order[j];
    MEGATON_CHECK(c >= 0 && c < int64_t(chunks) && !seen[size_t(c)],
                  "{}: order is not a permutation of 0..{} (entry {} is {})", op, chunks - 1, j, c);
    seen[size_t(c)] = true;
    src_first[j] = start[size_t(c)];
    rows[j] = chunk_rows[size_t(c)];
  }
  if (src.numel() == 0) return;
  MEGATON_CUDA_DISPATCH(src, cuda::moe_sort_chunks(src, src_first, rows, dst));
  const size_t row_bytes = src.nbytes() / size_t(src.dim(0));
  const auto* from = static_cast<const char*>(src.raw());
  auto* to = static_cast<char*>(dst.raw());
  for (size_t j = 0, at = 0; j < chunks; at += size_t(rows[j]), ++j)
    if (rows[j] > 0)
      std::memcpy(to + at * row_bytes, from + size_t(src_first[j]) * row_bytes,
                  size_t(rows[j]) * row_bytes);
}

}  // namespace megaton::ops
