// Mamba-2's selective scan (ops/ssm.h): the doors check the arguments, then run the CUDA
// kernels (ops/cuda/ssm_scan.cu) for device tensors or the CPU reference, which converts
// the F32 tensors to fp64 and runs ops/cpu/ssm_scan.cpp (the convolution and the gated
// RMSNorm are in ssm_conv.cpp and ssm_norm.cpp).
#include "ops/ssm.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/cpu/ssm_checks.h"
#include "ops/cpu/ssm_scan.h"
#include "ops/dispatch.h"
#include "ops/qkv_checks.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/ssm.h"
#endif

namespace megaton::ops {
namespace {

using ssm_detail::check_cpu;
using ssm_detail::check_f32;
using ssm_detail::check_like;
using ssm_detail::check_vector;
using ssm_scan::SsdGrads;
using ssm_scan::SsdProblem;

// The scan's inputs over `rows` rows (B*S, or B for a step): x [rows, nheads * head_dim]
// float, dt [rows, nheads] and B, C [rows, ngroups * state_dim] in x's dtype and on its
// device, A_log, D, dt_bias [nheads] any float dtype; every size positive, ngroups
// dividing nheads.
void check_ssd(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
               const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& d,
               int64_t rows, const char* op) {
  MEGATON_CHECK(d.batch > 0 && d.seq > 0 && d.nheads > 0 && d.head_dim > 0 && d.ngroups > 0 &&
                    d.state_dim > 0 && d.chunk_size > 0 && d.nheads % d.ngroups == 0,
                "{}: dims batch {}, seq {}, nheads {}, head_dim {}, ngroups {}, state_dim {}, "
                "chunk_size {} must be positive, ngroups dividing nheads",
                op, d.batch, d.seq, d.nheads, d.head_dim, d.ngroups, d.state_dim, d.chunk_size);
  MEGATON_CHECK(x.defined() && ssm_detail::is_activation_dtype(x.dtype()),
                "{}: x must be an allocated float tensor", op);
  MEGATON_CHECK(x.shape() == Shape({rows, d.nheads * d.head_dim}),
                "{}: x is {}, expected [{}, nheads * head_dim = {}]", op, shape_str(x.shape()),
                rows, d.nheads * d.head_dim);
  check_like(dt, x, {rows, d.nheads}, op, "dt");
  check_like(B, x, {rows, d.ngroups * d.state_dim}, op, "B");
  check_like(C, x, {rows, d.ngroups * d.state_dim}, op, "C");
  check_vector(A_log, d.nheads, x.device(), op, "A_log");
  check_vector(D, d.nheads, x.device(), op, "D");
  check_vector(dt_bias, d.nheads, x.device(), op, "dt_bias");
}

// The backward's tensors besides the forward's inputs.
void check_ssd_grads(const Tensor& dy, const Tensor& x, const Tensor& dt, const Tensor& B,
                     const Tensor& C, const Tensor& dx, const Tensor& ddt, const Tensor& dB,
                     const Tensor& dC, const Tensor& dA_log_acc, const Tensor& dD_acc,
                     const Tensor& ddt_bias_acc, const SsdDims& d, const char* op) {
  check_like(dy, x, x.shape(), op, "dy");
  check_like(dx, x, x.shape(), op, "dx");
  check_like(ddt, x, dt.shape(), op, "ddt");
  check_like(dB, x, B.shape(), op, "dB");
  check_like(dC, x, C.shape(), op, "dC");
  check_f32(dA_log_acc, {d.nheads}, x.device(), op, "dA_log_acc");
  check_f32(dD_acc, {d.nheads}, x.device(), op, "dD_acc");
  check_f32(ddt_bias_acc, {d.nheads}, x.device(), op, "ddt_bias_acc");
}

std::vector<double> to_double(const Tensor& t) {
  const float* v = t.f32();
  return std::vector<double>(v, v + t.numel());
}

void store(const std::vector<double>& v, Tensor& t) {
  float* out = t.f32();
  for (size_t i = 0; i < v.size(); ++i) out[i] = float(v[i]);
}

// The CPU inputs in fp64 with softplus and -exp applied; `u` receives dt + dt_bias
// ([rows, nheads]) when given, for softplus's derivative.
SsdProblem make_problem(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
                        const Tensor& C, const Tensor& D, const Tensor& dt_bias,
                        const SsdDims& dims, const Tensor& position_ids,
                        std::vector<double>* u = nullptr) {
  SsdProblem p;
  p.dims = dims;
  p.x = to_double(x);
  p.B = to_double(B);
  p.C = to_double(C);
  p.D = ssm_detail::read_vector(D);
  p.A = ssm_detail::read_vector(A_log);
  for (double& a : p.A) a = -std::exp(a);
  const std::vector<double> bias = ssm_detail::read_vector(dt_bias);
  const int64_t rows = dims.batch * dims.seq, H = dims.nheads;
  p.delta.resize(size_t(rows * H));
  if (u) u->resize(p.delta.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const double biased = double(dt.f32()[r * H + h]) + bias[size_t(h)];
      p.delta[size_t(r * H + h)] = ssm_detail::softplus(biased);
      if (u) (*u)[size_t(r * H + h)] = biased;
    }
  // A document starts at each sample's first row and wherever position_ids is 0.
  p.document.assign(size_t(rows), 0);
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  for (int64_t r = 0; r < rows; ++r)
    if (r % dims.seq != 0)
      p.document[size_t(r)] = p.document[size_t(r - 1)] + (positions && positions[r] == 0);
  return p;
}

void check_final_state(const Tensor* final_state, const SsdDims& d, Device device, const char* op) {
  if (final_state)
    check_f32(*final_state, {d.batch, d.nheads, d.head_dim, d.state_dim}, device, op,
              "final_state");
}

// Writes the scan's gradients: ddt through softplus, the per-head ones added to their
// accumulators (d A / d A_log = A).
void store_grads(const SsdProblem& p, const SsdGrads& g, const std::vector<double>& u, Tensor& dx,
                 Tensor& ddt, Tensor& dB, Tensor& dC, Tensor& dA_log_acc, Tensor& dD_acc,
                 Tensor& ddt_bias_acc) {
  const int64_t H = p.dims.nheads, rows = p.dims.batch * p.dims.seq;
  std::vector<double> ddt_raw(u.size()), ddt_bias(size_t(H), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const size_t i = size_t(r * H + h);
      ddt_raw[i] = g.delta[i] * ssm_detail::softplus_grad(u[i]);
      ddt_bias[size_t(h)] += ddt_raw[i];
    }
  store(g.x, dx);
  store(ddt_raw, ddt);
  store(g.B, dB);
  store(g.C, dC);
  for (int64_t h = 0; h < H; ++h) {
    dA_log_acc.f32()[h] += float(g.A[size_t(h)] * p.A[size_t(h)]);
    dD_acc.f32()[h] += float(g.D[size_t(h)]);
    ddt_bias_acc.f32()[h] += float(ddt_bias[size_t(h)]);
  }
}

}  // namespace

void ssd_forward(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
                 const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
                 Tensor& y, const Tensor& position_ids, Tensor* final_state) {
  const char* op = "ssd_forward";
  check_ssd(x, dt, A_log, B, C, D, dt_bias, dims, dims.batch * dims.seq, op);
  check_like(y, x, x.shape(), op, "y");
  check_position_ids(op, position_ids, dims.batch * dims.seq, x.device());
  check_final_state(final_state, dims, x.device(), op);
  MEGATON_CUDA_DISPATCH(
      x, cuda::ssd_forward(x, dt, A_log, B, C, D, dt_bias, dims, y, position_ids, final_state));
  check_cpu(x, op);
  const SsdProblem p = make_problem(x, dt, A_log, B, C, D, dt_bias, dims, position_ids);
  std::vector<double> out, state;
  ssm_scan::chunked_forward(p, out, final_state ? &state : nullptr);
  store(out, y);
  if (final_state) store(state, *final_state);
}

void ssd_backward(const Tensor& dy, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                  const Tensor& B, const Tensor& C, const Tensor& D, const Tensor& dt_bias,
                  const SsdDims& dims, Tensor& dx, Tensor& ddt, Tensor& dB, Tensor& dC,
                  Tensor& dA_log_acc, Tensor& dD_acc, Tensor& ddt_bias_acc,
                  const Tensor& position_ids) {
  const char* op = "ssd_backward";
  check_ssd(x, dt, A_log, B, C, D, dt_bias, dims, dims.batch * dims.seq, op);
  check_ssd_grads(dy, x, dt, B, C, dx, ddt, dB, dC, dA_log_acc, dD_acc, ddt_bias_acc, dims, op);
  check_position_ids(op, position_ids, dims.batch * dims.seq, x.device());
  MEGATON_CUDA_DISPATCH(x, cuda::ssd_backward(dy, x, dt, A_log, B, C, D, dt_bias, dims, dx, ddt, dB,
                                              dC, dA_log_acc, dD_acc, ddt_bias_acc, position_ids));
  check_cpu(x, op);
  std::vector<double> u;
  const SsdProblem p = make_problem(x, dt, A_log, B, C, D, dt_bias, dims, position_ids, &u);
  SsdGrads g;
  ssm_scan::chunked_backward(p, to_double(dy), g);
  store_grads(p, g, u, dx, ddt, dB, dC, dA_log_acc, dD_acc, ddt_bias_acc);
}

void ssd_forward_recurrent(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
                           const Tensor& C, const Tensor& D, const Tensor& dt_bias,
                           const SsdDims& dims, Tensor& y, const Tensor& position_ids,
                           Tensor* final_state) {
  const char* op = "ssd_forward_recurrent";
  check_ssd(x, dt, A_log, B, C, D, dt_bias, dims, dims.batch * dims.seq, op);
  check_like(y, x, x.shape(), op, "y");
  check_position_ids(op, position_ids, dims.batch * dims.seq, x.device());
  check_final_state(final_state, dims, x.device(), op);
  check_cpu(x, op);
  const SsdProblem p = make_problem(x, dt, A_log, B, C, D, dt_bias, dims, position_ids);
  std::vector<double> out, state;
  ssm_scan::recurrent_forward(p, out, final_state ? &state : nullptr);
  store(out, y);
  if (final_state) store(state, *final_state);
}

void ssd_backward_recurrent(const Tensor& dy, const Tensor& x, const Tensor& dt,
                            const Tensor& A_log, const Tensor& B, const Tensor& C, const Tensor& D,
                            const Tensor& dt_bias, const SsdDims& dims, Tensor& dx, Tensor& ddt,
                            Tensor& dB, Tensor& dC, Tensor& dA_log_acc, Tensor& dD_acc,
                            Tensor& ddt_bias_acc, const Tensor& position_ids) {
  const char* op = "ssd_backward_recurrent";
  check_ssd(x, dt, A_log, B, C, D, dt_bias, dims, dims.batch * dims.seq, op);
  check_ssd_grads(dy, x, dt, B, C, dx, ddt, dB, dC, dA_log_acc, dD_acc, ddt_bias_acc, dims, op);
  check_position_ids(op, position_ids, dims.batch * dims.seq, x.device());
  check_cpu(x, op);
  std::vector<double> u;
  const SsdProblem p = make_problem(x, dt, A_log, B, C, D, dt_bias, dims, position_ids, &u);
  SsdGrads g;
  ssm_scan::recurrent_backward(p, to_double(dy), g);
  store_grads(p, g, u, dx, ddt, dB, dC, dA_log_acc, dD_acc, ddt_bias_acc);
}

void ssd_step(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
              const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
              Tensor& state, Tensor& y) {
  const char* op = "ssd_step";
  SsdDims one = dims;
  one.seq = 1;
  check_ssd(x, dt, A_log, B, C, D, dt_bias, one, dims.batch, op);
  check_f32(state, {dims.batch, dims.nheads, dims.head_dim, dims.state_dim}, x.device(), op,
            "state");
  check_like(y, x, x.shape(), op, "y");
  MEGATON_CUDA_DISPATCH(x, cuda::ssd_step(x, dt, A_log, B, C, D, dt_bias, dims, state, y));
  check_cpu(x, op);
  const SsdProblem p = make_problem(x, dt, A_log, B, C, D, dt_bias, one, Tensor());
  const int64_t H = dims.nheads, P = dims.head_dim, N = dims.state_dim;
  const int64_t GN = dims.ngroups * N, heads_per_group = H / dims.ngroups;
  std::vector<double> out(p.x.size());
  float* st = state.f32();
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const double delta = p.delta[size_t(b * H + h)];
      const double decay = std::exp(delta * p.A[size_t(h)]);
      const double* xs = p.x.data() + (b * H + h) * P;
      const double* bs = p.B.data() + b * GN + (h / heads_per_group) * N;
      const double* cs = p.C.data() + b * GN + (h / heads_per_group) * N;
      float* hs = st + (b * H + h) * P * N;
      for (int64_t i = 0; i < P; ++i) {
        double yi = p.D[size_t(h)] * xs[i];
        for (int64_t n = 0; n < N; ++n) {
          const double next = decay * hs[i * N + n] + delta * xs[i] * bs[n];
          hs[i * N + n] = float(next);
          yi += next * cs[n];
        }
        out[size_t((b * H + h) * P + i)] = yi;
      }
    }
  store(out, y);
}

}  // namespace megaton::ops
