// The CUTLASS 3 Hopper grouped GEMM behind cutlass_grouped_gemm, as a template over the
// operand layouts and the output type; each grouped_gemm_cutlass_*.cu instantiates one
// case (they compile in parallel: each takes minutes).
//
// Kernel: cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative (CUTLASS 4.2,
// examples/57_hopper_grouped_gemm): one persistent launch walks the tiles of every group;
// per-group problem sizes, pointers and strides are read from device memory, and the TMA
// descriptors are rewritten on the device when a CTA moves to another group. With the
// group sizes on the host the grid is sized to their tiles; with device counts
// (GroupedRowsProblem) a setup kernel writes the sizes and the grid is one CTA per SM.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
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

// Device-count calls (GroupedRowsProblem): the argument block's pointer arrays that hold
// row 0 of a row-cut operand for every group, to be moved to each group's first row, and
// the bytes of one row of each (a null array is unused).
struct RowSegments {
  unsigned char* pointers[3];
  int64_t row_bytes[3];
  bool count_is_k;  // wgrad: the count is the group's k (else its m)
};
constexpr int kRowsSetupThreads = 256;

// One block: writes each group's count into its shape (m, or k for wgrad, where an empty
// group gets m = 0: no output tile, so c[g] is left as it is; with k = 0 the main loop
// would run no k tile and leave the accumulator unset) and moves the row-cut operands'
// pointers to the group's first row.
template <class Shape>
__global__ void rows_setup_kernel(const int64_t* group_rows, int64_t groups, int64_t total_rows,
                                  Shape* shapes, RowSegments segments) {
  group_rows_of<kRowsSetupThreads>(
      group_rows, groups, total_rows, [&](int64_t g, int64_t first_row, int64_t count) {
        Shape shape = shapes[g];
        if (segments.count_is_k) {
          cute::get<2>(shape) = int(count);
          if (count == 0) cute::get<0>(shape) = 0;
        } else {
          cute::get<0>(shape) = int(count);
        }
        shapes[g] = shape;
        for (int i = 0; i < 3; ++i)
          if (segments.pointers[i] != nullptr)
            reinterpret_cast<uintptr_t*>(segments.pointers[i])[g] +=
                uintptr_t(first_row * segments.row_bytes[i]);
      });
}

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

  // The argument block in device memory: [shapes | A ptrs | B ptrs | C ptrs | D ptrs |
  // strides A, B, C, D], one entry per group in each array, each array 16-byte aligned.
  struct Block {
    size_t shapes, ptr_a, ptr_b, ptr_c, ptr_d, stride_a, stride_b, stride_c, stride_d, total;
    explicit Block(int count) {
      auto round16 = [](size_t b) { return (b + 15) / 16 * 16; };
      shapes = 0;
      ptr_a = shapes + round16(count * sizeof(Shape));
      ptr_b = ptr_a + round16(count * sizeof(void*));
      ptr_c = ptr_b + round16(count * sizeof(void*));
      ptr_d = ptr_c + round16(count * sizeof(void*));
      stride_a = ptr_d + round16(count * sizeof(void*));
      stride_b = stride_a + round16(count * sizeof(StrideA));
      stride_c = stride_b + round16(count * sizeof(StrideB));
      stride_d = stride_c + round16(count * sizeof(StrideC));
      total = stride_d + round16(count * sizeof(StrideD));
    }
  };

  // The host image of a block, written group by group, then uploaded.
  struct HostBlock {
    Block at;
    std::vector<unsigned char> bytes;
    explicit HostBlock(int count) : at(count), bytes(at.total, 0) {}
    template <class T>
    void put(size_t array, int i, const T& value) {
      std::memcpy(bytes.data() + array + i * sizeof(T), &value, sizeof(T));
    }
    // Group i: its shape, the pointers of op(a), op(b) and c (= d: c is updated in
    // place) and their row strides in elements.
    void set(int i, const Shape& shape, const void* a, const void* b, void* c, int64_t lda,
             int64_t ldb, int64_t ldc) {
      put(at.shapes, i, shape);
      put(at.ptr_a, i, a);
      put(at.ptr_b, i, b);
      put(at.ptr_c, i, static_cast<const void*>(c));
      put(at.ptr_d, i, c);
      put(at.stride_a, i, stride_a(lda));
      put(at.stride_b, i, stride_b(ldb));
      put(at.stride_c, i, stride_row_major<StrideC>(ldc));
      put(at.stride_d, i, stride_row_major<StrideD>(ldc));
    }
  };

  // The kernel's arguments over a block at `base` in device memory. host_shapes: the
  // groups' shapes on the host (the grid is then sized to their tiles), or nullptr when
  // they are only in device memory (a persistent grid of one CTA per SM walks the groups
  // there, and can_implement skips its per-group alignment checks).
  static typename Gemm::Arguments arguments(const Block& at, unsigned char* base, int count,
                                            const Shape* host_shapes, float beta) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {count, reinterpret_cast<Shape*>(base + at.shapes), host_shapes};
    args.mainloop = {reinterpret_cast<const ElementAB**>(base + at.ptr_a),
                     reinterpret_cast<StrideA*>(base + at.stride_a),
                     reinterpret_cast<const ElementAB**>(base + at.ptr_b),
                     reinterpret_cast<StrideB*>(base + at.stride_b)};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = beta;
    args.epilogue.ptr_C = reinterpret_cast<const ElementD**>(base + at.ptr_c);
    args.epilogue.dC = reinterpret_cast<StrideC*>(base + at.stride_c);
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(base + at.ptr_d);
    args.epilogue.dD = reinterpret_cast<StrideD*>(base + at.stride_d);
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = ::megaton::cuda::multiprocessor_count();
    return args;
  }

  static Tensor device_block(const Block& at) {
    return Tensor::empty({int64_t(at.total / 8)}, DType::I64, Device::CUDA);
  }

  // Initializes and launches a kernel whose can_implement passed, its block in place.
  static void launch(Gemm& gemm, const typename Gemm::Arguments& args) {
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
    // The argument block and `workspace` return to the allocator's cache; their next user
    // is queued on the same stream after this kernel.
  }

  // Runs all problems in one launch; false, having launched nothing, if CUTLASS cannot
  // implement them.
  static bool run(const std::vector<GroupedProblem>& problems, float beta) {
    const int count = int(problems.size());
    HostBlock host(count);
    std::vector<Shape> host_shapes(count);
    for (int i = 0; i < count; ++i) {
      const GroupedProblem& p = problems[i];
      host_shapes[i] = Shape{int(p.m), int(p.n), int(p.k)};
      host.set(i, host_shapes[i], p.a, p.b, p.c, p.lda, p.ldb, p.ldc);
    }
    Tensor block = device_block(host.at);
    auto* base = static_cast<unsigned char*>(block.raw());
    typename Gemm::Arguments args = arguments(host.at, base, count, host_shapes.data(), beta);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    upload(base, host.bytes.data(), host.at.total);
    launch(gemm, args);
    return true;
  }

  // The device-count form (GroupedRowsProblem): the host writes every group's fixed dims,
  // its own operand's pointer (b[g] or c[g]), the row-0 pointers of the cut operands and
  // the strides; the setup kernel then reads the counts and writes the count's dim and the
  // cut operands' row offsets. False, having launched nothing, if CUTLASS cannot implement
  // the call (checked without the shapes: the caller has checked alignment on the host).
  static bool run(const GroupedRowsProblem& p, float beta) {
    const int count = int(p.groups);
    HostBlock host(count);
    for (int i = 0; i < count; ++i) {
      if (p.trans_a)  // wgrad: k = the count
        host.set(i, Shape{int(p.m), int(p.n), 0}, p.a, p.b, p.c_groups[i], p.lda, p.ldb, p.ldc);
      else  // fprop, dgrad: m = the count
        host.set(i, Shape{0, int(p.n), int(p.k)}, p.a, p.b_groups[i], p.c, p.lda, p.ldb, p.ldc);
    }
    Tensor block = device_block(host.at);
    auto* base = static_cast<unsigned char*>(block.raw());
    typename Gemm::Arguments args = arguments(host.at, base, count, nullptr, beta);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    upload(base, host.bytes.data(), host.at.total);
    RowSegments segments{};
    segments.count_is_k = p.trans_a;
    const int64_t ab_bytes = int64_t(sizeof(ElementAB)), d_bytes = int64_t(sizeof(ElementD));
    segments.pointers[0] = base + host.at.ptr_a;
    segments.row_bytes[0] = p.lda * ab_bytes;
    if (p.trans_a) {
      segments.pointers[1] = base + host.at.ptr_b;
      segments.row_bytes[1] = p.ldb * ab_bytes;
    } else {
      segments.pointers[1] = base + host.at.ptr_c;
      segments.pointers[2] = base + host.at.ptr_d;
      segments.row_bytes[1] = segments.row_bytes[2] = p.ldc * d_bytes;
    }
    rows_setup_kernel<<<1, kRowsSetupThreads, 0, ::megaton::cuda::stream()>>>(
        p.group_rows, p.groups, p.total_rows, reinterpret_cast<Shape*>(base + host.at.shapes),
        segments);
    MEGATON_CUDA_CHECK_LAUNCH();
    launch(gemm, args);
    return true;
  }
};

// The three cases the MoE experts use (one .cu file each), with host or device counts:
// fprop  c [rows, n] = a [rows, k] @ w[g]^T (w [n, k]), BF16 out;
bool run_fprop(const std::vector<GroupedProblem>& problems, float beta);
bool run_fprop(const GroupedRowsProblem& problem, float beta);
// dgrad  c [rows, k] = dy [rows, n] @ w[g] (w [n, k]), BF16 out;
bool run_dgrad(const std::vector<GroupedProblem>& problems, float beta);
bool run_dgrad(const GroupedRowsProblem& problem, float beta);
// wgrad  c[g] [m, n] += a [rows_g, m]^T @ b [rows_g, n], F32 out (main_grad), Pingpong128x128.
bool run_wgrad(const std::vector<GroupedProblem>& problems, float beta);
bool run_wgrad(const GroupedRowsProblem& problem, float beta);

}  // namespace megaton::ops::cuda::grouped_cutlass
