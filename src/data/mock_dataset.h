// MockGPTDataset: random token samples for --mock-data runs (throughput, no corpus).
#pragma once
#include <cstdint>

#include "data/gpt_dataset.h"

namespace megaton::data {

// Sample i is seq_length + 1 token ids uniform in [0, vocab_size), drawn from Philox
// keyed by (seed, split stream, i): deterministic and free to index. Like Megatron's
// --mock-data, it measures speed, not learning.
class MockGPTDataset final : public SampleSource {
 public:
  MockGPTDataset(int64_t num_samples, int64_t seq_length, int64_t vocab_size, uint64_t seed,
                 uint64_t stream);
  int64_t size() const override { return num_samples_; }
  int64_t seq_length() const override { return seq_length_; }
  void get(int64_t index, int32_t* tokens) const override;

 private:
  int64_t num_samples_, seq_length_, vocab_size_;
  uint64_t seed_, stream_;
};

}  // namespace megaton::data
