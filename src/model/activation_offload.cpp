// ActivationOffload: grouping a layer's saved tensors by memory, the copies out and in.
#include "model/activation_offload.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "core/error.h"
#include "model/gpt.h"

namespace megaton {

namespace {

// Byte range [begin, end) of a tensor's memory.
struct Range {
  uintptr_t begin = 0, end = 0;
  bool overlaps(const Range& o) const { return begin < o.end && o.begin < end; }
};
Range range_of(const Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.raw());
  return {begin, begin + t.nbytes()};
}

// The memory the layer's saved state may view but must never be moved: its parameters'
// tensors and the FP8 delayed recipe's state (amax histories, scales).
std::vector<Range> pinned_ranges(TransformerLayer& layer, Device device) {
  std::vector<Tensor> tensors;
  std::vector<Param*> params;
  layer.collect_params(params);
  for (const Param* p : params)
    for (const Tensor* t : {&p->weight, &p->main_param, &p->main_grad, &p->fp8_scales})
      tensors.push_back(*t);
  for (bool experts : {false, true})
    for (const auto& [name, t] : layer.fp8_state(experts)) tensors.push_back(*t);
  std::vector<Range> out;
  for (const Tensor& t : tensors)
    if (t.defined() && t.device() == device && t.nbytes() > 0) out.push_back(range_of(t));
  return out;
}

// A tensor of the layer's saved state that may be offloaded.
struct Candidate {
  int64_t slot = 0;
  Tensor tensor;
  Range range;
};

}  // namespace

ActivationOffload::ActivationOffload(std::vector<TransformerLayer*> layers, int64_t num_offloaded,
                                     Device device)
    : layers_(std::move(layers)), device_(device), stream_(device) {
  MEGATON_CHECK(num_offloaded >= 0 && num_offloaded <= int64_t(layers_.size()),
                "ActivationOffload: {} layers to offload of {}", num_offloaded, layers_.size());
  stashes_.reserve(size_t(num_offloaded));
  for (int64_t i = 0; i < num_offloaded; ++i) stashes_.emplace_back(device);
}

ActivationOffload::~ActivationOffload() {
  // Device tensors a copy in may still write must not reach the allocator before it ends.
  try {
    stream_.synchronize();
  } catch (...) {
    // A destructor cannot report it; HostCopyStream's destructor tries again.
  }
}

bool ActivationOffload::holds() const {
  return std::any_of(stashes_.begin(), stashes_.end(),
                     [](const Stash& s) { return s.state != State::Empty; });
}

int64_t ActivationOffload::offloaded_bytes(int64_t index) const {
  MEGATON_CHECK(index >= 0 && index < num_offloaded(), "ActivationOffload: no layer {}", index);
  return stashes_[size_t(index)].bytes;
}

int64_t ActivationOffload::host_bytes() const {
  int64_t bytes = 0;
  for (const Stash& s : stashes_) bytes += int64_t(s.host.capacity());
  return bytes;
}

void ActivationOffload::after_forward(int64_t index) {
  MEGATON_CHECK(index >= 0 && index < int64_t(layers_.size()),
                "ActivationOffload::after_forward: no layer {}", index);
  if (index >= 1 && index - 1 < num_offloaded()) release(stashes_[size_t(index - 1)]);
  if (index < num_offloaded()) offload(index);
}

void ActivationOffload::finish_forward() {
  for (Stash& s : stashes_) release(s);
}

void ActivationOffload::offload(int64_t index) {
  Stash& s = stashes_[size_t(index)];
  MEGATON_CHECK(s.state == State::Empty,
                "ActivationOffload: layer {} still holds an offloaded forward", index);
  TransformerLayer& layer = *layers_[size_t(index)];
  const std::vector<Range> pinned = pinned_ranges(layer, device_);
  std::vector<Candidate> candidates;
  int64_t num_slots = 0;
  layer.for_each_saved_tensor([&](Tensor& t) {
    const int64_t slot = num_slots++;
    if (t.defined() && t.device() == device_ && t.nbytes() > 0)
      candidates.push_back({slot, t, range_of(t)});
  });
  s.slots.assign(size_t(num_slots), Slot{});
  s.groups.clear();
  s.bytes = 0;

  // Groups of tensors whose memory overlaps (sweep by start address). A group is copied
  // as its widest tensor when that one covers all the others with the same dtype at
  // element offsets; otherwise it stays.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.range.begin != b.range.begin ? a.range.begin < b.range.begin : a.slot < b.slot;
  });
  size_t host_bytes = 0;
  for (size_t first = 0; first < candidates.size();) {
    Range cover = candidates[first].range;
    size_t last = first + 1;
    while (last < candidates.size() && candidates[last].range.begin < cover.end)
      cover.end = std::max(cover.end, candidates[last++].range.end);
    const Candidate* root = nullptr;
    for (size_t i = first; i < last && !root; ++i)
      if (candidates[i].range.begin == cover.begin && candidates[i].range.end == cover.end)
        root = &candidates[i];
    bool movable = root != nullptr &&
                   std::none_of(pinned.begin(), pinned.end(),
                                [&](const Range& p) { return p.overlaps(cover); });
    const size_t element = root ? dtype_size(root->tensor.dtype()) : 1;
    for (size_t i = first; i < last && movable; ++i)
      movable = candidates[i].tensor.dtype() == root->tensor.dtype() &&
                (candidates[i].range.begin - cover.begin) % element == 0;
    if (movable) {
      const int32_t g = int32_t(s.groups.size());
      s.groups.push_back({root->tensor.shape(), root->tensor.dtype(), host_bytes, root->tensor});
      host_bytes += (root->tensor.nbytes() + 63) / 64 * 64;
      s.bytes += int64_t(root->tensor.nbytes());
      for (size_t i = first; i < last; ++i)
        s.slots[size_t(candidates[i].slot)] = {
            g, int64_t((candidates[i].range.begin - cover.begin) / element),
            candidates[i].tensor.shape()};
    }
    first = last;
  }
  if (s.groups.empty()) return;

  if (host_bytes > s.host.capacity()) {
    // The old buffer may still feed the last step's copy in: wait for it before freeing.
    stream_.synchronize();
    s.host.reserve(s.host.capacity() == 0 ? host_bytes : host_bytes + host_bytes / 8);
  }
  // The copies start where the compute stream is now: the end of this layer's forward.
  stream_.wait_for_compute();
  for (const Group& g : s.groups) stream_.copy_to_host(s.host.data() + g.host_offset, g.device);
  stream_.record(s.copied);
  // The layer lets go of the tensors; the groups keep their memory until the copies end.
  int64_t slot = 0;
  layer.for_each_saved_tensor([&](Tensor& t) {
    if (s.slots[size_t(slot++)].group >= 0) t = Tensor();
  });
  s.state = State::OnHost;
}

void ActivationOffload::release(Stash& s) {
  if (s.state != State::OnHost) return;
  bool held = false;
  for (const Group& g : s.groups) held = held || g.device.defined();
  if (!held) return;
  // Blocks go back to the allocator, which hands them out in compute-stream order: the
  // compute stream must first have waited for the copies that read them.
  stream_.compute_waits(s.copied);
  for (Group& g : s.groups) g.device = Tensor();
}

void ActivationOffload::prefetch(Stash& s) {
  if (s.state != State::OnHost) return;
  release(s);
  for (Group& g : s.groups) g.device = Tensor::empty(g.shape, g.dtype, device_);
  // The new blocks may have been freed by work still queued on the compute stream.
  stream_.wait_for_compute();
  for (Group& g : s.groups) stream_.copy_to_device(g.device, s.host.data() + g.host_offset);
  stream_.record(s.loaded);
  s.state = State::Loading;
}

void ActivationOffload::restore(int64_t index) {
  Stash& s = stashes_[size_t(index)];
  if (s.state == State::Empty) return;
  prefetch(s);  // when no earlier backward started it
  stream_.compute_waits(s.loaded);
  int64_t slot = 0;
  layers_[size_t(index)]->for_each_saved_tensor([&](Tensor& t) {
    MEGATON_CHECK(size_t(slot) < s.slots.size(),
                  "ActivationOffload: layer {}'s saved state changed shape", index);
    const Slot& at = s.slots[size_t(slot++)];
    if (at.group < 0) return;
    const Tensor& whole = s.groups[size_t(at.group)].device;
    if (at.element_offset == 0 && at.shape == whole.shape()) {
      t = whole;
      return;
    }
    int64_t numel = 1;
    for (int64_t d : at.shape) numel *= d;
    t = whole.view({whole.numel()}).rows(at.element_offset, numel).view(at.shape);
  });
  MEGATON_CHECK(size_t(slot) == s.slots.size(),
                "ActivationOffload: layer {}'s saved state changed shape", index);
  for (Group& g : s.groups) g.device = Tensor();
  s.state = State::Empty;
}

void ActivationOffload::before_backward(int64_t index) {
  MEGATON_CHECK(index >= 0 && index < int64_t(layers_.size()),
                "ActivationOffload::before_backward: no layer {}", index);
  if (index < num_offloaded()) restore(index);
  if (index >= 1 && index - 1 < num_offloaded()) prefetch(stashes_[size_t(index - 1)]);
}

void ActivationOffload::reload_all() {
  for (int64_t i = 0; i < num_offloaded(); ++i) restore(i);
}

void ActivationOffload::discard() {
  for (Stash& s : stashes_) {
    if (s.state == State::OnHost) release(s);
    if (s.state == State::Loading) stream_.compute_waits(s.loaded);  // the blocks' last writer
    for (Group& g : s.groups) g.device = Tensor();
    s.state = State::Empty;
  }
}

}  // namespace megaton
