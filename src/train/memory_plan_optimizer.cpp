// Memory plan: how the optimizer state lies in the buffers (train/memory_plan_params.h): the
// flat buffers' buckets and the CPU's copies of them at the gradient sync, Muon's
// whole-matrix buffers under the distributed optimizer, and the scratch of Muon's step.
#include <algorithm>
#include <cmath>

#include "model/param_buffer.h"
#include "train/memory_plan_params.h"

namespace megaton::memory_plan_detail {

namespace {
double round_up(double n, double multiple) { return std::ceil(n / multiple) * multiple; }
// Sizes past this are not laid out with 64-bit integers (costs add up over a buffer).
constexpr double kLayoutLimit = 4611686018427387904.0;  // 2^62
// Past this many shards the placement (a search over the shards per param) is bounded too.
constexpr int64_t kLayoutShards = 65536;
}  // namespace

FlatLayout flat_layout(const std::vector<double>& sizes, const std::vector<bool>& alone,
                       double bucket_size, double shards) {
  FlatLayout out;
  out.offsets.assign(sizes.size(), 0);
  out.bucket.assign(sizes.size(), 0);
  double total = 0;
  bool open = false;  // the current bucket holds a param
  auto close = [&] {
    if (!open) return;
    const double begin = out.buckets.empty() ? 0 : out.buckets.back().second;
    total = round_up(std::max(total, begin + 1), 64 * shards);
    out.buckets.push_back({begin, total});
    open = false;
  };
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (alone[k]) close();
    out.offsets[k] = total;
    out.bucket[k] = out.buckets.size();
    total += round_up(sizes[k], 64);
    open = true;
    const double begin = out.buckets.empty() ? 0 : out.buckets.back().second;
    if (alone[k] || (bucket_size > 0 && total - begin >= bucket_size)) close();
  }
  close();
  out.numel = total;
  return out;
}

double grad_sync_copy(double bucket_numel, double shards, double grad_bytes, Device device) {
  if (device == Device::CUDA) return 0;
  const double copy = memory_plan_block_bytes(bucket_numel * 4, device);
  return grad_bytes == 4 ? copy : copy + memory_plan_block_bytes(bucket_numel / shards * 4, device);
}

MuonBufferPlan plan_muon_buffer(const std::vector<ParamShape>& params, int64_t shards,
                                int64_t bucket_size, bool main_params, Device device) {
  MuonBufferPlan out;
  out.momentum.assign(size_t(shards), 0);
  out.main_params.assign(size_t(shards), 0);
  out.owner.assign(params.size(), 0);
  auto block = [&](double numel) { return memory_plan_block_bytes(numel * 4, device); };
  double numel_sum = 0, cost_sum = 0, largest = 0;
  for (const ParamShape& p : params) {
    const double small = std::min(p.rows, p.cols), big = std::max(p.rows, p.cols);
    numel_sum += p.numel;
    cost_sum += p.matrix() ? big * small * small : p.numel;
    largest = std::max(largest, p.numel);
  }
  if (cost_sum < kLayoutLimit && numel_sum * double(shards) < kLayoutLimit &&
      shards <= kLayoutShards) {
    std::vector<int64_t> numels, costs;
    for (const ParamShape& p : params) {
      numels.push_back(std::llround(p.numel));
      costs.push_back(newton_schulz_cost(p.matrix()
                                             ? Shape{std::llround(p.rows), std::llround(p.cols)}
                                             : Shape{std::llround(p.numel)}));
    }
    const WholeParamsLayout layout = whole_params_layout(numels, costs, shards, bucket_size);
    out.numel = double(layout.numel);
    for (const WholeParamsLayout::Bucket& b : layout.buckets)
      out.bucket_numels.push_back(double(b.end - b.begin));
    for (size_t i = 0; i < params.size(); ++i) {
      const size_t s = size_t(layout.shards[i]);
      out.owner[i] = layout.shards[i];
      out.momentum[s] += block(params[i].numel);
      if (main_params) out.main_params[s] += block(params[i].numel);
    }
    return out;
  }
  // The bound: a param goes where it stays within 1.3 x the even share (else to the least
  // filled shard), so no shard passes 1.3 x the share plus the largest param. (Every param
  // counted on shard 0 for the step's scratch.)
  const double shard = round_up(1.3 * numel_sum / double(shards) + largest, 64);
  out.numel = shard * double(shards);
  out.bucket_numels = {out.numel};
  out.momentum[0] = block(shard);
  if (main_params) out.main_params[0] = block(shard);
  out.bounded = true;
  return out;
}

MuonStepScratch muon_step_scratch(const TrainArgs& args, const std::vector<ParamShape>& params,
                                  double tp, double etp) {
  const optim::MuonConfig& mc = args.optimizer.muon;
  const GPTConfig& m = args.model;
  const Device dev = m.device;
  const bool gpu = dev == Device::CUDA;
  // --muon-fp32-matmul-prec medium: the GPU iterates in BF16; else in fp32 (the CPU always).
  const double ns_b = gpu && mc.matmul_precision == optim::MuonMatmulPrecision::Medium ? 2 : 4;
  auto bytes = [&](double numel, double element) {
    return memory_plan_block_bytes(numel * element, dev);
  };
  // newton_schulz's own tensors on `batch` [R, C] matrices (besides them): on the GPU a
  // scratch copy for the ping-pong, the Gram matrices and the polynomials [batch, k, k] in
  // the iteration's dtype (one strided-batched GEMM per step and product; + the sums of
  // squares, F32 [batch], distributed); on the CPU the fp64
  // iteration lives in std::vectors outside the tensor allocator, and only the distributed
  // mode's all-reduce takes a tensor, the Gram batch F32 [1, k, k]. k: the side the
  // iteration takes (the smaller, or the one the distributed mode forces).
  auto ns_scratch = [&](double batch, double R, double C, int transpose, bool distributed) {
    const bool t = transpose == 1 || (transpose == -1 && R > C);
    const double k = t ? C : R;
    if (gpu)
      return bytes(batch * R * C, ns_b) + 2 * bytes(batch * k * k, ns_b) +
             (distributed ? bytes(batch, 4) : 0);
    return distributed ? bytes(k * k, 4) : 0.0;
  };
  // Q, K and V rows per query group (ops::qkv_split_shapes).
  const double d = double(m.kv_channels);
  const double q =
      double(m.num_attention_heads) / double(std::max<int64_t>(m.num_query_groups, 1)) * d;
  const std::vector<double> qkv_rows = {q, d, d};
  const double per_group = q + 2 * d;
  constexpr double kBatchBytes = double(int64_t(256) << 20);  // Muon::kBatchBytes
  MuonStepScratch out;
  auto consider = [&](double peak, const std::string& what) {
    if (peak <= out.bytes) return;
    out.bytes = peak;
    out.what = what;
  };
  // Muon::step_batch: the matrices of one local shape without a TP collective or the QKV
  // split, in batches of max(1, kBatchBytes / (4 rows cols)); the momenta write their
  // updates into the batch [n, rows, cols] in the iteration's dtype, iterated in place.
  std::vector<std::pair<std::pair<double, double>, double>> shapes;  // (rows, cols), count
  for (const ParamShape& p : params) {
    const double group = p.expert ? etp : tp;
    const bool split =
        p.tp_split_dim >= 0 && group > 1 && mc.tp_mode != optim::MuonTpMode::Blockwise;
    if (split || (mc.split_qkv && p.qkv)) continue;
    auto it = std::find_if(shapes.begin(), shapes.end(), [&](const auto& e) {
      return e.first == std::make_pair(p.rows, p.cols);
    });
    if (it == shapes.end())
      shapes.push_back({{p.rows, p.cols}, 1.0});
    else
      it->second += 1;
  }
  for (const auto& [shape, count] : shapes) {
    const auto [r, c] = shape;
    const double n = std::min(count, std::max(1.0, std::floor(kBatchBytes / (4 * r * c))));
    consider(bytes(n * r * c, ns_b) + ns_scratch(n, r, c, -1, false),
             fmt::format("batch of {:.0f} [{:.0f}, {:.0f}]", n, r, c));
  }
  // Muon::step_single (orthogonalised) for the others, one at a time.
  for (const ParamShape& p : params) {
    const double group = p.expert ? etp : tp;
    const bool split =
        p.tp_split_dim >= 0 && group > 1 && mc.tp_mode != optim::MuonTpMode::Blockwise;
    const bool qkv = mc.split_qkv && p.qkv;
    if (!split && !qkv) continue;
    const bool duplicated = split && mc.tp_mode == optim::MuonTpMode::Duplicated;
    const bool distributed = split && mc.tp_mode == optim::MuonTpMode::Distributed;
    const int dim = p.tp_split_dim;
    // The momentum's update, F32 of the local shape; duplicated: gathered over TP in F32 (a
    // row-parallel slice then copied into the whole matrix's columns).
    const double update = bytes(p.numel, 4);
    double R = p.rows, C = p.cols;
    if (duplicated) (dim == 0 ? R : C) *= group;
    const double N = R * C;
    double peak = update, whole = 0;
    if (duplicated) {
      whole = bytes(N, 4);
      peak = std::max(peak, update + whole + (dim == 1 ? bytes(N, 4) : 0));
    }
    const double held = update + whole;
    const int transpose = distributed ? (dim == 0 ? 1 : 0) : -1;
    double result = 0, result_b = ns_b;  // beyond held: the orthogonalised matrix
    if (qkv) {
      // Q, K and V copied apart (F32), each iterated (on a BF16 copy, widened back into a
      // new F32 piece), then joined into a new F32 matrix.
      double pieces = 0;
      for (double rows : qkv_rows) pieces += bytes(N * rows / per_group, 4);
      for (double rows : qkv_rows) {
        const double n = N * rows / per_group;
        const double work = ns_b == 4 ? 0 : bytes(n, ns_b);
        peak = std::max(peak, held + pieces + work +
                                  ns_scratch(1, R * rows / per_group, C, transpose, distributed));
        if (ns_b != 4) peak = std::max(peak, held + pieces + work + bytes(n, 4));
      }
      result = bytes(N, 4);
      result_b = 4;
      peak = std::max(peak, held + pieces + result);
    } else {
      result = ns_b == 4 ? 0 : bytes(N, ns_b);  // fp32: in place
      peak = std::max(peak, held + result + ns_scratch(1, R, C, transpose, distributed));
    }
    // Duplicated, row-parallel: this rank's columns copied out of the whole result.
    if (duplicated && dim == 1) peak = std::max(peak, held + result + bytes(p.numel, result_b));
    consider(peak, fmt::format("[{:.0f}, {:.0f}]{}{}", p.rows, p.cols, qkv ? " (QKV, split)" : "",
                               duplicated    ? " (this rank's slice, gathered over TP)"
                               : distributed ? " (this rank's slice, distributed over TP)"
                                             : ""));
  }
  return out;
}

}  // namespace megaton::memory_plan_detail
