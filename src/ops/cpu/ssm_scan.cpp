// The CPU reference of Mamba-2's selective scan in fp64 (ops/cpu/ssm_scan.h): the chunked
// SSD form and the recurrence, forward and backward. One (sample, head) at a time; the
// samples run in parallel, each writing only its own rows.
#include "ops/cpu/ssm_scan.h"

#include <algorithm>
#include <cmath>

namespace megaton::ops::ssm_scan {
namespace {

// Below this many multiply-adds a call runs on the calling thread.
constexpr int64_t kParallelMinWork = int64_t(1) << 16;

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One (sample, head) of a problem: pointers to row s's vectors and the offsets of its
// gradients. State matrices are [head_dim, state_dim], row-major.
struct HeadSlice {
  const SsdProblem& p;
  int64_t b, h, g, P, N;
  HeadSlice(const SsdProblem& problem, int64_t sample, int64_t head)
      : p(problem),
        b(sample),
        h(head),
        g(head / (problem.dims.nheads / problem.dims.ngroups)),
        P(problem.dims.head_dim),
        N(problem.dims.state_dim) {}
  int64_t row(int64_t s) const { return b * p.dims.seq + s; }
  int64_t x_at(int64_t s) const { return (row(s) * p.dims.nheads + h) * P; }
  int64_t bc_at(int64_t s) const { return (row(s) * p.dims.ngroups + g) * N; }
  int64_t head_at(int64_t s) const { return row(s) * p.dims.nheads + h; }
  const double* x(int64_t s) const { return p.x.data() + x_at(s); }
  const double* B(int64_t s) const { return p.B.data() + bc_at(s); }
  const double* C(int64_t s) const { return p.C.data() + bc_at(s); }
  double delta(int64_t s) const { return p.delta[size_t(head_at(s))]; }
  int64_t doc(int64_t s) const { return p.document[size_t(row(s))]; }
  double A() const { return p.A[size_t(h)]; }
  double D() const { return p.D[size_t(h)]; }
};

// Rows [start, start + len) of one head: cs[i] = sum_{k <= i} delta_k A (inclusive), and
// the document of the row before the chunk (-1 at the sample's start: nothing flows in).
struct Chunk {
  int64_t start, len;
  int64_t prev_doc;
  std::vector<double> cs;
  Chunk(const HeadSlice& v, int64_t chunk_start, int64_t chunk_len)
      : start(chunk_start),
        len(chunk_len),
        prev_doc(chunk_start > 0 ? v.doc(chunk_start - 1) : -1),
        cs(size_t(chunk_len)) {
    double sum = 0;
    for (int64_t i = 0; i < len; ++i) cs[size_t(i)] = sum += v.delta(start + i) * v.A();
  }
  int64_t last() const { return start + len - 1; }
  double cum(int64_t s) const { return cs[size_t(s - start)]; }
};

// The chunk's output rows into y: the diagonal block (C B^T o L) X with the decay matrix
// L_ij = exp(cs_i - cs_j) (zero across a document boundary), the off-diagonal term of the
// entering state, and the D skip.
void chunk_output(const HeadSlice& v, const Chunk& ch, const std::vector<double>& state_in,
                  std::vector<double>& y) {
  const int64_t P = v.P, N = v.N;
  for (int64_t i = ch.start; i <= ch.last(); ++i) {
    double* yi = y.data() + v.x_at(i);
    const double* xi = v.x(i);
    for (int64_t p = 0; p < P; ++p) yi[p] = v.D() * xi[p];
    for (int64_t j = ch.start; j <= i; ++j) {
      if (v.doc(j) != v.doc(i)) continue;
      const double m = std::exp(ch.cum(i) - ch.cum(j)) * v.delta(j) * dot(v.C(i), v.B(j), N);
      const double* xj = v.x(j);
      for (int64_t p = 0; p < P; ++p) yi[p] += m * xj[p];
    }
    if (v.doc(i) != ch.prev_doc) continue;
    const double e = std::exp(ch.cum(i));
    for (int64_t p = 0; p < P; ++p) yi[p] += e * dot(state_in.data() + p * N, v.C(i), N);
  }
}

// The state after the chunk's last row: the entering state decayed over the chunk plus
// the chunk's own contributions, each decayed to the end.
void chunk_state(const HeadSlice& v, const Chunk& ch, const std::vector<double>& state_in,
                 std::vector<double>& state_out) {
  const int64_t P = v.P, N = v.N, last = ch.last();
  const double carry = v.doc(last) == ch.prev_doc ? std::exp(ch.cum(last)) : 0.0;
  for (size_t k = 0; k < state_out.size(); ++k) state_out[k] = carry * state_in[k];
  for (int64_t j = ch.start; j <= last; ++j) {
    if (v.doc(j) != v.doc(last)) continue;
    const double w = std::exp(ch.cum(last) - ch.cum(j)) * v.delta(j);
    const double *xj = v.x(j), *bj = v.B(j);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t n = 0; n < N; ++n) state_out[size_t(p * N + n)] += w * xj[p] * bj[n];
  }
}

// Gradient accumulators of one sample (its rows of x, delta, B, C are its own; A and D
// per head are summed over the samples after the parallel loop).
struct SampleGrads {
  SsdGrads& all;
  double* A;  // [nheads] of this sample
  double* D;
};

// The reverse of chunk_output and chunk_state. state_grad: d loss / d state_out; adds
// d loss / d state_in into state_in_grad (zeroed by the caller). The decay's gradient is
// gathered per row as dcs_i = d loss / d cs_i, then d loss / d (delta_k A) =
// sum_{i >= k} dcs_i.
void chunk_backward(const HeadSlice& v, const Chunk& ch, const std::vector<double>& state_in,
                    const std::vector<double>& state_grad, const std::vector<double>& dy,
                    SampleGrads& out, std::vector<double>& state_in_grad) {
  const int64_t P = v.P, N = v.N, last = ch.last();
  std::vector<double> dcs(size_t(ch.len), 0.0);
  auto dcum = [&](int64_t s) -> double& { return dcs[size_t(s - ch.start)]; };
  SsdGrads& gr = out.all;
  for (int64_t i = ch.start; i <= last; ++i) {
    const double *dyi = dy.data() + v.x_at(i), *xi = v.x(i), *ci = v.C(i);
    double* gxi = gr.x.data() + v.x_at(i);
    double* gci = gr.C.data() + v.bc_at(i);
    for (int64_t p = 0; p < P; ++p) gxi[p] += v.D() * dyi[p];
    out.D[v.h] += dot(dyi, xi, P);
    // Diagonal block: y_i += M_ij x_j with M_ij = L_ij delta_j (C_i . B_j).
    for (int64_t j = ch.start; j <= i; ++j) {
      if (v.doc(j) != v.doc(i)) continue;
      const double *xj = v.x(j), *bj = v.B(j);
      const double decay = std::exp(ch.cum(i) - ch.cum(j)), cb = dot(ci, bj, N);
      const double m = decay * v.delta(j) * cb, dm = dot(dyi, xj, P);
      double* gxj = gr.x.data() + v.x_at(j);
      double* gbj = gr.B.data() + v.bc_at(j);
      for (int64_t p = 0; p < P; ++p) gxj[p] += m * dyi[p];
      const double dcb = dm * decay * v.delta(j);
      for (int64_t n = 0; n < N; ++n) {
        gci[n] += dcb * bj[n];
        gbj[n] += dcb * ci[n];
      }
      gr.delta[size_t(v.head_at(j))] += dm * decay * cb;
      // d m / d cs_i = m, d m / d cs_j = -m.
      dcum(i) += dm * m;
      dcum(j) -= dm * m;
    }
    // Off-diagonal: y_i += exp(cs_i) h_prev C_i.
    if (v.doc(i) != ch.prev_doc) continue;
    const double e = std::exp(ch.cum(i));
    double dy_h_c = 0;
    for (int64_t p = 0; p < P; ++p) {
      const double* hp = state_in.data() + p * N;
      double* ghp = state_in_grad.data() + p * N;
      dy_h_c += dyi[p] * dot(hp, ci, N);
      for (int64_t n = 0; n < N; ++n) {
        gci[n] += e * dyi[p] * hp[n];
        ghp[n] += e * dyi[p] * ci[n];
      }
    }
    dcum(i) += e * dy_h_c;
  }
  // The chunk's state: h_out = carry h_prev + sum_j w_j delta_j x_j B_j^T.
  std::vector<double> gs_b(static_cast<size_t>(P));  // state_grad B_j
  for (int64_t j = ch.start; j <= last; ++j) {
    if (v.doc(j) != v.doc(last)) continue;
    const double *xj = v.x(j), *bj = v.B(j);
    const double w = std::exp(ch.cum(last) - ch.cum(j)), wd = w * v.delta(j);
    for (int64_t p = 0; p < P; ++p) gs_b[size_t(p)] = dot(state_grad.data() + p * N, bj, N);
    const double x_gs_b = dot(xj, gs_b.data(), P);
    double* gxj = gr.x.data() + v.x_at(j);
    double* gbj = gr.B.data() + v.bc_at(j);
    for (int64_t p = 0; p < P; ++p) {
      gxj[p] += wd * gs_b[size_t(p)];
      for (int64_t n = 0; n < N; ++n) gbj[n] += wd * state_grad[size_t(p * N + n)] * xj[p];
    }
    gr.delta[size_t(v.head_at(j))] += w * x_gs_b;
    dcum(last) += wd * x_gs_b;
    dcum(j) -= wd * x_gs_b;
  }
  if (v.doc(last) == ch.prev_doc) {
    const double carry = std::exp(ch.cum(last));
    dcum(last) += carry * dot(state_grad.data(), state_in.data(), P * N);
    for (size_t k = 0; k < state_in_grad.size(); ++k) state_in_grad[k] += carry * state_grad[k];
  }
  double da = 0;  // d loss / d (delta_k A), summed from the chunk's end
  for (int64_t k = last; k >= ch.start; --k) {
    da += dcum(k);
    gr.delta[size_t(v.head_at(k))] += v.A() * da;
    out.A[v.h] += v.delta(k) * da;
  }
}

int64_t work(const SsdProblem& p) {
  const SsdDims& d = p.dims;
  return d.batch * d.seq * d.nheads * d.head_dim * d.state_dim * std::min(d.seq, d.chunk_size);
}

void size_grads(const SsdProblem& p, SsdGrads& g, std::vector<double>& per_sample) {
  g.x.assign(p.x.size(), 0.0);
  g.delta.assign(p.delta.size(), 0.0);
  g.B.assign(p.B.size(), 0.0);
  g.C.assign(p.C.size(), 0.0);
  per_sample.assign(size_t(2 * p.dims.batch * p.dims.nheads), 0.0);
}

// Sums the samples' A and D gradients ([B, nheads] each, A's first) into g.A and g.D.
void sum_head_grads(const SsdProblem& p, const std::vector<double>& per_sample, SsdGrads& g) {
  const int64_t H = p.dims.nheads, BH = p.dims.batch * H;
  g.A.assign(size_t(H), 0.0);
  g.D.assign(size_t(H), 0.0);
  for (int64_t i = 0; i < BH; ++i) {
    g.A[size_t(i % H)] += per_sample[size_t(i)];
    g.D[size_t(i % H)] += per_sample[size_t(BH + i)];
  }
}

}  // namespace

void chunked_forward(const SsdProblem& p, std::vector<double>& y,
                     std::vector<double>* final_state) {
  const SsdDims& d = p.dims;
  const int64_t PN = d.head_dim * d.state_dim;
  y.assign(p.x.size(), 0.0);
  if (final_state) final_state->assign(size_t(d.batch * d.nheads * PN), 0.0);
#pragma omp parallel for schedule(static) if (work(p) >= kParallelMinWork)
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.nheads; ++h) {
      const HeadSlice v(p, b, h);
      std::vector<double> state(size_t(PN), 0.0), next(static_cast<size_t>(PN));
      for (int64_t start = 0; start < d.seq; start += d.chunk_size) {
        const Chunk ch(v, start, std::min(d.chunk_size, d.seq - start));
        chunk_output(v, ch, state, y);
        chunk_state(v, ch, state, next);
        state.swap(next);
      }
      if (final_state)
        std::copy(state.begin(), state.end(), final_state->begin() + (b * d.nheads + h) * PN);
    }
}

void chunked_backward(const SsdProblem& p, const std::vector<double>& dy, SsdGrads& grads) {
  const SsdDims& d = p.dims;
  const int64_t PN = d.head_dim * d.state_dim;
  const int64_t chunks = (d.seq + d.chunk_size - 1) / d.chunk_size;
  std::vector<double> per_sample;
  size_grads(p, grads, per_sample);
#pragma omp parallel for schedule(static) if (work(p) >= kParallelMinWork)
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.nheads; ++h) {
      const HeadSlice v(p, b, h);
      SampleGrads out{grads, per_sample.data() + b * d.nheads,
                      per_sample.data() + (d.batch + b) * d.nheads};
      // The states entering each chunk, passed forward as in chunked_forward.
      std::vector<std::vector<double>> state_in(size_t(chunks),
                                                std::vector<double>(size_t(PN), 0.0));
      for (int64_t c = 0; c + 1 < chunks; ++c) {
        const Chunk ch(v, c * d.chunk_size, d.chunk_size);
        chunk_state(v, ch, state_in[size_t(c)], state_in[size_t(c + 1)]);
      }
      // Backwards over the chunks: the gradient of a chunk's entering state is the
      // gradient of the previous chunk's output state. The last state reaches no output.
      std::vector<double> state_grad(size_t(PN), 0.0), state_in_grad(static_cast<size_t>(PN));
      for (int64_t c = chunks - 1; c >= 0; --c) {
        const int64_t start = c * d.chunk_size;
        const Chunk ch(v, start, std::min(d.chunk_size, d.seq - start));
        std::fill(state_in_grad.begin(), state_in_grad.end(), 0.0);
        chunk_backward(v, ch, state_in[size_t(c)], state_grad, dy, out, state_in_grad);
        state_grad.swap(state_in_grad);
      }
    }
  sum_head_grads(p, per_sample, grads);
}

void recurrent_forward(const SsdProblem& p, std::vector<double>& y,
                       std::vector<double>* final_state) {
  const SsdDims& d = p.dims;
  const int64_t P = d.head_dim, N = d.state_dim;
  y.assign(p.x.size(), 0.0);
  if (final_state) final_state->assign(size_t(d.batch * d.nheads * P * N), 0.0);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.nheads; ++h) {
      const HeadSlice v(p, b, h);
      std::vector<double> state(size_t(P * N), 0.0);
      for (int64_t s = 0; s < d.seq; ++s) {
        const bool continues = s > 0 && v.doc(s) == v.doc(s - 1);
        const double decay = continues ? std::exp(v.delta(s) * v.A()) : 0.0;
        const double *xs = v.x(s), *bs = v.B(s), *cs = v.C(s);
        double* ys = y.data() + v.x_at(s);
        for (int64_t i = 0; i < P; ++i) {
          double* hi = state.data() + i * N;
          for (int64_t n = 0; n < N; ++n) hi[n] = decay * hi[n] + v.delta(s) * xs[i] * bs[n];
          ys[i] = dot(hi, cs, N) + v.D() * xs[i];
        }
      }
      if (final_state)
        std::copy(state.begin(), state.end(), final_state->begin() + (b * d.nheads + h) * P * N);
    }
}

// Reverse mode of the recurrence with every state kept: gh = d loss / d h_t collects
// dy_t C_t^T and exp(delta_{t+1} A) times the next row's gh.
void recurrent_backward(const SsdProblem& p, const std::vector<double>& dy, SsdGrads& grads) {
  const SsdDims& d = p.dims;
  const int64_t P = d.head_dim, N = d.state_dim, PN = P * N;
  std::vector<double> per_sample;
  size_grads(p, grads, per_sample);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.nheads; ++h) {
      const HeadSlice v(p, b, h);
      double &dA = per_sample[size_t(b * d.nheads + h)],
             &dD = per_sample[size_t((d.batch + b) * d.nheads + h)];
      std::vector<double> states(size_t(d.seq * PN), 0.0);
      for (int64_t s = 0; s < d.seq; ++s) {
        const bool continues = s > 0 && v.doc(s) == v.doc(s - 1);
        const double decay = continues ? std::exp(v.delta(s) * v.A()) : 0.0;
        for (int64_t i = 0; i < P; ++i)
          for (int64_t n = 0; n < N; ++n) {
            const double before = continues ? states[size_t((s - 1) * PN + i * N + n)] : 0.0;
            states[size_t(s * PN + i * N + n)] =
                decay * before + v.delta(s) * v.x(s)[i] * v.B(s)[n];
          }
      }
      std::vector<double> gh(size_t(PN), 0.0);  // holds exp(delta_{t+1} A) gh_{t+1}
      for (int64_t s = d.seq - 1; s >= 0; --s) {
        const double *xs = v.x(s), *bs = v.B(s), *cs = v.C(s), *dys = dy.data() + v.x_at(s);
        const double* hs = states.data() + s * PN;
        double* gx = grads.x.data() + v.x_at(s);
        double *gb = grads.B.data() + v.bc_at(s), *gc = grads.C.data() + v.bc_at(s);
        double& gdelta = grads.delta[size_t(v.head_at(s))];
        for (int64_t i = 0; i < P; ++i)
          for (int64_t n = 0; n < N; ++n) {
            gh[size_t(i * N + n)] += dys[i] * cs[n];
            gc[n] += hs[i * N + n] * dys[i];
          }
        for (int64_t i = 0; i < P; ++i) {
          const double gh_b = dot(gh.data() + i * N, bs, N);
          gx[i] += v.delta(s) * gh_b + v.D() * dys[i];
          gdelta += gh_b * xs[i];
          for (int64_t n = 0; n < N; ++n) gb[n] += v.delta(s) * gh[size_t(i * N + n)] * xs[i];
        }
        dD += dot(dys, xs, P);
        const bool continues = s > 0 && v.doc(s) == v.doc(s - 1);
        if (!continues) {
          std::fill(gh.begin(), gh.end(), 0.0);
          continue;
        }
        const double decay = std::exp(v.delta(s) * v.A());
        // d loss / d (delta_s A) = decay sum(gh o h_{s-1}).
        const double da = decay * dot(gh.data(), states.data() + (s - 1) * PN, PN);
        gdelta += v.A() * da;
        dA += v.delta(s) * da;
        for (double& g : gh) g *= decay;
      }
    }
  sum_head_grads(p, per_sample, grads);
}

}  // namespace megaton::ops::ssm_scan
