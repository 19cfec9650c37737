// Megatron's GPTDataset: split ranges, document/sample/shuffle indices and their cache.
#include "data/gpt_dataset.h"

#include <cfenv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace megaton::data {

namespace fs = std::filesystem;

std::string_view split_name(Split split) {
  switch (split) {
    case Split::Train:
      return "train";
    case Split::Valid:
      return "valid";
    case Split::Test:
      return "test";
  }
  return "?";
}

std::array<double, 3> parse_split(const std::string& split) {
  std::array<double, 3> fractions{0, 0, 0};
  size_t count = 0, start = 0;
  for (;;) {
    size_t end = split.find_first_of(",/", start);
    std::string part =
        split.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (count == 3) fail("--split '{}': expected at most 3 numbers (train,valid,test)", split);
    char* stop = nullptr;
    double v = std::strtod(part.c_str(), &stop);
    if (part.empty() || *stop != '\0' || !std::isfinite(v) || v < 0)
      fail("--split '{}': '{}' is not a non-negative number", split, part);
    fractions[count++] = v;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  double sum = fractions[0] + fractions[1] + fractions[2];
  if (!(sum > 0)) fail("--split '{}': the fractions sum to 0", split);
  for (double& f : fractions) f /= sum;
  return fractions;
}

std::array<std::pair<int64_t, int64_t>, 3> split_ranges(const std::array<double, 3>& fractions,
                                                        int64_t num_documents) {
  // Python's round() rounds half to even, as nearbyint does in the default FE_TONEAREST.
  MEGATON_CHECK(std::fegetround() == FE_TONEAREST, "rounding mode changed");
  std::array<int64_t, 4> bounds{0, 0, 0, 0};
  for (int i = 0; i < 3; ++i)
    bounds[i + 1] =
        bounds[i] + static_cast<int64_t>(std::nearbyint(fractions[i] * double(num_documents)));
  int64_t excess = bounds[3] - num_documents;
  for (int i = 1; i < 4; ++i) bounds[i] -= excess;
  std::array<std::pair<int64_t, int64_t>, 3> ranges;
  for (int i = 0; i < 3; ++i)
    ranges[i] = {std::max<int64_t>(bounds[i], 0), std::max<int64_t>(bounds[i + 1], 0)};
  return ranges;
}

uint64_t ShuffleRng::below(uint64_t n) {
  // Lemire, "Fast random integer generation in an interval" (2019).
  unsigned __int128 m = static_cast<unsigned __int128>(engine_()) * n;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < n) {
    const uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      m = static_cast<unsigned __int128>(engine_()) * n;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

int64_t gpt_num_epochs(int64_t tokens_per_epoch, int64_t num_samples, int64_t seq_length) {
  MEGATON_CHECK(tokens_per_epoch > 0, "tokens_per_epoch {}", tokens_per_epoch);
  const int64_t requested = num_samples * seq_length + 1;  // + the extra label token
  return std::max<int64_t>(1, (requested + tokens_per_epoch - 1) / tokens_per_epoch);
}

bool gpt_separate_final_epoch(int64_t num_epochs, int64_t tokens_per_epoch, int64_t num_samples,
                              int64_t seq_length) {
  if (num_epochs == 1) return false;
  const int64_t samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) / seq_length;
  const int64_t samples_from_final = num_samples - samples_before_final;
  const int64_t samples_per_epoch = (tokens_per_epoch - 1) / seq_length;
  MEGATON_CHECK(samples_from_final >= 0 && samples_from_final <= samples_per_epoch + 1,
                "{} samples from the final epoch of {}", samples_from_final, samples_per_epoch);
  return samples_from_final < static_cast<int64_t>(0.80 * double(samples_per_epoch));
}

std::vector<int32_t> build_document_index(int64_t begin, int64_t end, int64_t num_epochs,
                                          bool separate_final_epoch, ShuffleRng& rng) {
  MEGATON_CHECK(end <= std::numeric_limits<int32_t>::max(), "document ids above int32: {}", end);
  const int64_t docs = end - begin;
  std::vector<int32_t> index(static_cast<size_t>(docs * num_epochs));
  for (int64_t e = 0; e < num_epochs; ++e)
    for (int64_t d = 0; d < docs; ++d) index[e * docs + d] = static_cast<int32_t>(begin + d);
  std::span<int32_t> all(index);
  if (!separate_final_epoch || num_epochs == 1) {
    rng.shuffle(all);
  } else {
    const size_t first = static_cast<size_t>((num_epochs - 1) * docs);
    rng.shuffle(all.subspan(0, first));
    rng.shuffle(all.subspan(first));
  }
  return index;
}

std::vector<int64_t> build_sample_index(std::span<const int32_t> sequence_lengths,
                                        std::span<const int32_t> document_index, int64_t seq_length,
                                        int64_t num_epochs, int64_t tokens_per_epoch) {
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  std::vector<int64_t> index(static_cast<size_t>(2 * (num_samples + 1)));
  int64_t position = 0;  // into document_index
  int64_t offset = 0;    // tokens into that document
  index[0] = 0;
  index[1] = 0;
  for (int64_t sample = 1; sample <= num_samples; ++sample) {
    int64_t remaining = seq_length + 1;
    while (remaining != 0) {
      const int64_t available = sequence_lengths[document_index[position]] - offset;
      remaining -= available;
      if (remaining <= 0) {
        // The sample ends inside this document; its last token starts the next sample.
        offset += remaining + available - 1;
        remaining = 0;
      } else {
        ++position;
        MEGATON_CHECK(position < static_cast<int64_t>(document_index.size()),
                      "ran out of documents at sample {} of {}", sample, num_samples);
        offset = 0;
      }
    }
    index[2 * sample] = position;
    index[2 * sample + 1] = offset;
  }
  return index;
}

std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, ShuffleRng& rng) {
  std::vector<int64_t> index(static_cast<size_t>(total_size));
  for (int64_t i = 0; i < total_size; ++i) index[i] = i;
  std::span<int64_t> all(index);
  rng.shuffle(all.subspan(0, static_cast<size_t>(num_samples)));
  if (num_samples < total_size) rng.shuffle(all.subspan(static_cast<size_t>(num_samples)));
  return index;
}

// ---------------------------------------------------------------------------------------
// Cache files: a 24-byte header (8-byte magic, u64 element size, u64 count) and the
// elements, little-endian; the data starts 8-byte aligned in the map.

namespace {

constexpr char kCacheMagic[8] = {'M', 'G', 'T', 'N', 'I', 'D', 'X', '1'};
constexpr size_t kCacheHeader = 24;

template <typename T>
void write_cache_array(const std::string& path, const std::vector<T>& values) {
  AtomicFile f(path);
  uint64_t header[2] = {sizeof(T), values.size()};
  f.write(kCacheMagic, sizeof(kCacheMagic));
  f.write(header, sizeof(header));
  f.write(values.data(), values.size() * sizeof(T));
  f.commit();
}

// Maps a cache array; returns false (leaving `out` empty) when it is missing or malformed.
bool map_cache_array(const std::string& path, size_t element_size, uint64_t expected_count,
                     MappedFile& out) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  MappedFile f(path);
  if (f.size() < kCacheHeader || std::memcmp(f.data(), kCacheMagic, 8) != 0) return false;
  uint64_t header[2];
  std::memcpy(header, f.data() + 8, sizeof(header));
  if (header[0] != element_size || header[1] != expected_count ||
      f.size() != kCacheHeader + header[0] * header[1])
    return false;
  out = std::move(f);
  return true;
}

template <typename T>
std::span<const T> cache_span(const MappedFile& f) {
  if (f.size() <= kCacheHeader) return {};
  return {reinterpret_cast<const T*>(f.data() + kCacheHeader),
          (f.size() - kCacheHeader) / sizeof(T)};
}

}  // namespace

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> dataset,
                       const GPTDatasetConfig& config, Split split, int64_t num_samples)
    : dataset_(std::move(dataset)),
      split_(split),
      seq_length_(config.seq_length),
      seed_(config.seed),
      num_samples_(num_samples) {
  const std::string& prefix = dataset_->path_prefix();
  if (seq_length_ < 1) fail("--seq-length {}: expected >= 1", seq_length_);
  if (num_samples_ < 1)
    fail("{}: {} split asked for {} samples, expected >= 1", prefix, split_name(split),
         num_samples_);
  const auto fractions = parse_split(config.split);
  range_ = split_ranges(fractions, dataset_->num_sequences())[static_cast<int>(split)];
  if (range_.second <= range_.first)
    fail("{}: the {} split of --split '{}' has no documents ({} in the dataset)", prefix,
         split_name(split), config.split, dataset_->num_sequences());
  for (int64_t d = range_.first; d < range_.second; ++d)
    tokens_per_epoch_ += dataset_->sequence_length(d);
  if (tokens_per_epoch_ == 0)
    fail("{}: the {} split (documents [{}, {})) holds no tokens", prefix, split_name(split),
         range_.first, range_.second);
  num_epochs_ = gpt_num_epochs(tokens_per_epoch_, num_samples_, seq_length_);
  num_built_samples_ = (num_epochs_ * tokens_per_epoch_ - 1) / seq_length_;

  std::error_code ec;
  fs::path abs_prefix = fs::weakly_canonical(fs::absolute(prefix), ec);
  if (ec) abs_prefix = fs::absolute(prefix);
  nlohmann::ordered_json desc;
  desc["class"] = "GPTDataset";
  desc["format"] = "megaton-gpt-indices-1";
  desc["path_prefix"] = abs_prefix.string();
  desc["index_bytes"] = dataset_->index_bytes();
  desc["data_bytes"] = dataset_->data_bytes();
  desc["num_sequences"] = dataset_->num_sequences();
  desc["split"] = config.split;
  desc["split_fractions"] = fractions;
  desc["index_split"] = split_name(split);
  desc["documents"] = {range_.first, range_.second};
  desc["random_seed"] = seed_;
  desc["sequence_length"] = seq_length_;
  desc["num_samples"] = num_samples_;
  desc["add_extra_token_to_sequence"] = true;
  desc["rng"] = "mt19937_64+lemire+fisher-yates";
  description_ = desc.dump(2) + "\n";

  fs::path cache_dir =
      config.path_to_cache.empty() ? abs_prefix.parent_path() : fs::path(config.path_to_cache);
  if (!config.path_to_cache.empty()) {
    fs::create_directories(cache_dir, ec);
    if (ec) fail("--data-cache-path {}: cannot create: {}", config.path_to_cache, ec.message());
  }
  cache_prefix_ = (cache_dir / abs_prefix.filename()).string() + "_" + fnv1a_hex(description_);

  if (!load_cache()) build_and_save();
}

bool GPTDataset::load_cache() {
  std::error_code ec;
  const std::string desc_path = cache_prefix_ + "_description.json";
  if (!fs::is_regular_file(desc_path, ec)) return false;
  if (read_file(desc_path) != description_) return false;
  const uint64_t docs = static_cast<uint64_t>((range_.second - range_.first) * num_epochs_);
  const uint64_t samples = static_cast<uint64_t>(num_built_samples_);
  return map_cache_array(cache_prefix_ + "_doc_idx.bin", sizeof(int32_t), docs, doc_idx_) &&
         map_cache_array(cache_prefix_ + "_sample_idx.bin", sizeof(int64_t), 2 * (samples + 1),
                         sample_idx_) &&
         map_cache_array(cache_prefix_ + "_shuffle_idx.bin", sizeof(int64_t), samples,
                         shuffle_idx_);
}

void GPTDataset::build_and_save() {
  ShuffleRng rng(seed_);
  const bool separate =
      gpt_separate_final_epoch(num_epochs_, tokens_per_epoch_, num_samples_, seq_length_);
  std::vector<int32_t> doc_idx =
      build_document_index(range_.first, range_.second, num_epochs_, separate, rng);
  std::vector<int32_t> lengths = dataset_->sequence_lengths();
  std::vector<int64_t> sample_idx =
      build_sample_index(lengths, doc_idx, seq_length_, num_epochs_, tokens_per_epoch_);
  const int64_t total = static_cast<int64_t>(sample_idx.size() / 2) - 1;
  MEGATON_CHECK(total == num_built_samples_, "{} samples built, {} expected", total,
                num_built_samples_);
  const int64_t first =
      separate ? ((num_epochs_ - 1) * tokens_per_epoch_ - 1) / seq_length_ : total;
  std::vector<int64_t> shuffle_idx = build_shuffle_index(first, total, rng);

  write_cache_array(cache_prefix_ + "_doc_idx.bin", doc_idx);
  write_cache_array(cache_prefix_ + "_sample_idx.bin", sample_idx);
  write_cache_array(cache_prefix_ + "_shuffle_idx.bin", shuffle_idx);
  write_file_atomic(cache_prefix_ + "_description.json", description_.data(), description_.size());
  built_ = true;
  MEGATON_CHECK(load_cache(), "cache {} unreadable right after writing", cache_prefix_);
}

std::span<const int32_t> GPTDataset::document_index() const {
  return cache_span<int32_t>(doc_idx_);
}
std::span<const int64_t> GPTDataset::sample_index() const {
  return cache_span<int64_t>(sample_idx_);
}
std::span<const int64_t> GPTDataset::shuffle_index() const {
  return cache_span<int64_t>(shuffle_idx_);
}

void GPTDataset::get(int64_t index, int32_t* tokens) const {
  MEGATON_CHECK(index >= 0 && index < num_built_samples_, "sample {} of {}", index,
                num_built_samples_);
  const auto docs = document_index();
  const auto samples = sample_index();
  const int64_t s = shuffle_index()[index];
  const int64_t begin = samples[2 * s], begin_offset = samples[2 * s + 1];
  const int64_t end = samples[2 * s + 2], end_offset = samples[2 * s + 3];
  int64_t written = 0;
  for (int64_t pos = begin; pos <= end; ++pos) {
    const int64_t offset = pos == begin ? begin_offset : 0;
    const int64_t length =
        pos == end ? end_offset + 1 - offset : dataset_->sequence_length(docs[pos]) - offset;
    MEGATON_CHECK(length >= 0 && written + length <= seq_length_ + 1,
                  "sample {} overruns {} tokens (corrupt index cache {}?)", index, seq_length_ + 1,
                  cache_prefix_);
    dataset_->get(docs[pos], offset, length, tokens + written);
    written += length;
  }
  MEGATON_CHECK(written == seq_length_ + 1, "sample {} has {} tokens, expected {}", index, written,
                seq_length_ + 1);
}

}  // namespace megaton::data
