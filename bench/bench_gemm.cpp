// ops::gemm against a direct cblas_sgemm call on the GEMM shapes of the CPU model
// (T = 2048 tokens = micro-batch 8 x seq 256, hidden 256, SwiGLU ffn 1024, vocab 8192):
// the forward (x W^T), dgrad (dy W) and wgrad (dy^T x) of every linear layer. The two
// should match; a gap is door-check or dispatch overhead in ops::gemm.
//
//   bench_gemm --benchmark_min_time=0.05   (Google Benchmark 1.7.1: seconds, no unit)
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <random>
#include <string>
#include <vector>

#include "ops/ops.h"

namespace {

using megaton::Tensor;

Tensor random_matrix(int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols});
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(gen);
  return t;
}

constexpr int64_t kTokens = 8 * 256, kHidden = 256, kFfn = 1024, kVocab = 8192;

struct Linear {
  const char* name;
  int64_t in, out;  // weight [out, in]
};

// linear_qkv: 768 = 3 x hidden (no GQA at this size); linear_fc1 packs [gate | up].
constexpr Linear kLinears[] = {{"linear_qkv", kHidden, 3 * kHidden},
                               {"linear_proj", kHidden, kHidden},
                               {"linear_fc1", kHidden, 2 * kFfn},
                               {"linear_fc2", kFfn, kHidden},
                               {"output_layer", kHidden, kVocab}};

// One product c[M, N] = op(a) op(b) as the linear layer's pass computes it.
struct GemmShape {
  std::string name;
  int64_t a_rows, a_cols, b_rows, b_cols;
  bool trans_a, trans_b;
  int64_t m, n, k;
};

std::vector<GemmShape> model_shapes() {
  std::vector<GemmShape> shapes;
  for (const Linear& l : kLinears) {
    std::string base = std::string(l.name) + "/";
    // forward: y [T, out] = x [T, in] @ W^T, W [out, in]
    shapes.push_back({base + "fwd", kTokens, l.in, l.out, l.in, false, true, kTokens, l.out, l.in});
    // dgrad: dx [T, in] = dy [T, out] @ W [out, in]
    shapes.push_back(
        {base + "dgrad", kTokens, l.out, l.out, l.in, false, false, kTokens, l.in, l.out});
    // wgrad: dW [out, in] = dy^T [out, T] @ x [T, in]
    shapes.push_back(
        {base + "wgrad", kTokens, l.out, kTokens, l.in, true, false, l.out, l.in, kTokens});
  }
  return shapes;
}

void set_flops(benchmark::State& state, const GemmShape& s) {
  // Shown as FLOP=<n>G/s: 2 M N K per iteration, divided by the elapsed (real) time.
  state.counters["FLOP"] = benchmark::Counter(2.0 * double(s.m) * double(s.n) * double(s.k),
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["M"] = double(s.m);
  state.counters["N"] = double(s.n);
  state.counters["K"] = double(s.k);
}

void bench_ops_gemm(benchmark::State& state, GemmShape s) {
  Tensor a = random_matrix(s.a_rows, s.a_cols, 1);
  Tensor b = random_matrix(s.b_rows, s.b_cols, 2);
  Tensor c = Tensor::empty({s.m, s.n});
  for (auto _ : state) {
    megaton::ops::gemm(a, s.trans_a, b, s.trans_b, c);
    benchmark::DoNotOptimize(c.raw());
    benchmark::ClobberMemory();
  }
  set_flops(state, s);
}

void bench_cblas(benchmark::State& state, GemmShape s) {
  Tensor a = random_matrix(s.a_rows, s.a_cols, 1);
  Tensor b = random_matrix(s.b_rows, s.b_cols, 2);
  Tensor c = Tensor::empty({s.m, s.n});
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, s.trans_a ? CblasTrans : CblasNoTrans,
                s.trans_b ? CblasTrans : CblasNoTrans, int(s.m), int(s.n), int(s.k), 1.0f, a.f32(),
                int(s.a_cols), b.f32(), int(s.b_cols), 0.0f, c.f32(), int(s.n));
    benchmark::DoNotOptimize(c.raw());
    benchmark::ClobberMemory();
  }
  set_flops(state, s);
}

}  // namespace

int main(int argc, char** argv) {
  for (const GemmShape& s : model_shapes()) {
    benchmark::RegisterBenchmark(("ops_gemm/" + s.name).c_str(), bench_ops_gemm, s)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("cblas_sgemm/" + s.name).c_str(), bench_cblas, s)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
