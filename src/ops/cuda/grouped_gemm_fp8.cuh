// The CUTLASS 3 Hopper FP8 grouped GEMM behind ops::cuda::fp8_grouped_gemm, as a template
// over the operand FP8 formats, the output type and the kernel schedule; the
// grouped_gemm_fp8_{fast,split}_{bf16,f32}.cu files instantiate it (they compile in
// parallel: each instantiation takes minutes).
//
// Kernel: CUTLASS 4.2's ptr-array grouped GEMM (examples/57_hopper_grouped_gemm), both
// operands K-major ("TN": LayoutA RowMajor [M, K], LayoutB ColumnMajor [K, N] = b [N, K]
// row-major), warp-specialized cooperative, one persistent launch for all groups:
//   KernelPtrArrayTmaWarpSpecializedCooperative           the FP8 mainloop that adds the
//       tensor cores' partial sums into fp32 registers every 4 MMAs (128 of K with a
//       128-deep tile): the split accumulator;
//   KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum   the tensor cores' reduced-
//       precision accumulator for the whole K loop (fp8_gemm's fast_accumulation).
// Epilogue LinearCombination: D = alpha_g * acc + beta * C, alpha_g read per group from a
// device array (the per-tensor scales folded in: alpha * a_scale_inv[g] * b_scale_inv[g],
// computed by a one-block kernel, so the host never reads a scale).
#pragma once
#include <type_traits>

#include <cuda_runtime.h>

#include <climits>
#include <cstring>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/float8.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "ops/cuda/grouped_gemm_cutlass.cuh"  // grouped_cutlass::upload

namespace megaton::ops::cuda::grouped_fp8 {

// One group: c [m, n] = alpha * *a_scale_inv * *b_scale_inv * a [m, k] @ b [n, k]^T
// + beta * c; a, b, c contiguous row-major, 16-byte aligned; m, n, k > 0, multiples of 16.
struct Fp8GroupedProblem {
  const void* a;
  const void* b;
  void* c;
  const float* a_scale_inv;
  const float* b_scale_inv;
  int m, n, k;
};

// group_alpha[g] = alpha * *a_scale_inv[g] * *b_scale_inv[g] for g < count, one block
// on megaton::cuda::stream() (defined in grouped_gemm_fp8.cu). All pointers are device
// pointers.
void launch_group_alpha(const float* const* a_scale_inv, const float* const* b_scale_inv,
                        float alpha, float* group_alpha, int count);

template <class ElementA, class ElementB, class ElementD, class KernelSchedule>
struct Fp8GroupedGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using LayoutA = cutlass::layout::RowMajor;     // a [M, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // b [N, K], K contiguous
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;                         // 16 bytes of FP8
  static constexpr int kAlignD = 16 / int(sizeof(ElementD));  // 16 bytes
  // 128x128x128 tiles (FP8's 128-deep K tile: four 32-deep WGMMAs, the promotion
  // interval), 2-CTA clusters sharing B by TMA multicast. 128x256 holds 128 fp32
  // accumulators per thread: the fast-accumulation forward (BF16 out) takes it; the split
  // accumulator's second copy would spill.
  static constexpr bool kWide =
      std::is_same_v<KernelSchedule,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum> &&
      std::is_same_v<ElementD, cutlass::bfloat16_t>;
  using TileShape = std::conditional_t<kWide, cute::Shape<cute::_128, cute::_256, cute::_128>,
                                       cute::Shape<cute::_128, cute::_128, cute::_128>>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutC*, kAlignD,
      ElementD, LayoutC*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename ProblemShape::UnderlyingProblemShape;

  // The leading-dimension mode of a K-major (or row-major C/D) stride: the row stride is
  // mode 0, the contiguous mode 1 is a static 1, the batch mode a static 0.
  template <class S>
  static S leading(int64_t ld) {
    S s{};
    cute::get<0>(s) = ld;
    return s;
  }

  // Runs all problems in one launch. InternalError if CUTLASS cannot implement them.
  static void run(const std::vector<Fp8GroupedProblem>& problems, float alpha, float beta) {
    const int count = int(problems.size());
    // One device block: [shapes | A, B, C, D pointers | strides A, B, C, D | a_scale_inv,
    // b_scale_inv pointers | alpha per group], each array 16-byte aligned.
    auto round16 = [](size_t bytes) { return (bytes + 15) / 16 * 16; };
    const size_t pointers = round16(count * sizeof(void*));
    const size_t shapes_at = 0;
    const size_t ptr_a_at = shapes_at + round16(count * sizeof(Shape));
    const size_t ptr_b_at = ptr_a_at + pointers;
    const size_t ptr_c_at = ptr_b_at + pointers;
    const size_t ptr_d_at = ptr_c_at + pointers;
    const size_t stride_a_at = ptr_d_at + pointers;
    const size_t stride_b_at = stride_a_at + round16(count * sizeof(StrideA));
    const size_t stride_c_at = stride_b_at + round16(count * sizeof(StrideB));
    const size_t stride_d_at = stride_c_at + round16(count * sizeof(StrideC));
    const size_t a_scale_at = stride_d_at + round16(count * sizeof(StrideD));
    const size_t b_scale_at = a_scale_at + pointers;
    const size_t alpha_at = b_scale_at + pointers;
    const size_t uploaded = alpha_at;  // the alphas are written on the device
    const size_t total = alpha_at + round16(count * sizeof(float));

    std::vector<unsigned char> host(uploaded, 0);
    std::vector<Shape> host_shapes(count);
    auto put = [&](size_t at, int i, const auto& value) {
      std::memcpy(host.data() + at + i * sizeof(value), &value, sizeof(value));
    };
    for (int i = 0; i < count; ++i) {
      const Fp8GroupedProblem& p = problems[i];
      host_shapes[i] = Shape{p.m, p.n, p.k};
      put(shapes_at, i, host_shapes[i]);
      put(ptr_a_at, i, p.a);
      put(ptr_b_at, i, p.b);
      put(ptr_c_at, i, static_cast<const void*>(p.c));
      put(ptr_d_at, i, p.c);  // D = C: the F32 weight gradient accumulates in place
      put(stride_a_at, i, leading<StrideA>(p.k));
      put(stride_b_at, i, leading<StrideB>(p.k));
      put(stride_c_at, i, leading<StrideC>(p.n));
      put(stride_d_at, i, leading<StrideD>(p.n));
      put(a_scale_at, i, p.a_scale_inv);
      put(b_scale_at, i, p.b_scale_inv);
    }
    Tensor block = Tensor::empty({int64_t(total / 8)}, DType::I64, Device::CUDA);
    auto* base = static_cast<unsigned char*>(block.raw());
    grouped_cutlass::upload(base, host.data(), uploaded);
    auto* group_alpha = reinterpret_cast<float*>(base + alpha_at);
    launch_group_alpha(reinterpret_cast<const float* const*>(base + a_scale_at),
                       reinterpret_cast<const float* const*>(base + b_scale_at), alpha, group_alpha,
                       count);

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {count, reinterpret_cast<Shape*>(base + shapes_at), host_shapes.data()};
    // Both mainloops' arguments start {ptr_A, dA, ptr_B, dB}; the split accumulator's
    // promotion interval keeps its default (4 MMAs).
    args.mainloop = {reinterpret_cast<const ElementA**>(base + ptr_a_at),
                     reinterpret_cast<StrideA*>(base + stride_a_at),
                     reinterpret_cast<const ElementB**>(base + ptr_b_at),
                     reinterpret_cast<StrideB*>(base + stride_b_at)};
    auto& fusion = args.epilogue.thread;
    // One alpha per group: alpha_ptr[l * 1] for group l (Sm90ScalarBroadcastPtrArray).
    fusion.alpha_ptr = group_alpha;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
    fusion.beta = beta;  // beta 0: C is not read (homogeneous_multiply_add skips it)
    args.epilogue.ptr_C = reinterpret_cast<const ElementD**>(base + ptr_c_at);
    args.epilogue.dC = reinterpret_cast<StrideC*>(base + stride_c_at);
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(base + ptr_d_at);
    args.epilogue.dD = reinterpret_cast<StrideD*>(base + stride_d_at);
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = ::megaton::cuda::multiprocessor_count();

    Gemm gemm;
    cutlass::Status status = gemm.can_implement(args);
    MEGATON_CHECK(status == cutlass::Status::kSuccess,
                  "fp8_grouped_gemm: CUTLASS cannot implement {} groups (first M={} N={} K={}): {}",
                  count, problems[0].m, problems[0].n, problems[0].k,
                  cutlassGetStatusString(status));
    const size_t workspace_bytes = std::max<size_t>(Gemm::get_workspace_size(args), 8);
    Tensor workspace =
        Tensor::empty({int64_t((workspace_bytes + 7) / 8)}, DType::I64, Device::CUDA);
    cudaStream_t stream = ::megaton::cuda::stream();
    status = gemm.initialize(args, workspace.raw(), stream);
    MEGATON_CHECK(status == cutlass::Status::kSuccess,
                  "fp8_grouped_gemm: CUTLASS initialize ({} groups): {}", count,
                  cutlassGetStatusString(status));
    status = gemm.run(stream);
    MEGATON_CHECK(status == cutlass::Status::kSuccess,
                  "fp8_grouped_gemm: CUTLASS run ({} groups): {}", count,
                  cutlassGetStatusString(status));
    MEGATON_CUDA_CHECK_LAUNCH();
    // `block` and `workspace` return to the allocator's cache; their next user is queued
    // on the same stream after this kernel.
  }
};

// The instantiations, one file per (schedule, output); a_e5m2 picks A's format (E5M2: the
// hybrid format's gradient, else E4M3); B is E4M3.
using SplitAccumulation = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using FastAccumulation = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum;
void run_split_bf16(const std::vector<Fp8GroupedProblem>& problems, bool a_e5m2, float alpha,
                    float beta);
void run_split_f32(const std::vector<Fp8GroupedProblem>& problems, bool a_e5m2, float alpha,
                   float beta);
void run_fast_bf16(const std::vector<Fp8GroupedProblem>& problems, bool a_e5m2, float alpha,
                   float beta);
void run_fast_f32(const std::vector<Fp8GroupedProblem>& problems, bool a_e5m2, float alpha,
                  float beta);

// The body of each run_* above.
template <class ElementD, class KernelSchedule>
void run_case(const std::vector<Fp8GroupedProblem>& problems, bool a_e5m2, float alpha,
              float beta) {
  if (a_e5m2)
    Fp8GroupedGemm<cutlass::float_e5m2_t, cutlass::float_e4m3_t, ElementD, KernelSchedule>::run(
        problems, alpha, beta);
  else
    Fp8GroupedGemm<cutlass::float_e4m3_t, cutlass::float_e4m3_t, ElementD, KernelSchedule>::run(
        problems, alpha, beta);
}

}  // namespace megaton::ops::cuda::grouped_fp8
