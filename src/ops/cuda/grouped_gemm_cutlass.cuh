// The CUTLASS 3 Hopper grouped GEMM behind cutlass_grouped_gemm, as a template over the
// operand layouts and the output type; each grouped_gemm_cutlass_*.cu instantiates one
// case (they compile in parallel: each takes minutes).
//
// Kernel: cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative (CUTLASS 4.2,
// examples/57_hopper_grouped_gemm): one persistent launch walks the tiles of every group;
// per-group problem sizes, pointers and strides are read from device memory, and the TMA
// descriptors are rewritten on the device when a CTA moves to another group.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "ops/cuda/grouped_gemm_problem.h"

namespace megaton::ops::cuda::grouped_cutlass {

// Copies a small host buffer to device memory in stream order, through kernel
// parameters (no pageable cudaMemcpyAsync, which may block the host until the stream
// drains; defined in grouped_gemm.cu).
void upload(void* device_dst, const void* host_src, size_t bytes);

// Kernel shapes (CUTLASS 4.2 Hopper ptr-array schedules).
// Cooperative128x256: two consumer warp groups share one 128x256x64 tile, 2-CTA clusters:
// the cooperative shape CUTLASS's profiler favours for bf16 on H100 at these sizes.
struct Cooperative128x256 {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// Pingpong128x128: each consumer warp group owns a 128x128x64 tile, and one's epilogue
// runs while the other's main loop does: for outputs whose epilogue is heavy relative to
// a short K, as the fp32 weight gradient (read and written with beta = 1), where it is the
// faster schedule (grouped_gemm_cutlass_wgrad.cu).
struct Pingpong128x128 {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// CUTLASS's row/column-major tags for our row-major operands: op(a) [m, k] is a [m, k]
// row-major (RowMajor) or, when transposed, [k, m] row-major (ColumnMajor); op(b) [k, n]
// is b [k, n] row-major (RowMajor: n contiguous) or, when transposed, [n, k]
// (ColumnMajor: k contiguous).
template <class LayoutA, class LayoutB, class ElementD, class Config = Cooperative128x256>
struct GroupedGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ElementAB = cutlass::bfloat16_t;
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 8;                       // 16 bytes of bf16
  static constexpr int kAlignD = 16 / int(sizeof(ElementD));  // 16 bytes
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, LayoutC*,
      kAlignD, ElementD, LayoutC*, kAlignD, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB,
      ElementAB, LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename ProblemShape::UnderlyingProblemShape;

  static constexpr bool kColumnMajorA = std::is_same_v<LayoutA, cutlass::layout::ColumnMajor>;
  static constexpr bool kColumnMajorB = std::is_same_v<LayoutB, cutlass::layout::ColumnMajor>;

  // The leading-dimension mode of each stride (the other two are static 1 and 0).
  static StrideA stride_a(int64_t ld) {
    StrideA s{};
    if constexpr (kColumnMajorA) cute::get<1>(s) = ld; else cute::get<0>(s) = ld;
    return s;
  }
  static StrideB stride_b(int64_t ld) {
    StrideB s{};
    if constexpr (kColumnMajorB) cute::get<0>(s) = ld; else cute::get<1>(s) = ld;
    return s;
  }
  template <class S>
  static S stride_row_major(int64_t ld) {
    S s{};
    cute::get<0>(s) = ld;
    return s;
  }

  // Runs all problems in one launch; false if CUTLASS cannot implement them.
  static bool run(const std::vector<GroupedProblem>& problems, float beta) {
    const int count = int(problems.size());
    // One device block: [shapes | A ptrs | B ptrs | C ptrs | D ptrs | strides A, B, C, D],
    // each array 16-byte aligned.
    auto round16 = [](size_t b) { return (b + 15) / 16 * 16; };
    const size_t shapes_at = 0;
    const size_t ptr_a_at = shapes_at + round16(count * sizeof(Shape));
    const size_t ptr_b_at = ptr_a_at + round16(count * sizeof(void*));
    const size_t ptr_c_at = ptr_b_at + round16(count * sizeof(void*));
    const size_t ptr_d_at = ptr_c_at + round16(count * sizeof(void*));
    const size_t stride_a_at = ptr_d_at + round16(count * sizeof(void*));
    const size_t stride_b_at = stride_a_at + round16(count * sizeof(StrideA));
    const size_t stride_c_at = stride_b_at + round16(count * sizeof(StrideB));
    const size_t stride_d_at = stride_c_at + round16(count * sizeof(StrideC));
    const size_t total = stride_d_at + round16(count * sizeof(StrideD));

    std::vector<unsigned char> host(total, 0);
    std::vector<Shape> host_shapes(count);
    auto put = [&](size_t at, int i, const auto& value) {
      std::memcpy(host.data() + at + i * sizeof(value), &value, sizeof(value));
    };
    for (int i = 0; i < count; ++i) {
      const GroupedProblem& p = problems[i];
      host_shapes[i] = Shape{int(p.m), int(p.n), int(p.k)};
      put(shapes_at, i, host_shapes[i]);
      put(ptr_a_at, i, p.a);
      put(ptr_b_at, i, p.b);
      put(ptr_c_at, i, static_cast<const void*>(p.c));
      put(ptr_d_at, i, p.c);
      put(stride_a_at, i, stride_a(p.lda));
      put(stride_b_at, i, stride_b(p.ldb));
      put(stride_c_at, i, stride_row_major<StrideC>(p.ldc));
      put(stride_d_at, i, stride_row_major<StrideD>(p.ldc));
    }
    Tensor block = Tensor::empty({int64_t(total / 8)}, DType::I64, Device::CUDA);
    auto* base = static_cast<unsigned char*>(block.raw());
    upload(base, host.data(), total);

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {count, reinterpret_cast<Shape*>(base + shapes_at), host_shapes.data()};
    args.mainloop = {reinterpret_cast<const ElementAB**>(base + ptr_a_at),
                     reinterpret_cast<StrideA*>(base + stride_a_at),
                     reinterpret_cast<const ElementAB**>(base + ptr_b_at),
                     reinterpret_cast<StrideB*>(base + stride_b_at)};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = beta;
    args.epilogue.ptr_C = reinterpret_cast<const ElementD**>(base + ptr_c_at);
    args.epilogue.dC = reinterpret_cast<StrideC*>(base + stride_c_at);
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(base + ptr_d_at);
    args.epilogue.dD = reinterpret_cast<StrideD*>(base + stride_d_at);
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = ::megaton::cuda::multiprocessor_count();

    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    const size_t workspace_bytes = std::max<size_t>(Gemm::get_workspace_size(args), 8);
    Tensor workspace = Tensor::empty({int64_t((workspace_bytes + 7) / 8)}, DType::I64, Device::CUDA);
    cudaStream_t stream = ::megaton::cuda::stream();
    cutlass::Status status = gemm.initialize(args, workspace.raw(), stream);
    MEGATON_CHECK(status == cutlass::Status::kSuccess, "CUTLASS grouped GEMM initialize: {}",
                  cutlassGetStatusString(status));
    status = gemm.run(stream);
    MEGATON_CHECK(status == cutlass::Status::kSuccess, "CUTLASS grouped GEMM run: {}",
                  cutlassGetStatusString(status));
    MEGATON_CUDA_CHECK_LAUNCH();
    // `block` and `workspace` return to the allocator's cache; their next user is queued
    // on the same stream after this kernel.
    return true;
  }
};

// The three cases the MoE experts use (one .cu file each):
// fprop  c [rows, n] = a [rows, k] @ w[g]^T (w [n, k]), BF16 out;
bool run_fprop(const std::vector<GroupedProblem>& problems, float beta);
// dgrad  c [rows, k] = dy [rows, n] @ w[g] (w [n, k]), BF16 out;
bool run_dgrad(const std::vector<GroupedProblem>& problems, float beta);
// wgrad  c[g] [m, n] += a [rows_g, m]^T @ b [rows_g, n], F32 out (main_grad), Pingpong128x128.
bool run_wgrad(const std::vector<GroupedProblem>& problems, float beta);

}  // namespace megaton::ops::cuda::grouped_cutlass
