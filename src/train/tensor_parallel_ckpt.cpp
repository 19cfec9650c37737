// Assembling and slicing tensor-parallel checkpoint tensors.
#include "train/tensor_parallel_ckpt.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "model/layers.h"

namespace megaton {

const dist::Group& tensor_parallel_group(const Param& p, const ModelParallel& mp) {
  return p.is_expert ? mp.etp() : mp.tp();
}

namespace {

// The inverse of shard_of: slices [size][...] of one tensor, in rank order, -> full.
Tensor unshard(const Tensor& gathered, const Param& p, int size) {
  const Tensor host = gathered.device() == Device::CPU ? gathered : gathered.to(Device::CPU);
  Tensor full = Tensor::empty(p.full_shape, host.dtype());
  const int64_t rows = p.full_shape[0];
  const int64_t cols = full.numel() / std::max<int64_t>(rows, 1);
  const size_t elem = dtype_size(host.dtype());
  const int64_t slice_numel = full.numel() / size;
  const auto* src = static_cast<const char*>(host.raw());
  auto* dst = static_cast<char*>(full.raw());
  for (int r = 0; r < size; ++r) {
    const char* slice = src + r * slice_numel * int64_t(elem);
    if (p.tp_split_dim == 0) {
      for (const TpRowRun& run : tp_row_runs(p.tp_blocks, rows, r, size))
        std::memcpy(dst + run.full_first * cols * int64_t(elem),
                    slice + run.local_first * cols * int64_t(elem),
                    size_t(run.count * cols) * elem);
    } else {
      const int64_t width = cols / size;
      for (int64_t row = 0; row < rows; ++row)
        std::memcpy(dst + (row * cols + r * width) * int64_t(elem),
                    slice + row * width * int64_t(elem), size_t(width) * elem);
    }
  }
  return full;
}

}  // namespace

const Param* param_of_entry(const std::string& entry,
                            const std::map<std::string, const Param*>& params) {
  std::string name;
  if (entry.starts_with("model.")) {
    name = entry.substr(6);
  } else if (entry.starts_with("optimizer.")) {
    name = entry.substr(10);
    // Adam's moments, Lion's exp_avg, Muon's and SGD's momentum_buffer.
    for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".momentum_buffer"})
      if (name.ends_with(suffix)) {
        name.resize(name.size() - std::strlen(suffix));
        break;
      }
  }
  auto it = params.find(name);
  return it == params.end() ? nullptr : it->second;
}

dist::NamedTensors assemble_tensor_parallel(const dist::NamedTensors& entries,
                                            const std::map<std::string, const Param*>& params,
                                            const ModelParallel& mp) {
  dist::NamedTensors out;
  for (const auto& [name, t] : entries) {
    // The scale of an fp16 or fp8 moment ("optimizer.<name>.exp_avg.scale") or of an fp16
    // main param ("optimizer.<name>.main_param.scale"): one per whole parameter, the same on
    // every tensor-parallel rank (the optimizer reduces its absmax over the group), written
    // as a replicated tensor.
    const bool main_param_scale = name.ends_with(".main_param.scale");
    const bool moment_scale =
        main_param_scale || name.ends_with(".exp_avg.scale") || name.ends_with(".exp_avg_sq.scale");
    const size_t suffix = main_param_scale ? std::strlen(".main_param.scale")
                          : moment_scale   ? std::strlen(".scale")
                                           : 0;
    const Param* p = param_of_entry(name.substr(0, name.size() - suffix), params);
    MEGATON_CHECK(p != nullptr, "checkpoint entry '{}' belongs to no parameter", name);
    const dist::Group& g = tensor_parallel_group(*p, mp);
    if (g.size() <= 1) {
      out.emplace_back(name, t);
      continue;
    }
    if (p->tp_split_dim < 0 || moment_scale) {  // replicated: the group's rank 0 writes it
      if (g.rank == 0) out.emplace_back(name, t);
      continue;
    }
    // The collective runs on the communicator's device (a host tensor, e.g. an offloaded
    // main param, is copied there first).
    const Tensor src = t.device() == mp.comm->device() ? t : t.to(mp.comm->device());
    Tensor gathered = Tensor::empty({t.numel() * g.size()}, t.dtype(), src.device());
    mp.comm->all_gather(src, gathered, g);
    if (g.rank == 0) out.emplace_back(name, unshard(gathered, *p, g.size()));
  }
  return out;
}

Tensor tensor_parallel_slice(const Tensor& full, const Param& p, const ModelParallel& mp) {
  const dist::Group& g = tensor_parallel_group(p, mp);
  if (p.tp_split_dim < 0 || g.size() <= 1) return full;
  return shard_of(full, p.tp_split_dim, g.rank, g.size(), p.tp_blocks);
}

Tensor fit_padded_vocab_rows(const Tensor& full, int64_t padded_vocab_size, int64_t vocab_size,
                             const std::string& entry, const std::string& source) {
  MEGATON_CHECK(full.ndim() >= 1 && padded_vocab_size >= vocab_size && vocab_size > 0,
                "fit_padded_vocab_rows of {} {} to {} rows for a vocabulary of {}", entry,
                shape_str(full.shape()), padded_vocab_size, vocab_size);
  const int64_t rows = full.dim(0);
  if (rows == padded_vocab_size) return full;
  if (rows < vocab_size)
    fail(
        "checkpoint '{}': tensor '{}' has {} vocabulary rows, fewer than the tokenizer's {} "
        "tokens (was it trained with another tokenizer?)",
        source, entry, rows, vocab_size);
  const Tensor host = full.device() == Device::CPU ? full : full.to(Device::CPU);
  Shape shape = host.shape();
  shape[0] = padded_vocab_size;
  Tensor out = Tensor::empty(shape, host.dtype());
  const size_t row_bytes =
      size_t(host.numel() / std::max<int64_t>(rows, 1)) * dtype_size(host.dtype());
  const auto* src = static_cast<const char*>(host.raw());
  auto* dst = static_cast<char*>(out.raw());
  const int64_t kept = std::min(rows, padded_vocab_size);
  std::memcpy(dst, src, size_t(kept) * row_bytes);
  const bool last_row_is_padding = rows > vocab_size;
  for (int64_t r = kept; r < padded_vocab_size; ++r) {
    if (last_row_is_padding)
      std::memcpy(dst + r * row_bytes, src + (rows - 1) * row_bytes, row_bytes);
    else
      std::memset(dst + r * row_bytes, 0, row_bytes);
  }
  return out;
}

}  // namespace megaton
