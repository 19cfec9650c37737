// Pieces of tensor-parallel slices for the sharded checkpoint, and reading them back.
#include "train/sharded_ckpt.h"

#include <algorithm>
#include <string_view>

#include "core/error.h"
#include "train/tensor_parallel_ckpt.h"

namespace megaton {

namespace {

std::vector<int64_t> dims_of(const Shape& s) { return std::vector<int64_t>(s.begin(), s.end()); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

using Box = SliceBox;
std::vector<Box> slice_boxes(const Param& p, const dist::Group& g) {
  const std::vector<int64_t> full = dims_of(p.full_shape);
  Box whole{std::vector<int64_t>(full.size(), 0), full};
  if (p.tp_split_dim < 0 || g.size() <= 1) return {whole};
  const size_t d = size_t(p.tp_split_dim);
  MEGATON_CHECK(d < full.size(), "param {}: split dim {} of {}", p.name, d,
                shape_str(p.full_shape));
  if (p.tp_blocks.empty()) {
    Box b = whole;
    b.shape[d] = full[d] / g.size();
    b.offsets[d] = int64_t(g.rank) * b.shape[d];
    return {b};
  }
  MEGATON_CHECK(d == 0, "param {}: stacked blocks split along dim {}", p.name, d);
  std::vector<Box> out;
  for (const TpRowRun& run : tp_row_runs(p.tp_blocks, full[0], g.rank, g.size())) {
    Box b = whole;
    b.shape[0] = run.count;
    b.offsets[0] = run.full_first;
    out.push_back(b);
  }
  return out;
}

}  // namespace

std::vector<SliceBox> tensor_parallel_boxes(const Param& p, const ModelParallel& mp) {
  return slice_boxes(p, tensor_parallel_group(p, mp));
}

std::vector<ckpt::ShardedPiece> sharded_pieces(
    const std::string& name, const Param* p, const Tensor& data, int64_t param_offset,
    const ModelParallel& mp, const std::function<Tensor(const Tensor&)>& snapshot) {
  // A replicated param is written by rank 0 of its tensor-parallel group (no copy elsewhere).
  if (p && p->tp_split_dim < 0 && tensor_parallel_group(*p, mp).size() > 1 &&
      tensor_parallel_group(*p, mp).rank != 0)
    return {};
  // A copy on the host (the snapshot an --async-save writes while training goes on).
  const Tensor host = snapshot                       ? snapshot(data)
                      : data.device() == Device::CPU ? data.clone()
                                                     : data.to(Device::CPU);
  if (!p) {
    const std::vector<int64_t> shape = dims_of(host.shape());
    return {
        ckpt::ShardedPiece{name, shape, std::vector<int64_t>(shape.size(), 0), shape, 0, -1, host}};
  }
  const dist::Group& g = tensor_parallel_group(*p, mp);
  const Tensor flat = host.view({host.numel()});
  const std::vector<Box> boxes = slice_boxes(*p, g);
  std::vector<ckpt::ShardedPiece> out;
  int64_t box_start = 0;  // the box's first element in the slice
  for (const Box& b : boxes) {
    const int64_t box_numel = numel_of(b.shape);
    const int64_t begin = std::max(param_offset, box_start),
                  end = std::min(param_offset + host.numel(), box_start + box_numel);
    if (begin < end)
      out.push_back({name, dims_of(p->full_shape), b.offsets, b.shape, begin - box_start,
                     end - box_start, flat.rows(begin - param_offset, end - begin)});
    box_start += box_numel;
  }
  MEGATON_CHECK(param_offset >= 0 && param_offset + host.numel() <= box_start,
                "checkpoint entry {}: elements [{}, {}) outside the {} of this rank's slice", name,
                param_offset, param_offset + host.numel(), box_start);
  return out;
}

std::vector<ckpt::ShardedPiece> sharded_scale_pieces(
    const std::string& name, const Tensor& data, const std::map<std::string, const Param*>& params,
    const ModelParallel& mp, const std::function<Tensor(const Tensor&)>& snapshot) {
  const bool main_param = name.ends_with(".main_param.scale");
  MEGATON_CHECK(
      main_param || name.ends_with(".exp_avg.scale") || name.ends_with(".exp_avg_sq.scale"),
      "checkpoint entry '{}' is not a scale", name);
  const size_t suffix = std::string_view(main_param ? ".main_param.scale" : ".scale").size();
  const Param* p = param_of_entry(name.substr(0, name.size() - suffix), params);
  MEGATON_CHECK(p != nullptr, "checkpoint entry '{}' belongs to no parameter", name);
  if (tensor_parallel_group(*p, mp).rank != 0) return {};
  return sharded_pieces(name, nullptr, data, 0, mp, snapshot);
}

namespace {

// Checks that checkpoint entry `name` has p's full shape (a padded vocabulary aside);
// returns whether its vocabulary padding differs from this run's.
bool check_global_shape(ckpt::ShardedCheckpointReader& reader, const std::string& name,
                        const Param& p) {
  const auto& info = reader.tensors().at(name);
  const std::vector<int64_t> full = dims_of(p.full_shape);
  std::vector<int64_t> saved = info.global_shape;
  const bool other_padding =
      p.padded_vocab_rows && !saved.empty() && !full.empty() && saved[0] != full[0];
  if (other_padding) saved[0] = full[0];
  if (saved != full)
    fail(
        "checkpoint '{}': tensor '{}' is {} {}, the model expects {} (whole tensors, before "
        "the tensor-parallel split)",
        reader.path(), name, dtype_name(info.dtype),
        shape_str(Shape(info.global_shape.begin(), info.global_shape.end())),
        shape_str(p.full_shape));
  return other_padding;
}

}  // namespace

Tensor read_tensor_parallel_slice(ckpt::ShardedCheckpointReader& reader, const std::string& name,
                                  const Param& p, const ModelParallel& mp,
                                  int64_t padded_vocab_size, int64_t vocab_size) {
  if (check_global_shape(reader, name, p)) {
    const Tensor whole = fit_padded_vocab_rows(reader.read(name), padded_vocab_size, vocab_size,
                                               name, reader.path());
    return tensor_parallel_slice(whole, p, mp);
  }
  const auto& info = reader.tensors().at(name);
  const std::vector<Box> boxes = slice_boxes(p, tensor_parallel_group(p, mp));
  if (boxes.size() == 1)
    return reader.read_box(name, boxes[0].offsets, boxes[0].shape).view(p.weight.shape());
  // SwiGLU: the gate box's rows, then the up box's.
  Tensor out = Tensor::empty(p.weight.shape(), info.dtype);
  Tensor rows = out.view({out.numel()});
  int64_t at = 0;
  for (const Box& b : boxes) {
    const Tensor part = reader.read_box(name, b.offsets, b.shape);
    rows.rows(at, part.numel()).copy_from(part.view({part.numel()}));
    at += part.numel();
  }
  return out;
}

Tensor read_tensor_parallel_range(ckpt::ShardedCheckpointReader& reader, const std::string& name,
                                  const Param& p, const ModelParallel& mp,
                                  int64_t padded_vocab_size, int64_t vocab_size, int64_t offset,
                                  int64_t numel) {
  MEGATON_CHECK(offset >= 0 && numel >= 0 && offset + numel <= p.weight.numel(),
                "read_tensor_parallel_range: [{}, {}) outside {}'s {} elements", offset,
                offset + numel, name, p.weight.numel());
  if (check_global_shape(reader, name, p)) {
    const Tensor slice =
        read_tensor_parallel_slice(reader, name, p, mp, padded_vocab_size, vocab_size);
    return slice.view({slice.numel()}).rows(offset, numel).clone();
  }
  // The slice is its boxes' elements one after another: read each box's overlap with the
  // range by offset.
  Tensor out = Tensor::empty({numel}, reader.tensors().at(name).dtype);
  int64_t box_start = 0;
  for (const Box& b : slice_boxes(p, tensor_parallel_group(p, mp))) {
    const int64_t box_end = box_start + numel_of(b.shape);
    const int64_t begin = std::max(offset, box_start), end = std::min(offset + numel, box_end);
    if (begin < end)
      out.rows(begin - offset, end - begin)
          .copy_from(
              reader.read_flat(name, b.offsets, b.shape, begin - box_start, end - box_start));
    box_start = box_end;
  }
  return out;
}

}  // namespace megaton
