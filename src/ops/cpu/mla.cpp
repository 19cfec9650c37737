// Multi-latent attention's data movement (ops/mla.h): the doors check the arguments, then
// run the CUDA kernels (ops/cuda/mla.cu) for device tensors or the fp32 reference here.
#include "ops/mla.h"

#include <cstring>
#include <vector>

#include "core/error.h"
#include "ops/cpu/rope_tables.h"
#include "ops/dispatch.h"
#include "ops/qkv_checks.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/mla.h"
#endif

namespace megaton::ops {
namespace {

const char* device_name(Device d) { return d == Device::CUDA ? "CUDA" : "CPU"; }

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

void check_same(const Tensor& t, const Tensor& ref, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} must be allocated", op, name);
  MEGATON_CHECK(t.dtype() == ref.dtype() && t.device() == ref.device(),
                "{}: {} is {} on {}, expected {} on {}", op, name, dtype_name(t.dtype()),
                device_name(t.device()), dtype_name(ref.dtype()), device_name(ref.device()));
}

// Columns of [R, C] tensors: every part has x's rows, the widths add up.
void check_columns(const Tensor& whole, const std::vector<Tensor>& parts, const char* op) {
  MEGATON_CHECK(whole.defined() && whole.ndim() == 2 && is_float(whole.dtype()),
                "{}: the whole tensor must be an allocated float [R, C]", op);
  MEGATON_CHECK(!parts.empty(), "{}: no parts", op);
  int64_t width = 0;
  for (const Tensor& p : parts) {
    check_same(p, whole, op, "a part");
    MEGATON_CHECK(p.ndim() == 2 && p.dim(0) == whole.dim(0),
                  "{}: part {} must have the whole's {} rows", op, shape_str(p.shape()),
                  whole.dim(0));
    width += p.dim(1);
  }
  MEGATON_CHECK(width == whole.dim(1), "{}: parts are {} columns wide, the whole {}", op, width,
                whole.dim(1));
}

// The MLA tensors' shapes, from q, kv and k_pe (forward) or their gradients (backward).
struct MlaDims {
  int64_t B, S, n, qk, rope, v;
};

MlaDims check_mla(const Tensor& q, const Tensor& kv, const Tensor& k_pe, const Tensor& query,
                  const Tensor& key, const Tensor& value, int64_t qk_head_dim,
                  const std::vector<float>& inv_freq, int64_t position_offset,
                  const Tensor& position_ids, const char* op) {
  MEGATON_CHECK(q.defined() && is_float(q.dtype()) && q.ndim() == 4,
                "{}: q must be an allocated float [B, S, n, qk + rope]", op);
  for (auto [t, name] : {std::pair{&kv, "kv"}, {&k_pe, "k_pe"}, {&query, "query"},
                         {&key, "key"}, {&value, "value"}})
    check_same(*t, q, op, name);
  const int64_t B = q.dim(0), S = q.dim(1), n = q.dim(2), rope = k_pe.ndim() == 3 ? k_pe.dim(2) : -1;
  const int64_t qk = qk_head_dim, v = kv.ndim() == 4 ? kv.dim(3) - qk : -1;
  MEGATON_CHECK(qk > 0 && rope > 0 && rope % 2 == 0 && v > 0 && q.dim(3) == qk + rope &&
                    int64_t(inv_freq.size()) == rope / 2 && rope / 2 <= 256,
                "{}: q {} with kv {}, k_pe {}, qk_head_dim {} and {} frequencies do not make "
                "MLA's [B, S, n, qk + rope] / [B, S, n, qk + v] / [B, S, rope] (rope even, at "
                "most 512)",
                op, shape_str(q.shape()), shape_str(kv.shape()), shape_str(k_pe.shape()), qk,
                inv_freq.size());
  const Shape qk_shape{B, S, n, qk + rope};
  MEGATON_CHECK(kv.shape() == Shape({B, S, n, qk + v}) && k_pe.shape() == Shape({B, S, rope}) &&
                    query.shape() == qk_shape && key.shape() == qk_shape &&
                    value.shape() == Shape({B, S, n, v}),
                "{}: shapes q {}, kv {}, k_pe {}, query {}, key {}, value {} do not agree", op,
                shape_str(q.shape()), shape_str(kv.shape()), shape_str(k_pe.shape()),
                shape_str(query.shape()), shape_str(key.shape()), shape_str(value.shape()));
  MEGATON_CHECK(position_offset >= 0, "{}: position_offset {} must be >= 0", op,
                position_offset);
  check_position_ids(op, position_ids, B * S, q.device());
  return {B, S, n, qk, rope, v};
}

void check_cpu(const Tensor& t, const char* op) {
  MEGATON_CHECK(t.device() == Device::CPU && t.dtype() == DType::F32,
                "{}: the CPU backend takes F32 CPU tensors, got {} on {}", op,
                dtype_name(t.dtype()), device_name(t.device()));
}

}  // namespace

void split_columns(const Tensor& x, std::vector<Tensor>& parts) {
  check_columns(x, parts, "split_columns");
  MEGATON_CUDA_DISPATCH(x, cuda::split_columns(x, parts));
  check_cpu(x, "split_columns");
  const int64_t R = x.dim(0), C = x.dim(1);
  int64_t at = 0;
  for (Tensor& p : parts) {
    const int64_t w = p.dim(1);
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(p.f32() + r * w, x.f32() + r * C + at, size_t(w) * sizeof(float));
    at += w;
  }
}

void concat_columns(const std::vector<Tensor>& parts, Tensor& y) {
  check_columns(y, parts, "concat_columns");
  MEGATON_CUDA_DISPATCH(y, cuda::concat_columns(parts, y));
  check_cpu(y, "concat_columns");
  const int64_t R = y.dim(0), C = y.dim(1);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    const int64_t w = p.dim(1);
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(y.f32() + r * C + at, p.f32() + r * w, size_t(w) * sizeof(float));
    at += w;
  }
}

void mla_qkv_rope(const Tensor& q, const Tensor& kv, const Tensor& k_pe, int64_t qk_head_dim,
                  const std::vector<float>& inv_freq, float rope_scale, Tensor& query, Tensor& key,
                  Tensor& value, int64_t position_offset, const Tensor& position_ids) {
  const MlaDims d = check_mla(q, kv, k_pe, query, key, value, qk_head_dim, inv_freq,
                              position_offset, position_ids, "mla_qkv_rope");
  MEGATON_CUDA_DISPATCH(q, cuda::mla_qkv_rope(q, kv, k_pe, qk_head_dim, inv_freq, rope_scale, query,
                                              key, value, position_offset, position_ids));
  check_cpu(q, "mla_qkv_rope");
  const cpu::RopeRows table =
      cpu::rope_rows(inv_freq, d.S, d.B * d.S,
                     position_ids.defined() ? position_ids.i32() : nullptr, position_offset);
  const int64_t half = d.rope / 2, dq = d.qk + d.rope, dkv = d.qk + d.v;
  // Interleaved pairs (x[2j], x[2j+1]) rotated and left de-interleaved (ops/rope_interleaved.h).
  auto rotate = [&](const float* x, float* y, const float* c, const float* sn) {
    for (int64_t j = 0; j < half; ++j) {
      const float a = x[2 * j], e = x[2 * j + 1];
      y[j] = rope_scale * (a * c[j] - e * sn[j]);
      y[j + half] = rope_scale * (e * c[j] + a * sn[j]);
    }
  };
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t s = 0; s < d.S; ++s) {
      const int64_t row = b * d.S + s;
      const float *c = table.cos_at(row), *sn = table.sin_at(row);
      std::vector<float> k_rot(size_t(d.rope));
      rotate(k_pe.f32() + row * d.rope, k_rot.data(), c, sn);
      for (int64_t h = 0; h < d.n; ++h) {
        const int64_t head = row * d.n + h;
        const float* qh = q.f32() + head * dq;
        const float* kvh = kv.f32() + head * dkv;
        float* out_q = query.f32() + head * dq;
        float* out_k = key.f32() + head * dq;
        std::memcpy(out_q, qh, size_t(d.qk) * sizeof(float));
        rotate(qh + d.qk, out_q + d.qk, c, sn);
        std::memcpy(out_k, kvh, size_t(d.qk) * sizeof(float));
        std::memcpy(out_k + d.qk, k_rot.data(), size_t(d.rope) * sizeof(float));
        std::memcpy(value.f32() + head * d.v, kvh + d.qk, size_t(d.v) * sizeof(float));
      }
    }
}

void mla_qkv_rope_backward(const Tensor& dquery, const Tensor& dkey, const Tensor& dvalue,
                           int64_t qk_head_dim, const std::vector<float>& inv_freq,
                           float rope_scale, Tensor& dq, Tensor& dkv, Tensor& dk_pe,
                           int64_t position_offset, const Tensor& position_ids) {
  // The forward's check with the roles of inputs and outputs swapped.
  const MlaDims d = check_mla(dq, dkv, dk_pe, dquery, dkey, dvalue, qk_head_dim, inv_freq,
                              position_offset, position_ids, "mla_qkv_rope_backward");
  MEGATON_CUDA_DISPATCH(
      dquery, cuda::mla_qkv_rope_backward(dquery, dkey, dvalue, qk_head_dim, inv_freq, rope_scale,
                                          dq, dkv, dk_pe, position_offset, position_ids));
  check_cpu(dquery, "mla_qkv_rope_backward");
  const cpu::RopeRows table =
      cpu::rope_rows(inv_freq, d.S, d.B * d.S,
                     position_ids.defined() ? position_ids.i32() : nullptr, position_offset);
  const int64_t half = d.rope / 2, dqw = d.qk + d.rope, dkvw = d.qk + d.v;
  // The rotation's transpose, added into dx (re-interleaving the pairs).
  auto unrotate_add = [&](const float* g, float* dx, const float* c, const float* sn) {
    for (int64_t j = 0; j < half; ++j) {
      const float g1 = g[j], g2 = g[j + half];
      dx[2 * j] += rope_scale * (g1 * c[j] + g2 * sn[j]);
      dx[2 * j + 1] += rope_scale * (g2 * c[j] - g1 * sn[j]);
    }
  };
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t s = 0; s < d.S; ++s) {
      const int64_t row = b * d.S + s;
      const float *c = table.cos_at(row), *sn = table.sin_at(row);
      // The key's RoPE part was shared by the heads: its gradient is their sum, taken
      // before the (linear) inverse rotation.
      std::vector<float> g_sum(size_t(d.rope), 0.0f), dk_row(size_t(d.rope), 0.0f);
      for (int64_t h = 0; h < d.n; ++h) {
        const int64_t head = row * d.n + h;
        const float* gq = dquery.f32() + head * dqw;
        const float* gk = dkey.f32() + head * dqw;
        float* dqh = dq.f32() + head * dqw;
        float* dkvh = dkv.f32() + head * dkvw;
        std::memcpy(dqh, gq, size_t(d.qk) * sizeof(float));
        std::fill(dqh + d.qk, dqh + dqw, 0.0f);
        unrotate_add(gq + d.qk, dqh + d.qk, c, sn);
        std::memcpy(dkvh, gk, size_t(d.qk) * sizeof(float));
        std::memcpy(dkvh + d.qk, dvalue.f32() + head * d.v, size_t(d.v) * sizeof(float));
        for (int64_t i = 0; i < d.rope; ++i) g_sum[size_t(i)] += gk[d.qk + i];
      }
      unrotate_add(g_sum.data(), dk_row.data(), c, sn);
      std::memcpy(dk_pe.f32() + row * d.rope, dk_row.data(), size_t(d.rope) * sizeof(float));
    }
}

}  // namespace megaton::ops
