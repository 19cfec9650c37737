// Gathering named tensors of every rank onto one rank (checkpoint saving).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "dist/comm.h"

namespace megaton::dist {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Every member's `mine` (names, shapes, dtypes may differ between members; tensors
// contiguous, on any device) arrives at member `root` of g, concatenated in member
// order, as tensors on the Comm's device (root's own tensors: where they are); the other
// members get an empty list. Point to
// point over g (Comm::send/recv), one member at a time: meant for checkpoints, not for
// the training step. Collective over g.
NamedTensors gather_named_tensors(Comm& comm, const Group& g, const NamedTensors& mine,
                                  int root = 0);

}  // namespace megaton::dist
