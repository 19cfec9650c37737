// Helpers shared by the token dispatchers' files (token_dispatcher.cpp,
// token_dispatcher_allgather.cpp); not part of the dispatchers' interface.
#pragma once
#include <any>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "model/token_dispatcher.h"

namespace megaton::token_dispatcher_detail {

// A new uninitialised tensor shaped `shape` with the dtype and device of `like`.
inline Tensor empty_as(const Tensor& like, const Shape& shape) {
  return Tensor::empty(shape, like.dtype(), like.device());
}

inline int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t(0));
}

// The host copy of an int64 device (or host) tensor.
inline std::vector<int64_t> host_i64(const Tensor& t) {
  Tensor host = t.to(Device::CPU);
  return std::vector<int64_t>(host.i64(), host.i64() + host.numel());
}

// Calls beside when given (a call with no exchange to run it beside).
inline void run_beside(const MoETokenDispatcher::Beside& beside) {
  if (beside) beside();
}

// The dispatcher state held by `saved` (from take_saved of a dispatcher of the same kind).
template <class Saved>
Saved& saved_of(std::any& saved, const char* kind) {
  Saved* state = std::any_cast<Saved>(&saved);
  MEGATON_CHECK(state != nullptr, "MoE {} dispatcher: restore_saved of another kind's state", kind);
  return *state;
}

}  // namespace megaton::token_dispatcher_detail
