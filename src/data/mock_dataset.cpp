// Random-token samples.
#include "data/mock_dataset.h"

#include "core/rng.h"

namespace megaton::data {

MockGPTDataset::MockGPTDataset(int64_t num_samples, int64_t seq_length, int64_t vocab_size,
                               uint64_t seed, uint64_t stream)
    : num_samples_(num_samples),
      seq_length_(seq_length),
      vocab_size_(vocab_size),
      seed_(seed),
      stream_(stream) {}

void MockGPTDataset::get(int64_t index, int32_t* tokens) const {
  Philox rng(seed_);
  uint64_t base = uint64_t(index) * uint64_t(seq_length_ + 1);
  for (int64_t i = 0; i <= seq_length_; ++i)
    tokens[i] = int32_t(rng.uniform(stream_, base + uint64_t(i)) * float(vocab_size_)) %
                int32_t(vocab_size_);
}

}  // namespace megaton::data
