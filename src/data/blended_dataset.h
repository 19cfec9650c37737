// Megatron's BlendedDataset: samples drawn from several datasets in fixed proportions,
// and the --data-path parser that gives the blend.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "data/gpt_dataset.h"

namespace megaton::data {

// --data-path tokens -> (weight, prefix) pairs: a single token is one prefix with
// weight 1; otherwise the tokens must be pairs "weight prefix" with finite weights > 0
// (weights are not normalised here). Throws megaton::Error naming --data-path and the
// offending token for anything else (no tokens, an odd count, a weight that is not a
// positive number). Unlike Megatron, several prefixes without weights are refused.
std::vector<std::pair<double, std::string>> parse_data_path(const std::vector<std::string>& tokens);

// Megatron _get_size_per_split_per_dataset: samples to ask of a dataset with normalised
// weight `weight` so that a blend of `size` samples never runs short:
// ceil(ceil(size * weight) * 1.005).
int64_t blended_samples_per_dataset(double weight, int64_t size);

// Megatron helpers.cpp build_blending_indices: for each global sample i in [0, size),
// the dataset d with the largest error weights[d] * max(i, 1) - taken[d] (the first on
// ties), and taken[d] (then incremented) as the sample within it. weights normalised.
// dataset_index[size], dataset_sample_index[size].
void build_blending_indices(std::span<const double> weights, int64_t size,
                            std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index);

// `size` samples over `datasets` in the proportions of `weights` (normalised here). The
// blending indices are computed in memory on construction (not cached on disk). Throws
// megaton::Error when a dataset is too small for its share, the datasets disagree on
// seq_length, or the weights are not positive.
class BlendedDataset final : public SampleSource {
 public:
  BlendedDataset(std::vector<std::unique_ptr<SampleSource>> datasets, std::vector<double> weights,
                 int64_t size);

  int64_t size() const override { return size_; }
  int64_t seq_length() const override { return datasets_.front()->seq_length(); }
  void get(int64_t index, int32_t* tokens) const override;

  const std::vector<double>& weights() const { return weights_; }
  // Which dataset sample `index` comes from, and which of its samples.
  int dataset_of(int64_t index) const { return dataset_index_[index]; }
  int64_t sample_of(int64_t index) const { return dataset_sample_index_[index]; }
  const SampleSource& dataset(int d) const { return *datasets_[d]; }

 private:
  std::vector<std::unique_ptr<SampleSource>> datasets_;
  std::vector<double> weights_;
  int64_t size_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

}  // namespace megaton::data
