// The CPU reference of Mamba-2's selective scan (ops/ssm.h) on fp64 arrays: the chunked
// SSD form and the plain recurrence, each with its backward. The doors in ssm.cpp convert
// the tensors to an SsdProblem and the results back. Internal to ops/cpu.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/ssm.h"

namespace megaton::ops::ssm_scan {

// One call's inputs, as in ops/ssm.h with delta = softplus(dt + dt_bias) and A = -exp(A_log)
// already applied. Rows are b-major tokens (row b * seq + s).
struct SsdProblem {
  SsdDims dims;
  std::vector<double> x;          // [B*S, nheads * head_dim]
  std::vector<double> delta;      // [B*S, nheads]
  std::vector<double> B, C;       // [B*S, ngroups * state_dim]
  std::vector<double> A, D;       // [nheads]
  std::vector<int64_t> document;  // [B*S]: the row's document within its sample, from 0
};

// Gradients of a scalar loss with respect to SsdProblem's arrays (same shapes; A and D
// [nheads]). Every array is sized and overwritten by the backward functions.
struct SsdGrads {
  std::vector<double> x, delta, B, C, A, D;
};

// y [B*S, nheads * head_dim] (resized and overwritten); final_state (optional)
// [B, nheads, head_dim, state_dim]: the state after each sample's last row.
//
// The chunked form (arXiv:2405.21060 section 6, Listing 1), chunk by chunk of
// dims.chunk_size rows with the state entering the chunk h_prev and the inclusive
// cumulative decay cs_i = sum_{k <= i in the chunk} delta_k A:
//   y_i  = sum_{j <= i, same document} exp(cs_i - cs_j) delta_j (C_i . B_j) x_j   (diagonal)
//        + [i in h_prev's document] exp(cs_i) h_prev C_i                        (off-diagonal)
//        + D x_i
//   h_out = [last row in h_prev's document] exp(cs_last) h_prev
//        + sum_{j in the last row's document} exp(cs_last - cs_j) delta_j x_j B_j^T
void chunked_forward(const SsdProblem& p, std::vector<double>& y, std::vector<double>* final_state);
// dy [B*S, nheads * head_dim] -> grads: the chunked form's reverse, recomputing the states
// entering each chunk; then the state gradients pass backwards across chunks.
void chunked_backward(const SsdProblem& p, const std::vector<double>& dy, SsdGrads& grads);

// The same forward and backward as the recurrence h_t = exp(delta_t A) h_{t-1} +
// delta_t x_t B_t^T (h_{t-1} = 0 at a document's first row), y_t = h_t C_t + D x_t.
void recurrent_forward(const SsdProblem& p, std::vector<double>& y,
                       std::vector<double>* final_state);
void recurrent_backward(const SsdProblem& p, const std::vector<double>& dy, SsdGrads& grads);

}  // namespace megaton::ops::ssm_scan
