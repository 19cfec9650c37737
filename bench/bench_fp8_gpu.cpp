// The FP8 ops on the GPU (ops/fp8.h): the quantization kernels in GB/s of the bytes they
// must move (x read once, each FP8 copy written once), and the FP8 GEMM in TFLOP/s beside
// the BF16 GEMM (ops::gemm) on the same shapes: 8192^3 and Llama-3-8B's linear layers at
// T = 8192 tokens (h = 4096, ffn = 14336: QKV 4096 -> 6144, proj 4096 -> 4096, fc1
// 4096 -> 2 x 14336, fc2 14336 -> 4096), per-tensor and blockwise (1x128 x 128x128)
// scaled. CUDA events on the compute stream, median of 20 after 5 warm-up runs
// (bench/cuda_timing.h). Built only with the CUDA backend.
#include <fmt/core.h>

#include <cstdint>
#include <functional>
#include <string>

#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#include "core/tensor.h"
#include "cuda_timing.h"
#include "ops/fp8.h"
#include "ops/ops.h"
#endif

#ifdef MEGATON_WITH_CUDA
namespace {

using namespace megaton;
using bench::median_ms;

Tensor random_device(const Shape& shape, DType dtype) {
  Tensor host = Tensor::empty(shape, DType::F32);
  float* p = host.f32();
  uint64_t state = 12345;
  for (int64_t i = 0; i < host.numel(); ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    p[i] = float((state >> 40) % 2001) / 1000.0f - 1.0f;
  }
  return host.to(dtype).to(Device::CUDA);
}

void print_rate(const std::string& what, double ms, double amount, const char* unit) {
  fmt::print("{:<58} {:>9.3f} ms {:>9.1f} {}\n", what, ms, amount / (ms * 1e-3), unit);
}

void bench_quantize(int64_t rows, int64_t cols) {
  const std::string shape = fmt::format("[{}, {}]", rows, cols);
  for (DType dtype : {DType::BF16, DType::F32}) {
    Tensor x = random_device({rows, cols}, dtype);
    const double n = double(rows) * double(cols), in = n * double(dtype_size(dtype));
    const std::string name = shape + " " + std::string(dtype_name(dtype));
    Tensor out = Tensor::empty({rows, cols}, DType::F8E4M3, Device::CUDA);
    Tensor out_t = Tensor::empty({cols, rows}, DType::F8E4M3, Device::CUDA);
    Tensor amax = Tensor::empty({1}, DType::F32, Device::CUDA);
    Tensor scale = Tensor::from({1}, {1.0f}).to(Device::CUDA), none;
    print_rate("amax " + name, median_ms([&] { ops::fp8_amax(x, amax); }), in / 1e9, "GB/s");
    print_rate("quantize -> out " + name,
               median_ms([&] { ops::fp8_quantize(x, scale, out, none, none); }), (in + n) / 1e9,
               "GB/s");
    print_rate("quantize -> out, out_t, amax " + name,
               median_ms([&] { ops::fp8_quantize(x, scale, out, out_t, amax); }),
               (in + 2 * n) / 1e9, "GB/s");
    for (int64_t block_rows : {1, 128}) {
      const ops::Fp8ScaleRule rule{DType::F8E4M3, 0.0f, 0.0f, true};
      Tensor s = Tensor::empty({(rows + block_rows - 1) / block_rows, (cols + 127) / 128},
                               DType::F32, Device::CUDA);
      Tensor s_t = Tensor::empty({(cols + block_rows - 1) / block_rows, (rows + 127) / 128},
                                 DType::F32, Device::CUDA);
      const double scale_bytes = 4.0 * double(s.numel() + s_t.numel());
      print_rate(
          fmt::format("blockwise {} -> out, out_t {}", block_rows == 1 ? "1x128" : "128x128", name),
          median_ms([&] { ops::fp8_quantize_blockwise(x, block_rows, rule, out, s, out_t, s_t); }),
          (in + 2 * n + scale_bytes) / 1e9, "GB/s");
    }
  }
}

// c [m, n] = a [m, k] @ b [n, k]^T.
void bench_gemm(const std::string& name, int64_t m, int64_t n, int64_t k) {
  const double flops = 2.0 * double(m) * double(n) * double(k);
  const std::string shape = fmt::format("{} M {} N {} K {}", name, m, n, k);
  {
    Tensor a = random_device({m, k}, DType::BF16), b = random_device({n, k}, DType::BF16);
    Tensor c = Tensor::empty({m, n}, DType::BF16, Device::CUDA);
    print_rate("bf16 gemm " + shape, median_ms([&] { ops::gemm(a, false, b, true, c); }),
               flops / 1e12, "TFLOP/s");
  }
  Tensor one = Tensor::from({1}, {1.0f}).to(Device::CUDA), none;
  // FP8 operands cast on the GPU (the host's conversion is slow at these sizes).
  auto fp8_operand = [&](int64_t rows) {
    Tensor q = Tensor::empty({rows, k}, DType::F8E4M3, Device::CUDA);
    ops::fp8_quantize(random_device({rows, k}, DType::BF16), one, q, none, none);
    return q;
  };
  Tensor a = fp8_operand(m), b = fp8_operand(n);
  Tensor c = Tensor::empty({m, n}, DType::BF16, Device::CUDA);
  Tensor c32 = Tensor::zeros({m, n}, DType::F32, Device::CUDA);
  print_rate("fp8 gemm per tensor -> bf16 " + shape,
             median_ms([&] { ops::fp8_gemm(a, one, b, one, c); }), flops / 1e12, "TFLOP/s");
  print_rate("fp8 gemm per tensor += f32 " + shape,
             median_ms([&] { ops::fp8_gemm(a, one, b, one, c32, 1.0f, 1.0f); }), flops / 1e12,
             "TFLOP/s");
  if (k % 128 != 0) return;
  Tensor a_s = Tensor::empty({m, k / 128}, DType::F32, Device::CUDA);
  Tensor b_s = Tensor::empty({(n + 127) / 128, k / 128}, DType::F32, Device::CUDA);
  Tensor b_s1 = Tensor::empty({n, k / 128}, DType::F32, Device::CUDA);
  a_s.fill(1.0f), b_s.fill(1.0f), b_s1.fill(1.0f);
  print_rate("fp8 gemm 1x128 x 128x128 -> bf16 " + shape,
             median_ms([&] { ops::fp8_gemm(a, a_s, b, b_s, c); }), flops / 1e12, "TFLOP/s");
  print_rate("fp8 gemm 1x128 x 1x128 += f32 " + shape,
             median_ms([&] { ops::fp8_gemm(a, a_s, b, b_s1, c32, 1.0f, 1.0f); }), flops / 1e12,
             "TFLOP/s");
}

}  // namespace
#endif

int main() {
#ifdef MEGATON_WITH_CUDA
  using namespace megaton;
  if (!cuda::device_available()) {
    fmt::print("bench_fp8_gpu: no CUDA device\n");
    return 0;
  }
  bench_quantize(8192, 8192);
  bench_quantize(8192, 4096);
  bench_quantize(8192, 14336);
  const int64_t tokens = 8192, hidden = 4096, ffn = 14336;
  bench_gemm("square", 8192, 8192, 8192);
  bench_gemm("llama qkv", tokens, 6144, hidden);
  bench_gemm("llama proj", tokens, hidden, hidden);
  bench_gemm("llama fc1", tokens, 2 * ffn, hidden);
  bench_gemm("llama fc2", tokens, hidden, ffn);
  bench_gemm("llama fc2 dgrad", tokens, ffn, hidden);
  bench_gemm("llama fc2 wgrad", hidden, ffn, tokens);
#else
  fmt::print("bench_fp8_gpu: built without CUDA\n");
#endif
  return 0;
}
