// Mamba-2's causal depthwise convolution (ops/ssm.h): the doors check the arguments, then
// run the CUDA kernels (ops/cuda/ssm_conv.cu) for device tensors or the fp32 reference
// here (sums in fp64).
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "ops/cpu/ssm_checks.h"
#include "ops/dispatch.h"
#include "ops/qkv_checks.h"
#include "ops/ssm.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/ssm.h"
#endif

namespace megaton::ops {
namespace {

using ssm_detail::check_cpu;
using ssm_detail::check_f32;
using ssm_detail::check_like;

struct ConvDims {
  int64_t batch, seq, channels, width;
};

// x [B*S, C] with weight [C, K], bias [C] in x's dtype and on its device; position_ids
// undefined or I32 [B*S].
ConvDims check_conv(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t batch,
                    const Tensor& position_ids, const char* op) {
  MEGATON_CHECK(x.defined() && ssm_detail::is_activation_dtype(x.dtype()) && x.ndim() == 2,
                "{}: x must be an allocated float [B*S, C]", op);
  MEGATON_CHECK(batch > 0 && x.dim(0) % batch == 0 && x.dim(0) > 0,
                "{}: x has {} rows, not a positive multiple of batch {}", op, x.dim(0), batch);
  const int64_t C = x.dim(1), K = weight.ndim() == 2 ? weight.dim(1) : 0;
  MEGATON_CHECK(K > 0, "{}: weight must be [C, K], got {}", op, shape_str(weight.shape()));
  check_like(weight, x, {C, K}, op, "weight");
  check_like(bias, x, {C}, op, "bias");
  check_position_ids(op, position_ids, x.dim(0), x.device());
  return {batch, x.dim(0) / batch, C, K};
}

// Taps k of row s (position p in its document) read row s - (K-1) + k when that row is
// in the sample and in the document: k >= first_tap.
int64_t first_tap(const ConvDims& d, const int32_t* positions, int64_t row, int64_t s) {
  const int64_t back = positions ? std::min<int64_t>(positions[row], s) : s;
  return std::max<int64_t>(0, d.width - 1 - back);
}

}  // namespace

void causal_conv1d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t batch,
                           bool silu, Tensor& y, const Tensor& position_ids) {
  const char* op = "causal_conv1d_forward";
  const ConvDims d = check_conv(x, weight, bias, batch, position_ids, op);
  check_like(y, x, x.shape(), op, "y");
  MEGATON_CUDA_DISPATCH(x,
                        cuda::causal_conv1d_forward(x, weight, bias, batch, silu, y, position_ids));
  check_cpu(x, op);
  const float *xs = x.f32(), *w = weight.f32(), *bs = bias.f32();
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  std::vector<double> out(static_cast<size_t>(d.batch * d.seq * d.channels));
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t s = 0; s < d.seq; ++s) {
      const int64_t row = b * d.seq + s, k0 = first_tap(d, positions, row, s);
      for (int64_t c = 0; c < d.channels; ++c) {
        double pre = bs[c];
        for (int64_t k = k0; k < d.width; ++k)
          pre += double(w[c * d.width + k]) * xs[(row - (d.width - 1) + k) * d.channels + c];
        out[size_t(row * d.channels + c)] = silu ? ssm_detail::silu(pre) : pre;
      }
    }
  float* ys = y.f32();
  for (size_t i = 0; i < out.size(); ++i) ys[i] = float(out[i]);
}

void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                            const Tensor& bias, int64_t batch, bool silu, Tensor& dx,
                            Tensor& dweight_acc, Tensor& dbias_acc, const Tensor& position_ids) {
  const char* op = "causal_conv1d_backward";
  const ConvDims d = check_conv(x, weight, bias, batch, position_ids, op);
  check_like(dy, x, x.shape(), op, "dy");
  check_like(dx, x, x.shape(), op, "dx");
  check_f32(dweight_acc, weight.shape(), x.device(), op, "dweight_acc");
  check_f32(dbias_acc, bias.shape(), x.device(), op, "dbias_acc");
  MEGATON_CUDA_DISPATCH(x, cuda::causal_conv1d_backward(dy, x, weight, bias, batch, silu, dx,
                                                        dweight_acc, dbias_acc, position_ids));
  check_cpu(x, op);
  const float *xs = x.f32(), *dys = dy.f32(), *w = weight.f32(), *bs = bias.f32();
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  std::vector<double> dxs(size_t(d.batch * d.seq * d.channels), 0.0);
  std::vector<double> dw(size_t(d.channels * d.width), 0.0), db(size_t(d.channels), 0.0);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t s = 0; s < d.seq; ++s) {
      const int64_t row = b * d.seq + s, k0 = first_tap(d, positions, row, s);
      const int64_t tap_row0 = row - (d.width - 1);
      for (int64_t c = 0; c < d.channels; ++c) {
        double dpre = dys[row * d.channels + c];
        if (silu) {  // the pre-activation again, for SiLU's derivative
          double pre = bs[c];
          for (int64_t k = k0; k < d.width; ++k)
            pre += double(w[c * d.width + k]) * xs[(tap_row0 + k) * d.channels + c];
          dpre *= ssm_detail::silu_grad(pre);
        }
        db[size_t(c)] += dpre;
        for (int64_t k = k0; k < d.width; ++k) {
          const int64_t at = (tap_row0 + k) * d.channels + c;
          dw[size_t(c * d.width + k)] += dpre * xs[at];
          dxs[size_t(at)] += dpre * w[c * d.width + k];
        }
      }
    }
  float *dxo = dx.f32(), *dwa = dweight_acc.f32(), *dba = dbias_acc.f32();
  for (size_t i = 0; i < dxs.size(); ++i) dxo[i] = float(dxs[i]);
  for (size_t i = 0; i < dw.size(); ++i) dwa[i] += float(dw[i]);
  for (size_t i = 0; i < db.size(); ++i) dba[i] += float(db[i]);
}

void causal_conv1d_step(const Tensor& x, const Tensor& weight, const Tensor& bias, bool silu,
                        Tensor& conv_state, Tensor& y) {
  const char* op = "causal_conv1d_step";
  const ConvDims d = check_conv(x, weight, bias, x.ndim() == 2 ? x.dim(0) : 1, Tensor(), op);
  const int64_t B = d.batch, C = d.channels, K = d.width;
  check_like(conv_state, x, {B, K - 1, C}, op, "conv_state");
  check_like(y, x, x.shape(), op, "y");
  MEGATON_CUDA_DISPATCH(x, cuda::causal_conv1d_step(x, weight, bias, silu, conv_state, y));
  check_cpu(x, op);
  const float *xs = x.f32(), *w = weight.f32(), *bs = bias.f32();
  float* state = K > 1 ? conv_state.f32() : nullptr;
  float* ys = y.f32();
  for (int64_t b = 0; b < B; ++b) {
    float* st = state ? state + b * (K - 1) * C : nullptr;
    for (int64_t c = 0; c < C; ++c) {
      double pre = double(bs[c]) + double(w[c * K + K - 1]) * xs[b * C + c];
      for (int64_t k = 0; k + 1 < K; ++k) pre += double(w[c * K + k]) * st[k * C + c];
      // The state is shifted after the read, so x and y may share memory.
      const float xv = xs[b * C + c];
      ys[b * C + c] = float(silu ? ssm_detail::silu(pre) : pre);
      for (int64_t k = 0; k + 2 < K; ++k) st[k * C + c] = st[(k + 1) * C + c];
      if (K > 1) st[(K - 2) * C + c] = xv;
    }
  }
}

void causal_conv1d_final_state(const Tensor& x, int64_t batch, Tensor& conv_state) {
  const char* op = "causal_conv1d_final_state";
  MEGATON_CHECK(x.defined() && ssm_detail::is_activation_dtype(x.dtype()) && x.ndim() == 2,
                "{}: x must be an allocated float [B*S, C]", op);
  MEGATON_CHECK(batch > 0 && x.dim(0) % batch == 0 && x.dim(0) > 0,
                "{}: x has {} rows, not a positive multiple of batch {}", op, x.dim(0), batch);
  MEGATON_CHECK(conv_state.ndim() == 3, "{}: conv_state must be [B, K-1, C], got {}", op,
                shape_str(conv_state.shape()));
  const int64_t S = x.dim(0) / batch, C = x.dim(1), keep = conv_state.dim(1);
  check_like(conv_state, x, {batch, keep, C}, op, "conv_state");
  MEGATON_CUDA_DISPATCH(x, cuda::causal_conv1d_final_state(x, batch, conv_state));
  check_cpu(x, op);
  if (keep == 0) return;
  const float* xs = x.f32();
  float* st = conv_state.f32();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < keep; ++j) {
      const int64_t s = S - keep + j;  // the sample's row held in state row j
      for (int64_t c = 0; c < C; ++c)
        st[(b * keep + j) * C + c] = s >= 0 ? xs[(b * S + s) * C + c] : 0.0f;
    }
}

}  // namespace megaton::ops
