// Timing for the CUDA benchmarks in bench/: CUDA events on megaton::cuda::stream().
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "core/cuda/cuda_check.h"

namespace megaton::bench {

// Median milliseconds of 20 runs of `run` after 5 warm-up runs, each timed with CUDA events
// on the compute stream (its host-side launch included, since the host waits for each).
inline double median_ms(const std::function<void()>& run) {
  for (int i = 0; i < 5; ++i) run();
  std::vector<float> times;
  cudaEvent_t start, stop;
  MEGATON_CUDA_CHECK(cudaEventCreate(&start));
  MEGATON_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 20; ++i) {
    MEGATON_CUDA_CHECK(cudaEventRecord(start, cuda::stream()));
    run();
    MEGATON_CUDA_CHECK(cudaEventRecord(stop, cuda::stream()));
    MEGATON_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MEGATON_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  MEGATON_CUDA_CHECK(cudaEventDestroy(start));
  MEGATON_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace megaton::bench
