// Parameter creation and initial values (model/layers.h): make_param*, their recipes
// (ParamInit), the values drawn on demand for --init-model-with-meta-device, and the
// compute weight refreshed from the main param.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/rng.h"
#include "model/layers.h"
#include "ops/ops.h"

namespace megaton {

static uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

static Param place(const std::string& name, Tensor host_fp32, bool no_weight_decay,
                   Placement where) {
  Param p;
  p.name = name;
  p.no_weight_decay = no_weight_decay;
  p.full_shape = host_fp32.shape();
  p.main_param = host_fp32.to(where.device);
  if (where.dtype == DType::F32) {
    p.weight = p.main_param;
  } else {
    p.weight = Tensor::empty(host_fp32.shape(), where.dtype, where.device);
    ops::cast(p.main_param, p.weight);
  }
  return p;
}

// A parameter of `shape` on this rank without values (--init-model-with-meta-device).
static Param place_meta(const std::string& name, const Shape& shape, bool no_weight_decay,
                        Placement where, const ParamInit& init) {
  Param p;
  p.name = name;
  p.no_weight_decay = no_weight_decay;
  p.full_shape = shape;
  p.main_param = Tensor::unallocated(shape, DType::F32, where.device);
  p.weight = where.dtype == DType::F32 ? p.main_param
                                       : Tensor::unallocated(shape, where.dtype, where.device);
  p.init = init;
  return p;
}

static ParamInit normal_init(const std::string& name, float std, uint64_t seed, int rank,
                             int size) {
  ParamInit init;
  init.kind = ParamInit::Kind::Normal;
  init.seed = seed;
  init.stream = fnv1a(name);
  init.std = std;
  init.tp_rank = rank;
  init.tp_size = size;
  return init;
}

Param make_param(const std::string& name, const Shape& shape, float std, uint64_t seed,
                 Placement where) {
  const ParamInit init = normal_init(name, std, seed, 0, 1);
  if (where.meta_device) return place_meta(name, shape, false, where, init);
  // On the host, whatever the placement, so every device starts from the same values;
  // fill_normal is Philox(seed).normal(stream, i) per element over a thread team (the
  // serial loop took most of a large model's start-up).
  Tensor w = Tensor::empty(shape);
  ops::fill_normal(w, seed, init.stream);
  ops::scale_(w, std);
  Param p = place(name, w, false, where);
  p.init = init;
  return p;
}

std::vector<TpRowRun> tp_row_runs(const std::vector<int64_t>& blocks, int64_t rows, int rank,
                                  int size) {
  const std::vector<int64_t> sizes = blocks.empty() ? std::vector<int64_t>{rows} : blocks;
  std::vector<TpRowRun> out;
  int64_t full_first = 0, local_first = 0;
  for (int64_t n : sizes) {
    MEGATON_CHECK(n >= 0 && n % size == 0, "tp_row_runs: a block of {} rows does not split into {}",
                  n, size);
    out.push_back({full_first + int64_t(rank) * (n / size), local_first, n / size});
    full_first += n;
    local_first += n / size;
  }
  MEGATON_CHECK(full_first == rows, "tp_row_runs: blocks of {} rows in all, the tensor has {}",
                full_first, rows);
  return out;
}

Tensor shard_of(const Tensor& full, int split_dim, int rank, int size,
                const std::vector<int64_t>& blocks) {
  MEGATON_CHECK(split_dim == 0 || split_dim == 1, "shard_of: split dim {}", split_dim);
  MEGATON_CHECK(blocks.empty() || split_dim == 0, "shard_of: blocks split along dim 0");
  const Tensor host = full.device() == Device::CPU ? full : full.to(Device::CPU);
  const int64_t rows = host.dim(0), cols = host.numel() / std::max<int64_t>(rows, 1);
  const int64_t n = split_dim == 0 ? rows : cols;
  MEGATON_CHECK(n % size == 0, "shard_of: dim {} of {} not divisible into {} parts", split_dim,
                shape_str(host.shape()), size);
  Shape shape = host.shape();
  shape[split_dim] = n / size;
  Tensor out = Tensor::empty(shape, host.dtype());
  const size_t elem = dtype_size(host.dtype());
  const auto* src = static_cast<const char*>(host.raw());
  auto* dst = static_cast<char*>(out.raw());
  if (split_dim == 0) {
    const int64_t row_bytes = cols * int64_t(elem);
    for (const TpRowRun& run : tp_row_runs(blocks, rows, rank, size))
      std::memcpy(dst + run.local_first * row_bytes, src + run.full_first * row_bytes,
                  size_t(run.count * row_bytes));
  } else {
    const int64_t width = cols / size;
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * width * int64_t(elem), src + (r * cols + rank * width) * int64_t(elem),
                  size_t(width * int64_t(elem)));
  }
  return out;
}

Param make_param_sharded(const std::string& name, const Shape& full_shape, float std, uint64_t seed,
                         Placement where, int split_dim, int rank, int size,
                         const std::vector<int64_t>& blocks) {
  if (size == 1) return make_param(name, full_shape, std, seed, where);
  Param p;
  if (where.meta_device) {
    Shape shape = full_shape;
    MEGATON_CHECK(split_dim == 0 || split_dim == 1, "make_param_sharded: split dim {}", split_dim);
    MEGATON_CHECK(shape[size_t(split_dim)] % size == 0,
                  "make_param_sharded: dim {} of {} not divisible into {} parts", split_dim,
                  shape_str(full_shape), size);
    if (split_dim == 0) tp_row_runs(blocks, full_shape[0], rank, size);  // checks the blocks
    shape[size_t(split_dim)] /= size;
    p = place_meta(name, shape, false, where, normal_init(name, std, seed, rank, size));
  } else {
    Param full = make_param(name, full_shape, std, seed, Placement{Device::CPU, DType::F32});
    p = place(name, shard_of(full.main_param, split_dim, rank, size, blocks), false, where);
    p.init = normal_init(name, std, seed, rank, size);
  }
  p.tp_split_dim = split_dim;
  p.tp_blocks = blocks;
  p.full_shape = full_shape;
  return p;
}

// Uniform draws mapped as ParamInit::Map says.
static float uniform_value(const ParamInit& init, const Philox& rng, uint64_t index) {
  const float u = init.low + (init.high - init.low) * rng.uniform(init.stream, index);
  switch (init.map) {
    case ParamInit::Map::Identity:
      return u;
    case ParamInit::Map::Log:
      return std::log(u);
    case ParamInit::Map::MambaDt: {
      const double dt = std::max(std::exp(double(u)), 1e-4);
      return float(dt + std::log(-std::expm1(-dt)));
    }
  }
  return u;
}

Param make_uniform_param(const std::string& name, const Shape& full_shape, float low, float high,
                         ParamInit::Map map, bool no_weight_decay, uint64_t seed, Placement where,
                         int split_dim, int rank, int size, const std::vector<int64_t>& blocks) {
  ParamInit init;
  init.kind = ParamInit::Kind::Uniform;
  init.map = map;
  init.seed = seed;
  init.stream = fnv1a(name);
  init.low = low;
  init.high = high;
  init.tp_rank = size > 1 ? rank : 0;
  init.tp_size = size > 1 ? size : 1;
  const Philox rng(seed);
  Tensor full = Tensor::empty(full_shape);
  for (int64_t i = 0; i < full.numel(); ++i) full.f32()[i] = uniform_value(init, rng, uint64_t(i));
  if (size <= 1) {
    if (where.meta_device) return place_meta(name, full_shape, no_weight_decay, where, init);
    Param p = place(name, full, no_weight_decay, where);
    p.init = init;
    return p;
  }
  Tensor slice = shard_of(full, split_dim, rank, size, blocks);
  Param p = where.meta_device ? place_meta(name, slice.shape(), no_weight_decay, where, init)
                              : place(name, slice, no_weight_decay, where);
  p.init = init;
  p.tp_split_dim = split_dim;
  p.tp_blocks = blocks;
  p.full_shape = full_shape;
  return p;
}

Param make_constant_param(const std::string& name, const Shape& shape, float value,
                          bool no_weight_decay, Placement where) {
  ParamInit init;
  init.kind = ParamInit::Kind::Constant;
  init.value = value;
  if (where.meta_device) return place_meta(name, shape, no_weight_decay, where, init);
  Tensor w = Tensor::empty(shape);
  w.fill(value);
  Param p = place(name, w, no_weight_decay, where);
  p.init = init;
  return p;
}

Tensor initial_values(const Param& p, int64_t offset, int64_t numel) {
  const ParamInit& init = p.init;
  const int64_t local = p.weight.numel();
  MEGATON_CHECK(init.kind != ParamInit::Kind::None, "initial_values: '{}' has no recipe", p.name);
  MEGATON_CHECK(offset >= 0 && numel >= 0 && offset + numel <= local,
                "initial_values: elements [{}, {}) of '{}' ({} elements)", offset, offset + numel,
                p.name, local);
  Tensor out = Tensor::empty({numel});
  float* y = out.f32();
  if (init.kind == ParamInit::Kind::Constant) {
    out.fill(init.value);
    return out;
  }
  const bool uniform = init.kind == ParamInit::Kind::Uniform;
  // Local element j -> element of the full tensor, as shard_of cuts it.
  const Shape& full = p.full_shape;
  const int64_t full_rows = full.empty() ? 1 : full[0];
  int64_t full_numel = 1;
  for (int64_t d : full) full_numel *= d;
  const int64_t full_cols = full_rows > 0 ? full_numel / full_rows : 0;
  const int dim = init.tp_size > 1 ? p.tp_split_dim : -1;
  const int64_t local_cols = dim == 1 ? full_cols / init.tp_size : full_cols;
  // This rank's dim-0 runs (tp_blocks), for a row split.
  const std::vector<TpRowRun> runs =
      dim == 0 ? tp_row_runs(p.tp_blocks, full_rows, init.tp_rank, init.tp_size)
               : std::vector<TpRowRun>{};
  auto full_index = [&](int64_t j) -> int64_t {
    const int64_t r = j / std::max<int64_t>(local_cols, 1),
                  c = j % std::max<int64_t>(local_cols, 1);
    if (dim == 1) return r * full_cols + int64_t(init.tp_rank) * local_cols + c;
    if (dim != 0) return j;
    size_t b = 0;
    while (b + 1 < runs.size() && r >= runs[b + 1].local_first) ++b;
    return (runs[b].full_first + r - runs[b].local_first) * full_cols + c;
  };
  const Philox rng(init.seed);
#pragma omp parallel for schedule(static) if (numel >= 65536)
  for (int64_t k = 0; k < numel; ++k)
    y[k] = uniform ? uniform_value(init, rng, uint64_t(full_index(offset + k)))
                   : rng.normal(init.stream, uint64_t(full_index(offset + k))) * init.std;
  return out;
}

void write_initial_values(const Param& p, int64_t offset, Tensor dst) {
  const Tensor values = initial_values(p, offset, dst.numel()).to(dst.device());
  if (dst.dtype() == DType::F32)
    dst.copy_from(values);
  else
    ops::cast(values, dst);
}

Tensor main_param_values(const Param& p, int64_t offset, int64_t numel) {
  MEGATON_CHECK(p.main_param.defined(), "main_param_values: '{}' has no main param", p.name);
  if (!p.main_param.storage_released())
    return p.main_param.view({p.main_param.numel()}).rows(offset, numel);
  return initial_values(p, offset, numel).to(p.weight.device());
}

void refresh_compute_weight(Param& p) {
  // An FP8 weight (--fp8-param-gather) is requantized by the distributed optimizer.
  MEGATON_CHECK(!p.fp8_param, "refresh_compute_weight on the FP8 weight '{}'", p.name);
  if (p.weight.same_data(p.main_param)) return;
  // An offloaded main param (--optimizer-cpu-offload) is on the host: cast there, then copy.
  if (p.main_param.device() != p.weight.device())
    p.weight.copy_from(p.main_param.dtype() == p.weight.dtype()
                           ? p.main_param
                           : p.main_param.to(p.weight.dtype()));
  else
    ops::cast(p.main_param, p.weight);
}

}  // namespace megaton
