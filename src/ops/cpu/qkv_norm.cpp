// Fused QKV split + q/k norm (--qk-layernorm) + RoPE, and its gradient; CPU reference.
//
// The expressions are those of the unfused ops the fusion replaces, so that the results
// are theirs: the grouped layout walk of ops/cpu/qkv.cpp, the row norms of
// ops/cpu/norm.cpp (statistics and arithmetic in fp64, outputs rounded to fp32), the
// rotation of ops/cpu/rope.cpp (fp32) with the tables of rope_tables.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ops/cpu/rope_tables.h"
#include "ops/cpu/norm_weight_grads.h"
#include "ops/dispatch.h"
#include "ops/norm_checks.h"
#include "ops/ops.h"
#include "ops/qkv_checks.h"

namespace megaton::ops {
namespace {

// Below this many packed elements the loops run on the calling thread (as in qkv.cpp).
constexpr int64_t kParallelMin = int64_t(1) << 15;

void check_f32(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} must be allocated", op, name);
  MEGATON_CHECK(t.device() == Device::CPU, "{}: {} is on the GPU; only the CPU backend is built",
                op, name);
  MEGATON_CHECK(t.dtype() == DType::F32, "{}: {} must be F32, got {}", op, name,
                dtype_name(t.dtype()));
}

void check_f32_shape(const Tensor& t, const Shape& want, const char* op, const char* name) {
  check_f32(t, op, name);
  MEGATON_CHECK(t.shape() == want, "{}: {} has shape {}, expected {}", op, name,
                shape_str(t.shape()), shape_str(want));
}

// The norms' parameters: F32 [d] weights, biases for LayerNorm only, both or neither.
void check_norm(const QkNorm& norm, int64_t d, const char* op) {
  check_f32_shape(norm.q_weight, {d}, op, "q_weight");
  check_f32_shape(norm.k_weight, {d}, op, "k_weight");
  MEGATON_CHECK(norm.q_bias.defined() == norm.k_bias.defined(),
                "{}: q_bias and k_bias must be both defined or both undefined", op);
  if (norm.q_bias.defined()) {
    MEGATON_CHECK(norm.type == QkNormType::LayerNorm, "{}: RMSNorm takes no bias", op);
    check_f32_shape(norm.q_bias, {d}, op, "q_bias");
    check_f32_shape(norm.k_bias, {d}, op, "k_bias");
  }
}

// The saved split heads (F32, q's and k's shapes) and per-row statistics (F32 [rows]).
void check_saved(const QkNormSaved& saved, const QkvShape& sh, QkNormType type, const char* op) {
  check_f32_shape(saved.q_input, {sh.batch, sh.seq, sh.heads, sh.head_dim}, op, "q_input");
  check_f32_shape(saved.k_input, {sh.batch, sh.seq, sh.groups, sh.head_dim}, op, "k_input");
  const Shape q_rows{sh.tokens() * sh.heads}, k_rows{sh.tokens() * sh.groups};
  check_f32_shape(saved.q_rstd, q_rows, op, "q_rstd");
  check_f32_shape(saved.k_rstd, k_rows, op, "k_rstd");
  if (type == QkNormType::LayerNorm) {
    check_f32_shape(saved.q_mean, q_rows, op, "q_mean");
    check_f32_shape(saved.k_mean, k_rows, op, "k_mean");
  }
}

// Door checks shared by both directions; `grad` prefixes the names of qkv, q, k, v in
// messages ("" forward, "d" backward).
QkvShape check_args(const char* op, const char* grad, const Tensor& packed, const Tensor& q,
                    const Tensor& k, const Tensor& v, const QkNormSaved& saved,
                    int64_t num_query_groups, const QkNorm& norm, bool apply_rope,
                    float rotary_base, int64_t rotary_dim) {
  const std::string g(grad);
  check_f32(packed, op, (g + "qkv").c_str());
  check_f32(q, op, (g + "q").c_str());
  check_f32(k, op, (g + "k").c_str());
  check_f32(v, op, (g + "v").c_str());
  const QkvShape sh = check_qkv_shapes(op, grad, packed, q, k, v, num_query_groups, apply_rope,
                                      rotary_base, rotary_dim);
  check_norm(norm, sh.head_dim, op);
  check_saved(saved, sh, norm.type, op);
  return sh;
}

// `written` must share memory with none of `read` nor with each other.
void check_apart(const std::vector<const Tensor*>& written, const std::vector<const Tensor*>& read,
                 const char* op) {
  for (size_t w = 0; w < written.size(); ++w) {
    for (const Tensor* r : read)
      MEGATON_CHECK(!detail::overlaps(*written[w], *r), "{}: an output shares memory with an input",
                    op);
    for (size_t other = w + 1; other < written.size(); ++other)
      MEGATON_CHECK(!detail::overlaps(*written[w], *written[other]), "{}: two outputs share memory",
                    op);
  }
}

// One row of D values, norm.cpp's cpu::rmsnorm_forward (mean == nullptr) or
// cpu::layernorm_forward for that row.
void norm_row_forward(const float* x, const float* weight, const float* bias, float eps, float* y,
                      float* mean, float* rstd, int64_t D) {
  if (mean == nullptr) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += double(x[j]) * x[j];
    double r = 1.0 / std::sqrt(ss / double(D) + double(eps));
    for (int64_t j = 0; j < D; ++j) y[j] = float(x[j] * r * weight[j]);
    *rstd = float(r);
    return;
  }
  double s = 0;
  for (int64_t j = 0; j < D; ++j) s += x[j];
  double mu = s / double(D), var = 0;
  for (int64_t j = 0; j < D; ++j) var += (x[j] - mu) * (x[j] - mu);
  double r = 1.0 / std::sqrt(var / double(D) + double(eps));
  for (int64_t j = 0; j < D; ++j)
    y[j] = float((x[j] - mu) * r * weight[j] + (bias ? bias[j] : 0.0f));
  *mean = float(mu);
  *rstd = float(r);
}

// norm.cpp's cpu::rmsnorm_backward (mean == nullptr) / layernorm_backward dx of one row.
void norm_row_backward(const float* dy, const float* x, const float* weight, const float* mean,
                       float rstd, float* dx, int64_t D) {
  if (mean == nullptr) {
    double r = rstd, gx = 0;
    for (int64_t j = 0; j < D; ++j) gx += double(dy[j]) * weight[j] * x[j];
    double c = r * r * gx / double(D);
    for (int64_t j = 0; j < D; ++j) dx[j] = float(r * (double(dy[j]) * weight[j] - x[j] * c));
    return;
  }
  double mu = *mean, r = rstd, g_sum = 0, gx_sum = 0;
  for (int64_t j = 0; j < D; ++j) {
    double g = double(dy[j]) * weight[j];
    g_sum += g;
    gx_sum += g * ((x[j] - mu) * r);
  }
  double g_mean = g_sum / double(D), gx_mean = gx_sum / double(D);
  for (int64_t j = 0; j < D; ++j) {
    double g = double(dy[j]) * weight[j], xhat = (x[j] - mu) * r;
    dx[j] = float(r * (g - g_mean - xhat * gx_mean));
  }
}



// A head of the packed row: part 0 q, 1 k, 2 v; separate = its element offset in q, k or
// v (offset / D is its norm row for q and k).
struct Head {
  int64_t packed;
  int part;
  int64_t separate;
};

// Walks the grouped layout (qkv.cpp's for_each_head): for every token t, calls
// visit(t, head) for each head of its packed row, in the packed order. Tokens run in
// parallel; `visit` gets a per-thread scratch of D floats.
template <typename Visit>
void for_each_head(const QkvShape& sh, Visit&& visit) {
  const int64_t D = sh.head_dim, qpg = sh.heads_per_group();
#pragma omp parallel if (sh.tokens() * sh.row() >= kParallelMin)
  {
    std::vector<float> scratch(D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < sh.tokens(); ++t) {
      for (int64_t g = 0; g < sh.groups; ++g) {
        const int64_t group = t * sh.row() + g * (qpg + 2) * D;
        for (int64_t j = 0; j < qpg; ++j)
          visit(t, Head{group + j * D, 0, (t * sh.heads + g * qpg + j) * D}, scratch.data());
        visit(t, Head{group + qpg * D, 1, (t * sh.groups + g) * D}, scratch.data());
        visit(t, Head{group + (qpg + 1) * D, 2, (t * sh.groups + g) * D}, scratch.data());
      }
    }
  }
}

const float* f32_or_null(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

// The tokens' cos/sin rows (position s, or position_ids[t]; sh.rotary_dim / 2 frequencies
// over the rotary dim); empty without RoPE.
cpu::RopeRows rope_rows(const QkvShape& sh, bool apply_rope, float rotary_base,
                        const Tensor& position_ids) {
  if (!apply_rope) return {};
  return cpu::rope_rows(cpu::rope_inv_freq(sh.rotary_dim, rotary_base), sh.seq, sh.tokens(),
                        position_ids.defined() ? position_ids.i32() : nullptr);
}

}  // namespace

void qkv_split_norm_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups,
                         const QkNorm& norm, bool apply_rope, float rotary_base, Tensor& q,
                         Tensor& k, Tensor& v, QkNormSaved& saved, const Tensor& position_ids,
                         int64_t rotary_dim) {
  MEGATON_CUDA_DISPATCH(
      qkv, cuda::qkv_split_norm_rope(qkv, batch, num_query_groups, norm, apply_rope, rotary_base, q,
                                     k, v, saved, position_ids, rotary_dim));
  const char* op = "qkv_split_norm_rope";
  const QkvShape sh = check_args(op, "", qkv, q, k, v, saved, num_query_groups, norm, apply_rope,
                                 rotary_base, rotary_dim);
  check_position_ids(op, position_ids, sh.tokens(), Device::CPU);
  MEGATON_CHECK(batch == sh.batch, "{}: batch {} does not match q {}", op, batch,
                shape_str(q.shape()));
  const bool layernorm = norm.type == QkNormType::LayerNorm;
  std::vector<const Tensor*> written{
      &q, &k, &v, &saved.q_input, &saved.k_input, &saved.q_rstd, &saved.k_rstd};
  if (layernorm) written.insert(written.end(), {&saved.q_mean, &saved.k_mean});
  check_apart(written, {&qkv}, op);

  const int64_t D = sh.head_dim;
  const cpu::RopeRows rope = rope_rows(sh, apply_rope, rotary_base, position_ids);
  const float* src = qkv.f32();
  float* out[3] = {q.f32(), k.f32(), v.f32()};
  float* input[2] = {saved.q_input.f32(), saved.k_input.f32()};
  const float* weight[2] = {norm.q_weight.f32(), norm.k_weight.f32()};
  const float* bias[2] = {f32_or_null(norm.q_bias), f32_or_null(norm.k_bias)};
  float* mean[2] = {layernorm ? saved.q_mean.f32() : nullptr,
                    layernorm ? saved.k_mean.f32() : nullptr};
  float* rstd[2] = {saved.q_rstd.f32(), saved.k_rstd.f32()};
  for_each_head(sh, [&](int64_t t, const Head& h, float* y) {
    if (h.part == 2) {
      std::memcpy(out[2] + h.separate, src + h.packed, D * sizeof(float));
      return;
    }
    const int p = h.part;
    const int64_t row = h.separate / D;
    float* x = input[p] + h.separate;
    std::memcpy(x, src + h.packed, D * sizeof(float));
    norm_row_forward(x, weight[p], bias[p], norm.eps, y, mean[p] ? mean[p] + row : nullptr,
                     rstd[p] + row, D);
    cpu::rope_move_head(y, out[p] + h.separate, D, apply_rope ? rope.cos_at(t) : nullptr,
                        apply_rope ? rope.sin_at(t) : nullptr, 1.0f, sh.rotary_dim);
  });
}

void qkv_pack_norm_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                 const QkNormSaved& saved, int64_t num_query_groups,
                                 const QkNorm& norm, bool apply_rope, float rotary_base,
                                 Tensor& dqkv, QkNormGrads& grads, const Tensor& position_ids,
                                 int64_t rotary_dim) {
  MEGATON_CUDA_DISPATCH(
      dq, cuda::qkv_pack_norm_rope_backward(dq, dk, dv, saved, num_query_groups, norm, apply_rope,
                                            rotary_base, dqkv, grads, position_ids, rotary_dim));
  const char* op = "qkv_pack_norm_rope_backward";
  const QkvShape sh = check_args(op, "d", dqkv, dq, dk, dv, saved, num_query_groups, norm,
                                 apply_rope, rotary_base, rotary_dim);
  check_position_ids(op, position_ids, sh.tokens(), Device::CPU);
  const int64_t D = sh.head_dim;
  const bool layernorm = norm.type == QkNormType::LayerNorm;
  check_f32_shape(grads.q_weight, {D}, op, "grads.q_weight");
  check_f32_shape(grads.k_weight, {D}, op, "grads.k_weight");
  MEGATON_CHECK(grads.q_bias.defined() == grads.k_bias.defined(),
                "{}: grads.q_bias and grads.k_bias must be both defined or both undefined", op);
  if (grads.q_bias.defined()) {
    MEGATON_CHECK(norm.q_bias.defined(), "{}: bias gradients of a norm without a bias", op);
    check_f32_shape(grads.q_bias, {D}, op, "grads.q_bias");
    check_f32_shape(grads.k_bias, {D}, op, "grads.k_bias");
  }
  check_apart({&dqkv}, {&dq, &dk, &dv, &saved.q_input, &saved.k_input}, op);

  // The un-rotated gradients of the q and k rows (rope_backward's values), kept whole:
  // the weight gradients below read them again in their own (row) order.
  std::vector<float> dq_rows, dk_rows;
  const float* dy[2] = {dq.f32(), dk.f32()};
  if (apply_rope) {
    const cpu::RopeRows rope = rope_rows(sh, true, rotary_base, position_ids);
    dq_rows.resize(dq.numel());
    dk_rows.resize(dk.numel());
    float* rows[2] = {dq_rows.data(), dk_rows.data()};
    for_each_head(sh, [&](int64_t t, const Head& h, float*) {
      if (h.part == 2) return;
      cpu::rope_move_head(dy[h.part] + h.separate, rows[h.part] + h.separate, D, rope.cos_at(t),
                          rope.sin_at(t), -1.0f, sh.rotary_dim);
    });
    dy[0] = dq_rows.data();
    dy[1] = dk_rows.data();
  }

  const float* x[2] = {saved.q_input.f32(), saved.k_input.f32()};
  const float* weight[2] = {norm.q_weight.f32(), norm.k_weight.f32()};
  const float* mean[2] = {layernorm ? saved.q_mean.f32() : nullptr,
                          layernorm ? saved.k_mean.f32() : nullptr};
  const float* rstd[2] = {saved.q_rstd.f32(), saved.k_rstd.f32()};
  const float* dv_data = dv.f32();
  float* dst = dqkv.f32();
  for_each_head(sh, [&](int64_t, const Head& h, float*) {
    if (h.part == 2) {
      std::memcpy(dst + h.packed, dv_data + h.separate, D * sizeof(float));
      return;
    }
    const int p = h.part;
    const int64_t row = h.separate / D;
    norm_row_backward(dy[p] + h.separate, x[p] + h.separate, weight[p],
                      mean[p] ? mean[p] + row : nullptr, rstd[p][row], dst + h.packed, D);
  });

  float* dbias[2] = {grads.q_bias.defined() ? grads.q_bias.f32() : nullptr,
                     grads.k_bias.defined() ? grads.k_bias.f32() : nullptr};
  norm_math::weight_grads(dy[0], x[0], mean[0], rstd[0], grads.q_weight.f32(), dbias[0],
               sh.tokens() * sh.heads, D);
  norm_math::weight_grads(dy[1], x[1], mean[1], rstd[1], grads.k_weight.f32(), dbias[1],
               sh.tokens() * sh.groups, D);
}

}  // namespace megaton::ops
