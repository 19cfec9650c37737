// Megatron's --deterministic-mode for the ops: whether the ops that have a faster
// run-to-run-varying implementation take their deterministic one instead. Process-wide,
// off by default; set once by the trainer before the first step.
//
// What it changes (docs/performance.md, "Deterministic mode", has the measured cost):
//   - embedding_backward / embedding_backward_vocab_range on CUDA: the fp32 atomic adds,
//     whose order varies when an id repeats in the batch, are replaced by a stable sort of
//     the tokens by id and one in-order sum per id;
//   - CUDA attention backward: cuDNN's deterministic SDPA backward
//     (SDPA_backward_attributes::set_deterministic_algorithm), which does not accumulate dq
//     with atomics.
// Every other op is deterministic either way (ops.h states it per op where it matters).
#pragma once

namespace megaton::ops {

void set_deterministic(bool on);
bool deterministic();

}  // namespace megaton::ops
