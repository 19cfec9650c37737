// ActivationOffload: the saved activations of a model chunk's first layers, moved to host
// memory after each layer's forward and back before its backward (--cpu-offloading).
#pragma once
#include <cstdint>
#include <vector>

#include "core/copy_stream.h"
#include "core/tensor.h"

namespace megaton {

class TransformerLayer;

// Megatron's --cpu-offloading-num-layers (Transformer Engine's CPU offload context, one
// offload group per transformer layer), for GPTModel's training forward and backward
// (docs/memory.md, "Activation offloading"):
//
// - after_forward(l): the device tensors of layer l - 1 go back to the allocator (the
//   compute stream first waits for their copy), then, for l < N, layer l's saved tensors
//   (TransformerLayer::for_each_saved_tensor) are copied into a pinned host buffer on a
//   side stream that starts where the compute stream is now (the end of layer l's
//   forward), and taken out of the layer. The copy of layer l thus overlaps layer l + 1's
//   forward, and layer l's memory is reused from layer l + 2's forward on.
// - before_backward(l): layer l's tensors are put back (brought in now if no prefetch
//   did it; the compute stream waits for their copy), then layer l - 1's copy to the
//   device starts on the side stream, after the work queued so far, to overlap layer l's
//   backward.
//
// Tensors that share memory (views of one buffer: q, k, v or an output kept twice) are
// copied once and put back as views of one new tensor; a group of overlapping tensors
// none of which covers the others, and any tensor overlapping a parameter (weight, main
// param, main grad, FP8 scales) or the FP8 delayed recipe's state, stays on the device.
// Host buffers, one per offloaded layer, are kept and reused across steps (grown when a
// step needs more: MoE layers' expert rows vary). On the CPU backend the "device" is host
// memory from the tensor allocator and the host buffer is memory outside it: the copies
// run at once, but the bookkeeping is the same, so CPU tests check it.
//
// Not thread-safe; one micro-batch at a time (no pipeline: Megatron refuses offloading
// with pipeline parallelism).
class ActivationOffload {
 public:
  // layers: the model chunk's layers in forward order (they outlive this object); the
  // first num_offloaded of them are offloaded. device: the model's. InternalError when
  // num_offloaded is outside [0, layers.size()].
  ActivationOffload(std::vector<TransformerLayer*> layers, int64_t num_offloaded, Device device);
  ~ActivationOffload();  // waits for the side stream's copies
  ActivationOffload(const ActivationOffload&) = delete;
  ActivationOffload& operator=(const ActivationOffload&) = delete;

  // After layer `index`'s training forward (its saved state complete), every layer of
  // the forward in order. InternalError when layer `index` already holds offloaded
  // tensors (a forward without discard() since its last one).
  void after_forward(int64_t index);
  // After the last layer's forward: releases the device tensors still waiting for their
  // copy.
  void finish_forward();
  // Before layer `index`'s backward, every layer in reverse order (see above).
  void before_backward(int64_t index);
  // Puts every offloaded layer's tensors back (GPTModel::take_activations: a stash must
  // hold its tensors).
  void reload_all();
  // Drops what is offloaded (a new forward replaces the micro-batch the chunk held).
  void discard();
  // Whether some layer's tensors are on the host or on their way.
  bool holds() const;

  int64_t num_offloaded() const { return int64_t(stashes_.size()); }
  // Bytes the last offload of layer `index` copied to the host (its device tensors' bytes
  // once, views counted once).
  int64_t offloaded_bytes(int64_t index) const;
  // Bytes of the pinned (CPU backend: plain) host buffers.
  int64_t host_bytes() const;

 private:
  // One tensor copied to the host: the widest of a group of tensors sharing memory.
  struct Group {
    Shape shape;
    DType dtype = DType::F32;
    size_t host_offset = 0;  // bytes into the layer's host buffer
    Tensor device;           // while its copy out or in is in flight (else undefined)
  };
  // One slot of the layer's saved state (in for_each_saved_tensor's order).
  struct Slot {
    int32_t group = -1;          // -1: left on the device
    int64_t element_offset = 0;  // into the group's tensor, in its elements
    Shape shape;
  };
  enum class State { Empty, OnHost, Loading };
  struct Stash {
    explicit Stash(Device device) : host(device) {}
    State state = State::Empty;
    std::vector<Slot> slots;
    std::vector<Group> groups;
    HostBuffer host;
    int64_t bytes = 0;
    CopyEvent copied, loaded;  // the side stream's end of the copies out, and in
  };

  void offload(int64_t index);
  void release(Stash& s);   // drops the device tensors copied out (after their copy)
  void prefetch(Stash& s);  // starts the copy in
  void restore(int64_t index);

  std::vector<TransformerLayer*> layers_;
  Device device_;
  HostCopyStream stream_;
  std::vector<Stash> stashes_;  // per offloaded layer
};

}  // namespace megaton
