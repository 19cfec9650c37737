// The MoE experts' grouped GEMMs on the GPU at the benchmark configurations' shapes
// (../shared/bench/README.md: moe-8x-top2, moe-64x-top8; tokens = seq x micro-batch,
// spread evenly over the experts): forward (fc1, fc2), data gradient and weight gradient
// (BF16 x BF16 -> fp32 main_grad), timed with CUDA events, median of 20 after 5 warm-up runs.
// Each case runs twice: with the tokens per expert on the host (std::vector group_rows: a
// grid sized to the tiles) and on the device (Tensor group_rows: a setup kernel and the
// persistent grid of one CTA per SM; "device / host" is its time over the host-count one).
// Prints TFLOP/s per case; built only with the CUDA backend.
#include <cuda_runtime.h>
#include <fmt/core.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/tensor.h"
#include "cuda_timing.h"
#include "ops/ops.h"

using namespace megaton;

namespace {

using bench::median_ms;

Tensor random_bf16(Shape shape) {
  Tensor host = Tensor::empty(shape, DType::F32);
  float* p = host.data<float>();
  uint64_t state = 12345;
  for (int64_t i = 0; i < host.numel(); ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    p[i] = float((state >> 40) % 2001) / 1000.0f - 1.0f;
  }
  return host.to(DType::BF16).to(Device::CUDA);
}

[[maybe_unused]] void bench_config(const char* name, int64_t tokens, int64_t hidden,
                                   int64_t ffn, int experts, int topk) {
  const int64_t rows = tokens * topk, per_expert = rows / experts;
  std::vector<int64_t> group_rows(experts, per_expert);
  group_rows.back() += rows - per_expert * experts;
  Tensor counts = Tensor::empty({experts}, DType::I64);
  std::copy(group_rows.begin(), group_rows.end(), counts.i64());
  counts = counts.to(Device::CUDA);
  const int64_t fc1_out = 2 * ffn;  // SwiGLU: gate and up
  Tensor x = random_bf16({rows, hidden}), h = random_bf16({rows, fc1_out});
  Tensor act = random_bf16({rows, ffn}), y = random_bf16({rows, hidden});
  std::vector<Tensor> w1, w2, g1, g2;
  for (int e = 0; e < experts; ++e) {
    w1.push_back(random_bf16({fc1_out, hidden}));
    w2.push_back(random_bf16({hidden, ffn}));
    g1.push_back(Tensor::zeros({fc1_out, hidden}, DType::F32, Device::CUDA));
    g2.push_back(Tensor::zeros({hidden, ffn}, DType::F32, Device::CUDA));
  }
  struct Case {
    const char* what;
    double flops;
    std::function<void()> host_counts, device_counts;
  };
  const double fc1_flops = 2.0 * rows * hidden * fc1_out, fc2_flops = 2.0 * rows * ffn * hidden;
  std::vector<Case> cases = {
      {"fc1 forward", fc1_flops, [&] { ops::grouped_gemm(x, w1, true, h, group_rows); },
       [&] { ops::grouped_gemm(x, w1, true, h, counts); }},
      {"fc2 forward", fc2_flops, [&] { ops::grouped_gemm(act, w2, true, y, group_rows); },
       [&] { ops::grouped_gemm(act, w2, true, y, counts); }},
      {"fc2 dgrad", fc2_flops, [&] { ops::grouped_gemm(y, w2, false, act, group_rows); },
       [&] { ops::grouped_gemm(y, w2, false, act, counts); }},
      {"fc1 dgrad", fc1_flops, [&] { ops::grouped_gemm(h, w1, false, x, group_rows); },
       [&] { ops::grouped_gemm(h, w1, false, x, counts); }},
      {"fc2 wgrad", fc2_flops, [&] { ops::grouped_gemm_wgrad(y, act, g2, group_rows); },
       [&] { ops::grouped_gemm_wgrad(y, act, g2, counts); }},
      {"fc1 wgrad", fc1_flops, [&] { ops::grouped_gemm_wgrad(h, x, g1, group_rows); },
       [&] { ops::grouped_gemm_wgrad(h, x, g1, counts); }},
  };
  for (const Case& c : cases) {
    const double host_ms = median_ms(c.host_counts), device_ms = median_ms(c.device_counts);
    for (bool device : {false, true}) {
      const double ms = device ? device_ms : host_ms;
      fmt::print("{:<14} {:<12} {:<7} {:>9.3f} ms {:>7.1f} TFLOP/s", name, c.what,
                 device ? "device" : "host", ms, c.flops / (ms * 1e-3) / 1e12);
      if (device) fmt::print(" {:>6.3f}", device_ms / host_ms);
      fmt::print("\n");
    }
  }
}

}  // namespace

int main() {
#ifdef MEGATON_WITH_CUDA
  fmt::print("{:<14} {:<12} {:<7} {:>12} {:>15} {:>6}\n", "config", "GEMM", "counts", "median",
             "rate", "device / host");
  bench_config("moe-8x-top2", 2048 * 4, 1536, 4096, 8, 2);
  bench_config("moe-64x-top8", 2048 * 4, 2048, 1024, 64, 8);
#else
  fmt::print("bench_grouped_gemm_gpu: built without CUDA\n");
#endif
  return 0;
}
