// Megatron's GPTDataset: train/valid/test splits of an indexed dataset cut into
// fixed-length samples through cached document, sample and shuffle indices.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/file_util.h"
#include "data/indexed_dataset.h"

namespace megaton::data {

// A source of training samples. Read-only after construction and thread-safe.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  // Number of samples; get() accepts indices in [0, size()).
  virtual int64_t size() const = 0;
  // Tokens per sample minus one: get() writes seq_length() + 1 tokens.
  virtual int64_t seq_length() const = 0;
  // Sample `index` into tokens[seq_length() + 1] (inputs are tokens[0 : seq_length],
  // labels tokens[1 : seq_length + 1]). Throws InternalError when index is out of range.
  virtual void get(int64_t index, int32_t* tokens) const = 0;
};

struct GPTDatasetConfig {
  // (weight, path prefix) pairs, e.g. from parse_data_path(--data-path). Weights need
  // not be normalised. With one prefix its weight is ignored.
  std::vector<std::pair<double, std::string>> blend;
  // Megatron's blend_per_split (--train-data-path, --valid-data-path, --test-data-path or
  // --per-split-data-args-path): one blend per split, each dataset used whole for its
  // split (split is then not read). Used instead of `blend` when any is non-empty; an
  // empty one builds no dataset for that split.
  std::array<std::vector<std::pair<double, std::string>>, 3> blend_per_split;
  // --split: train, valid, test fractions of the documents, e.g. "969,30,1" or "98/2/0".
  std::string split = "969,30,1";
  // --seq-length: tokens per sample (each sample holds seq_length + 1 tokens).
  int64_t seq_length = 0;
  // --seed: seeds the document and shuffle index RNG (the same seed for every split
  // and every blended dataset, as in Megatron).
  uint64_t seed = 1234;
  // --data-cache-path: where the index caches go; empty = next to each dataset's .idx.
  std::string path_to_cache;
};

enum class Split : int { Train = 0, Valid = 1, Test = 2 };
// "train", "valid", "test".
std::string_view split_name(Split split);

// Megatron parse_and_normalize_split: up to 3 non-negative numbers separated by ',' or
// '/', missing ones are 0, normalised to sum 1. Throws megaton::Error naming --split.
std::array<double, 3> parse_split(const std::string& split);
// Megatron _get_split_indices: [begin, end) of each split over num_documents documents
// (round-half-to-even of fraction * num_documents, the excess taken off every bound).
std::array<std::pair<int64_t, int64_t>, 3> split_ranges(const std::array<double, 3>& fractions,
                                                        int64_t num_documents);

// The index RNG: std::mt19937_64 seeded with --seed, unbiased bounded integers by
// Lemire's multiply-and-reject, Fisher-Yates shuffles from the back (numpy's order).
// Portable: the same seed gives the same indices on every platform and compiler. It is
// NOT numpy's RandomState, so the indices differ from Megatron's for the same seed.
class ShuffleRng {
 public:
  explicit ShuffleRng(uint64_t seed) : engine_(seed) {}
  // Uniform in [0, n), n >= 1.
  uint64_t below(uint64_t n);
  template <typename T>
  void shuffle(std::span<T> values) {
    for (size_t i = values.size(); i > 1; --i) std::swap(values[i - 1], values[below(i)]);
  }

 private:
  std::mt19937_64 engine_;
};

// The pieces of Megatron's _build_document_sample_shuffle_indices, exposed for tests.
// Smallest E with E * tokens_per_epoch >= num_samples * seq_length + 1 (at least 1).
int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t num_samples, int64_t seq_length);
// Whether the last epoch is shuffled apart: it supplies fewer than 80% of an epoch's
// samples. Always false for one epoch.
bool gpt_separate_final_epoch(int64_t num_epochs, int64_t tokens_per_epoch, int64_t num_samples,
                              int64_t seq_length);
// Documents [begin, end) tiled num_epochs times and shuffled as one array; with
// separate_final_epoch the first E-1 epochs and the last are shuffled apart.
std::vector<int32_t> build_document_index(int64_t begin, int64_t end, int64_t num_epochs,
                                          bool separate_final_epoch, ShuffleRng& rng);
// Megatron helpers.cpp build_sample_idx with drop_last_partial_sequence: returns
// [(num_samples + 1) * 2] pairs (position in document_index, token offset) where
// num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length. Sample i spans from
// pair i to pair i + 1 inclusive: seq_length + 1 tokens, crossing documents, and its
// last token is the first of sample i + 1. sequence_lengths is indexed by document id.
std::vector<int64_t> build_sample_index(std::span<const int32_t> sequence_lengths,
                                        std::span<const int32_t> document_index, int64_t seq_length,
                                        int64_t num_epochs, int64_t tokens_per_epoch);
// 0..total_size-1 with [0, num_samples) and [num_samples, total_size) shuffled apart.
std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, ShuffleRng& rng);

// One split of one indexed dataset. The three indices are cached as
//   <cache>/<prefix name>_<hash>_{doc_idx,sample_idx,shuffle_idx}.bin
//   <cache>/<prefix name>_<hash>_description.json
// where hash is FNV-1a of the description (class, format, dataset path and sizes,
// split, range, seed, seq_length, num_samples, RNG). A cache whose description matches
// is loaded (memory-mapped); otherwise the indices are built and written atomically,
// the description last. size() is the number of samples the indices hold, which is at
// least num_samples (whole epochs, as Megatron's len(GPTDataset)).
class GPTDataset final : public SampleSource {
 public:
  // Throws megaton::Error when the split has no documents or no tokens, num_samples < 1,
  // seq_length < 1, or the cache cannot be written.
  GPTDataset(std::shared_ptr<const IndexedDataset> dataset, const GPTDatasetConfig& config,
             Split split, int64_t num_samples);

  int64_t size() const override { return num_built_samples_; }
  int64_t seq_length() const override { return seq_length_; }
  void get(int64_t index, int32_t* tokens) const override;

  Split split() const { return split_; }
  // Documents (sequences of the .idx) [begin, end) of this split.
  std::pair<int64_t, int64_t> document_range() const { return range_; }
  int64_t num_epochs() const { return num_epochs_; }
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  // True when the indices were built by this constructor, false when loaded from cache.
  bool built_indices() const { return built_; }
  // "<cache>/<prefix name>_<hash>": the cache files add _doc_idx.bin etc.
  const std::string& cache_prefix() const { return cache_prefix_; }
  const std::string& description() const { return description_; }
  std::span<const int32_t> document_index() const;
  std::span<const int64_t> sample_index() const;
  std::span<const int64_t> shuffle_index() const;

 private:
  bool load_cache();
  void build_and_save();

  std::shared_ptr<const IndexedDataset> dataset_;
  Split split_;
  std::pair<int64_t, int64_t> range_;
  int64_t seq_length_;
  uint64_t seed_;
  int64_t num_samples_;
  int64_t num_epochs_ = 0;
  int64_t tokens_per_epoch_ = 0;
  int64_t num_built_samples_ = 0;
  bool built_ = false;
  std::string description_;
  std::string cache_prefix_;
  MappedFile doc_idx_, sample_idx_, shuffle_idx_;
};

// Megatron's BlendedMegatronDatasetBuilder for GPT (in blended_dataset.cpp): with one prefix, a
// GPTDataset per split with num_samples[split] samples; with several, a BlendedDataset of
// num_samples samples over one GPTDataset per prefix (blended_dataset.h). A split with 0 requested
// samples, or whose fraction gives no documents, is nullptr. Throws megaton::Error for an
// empty blend, a non-positive weight, seq_length < 1, negative sample counts, a missing
// or bad dataset, or a split that is empty for some prefixes of a blend but not others.
std::array<std::unique_ptr<SampleSource>, 3> build_gpt_datasets(const GPTDatasetConfig& config,
                                                                std::array<int64_t, 3> num_samples);

}  // namespace megaton::data
