// cuda::StepGraph (core/cuda/graph.h), with Tensor copies and fills only (core's own
// kernels): a captured sequence replays with the values its inputs hold at replay time; its memory is its own (a block freed inside the capture is
// never handed to an allocation made after it); a host synchronization inside a capture is
// refused and leaves the stream usable; a large upload captured keeps its bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#ifdef MEGATON_WITH_CUDA
#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/graph.h"
#include "core/tensor.h"

namespace megaton {
namespace {

std::vector<float> host_values(const Tensor& t) { return t.to(Device::CPU).to_vector(); }

TEST(CudaGraph, ReplayReadsInputsAtReplayTime) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 4096;
  Tensor x = Tensor::zeros({n}, DType::F32, Device::CUDA);
  Tensor y;
  cuda::StepGraph graph;
  graph.capture("test", [&] {
    Tensor copy = x.clone();  // allocated and freed inside: the pool's
    y = copy.clone();
  });
  ASSERT_TRUE(graph.captured());
  EXPECT_GT(graph.num_nodes(), 0);
  EXPECT_GT(graph.pool_bytes(), 0);
  for (float value : {1.0f, -2.5f}) {
    x.fill(value);
    graph.replay();
    const std::vector<float> got = host_values(y);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], value) << i;
  }
}

TEST(CudaGraph, BlocksFreedInsideTheCaptureAreNotHandedOut) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 1 << 16;
  Tensor x = Tensor::empty({n}, DType::F32, Device::CUDA);
  x.fill(3.0f);
  Tensor y;
  cuda::StepGraph graph;
  graph.capture("test", [&] {
    Tensor scratch = Tensor::empty({n}, DType::F32, Device::CUDA);  // freed at the end
    scratch.fill(7.0f);
    y = x.clone();
  });
  // Allocations of the same size after the capture: none may be the scratch block, which
  // every replay writes 7s into.
  std::vector<Tensor> later;
  for (int i = 0; i < 8; ++i) {
    later.push_back(Tensor::empty({n}, DType::F32, Device::CUDA));
    later.back().fill(-1.0f);
  }
  graph.replay();
  graph.replay();
  for (const Tensor& t : later)
    for (float v : host_values(t)) ASSERT_EQ(v, -1.0f);
  for (float v : host_values(y)) ASSERT_EQ(v, 3.0f);
}

TEST(CudaGraph, HostSynchronizationInsideACaptureIsRefused) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  Tensor x = Tensor::zeros({16}, DType::F32, Device::CUDA);
  cuda::StepGraph graph;
  EXPECT_THROW(graph.capture("test", [&] {
    x.fill(5.0f);
    (void)x.to(Device::CPU);  // waits for the stream
  }), Error);
  EXPECT_FALSE(graph.captured());
  EXPECT_FALSE(cuda::capturing());
  // The stream works as before, and a capture can be made again.
  x.fill(1.0f);
  EXPECT_EQ(host_values(x)[0], 1.0f);
  Tensor y;
  graph.capture("test", [&] { y = x.clone(); });
  x.fill(2.0f);
  graph.replay();
  EXPECT_EQ(host_values(y)[0], 2.0f);
}

TEST(CudaGraph, LargeUploadKeepsItsBytes) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = int64_t(cuda::kUploadMaxBytes / sizeof(float)) * 4;  // staged, not a parameter
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i);
  Tensor host = Tensor::from({n}, values);
  Tensor dev = Tensor::zeros({n}, DType::F32, Device::CUDA);
  cuda::StepGraph graph;
  graph.capture("test", [&] { dev.copy_from(host); });
  std::memset(host.raw(), 0, host.nbytes());  // the source changes after the capture
  // Other large uploads reuse the staging pool meanwhile.
  for (int i = 0; i < 4; ++i) (void)Tensor::zeros({n}).to(Device::CUDA);
  graph.replay();
  const std::vector<float> got = host_values(dev);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], float(i)) << i;
}

TEST(CudaGraph, PoolReturnsToTheCacheWhenTheGraphIsDestroyed) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 1 << 18;
  const int64_t before = cuda::device_memory_stats().allocated_bytes;
  {
    cuda::StepGraph graph;
    graph.capture("test", [&] {
      Tensor t = Tensor::empty({n}, DType::F32, Device::CUDA);
      t.fill(1.0f);
    });
    graph.replay();
    // The block the graph writes stays allocated while the graph lives.
    EXPECT_GE(cuda::device_memory_stats().allocated_bytes, before + n * 4);
  }
  EXPECT_EQ(cuda::device_memory_stats().allocated_bytes, before);
}

}  // namespace
}  // namespace megaton
#else
TEST(CudaGraph, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }
#endif
