// Megatron's BlendedDataset, the --data-path parser and build_gpt_datasets.
#include "data/blended_dataset.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace megaton::data {

namespace {

bool parse_number(const std::string& s, double& value) {
  if (s.empty()) return false;
  char* end = nullptr;
  value = std::strtod(s.c_str(), &end);
  return *end == '\0';
}

}  // namespace

std::vector<std::pair<double, std::string>> parse_data_path(
    const std::vector<std::string>& tokens) {
  if (tokens.empty()) fail("--data-path: expected a path prefix or 'weight prefix' pairs");
  if (tokens.size() == 1) return {{1.0, tokens[0]}};
  if (tokens.size() % 2 != 0)
    fail(
        "--data-path: {} values; several datasets need 'weight prefix' pairs, e.g. "
        "--data-path 0.7 a_text_document 0.3 b_text_document",
        tokens.size());
  std::vector<std::pair<double, std::string>> blend;
  for (size_t i = 0; i < tokens.size(); i += 2) {
    double w = 0;
    if (!parse_number(tokens[i], w))
      fail("--data-path: '{}' (value {}) is not a weight; expected 'weight prefix' pairs",
           tokens[i], i + 1);
    if (!std::isfinite(w) || w <= 0)
      fail("--data-path: weight '{}' of {} must be a positive number", tokens[i], tokens[i + 1]);
    if (tokens[i + 1].empty()) fail("--data-path: empty prefix after weight '{}'", tokens[i]);
    blend.emplace_back(w, tokens[i + 1]);
  }
  return blend;
}

int64_t blended_samples_per_dataset(double weight, int64_t size) {
  return static_cast<int64_t>(std::ceil(std::ceil(double(size) * weight) * 1.005));
}

void build_blending_indices(std::span<const double> weights, int64_t size,
                            std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index) {
  const size_t n = weights.size();
  MEGATON_CHECK(n >= 1 && n <= size_t(std::numeric_limits<int16_t>::max()), "{} datasets", n);
  dataset_index.assign(static_cast<size_t>(size), 0);
  dataset_sample_index.assign(static_cast<size_t>(size), 0);
  std::vector<int64_t> taken(n, 0);
  for (int64_t i = 0; i < size; ++i) {
    // Megatron uses max(i, 1): sample 0 sees the same targets as sample 1.
    const double position = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double best_error = weights[0] * position - static_cast<double>(taken[0]);
    for (size_t d = 1; d < n; ++d) {
      double error = weights[d] * position - static_cast<double>(taken[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[i] = static_cast<int16_t>(best);
    dataset_sample_index[i] = taken[best]++;
  }
}

BlendedDataset::BlendedDataset(std::vector<std::unique_ptr<SampleSource>> datasets,
                               std::vector<double> weights, int64_t size)
    : datasets_(std::move(datasets)), weights_(std::move(weights)), size_(size) {
  MEGATON_CHECK(!datasets_.empty() && datasets_.size() == weights_.size(),
                "{} datasets, {} weights", datasets_.size(), weights_.size());
  MEGATON_CHECK(size_ >= 0, "blended size {}", size_);
  double sum = 0;
  for (double w : weights_) {
    if (!std::isfinite(w) || w <= 0) fail("blend weight {}: expected a positive number", w);
    sum += w;
  }
  for (double& w : weights_) w /= sum;
  for (const auto& d : datasets_) {
    MEGATON_CHECK(d != nullptr, "null dataset in a blend");
    if (d->seq_length() != datasets_.front()->seq_length())
      fail("blend: datasets with seq_length {} and {}", datasets_.front()->seq_length(),
           d->seq_length());
  }
  build_blending_indices(weights_, size_, dataset_index_, dataset_sample_index_);
  std::vector<int64_t> needed(datasets_.size(), 0);
  for (int64_t i = 0; i < size_; ++i)
    needed[dataset_index_[i]] = std::max(needed[dataset_index_[i]], dataset_sample_index_[i] + 1);
  for (size_t d = 0; d < datasets_.size(); ++d)
    if (needed[d] > datasets_[d]->size())
      fail("blend: dataset {} (weight {:.4f}) has {} samples, the blend needs {}", d, weights_[d],
           datasets_[d]->size(), needed[d]);
}

void BlendedDataset::get(int64_t index, int32_t* tokens) const {
  MEGATON_CHECK(index >= 0 && index < size_, "sample {} of {}", index, size_);
  datasets_[dataset_index_[index]]->get(dataset_sample_index_[index], tokens);
}

// ---------------------------------------------------------------------------------------

namespace {
// The datasets of one split built from a blend used whole for that split (Megatron's
// BlendedMegatronDatasetBuilder with blend_per_split: each low-level dataset gets the
// split vector with 1 for its split).
std::unique_ptr<SampleSource> build_per_split(const GPTDatasetConfig& config, Split split,
                                              const std::vector<std::pair<double, std::string>>& blend,
                                              int64_t num_samples) {
  GPTDatasetConfig whole = config;
  whole.split = split == Split::Train ? "1,0,0" : split == Split::Valid ? "0,1,0" : "0,0,1";
  whole.blend = blend;
  whole.blend_per_split = {};
  std::array<int64_t, 3> counts{};
  counts[int(split)] = num_samples;
  return std::move(build_gpt_datasets(whole, counts)[int(split)]);
}
}  // namespace

std::array<std::unique_ptr<SampleSource>, 3> build_gpt_datasets(
    const GPTDatasetConfig& config, std::array<int64_t, 3> num_samples) {
  const auto& per_split = config.blend_per_split;
  if (!per_split[0].empty() || !per_split[1].empty() || !per_split[2].empty()) {
    std::array<std::unique_ptr<SampleSource>, 3> result;
    for (int s = 0; s < 3; ++s)
      if (!per_split[s].empty() && num_samples[s] > 0)
        result[s] = build_per_split(config, static_cast<Split>(s), per_split[s], num_samples[s]);
    return result;
  }
  if (config.blend.empty()) fail("--data-path: no datasets given");
  if (config.seq_length < 1) fail("--seq-length {}: expected >= 1", config.seq_length);
  for (int s = 0; s < 3; ++s)
    if (num_samples[s] < 0)
      fail("{} samples {}: expected >= 0", split_name(static_cast<Split>(s)), num_samples[s]);
  const auto fractions = parse_split(config.split);

  std::vector<std::shared_ptr<const IndexedDataset>> datasets;
  std::vector<double> weights;
  double weight_sum = 0;
  for (const auto& [w, prefix] : config.blend) {
    if (config.blend.size() > 1 && (!std::isfinite(w) || w <= 0))
      fail("--data-path: weight {} of {} must be a positive number", w, prefix);
    datasets.push_back(std::make_shared<const IndexedDataset>(prefix));
    weights.push_back(w);
    weight_sum += w;
  }
  for (double& w : weights) w /= weight_sum;

  std::array<std::unique_ptr<SampleSource>, 3> result;
  for (int s = 0; s < 3; ++s) {
    const Split split = static_cast<Split>(s);
    if (num_samples[s] == 0) continue;
    std::vector<bool> has_documents;
    for (const auto& ds : datasets) {
      auto range = split_ranges(fractions, ds->num_sequences())[s];
      has_documents.push_back(range.second > range.first);
    }
    size_t nonempty = std::count(has_documents.begin(), has_documents.end(), true);
    if (nonempty == 0) continue;
    if (nonempty != datasets.size()) {
      size_t d =
          std::find(has_documents.begin(), has_documents.end(), false) - has_documents.begin();
      fail(
          "--data-path: the {} split of {} has no documents under --split '{}' while other "
          "datasets of the blend have some",
          split_name(split), datasets[d]->path_prefix(), config.split);
    }
    if (datasets.size() == 1) {
      result[s] = std::make_unique<GPTDataset>(datasets[0], config, split, num_samples[s]);
      continue;
    }
    std::vector<std::unique_ptr<SampleSource>> parts;
    for (size_t d = 0; d < datasets.size(); ++d)
      parts.push_back(std::make_unique<GPTDataset>(
          datasets[d], config, split, blended_samples_per_dataset(weights[d], num_samples[s])));
    result[s] = std::make_unique<BlendedDataset>(std::move(parts), weights, num_samples[s]);
  }
  return result;
}

}  // namespace megaton::data
