// Preprocessing: read documents, tokenize them on worker threads, write them in order.
#include "data/preprocess.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "data/indexed_dataset.h"

namespace megaton::data {

std::string preprocess_output_prefix(const std::string& output_prefix, const std::string& key) {
  return fmt::format("{}_{}_document", output_prefix, key);
}

namespace {

// Documents are cut into chunks (of one file) that a worker tokenizes as a unit; the
// writer takes chunks back in submission order.
constexpr size_t kChunkDocuments = 1024;
constexpr int64_t kChunkBytes = 4 << 20;

struct Chunk {
  int64_t index = 0;
  const std::string* path = nullptr;
  InputFormat format = InputFormat::Text;
  std::vector<SourceDocument> documents;
  int64_t bytes = 0;
  // Results, one per json key: the tokens of all documents back to back, the length of
  // every sequence, and the number of sequences of every document.
  struct KeyTokens {
    std::vector<int32_t> tokens;
    std::vector<int32_t> sequence_lengths;
    std::vector<int32_t> sequences_per_document;
  };
  std::vector<KeyTokens> keys;
  int64_t replaced_bytes = 0;
  std::exception_ptr error;
};

void tokenize_chunk(Chunk& chunk, const Tokenizer& tokenizer, const PreprocessOptions& options) {
  const size_t num_keys = options.json_keys.size();
  chunk.keys.assign(num_keys, {});
  for (SourceDocument& doc : chunk.documents) {
    auto texts = document_texts(std::move(doc), chunk.format, options.json_keys, *chunk.path,
                                &chunk.replaced_bytes);
    for (size_t k = 0; k < num_keys; ++k) {
      Chunk::KeyTokens& out = chunk.keys[k];
      int32_t sequences = 0;
      for (const std::string& text : texts[k]) {
        std::vector<int32_t> ids = tokenizer.encode(text);
        if (ids.empty()) continue;  // Megatron drops empty sentences
        out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
        out.sequence_lengths.push_back(static_cast<int32_t>(ids.size()));
        ++sequences;
      }
      if (options.append_eod && sequences > 0) {
        out.tokens.push_back(tokenizer.eod());
        ++out.sequence_lengths.back();
      }
      out.sequences_per_document.push_back(sequences);
    }
  }
  chunk.documents.clear();
  chunk.documents.shrink_to_fit();
}

void validate(const PreprocessOptions& options) {
  if (options.inputs.empty()) fail("--input: at least one file, directory or glob required");
  if (options.output_prefix.empty()) fail("--output-prefix: required");
  if (options.workers < 1 || options.workers > kMaxPreprocessWorkers)
    fail("--workers {}: expected 1 to {} tokenizer threads (the maximum)", options.workers,
         kMaxPreprocessWorkers);
  if (options.json_keys.empty()) fail("--json-keys: at least one key required");
  std::set<std::string> seen;
  for (const auto& key : options.json_keys) {
    if (key.empty()) fail("--json-keys: empty key");
    if (!seen.insert(key).second) fail("--json-keys: key '{}' given twice", key);
  }
  std::filesystem::path parent = std::filesystem::path(options.output_prefix).parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent))
    fail("--output-prefix {}: directory {} does not exist", options.output_prefix, parent.string());
}

// Worker threads and the queues between them and the writer. The destructor stops and
// joins the workers, so an exception in the writer unwinds cleanly.
class WorkerPool {
 public:
  // Throws megaton::Error naming --workers when a thread cannot be started (the OS
  // thread limit, memory), after stopping and joining the threads already started: a
  // joinable std::thread must never be destroyed (std::terminate).
  WorkerPool(int workers, const Tokenizer& tokenizer, const PreprocessOptions& options) {
    try {
      threads_.reserve(size_t(workers));
      for (int i = 0; i < workers; ++i)
        threads_.emplace_back([this, &tokenizer, &options] { work(tokenizer, options); });
    } catch (const std::exception& e) {
      const size_t started = threads_.size();
      stop_and_join();
      fail("--workers {}: could not start tokenizer thread {} ({}); try fewer workers",
           workers, started + 1, e.what());
    }
  }
  ~WorkerPool() { stop_and_join(); }

  void submit(std::unique_ptr<Chunk> chunk) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      todo_.push_back(std::move(chunk));
    }
    work_ready_.notify_one();
  }

  // Blocks until chunk `index` is tokenized and returns it.
  std::unique_ptr<Chunk> take(int64_t index) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_ready_.wait(lock, [&] { return done_.count(index) > 0; });
    auto node = done_.extract(index);
    return std::move(node.mapped());
  }

  // The chunk `index` if it is already tokenized, else nullptr.
  std::unique_ptr<Chunk> try_take(int64_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = done_.find(index);
    if (it == done_.end()) return nullptr;
    auto chunk = std::move(it->second);
    done_.erase(it);
    return chunk;
  }

 private:
  void work(const Tokenizer& tokenizer, const PreprocessOptions& options) {
    for (;;) {
      std::unique_ptr<Chunk> chunk;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_ready_.wait(lock, [&] { return closing_ || !todo_.empty(); });
        if (closing_) return;
        chunk = std::move(todo_.front());
        todo_.pop_front();
      }
      try {
        tokenize_chunk(*chunk, tokenizer, options);
      } catch (...) {
        chunk->error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        done_[chunk->index] = std::move(chunk);
      }
      done_ready_.notify_all();
    }
  }

  void stop_and_join() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
      todo_.clear();
    }
    work_ready_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  std::mutex mutex_;
  std::condition_variable work_ready_, done_ready_;
  std::deque<std::unique_ptr<Chunk>> todo_;
  std::map<int64_t, std::unique_ptr<Chunk>> done_;
  bool closing_ = false;
  std::vector<std::thread> threads_;
};

// "a.jsonl", "a.jsonl, b.jsonl", "a.jsonl, b.jsonl, c.jsonl and 7 more".
std::string describe_files(const std::vector<std::string>& files) {
  std::string out;
  const size_t shown = std::min<size_t>(files.size(), 3);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + files[i];
  if (files.size() > shown) out += fmt::format(" and {} more", files.size() - shown);
  return out;
}

// An input without tokens would write a dataset that training rejects later, far from
// the cause: refuse it here, before anything is renamed into place.
void check_not_empty(const PreprocessResult& result,
                     const std::vector<std::unique_ptr<IndexedDatasetBuilder>>& builders,
                     const PreprocessOptions& options) {
  const std::string inputs = describe_files(result.input_files);
  if (result.totals.documents == 0)
    fail("--input {}: no documents found; nothing written", inputs);
  for (size_t k = 0; k < builders.size(); ++k)
    if (builders[k]->num_tokens() == 0)
      fail("--input {}: {} documents, all empty{}; nothing written", inputs,
           result.totals.documents,
           options.json_keys.size() > 1 ? fmt::format(" under json key '{}'", options.json_keys[k])
                                        : std::string());
}

}  // namespace

PreprocessResult preprocess(const PreprocessOptions& options,
                            const std::function<void(const PreprocessProgress&)>& on_progress) {
  validate(options);
  TokenizerOptions t;
  t.type = options.tokenizer_type;
  t.model = options.tokenizer_model;
  t.vocab_file = options.vocab_file;
  t.merge_file = options.merge_file;
  t.include_special_tokens = options.tokenizer_hf_include_special_tokens;
  auto tokenizer = make_tokenizer(t);
  return preprocess(options, *tokenizer, on_progress);
}

PreprocessResult preprocess(const PreprocessOptions& options, const Tokenizer& tokenizer,
                            const std::function<void(const PreprocessProgress&)>& on_progress) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  validate(options);
  PreprocessResult result;
  result.input_files = expand_inputs(options.inputs);
  std::vector<InputFormat> formats;
  for (const auto& path : result.input_files) {
    formats.push_back(resolve_input_format(options.input_format, path));
    if (formats.back() != InputFormat::Jsonl && options.json_keys.size() != 1)
      fail("--json-keys: {} is read as {}, which has one field; give exactly one key", path,
           input_format_name(formats.back()));
  }

  const TokenDType dtype = token_dtype_for_vocab(tokenizer.vocab_size());
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  for (const auto& key : options.json_keys) {
    result.output_prefixes.push_back(preprocess_output_prefix(options.output_prefix, key));
    builders.push_back(
        std::make_unique<IndexedDatasetBuilder>(result.output_prefixes.back(), dtype));
  }

  PreprocessProgress& totals = result.totals;
  auto last_report = start;
  auto seconds_since_start = [&] {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  auto write_chunk = [&](std::unique_ptr<Chunk> chunk) {
    if (chunk->error) std::rethrow_exception(chunk->error);
    for (size_t k = 0; k < builders.size(); ++k) {
      const Chunk::KeyTokens& out = chunk->keys[k];
      size_t token_pos = 0, seq_pos = 0;
      for (int32_t sequences : out.sequences_per_document) {
        std::span<const int32_t> lengths(out.sequence_lengths.data() + seq_pos, sequences);
        size_t n = 0;
        for (int32_t len : lengths) n += len;
        builders[k]->add_document(std::span<const int32_t>(out.tokens.data() + token_pos, n),
                                  lengths);
        token_pos += n;
        seq_pos += sequences;
      }
      totals.tokens += static_cast<int64_t>(out.tokens.size());
      if (k == 0) totals.documents += static_cast<int64_t>(out.sequences_per_document.size());
    }
    totals.bytes += chunk->bytes;
    totals.replaced_bytes += chunk->replaced_bytes;
    if (on_progress && Clock::now() - last_report > std::chrono::milliseconds(500)) {
      last_report = Clock::now();
      totals.seconds = seconds_since_start();
      on_progress(totals);
    }
  };

  {
    WorkerPool pool(options.workers, tokenizer, options);
    const int64_t max_in_flight = 4 * int64_t(options.workers);
    int64_t submitted = 0, written = 0;
    auto submit = [&](std::unique_ptr<Chunk> chunk) {
      // Bound memory: wait for the oldest chunk while too many are in flight, and write
      // whatever is ready in order.
      while (submitted - written >= max_in_flight) write_chunk(pool.take(written++));
      while (auto ready = pool.try_take(written)) {
        write_chunk(std::move(ready));
        ++written;
      }
      chunk->index = submitted++;
      pool.submit(std::move(chunk));
    };
    for (size_t f = 0; f < result.input_files.size(); ++f) {
      DocumentReader reader(result.input_files[f], formats[f]);
      auto chunk = std::make_unique<Chunk>();
      SourceDocument doc;
      while (reader.next(doc)) {
        chunk->bytes += static_cast<int64_t>(doc.text.size());
        chunk->documents.push_back(std::move(doc));
        doc = SourceDocument{};
        if (chunk->documents.size() >= kChunkDocuments || chunk->bytes >= kChunkBytes) {
          chunk->path = &result.input_files[f];
          chunk->format = formats[f];
          submit(std::move(chunk));
          chunk = std::make_unique<Chunk>();
        }
      }
      if (!chunk->documents.empty()) {
        chunk->path = &result.input_files[f];
        chunk->format = formats[f];
        submit(std::move(chunk));
      }
    }
    while (written < submitted) write_chunk(pool.take(written++));
  }
  check_not_empty(result, builders, options);
  // All outputs are written and closed before the first is renamed into place, and a
  // failed rename takes back the outputs already renamed: all of them, or none.
  for (auto& builder : builders) builder->finish_writing();
  size_t published = 0;
  try {
    for (; published < builders.size(); ++published) builders[published]->publish();
  } catch (...) {
    for (size_t k = 0; k < published; ++k) builders[k]->unpublish();
    throw;
  }
  totals.seconds = seconds_since_start();
  totals.done = true;
  if (on_progress) on_progress(totals);
  return result;
}

}  // namespace megaton::data
