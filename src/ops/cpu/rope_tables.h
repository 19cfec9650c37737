// RoPE cos/sin tables shared by the CPU rope and fused QKV ops.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace megaton::ops::cpu {

// cos and sin of angle(s, i) = float(s + position_offset) * inv_freq[i] (one fp32 multiply)
// for s < S and the inv_freq.size() frequencies, laid out [S, inv_freq.size()]; cos/sin of
// that fp32 angle are evaluated in double and rounded once (at position 4096 one fp32 ulp
// of the angle is ~5e-4, so matching the references' fp32 angle is what matters).
inline void rope_tables_from_inv_freq(int64_t S, const std::vector<float>& inv_freq,
                                      int64_t position_offset, std::vector<float>& cos_table,
                                      std::vector<float>& sin_table) {
  const int64_t half = int64_t(inv_freq.size());
  cos_table.resize(S * half);
  sin_table.resize(S * half);
  for (int64_t s = 0; s < S; ++s) {
    float pos = float(s + position_offset);
    for (int64_t i = 0; i < half; ++i) {
      float angle = pos * inv_freq[i];
      cos_table[s * half + i] = float(std::cos(double(angle)));
      sin_table[s * half + i] = float(std::sin(double(angle)));
    }
  }
}

// RoPE's frequencies computed as HF Llama (LlamaRotaryEmbedding) and Megatron
// (RotaryEmbedding) do in fp32: inv_freq_i = 1 / base^(float(2i) / D), i < D / 2. With
// partial RoPE D is the rotary dim (Megatron: int(kv_channels * rotary_percent)).
inline std::vector<float> rope_inv_freq(int64_t D, float base) {
  const int64_t half = D / 2;
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    float exponent = float(2 * i) / float(D);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
  return inv_freq;
}

// cos and sin of angle(s, i) for s < S, i < D/2, laid out [S, D/2], with rope_inv_freq's
// frequencies (rope_tables_from_inv_freq for the rest).
inline void rope_tables(int64_t S, int64_t D, float base, int64_t position_offset,
                        std::vector<float>& cos_table, std::vector<float>& sin_table) {
  rope_tables_from_inv_freq(S, rope_inv_freq(D, base), position_offset, cos_table, sin_table);
}

// The cos/sin rows of the B*S tokens of a fused op (token t = b * S + s): one row per
// position s < S shared by the B sequences, or, with per-token position ids (packed
// sequences), one row per token at position position_ids[t] + position_offset. The
// values are rope_tables_from_inv_freq's (the same fp32 angle and rounding).
struct RopeRows {
  std::vector<float> cos, sin;
  int64_t half = 0, seq = 1;
  bool per_token = false;
  const float* cos_at(int64_t t) const { return cos.data() + row(t) * half; }
  const float* sin_at(int64_t t) const { return sin.data() + row(t) * half; }
  int64_t row(int64_t t) const { return per_token ? t : t % seq; }
};

// position_ids: null (position s) or tokens values.
inline RopeRows rope_rows(const std::vector<float>& inv_freq, int64_t seq, int64_t tokens,
                          const int32_t* position_ids, int64_t position_offset = 0) {
  RopeRows r;
  r.half = int64_t(inv_freq.size());
  r.seq = seq > 0 ? seq : 1;
  if (!position_ids) {
    rope_tables_from_inv_freq(seq, inv_freq, position_offset, r.cos, r.sin);
    return r;
  }
  r.per_token = true;
  r.cos.resize(size_t(tokens * r.half));
  r.sin.resize(size_t(tokens * r.half));
  for (int64_t t = 0; t < tokens; ++t) {
    float pos = float(int64_t(position_ids[t]) + position_offset);
    for (int64_t i = 0; i < r.half; ++i) {
      float angle = pos * inv_freq[i];
      r.cos[t * r.half + i] = float(std::cos(double(angle)));
      r.sin[t * r.half + i] = float(std::sin(double(angle)));
    }
  }
  return r;
}

// One head of D values with its first rotary_dim channels rotated by sign * angle
// (rope.cpp's rope_apply: sign +1 forward, -1 backward; pairs (i, i + rotary_dim / 2)) with
// one position's cos_s / sin_s [rotary_dim / 2] and the channels [rotary_dim, D) copied
// (partial RoPE, Megatron's --rotary-percent); the whole head copied when cos_s is null:
// the fused QKV ops' per-head move (qkv.cpp, qkv_norm.cpp). rotary_dim even, <= D.
inline void rope_move_head(const float* in, float* out, int64_t D, const float* cos_s,
                           const float* sin_s, float sign, int64_t rotary_dim) {
  if (!cos_s) {
    std::memcpy(out, in, D * sizeof(float));
    return;
  }
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    float x1 = in[i], x2 = in[i + half];
    float si = sign * sin_s[i];
    out[i] = x1 * cos_s[i] - x2 * si;
    out[i + half] = x2 * cos_s[i] + x1 * si;
  }
  if (rotary_dim < D)
    std::memcpy(out + rotary_dim, in + rotary_dim, (D - rotary_dim) * sizeof(float));
}

}  // namespace megaton::ops::cpu
