// ParamAndGradBuffer layout, buckets and piece lookup.
#include "model/param_buffer.h"

#include <algorithm>
#include <map>

#include "core/error.h"
#include "model/layers.h"

namespace megaton {

namespace {
constexpr int64_t kAlign = 64;  // elements: 256 bytes of fp32, 128 of bf16
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
const char* device_name(Device d) { return d == Device::CUDA ? "cuda" : "cpu"; }
}  // namespace

ParamAndGradBuffer::ParamAndGradBuffer(std::vector<Param*> params, int64_t num_shards,
                                       bool is_expert, int64_t bucket_size,
                                       const std::vector<const Param*>& own_bucket,
                                       DType grad_dtype, const std::vector<int>& param_units,
                                       const BufferSharding& sharding, BufferLayout layout)
    : params_(std::move(params)),
      num_shards_(num_shards),
      is_expert_(is_expert),
      layout_(layout),
      sharding_(sharding) {
  MEGATON_CHECK(num_shards >= 1, "ParamAndGradBuffer: {} shards", num_shards);
  // One shard is the whole buffer: nothing to release (FSDP at size 1 costs nothing more).
  if (num_shards == 1) sharding_.strategy = std::min(sharding_.strategy, ShardingStrategy::Optim);
  MEGATON_CHECK(!params_.empty(), "ParamAndGradBuffer: no params");
  MEGATON_CHECK(grad_dtype == DType::F32 || grad_dtype == DType::BF16,
                "ParamAndGradBuffer: grads must be F32 or BF16, got {}", dtype_name(grad_dtype));
  const bool fp8 = params_[0]->fp8_param;
  // --init-model-with-meta-device: the params have no values yet; what this buffer stores
  // of them is drawn here (initial_values), nothing more.
  const bool meta = params_[0]->weight.storage_released();
  MEGATON_CHECK(!meta || !fp8, "ParamAndGradBuffer: FP8 weights made without values");
  const DType dtype = fp8 ? DType::F8E4M3 : params_[0]->weight.dtype();
  const Device device = params_[0]->weight.device();
  MEGATON_CHECK(param_units.empty() || param_units.size() == params_.size(),
                "ParamAndGradBuffer: {} units for {} params", param_units.size(), params_.size());
  MEGATON_CHECK(sharding.shard_index >= 0 && sharding.shard_index < num_shards,
                "ParamAndGradBuffer: shard {} of {}", sharding.shard_index, num_shards);
  MEGATON_CHECK(!sharding_.sharded_grads() || !fp8,
                "ParamAndGradBuffer: FP8 weights are not stored sharded");
  MEGATON_CHECK(sharding.main_grad_dtype == DType::F32 || sharding.main_grad_dtype == DType::BF16,
                "ParamAndGradBuffer: main grads must be F32 or BF16, got {}",
                dtype_name(sharding.main_grad_dtype));
  // The whole-parameter layout cuts its buckets by size and cost alone.
  MEGATON_CHECK(layout != BufferLayout::WholeParams || (param_units.empty() && own_bucket.empty() &&
                                                        !fp8 && !sharding_.sharded_grads()),
                "ParamAndGradBuffer: whole-parameter layout with {}",
                !param_units.empty()  ? "a bucket per unit"
                : !own_bucket.empty() ? "a param in a bucket of its own"
                : fp8                 ? "FP8 weights"
                                      : "sharded storage");
  weight_dtype_ = dtype;
  grad_dtype_ = grad_dtype;
  device_ = device;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param* p = params_[i];
    MEGATON_CHECK(p->fp8_param == fp8,
                  "ParamAndGradBuffer: param '{}' is {}an FP8 weight, "
                  "the first is {}",
                  p->name, p->fp8_param ? "" : "not ", fp8 ? "" : "not");
    MEGATON_CHECK((fp8 || p->weight.dtype() == dtype) && p->weight.device() == device,
                  "ParamAndGradBuffer: param '{}' is {} on {}, the first {} on {}", p->name,
                  dtype_name(p->weight.dtype()), device_name(p->weight.device()), dtype_name(dtype),
                  device_name(device));
    MEGATON_CHECK(p->weight.storage_released() == meta,
                  "ParamAndGradBuffer: param '{}' is {}made without values, the first is {}",
                  p->name, meta ? "not " : "", meta ? "" : "not");
    MEGATON_CHECK(param_index_.emplace(p, i).second, "ParamAndGradBuffer: param '{}' given twice",
                  p->name);
  }
  if (layout == BufferLayout::WholeParams)
    lay_out_whole_params(bucket_size);
  else
    lay_out_flat(bucket_size, own_bucket, param_units);
  const int64_t total = numel_;
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (const Param* p : buckets_[b].params) bucket_index_[p] = int(b);
  // Whole buffers, or (sharded) one allocation per bucket so that each can be released.
  if (sharding_.sharded_params())
    for (const BufferBucket& bucket : buckets_)
      bucket_weights_.push_back(meta ? Tensor::unallocated({bucket.numel()}, dtype, device)
                                     : Tensor::zeros({bucket.numel()}, dtype, device));
  else
    weights_ = Tensor::zeros({total}, dtype, device);
  if (sharding_.sharded_grads())  // no memory until a backward needs it (restore_grads)
    for (const BufferBucket& bucket : buckets_)
      bucket_grads_.push_back(Tensor::unallocated({bucket.numel()}, grad_dtype, device));
  else
    grads_ = Tensor::zeros({total}, grad_dtype, device);
  // --fsdp-double-buffer: the slots, as large as the most common bucket (the larger on a tie).
  if (sharding_.double_buffer && sharding_.sharded_grads()) {
    std::map<int64_t, int> sizes;
    for (const BufferBucket& bucket : buckets_) ++sizes[bucket.numel()];
    int most = 0;
    for (const auto& [numel, count] : sizes)
      if (count >= most) {
        most = count;
        slot_numel_ = numel;
      }
    for (int i = 0; i < 2; ++i) {
      grad_slots_.memory[size_t(i)] = Tensor::empty({slot_numel_}, grad_dtype, device);
      if (sharding_.sharded_params())
        weight_slots_.memory[size_t(i)] = Tensor::empty({slot_numel_}, dtype, device);
    }
  }
  // A param's view of a buffer: elements [offset, offset + numel) of the whole buffer.
  auto view_of = [&](const Tensor& whole, const std::vector<Tensor>& by_bucket, size_t i) {
    const Param* p = params_[i];
    const int b = bucket_index_.at(p);
    const Tensor& t = whole.defined() ? whole : by_bucket[size_t(b)];
    const int64_t at = whole.defined() ? offsets_[i] : offsets_[i] - buckets_[size_t(b)].begin;
    return t.rows(at, p->weight.numel()).view(p->weight.shape());
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    const bool main_is_weight = p->main_param.defined() && p->main_param.same_data(p->weight);
    Tensor view = view_of(weights_, bucket_weights_, i);
    if (meta) {
      if (!sharding_.sharded_params()) write_initial_values(*p, 0, view);
      p->weight = view;
      if (main_is_weight) p->main_param = view;
    } else if (fp8) {
      // The fp32 values stay in main_param (an fp32 run's weight was its main param).
      MEGATON_CHECK(p->main_param.defined(), "FP8 weight '{}' without an fp32 main param", p->name);
      p->weight = view;
    } else {
      view.copy_from(p->weight);
      p->weight = view;
      if (main_is_weight) p->main_param = view;
    }
    p->main_grad = view_of(grads_, bucket_grads_, i);
  }
  if (sharding_.sharded_params())
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (!meta) {
        weight_shards_.push_back(Tensor::empty({shard_numel(b)}, dtype, device));
        store_own_weight_shard(b);
        continue;
      }
      weight_shards_.push_back(Tensor::zeros({shard_numel(b)}, dtype, device));
      const int64_t begin = shard_begin(b, sharding_.shard_index);
      for (const BufferPiece& piece : pieces(begin, begin + shard_numel(b)))
        write_initial_values(*piece.param, piece.param_offset,
                             weight_shards_.back().rows(piece.buffer_offset - begin, piece.numel));
    }
  if (sharding_.sharded_grads())
    for (size_t b = 0; b < buckets_.size(); ++b)
      grad_shards_.push_back(Tensor::zeros({shard_numel(b)}, sharding_.main_grad_dtype, device));
}

void ParamAndGradBuffer::lay_out_flat(int64_t bucket_size,
                                      const std::vector<const Param*>& own_bucket,
                                      const std::vector<int>& param_units) {
  offsets_.assign(params_.size(), 0);
  int64_t total = 0;
  BufferBucket current;
  auto close_bucket = [&] {
    if (current.params.empty()) return;
    current.begin = buckets_.empty() ? 0 : buckets_.back().end;
    current.end = round_up(std::max(total, current.begin + 1), kAlign * num_shards_);
    total = current.end;
    buckets_.push_back(std::move(current));
    current = BufferBucket();
  };
  // Reverse order: Megatron's _ParamAndGradBuffer iterates params[::-1].
  for (size_t k = params_.size(); k-- > 0;) {
    Param* p = params_[k];
    const bool alone = std::find(own_bucket.begin(), own_bucket.end(), p) != own_bucket.end();
    if (alone) close_bucket();
    // A new unit starts a new bucket (its neighbour in buffer order is params_[k + 1]).
    if (!param_units.empty() && k + 1 < params_.size() && param_units[k] != param_units[k + 1])
      close_bucket();
    offsets_[k] = total;
    total += round_up(p->weight.numel(), kAlign);
    current.params.push_back(p);
    const int64_t bucket_begin = buckets_.empty() ? 0 : buckets_.back().end;
    if (alone || (bucket_size > 0 && total - bucket_begin >= bucket_size)) close_bucket();
  }
  close_bucket();
  numel_ = total;
}

int64_t newton_schulz_cost(const Shape& shape) {
  if (shape.size() != 2) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    return numel;
  }
  const int64_t big = std::max(shape[0], shape[1]), small = std::min(shape[0], shape[1]);
  return big * small * small;
}

namespace {
// The first index of the least value among those `eligible` admits (all: none excluded),
// or -1 when it admits none.
template <class Eligible>
int64_t least(const std::vector<int64_t>& values, Eligible eligible) {
  int64_t best = -1;
  for (size_t s = 0; s < values.size(); ++s)
    if (eligible(s) && (best < 0 || values[s] < values[size_t(best)])) best = int64_t(s);
  return best;
}
}  // namespace

WholeParamsLayout whole_params_layout(const std::vector<int64_t>& numels,
                                      const std::vector<int64_t>& costs, int64_t num_shards,
                                      int64_t bucket_size) {
  MEGATON_CHECK(!numels.empty() && costs.size() == numels.size() && num_shards >= 1,
                "whole_params_layout: {} numels, {} costs, {} shards", numels.size(), costs.size(),
                num_shards);
  // Megatron's LayerWiseDistributedOptimizer._compute_per_buffer_param_layout, with
  // Megaton's 64-element shard alignment (ParamAndGradBuffer's comment says it exactly).
  constexpr double kPaddingFloor = 0.9, kNumelEpsilon = 0.3;
  const size_t shards = size_t(num_shards), count = numels.size();
  WholeParamsLayout out;
  out.offsets.assign(count, 0);
  out.shards.assign(count, 0);
  std::vector<int64_t> cost_loads(shards, 0);  // accumulated over every bucket
  auto emit = [&](const std::vector<size_t>& chunk) {
    if (chunk.empty()) return;
    int64_t chunk_numel = 0;
    for (size_t i : chunk) chunk_numel += numels[i];
    const double cap = double(chunk_numel) / double(num_shards) * (1 + kNumelEpsilon);
    std::vector<size_t> by_cost = chunk;
    std::stable_sort(by_cost.begin(), by_cost.end(),
                     [&](size_t a, size_t b) { return costs[a] > costs[b]; });
    std::vector<int64_t> cursors(shards, 0);
    for (size_t i : by_cost) {
      const int64_t numel = numels[i];
      int64_t s = least(cost_loads, [&](size_t t) {
        return double(round_up(cursors[t], kAlign) + numel) <= cap;
      });
      if (s < 0) s = least(cursors, [](size_t) { return true; });
      out.offsets[i] = round_up(cursors[size_t(s)], kAlign);
      cursors[size_t(s)] = out.offsets[i] + numel;
      cost_loads[size_t(s)] += costs[i];
      out.shards[i] = s;
    }
    WholeParamsLayout::Bucket bucket;
    bucket.shard_numel =
        std::max(round_up(*std::max_element(cursors.begin(), cursors.end()), kAlign), kAlign);
    bucket.begin = out.buckets.empty() ? 0 : out.buckets.back().end;
    bucket.end = bucket.begin + num_shards * bucket.shard_numel;
    for (size_t i : chunk) out.offsets[i] += bucket.begin + out.shards[i] * bucket.shard_numel;
    bucket.params = chunk;
    std::sort(bucket.params.begin(), bucket.params.end(),
              [&](size_t a, size_t b) { return out.offsets[a] < out.offsets[b]; });
    out.buckets.push_back(std::move(bucket));
  };
  // The bucket being collected, and Megatron's estimate of its shard loads (elements, the
  // params in walk order each on the least-loaded shard) that decides whether the next
  // param fits into its padding.
  std::vector<size_t> chunk;
  int64_t chunk_numel = 0, chunk_largest = 0;
  std::vector<int64_t> estimate(shards, 0);
  auto absorbs = [&](int64_t numel) {
    const auto [lo, hi] = std::minmax_element(estimate.begin(), estimate.end());
    return round_up(*lo, kAlign) + numel <= round_up(*hi, kAlign);
  };
  for (size_t k = count; k-- > 0;) {
    const int64_t numel = numels[k];
    if (bucket_size > 0 && !chunk.empty()) {
      const int64_t floor = int64_t(double(num_shards) * double(chunk_largest) * kPaddingFloor);
      if (chunk_numel >= std::max(bucket_size, floor) && !absorbs(numel)) {
        emit(chunk);
        chunk.clear();
        chunk_numel = chunk_largest = 0;
        std::fill(estimate.begin(), estimate.end(), 0);
      }
    }
    const size_t s = size_t(least(estimate, [](size_t) { return true; }));
    estimate[s] = round_up(estimate[s], kAlign) + numel;
    chunk.push_back(k);
    chunk_numel += numel;
    chunk_largest = std::max(chunk_largest, numel);
  }
  emit(chunk);
  out.numel = out.buckets.back().end;
  return out;
}

void ParamAndGradBuffer::lay_out_whole_params(int64_t bucket_size) {
  std::vector<int64_t> numels, costs;
  for (const Param* p : params_) {
    numels.push_back(p->weight.numel());
    costs.push_back(newton_schulz_cost(p->weight.shape()));
  }
  const WholeParamsLayout layout = whole_params_layout(numels, costs, num_shards_, bucket_size);
  offsets_ = layout.offsets;
  for (const WholeParamsLayout::Bucket& b : layout.buckets) {
    BufferBucket bucket;
    bucket.begin = b.begin;
    bucket.end = b.end;
    for (size_t i : b.params) bucket.params.push_back(params_[i]);
    buckets_.push_back(std::move(bucket));
  }
  numel_ = layout.numel;
}

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  for (ShardingStrategy s : {ShardingStrategy::NoShard, ShardingStrategy::Optim,
                             ShardingStrategy::OptimGrads, ShardingStrategy::OptimGradsParams})
    if (name == sharding_strategy_name(s)) return s;
  throw Error(
      fmt::format("data-parallel-sharding-strategy '{}' is not one of no_shard, optim, "
                  "optim_grads, optim_grads_params",
                  name));
}

const char* sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::NoShard:
      return "no_shard";
    case ShardingStrategy::Optim:
      return "optim";
    case ShardingStrategy::OptimGrads:
      return "optim_grads";
    case ShardingStrategy::OptimGradsParams:
      return "optim_grads_params";
  }
  return "?";
}

Tensor& ParamAndGradBuffer::weights() {
  MEGATON_CHECK(weights_.defined(), "ParamAndGradBuffer: the weights are stored by bucket");
  return weights_;
}

Tensor& ParamAndGradBuffer::grads() {
  MEGATON_CHECK(grads_.defined(), "ParamAndGradBuffer: the gradients are stored by bucket");
  return grads_;
}

Tensor ParamAndGradBuffer::bucket_weights(size_t b) const {
  if (!weights_.defined()) return bucket_weights_.at(b);
  return weights_.rows(buckets_[b].begin, buckets_[b].numel());
}

Tensor ParamAndGradBuffer::bucket_grads(size_t b) const {
  if (!grads_.defined()) return bucket_grads_.at(b);
  return grads_.rows(buckets_[b].begin, buckets_[b].numel());
}

Tensor ParamAndGradBuffer::own_weight_shard(size_t b) const {
  return sharding_.sharded_params() ? weight_shards_.at(b) : weight_shard(b, sharding_.shard_index);
}

Tensor ParamAndGradBuffer::own_grad_shard(size_t b) const {
  return sharding_.sharded_grads() ? grad_shards_.at(b) : grad_shard(b, sharding_.shard_index);
}

Tensor ParamAndGradBuffer::weight_piece(const BufferPiece& piece) const {
  if (weights_.defined()) return weights_.rows(piece.buffer_offset, piece.numel);
  const size_t b = size_t(bucket_of(piece.param));
  return own_weight_shard(b).rows(piece.buffer_offset - shard_begin(b, sharding_.shard_index),
                                  piece.numel);
}

Tensor ParamAndGradBuffer::grad_piece(const BufferPiece& piece) const {
  if (grads_.defined()) return grads_.rows(piece.buffer_offset, piece.numel);
  const size_t b = size_t(bucket_of(piece.param));
  return own_grad_shard(b).rows(piece.buffer_offset - shard_begin(b, sharding_.shard_index),
                                piece.numel);
}

void ParamAndGradBuffer::zero_grads() {
  if (grads_.defined()) grads_.zero();
  for (Tensor& t : grad_shards_) t.zero();
  for (Tensor& t : bucket_grads_)
    if (!t.storage_released()) t.zero();
}

bool ParamAndGradBuffer::weights_live(size_t b) const {
  return weights_.defined() || !bucket_weights_.at(b).storage_released();
}

bool ParamAndGradBuffer::grads_live(size_t b) const {
  return grads_.defined() || !bucket_grads_.at(b).storage_released();
}

void ParamAndGradBuffer::restore_grads(size_t b) {
  Tensor& t = bucket_grads_.at(b);
  if (!t.storage_released()) return;
  restore(bucket_grads_, grad_slots_, b);
  t.zero();
}

void ParamAndGradBuffer::restore(std::vector<Tensor>& buckets, Slots& slots, size_t b) {
  Tensor& t = buckets.at(b);
  if (!t.storage_released()) return;
  const size_t s = b % 2;
  if (slots.memory[s].defined() && slots.user[s] < 0 && t.numel() == slot_numel_) {
    t.adopt_storage(slots.memory[s].raw());
    slots.user[s] = int(b);
    return;
  }
  t.allocate_storage();
}

void ParamAndGradBuffer::release(std::vector<Tensor>& buckets, Slots& slots, size_t b) {
  buckets.at(b).release_storage();
  // The slot is free again; reuse by the next bucket of this parity is in stream order, as
  // the caching allocator's (the caller waits for a reduce-scatter that reads it first).
  const size_t s = b % 2;
  if (slots.user[s] == int(b)) slots.user[s] = -1;
}

void ParamAndGradBuffer::store_own_weight_shard(size_t b) {
  weight_shards_.at(b).copy_from(weight_shard(b, sharding_.shard_index));
}

int ParamAndGradBuffer::bucket_of(const Param* p) const {
  auto it = bucket_index_.find(p);
  return it == bucket_index_.end() ? -1 : it->second;
}

int64_t ParamAndGradBuffer::owner_shard(const Param* p) const {
  auto it = param_index_.find(p);
  MEGATON_CHECK(it != param_index_.end(), "ParamAndGradBuffer: param '{}' is not in this buffer",
                p ? p->name : std::string("(null)"));
  const BufferBucket& bucket = buckets_[size_t(bucket_index_.at(p))];
  const int64_t shard = bucket.numel() / num_shards_;
  const int64_t first = offsets_[it->second] - bucket.begin;
  const int64_t last = first + std::max<int64_t>(p->weight.numel(), 1) - 1;
  return first / shard == last / shard ? first / shard : -1;
}

std::vector<BufferPiece> ParamAndGradBuffer::shard_pieces(int64_t index) const {
  std::vector<BufferPiece> out;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int64_t begin = shard_begin(b, index);
    for (const BufferPiece& piece : pieces(begin, begin + shard_numel(b))) out.push_back(piece);
  }
  return out;
}

std::vector<BufferPiece> ParamAndGradBuffer::pieces(int64_t begin, int64_t end) const {
  std::vector<BufferPiece> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t start = offsets_[i], stop = start + params_[i]->weight.numel();
    const int64_t lo = std::max(start, begin), hi = std::min(stop, end);
    if (lo < hi) out.push_back({params_[i], lo - start, lo, hi - lo});
  }
  std::sort(out.begin(), out.end(), [](const BufferPiece& a, const BufferPiece& b) {
    return a.buffer_offset < b.buffer_offset;
  });
  return out;
}

}  // namespace megaton
