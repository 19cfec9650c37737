// megaton convert --load CKPT --to hf OUT: a Megaton checkpoint (either format, any layout)
// -> a Hugging Face model directory.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "ckpt/checkpoint.h"
#include "ckpt/hf_export.h"
#include "ckpt/safetensors.h"
#include "ckpt/sharded.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "train/checkpoint_args.h"
#include "train/hf_config.h"
#include "train/hf_convert.h"
#include "train/staged_directory.h"

namespace fs = std::filesystem;

namespace megaton {

namespace {

// The checkpoint's "model.<name>" tensors by <name>, read one at a time as stored (sharded:
// by offset; the single-file format of earlier versions is read whole once).
class ModelTensors {
 public:
  ModelTensors(const std::string& load_dir, const std::string& iteration_dir) {
    if (ckpt::is_sharded_checkpoint(iteration_dir)) {
      reader_.emplace(iteration_dir);
      for (const auto& [name, info] : reader_->tensors())
        if (name.starts_with("model.")) names_.push_back(name.substr(6));
      return;
    }
    ckpt::LoadedCheckpoint ck = ckpt::load_checkpoint(load_dir);
    for (auto& [name, t] : ck.tensors)
      if (name.starts_with("model.")) {
        names_.push_back(name.substr(6));
        whole_[name.substr(6)] = std::move(t);
      }
  }
  const std::vector<std::string>& names() const { return names_; }
  Tensor read(const std::string& name) {
    return reader_ ? reader_->read("model." + name) : whole_.at(name);
  }
  // After a part's tensors are read: the files' pages need not stay resident.
  void release() {
    if (reader_) reader_->release_mapped_pages();
  }

 private:
  std::optional<ckpt::ShardedCheckpointReader> reader_;
  std::map<std::string, Tensor> whole_;
  std::vector<std::string> names_;
};

// Hugging Face's model.safetensors, or shards of at most max_bytes each (a tensor larger
// than that alone) with model.safetensors.index.json, written as tensors arrive: the writer
// holds one shard's tensors at a time.
class ShardWriter {
 public:
  ShardWriter(fs::path dir, DType dtype, int64_t max_bytes)
      : dir_(std::move(dir)), dtype_(dtype), max_bytes_(max_bytes) {}

  void add(const std::string& name, const Tensor& t) {
    const int64_t bytes = t.numel() * int64_t(dtype_size(dtype_));
    if (!pending_.empty() && pending_bytes_ + bytes > max_bytes_) flush();
    pending_.emplace_back(name, t.dtype() == dtype_ ? t : t.to(dtype_));
    pending_bytes_ += bytes;
    total_bytes_ += bytes;
    ++tensors_;
  }

  // Writes the last shard, names the files (model.safetensors when there is one, else
  // model-0000i-of-0000N.safetensors) and the index. Returns the number of files.
  int64_t finish() {
    flush();
    const size_t n = std::max<size_t>(shards_.size(), 1);
    if (shards_.empty()) write_part({});  // a model of no tensors: one empty file
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < shards_.size(); ++i) {
      const std::string file = n == 1 ? "model.safetensors"
                                      : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
      fs::rename(dir_ / part_name(i), dir_ / file);
      for (const std::string& name : shards_[i]) weight_map[name] = file;
    }
    if (n > 1) {
      nlohmann::json index = {{"metadata", {{"total_size", total_bytes_}}},
                              {"weight_map", weight_map}};
      std::ofstream f(dir_ / "model.safetensors.index.json");
      f << index.dump(2) << "\n";
      if (!f.flush()) fail("cannot write {}", (dir_ / "model.safetensors.index.json").string());
    }
    return int64_t(n);
  }
  int64_t tensors() const { return tensors_; }

 private:
  static std::string part_name(size_t i) { return fmt::format("part-{:05d}.safetensors", i); }
  void write_part(const std::vector<std::pair<std::string, Tensor>>& part) {
    ckpt::save_safetensors((dir_ / part_name(shards_.size())).string(), part, {{"format", "pt"}});
    std::vector<std::string> names;
    for (const auto& [name, t] : part) names.push_back(name);
    shards_.push_back(std::move(names));
  }
  void flush() {
    if (pending_.empty()) return;
    write_part(pending_);
    pending_.clear();
    pending_bytes_ = 0;
    empty_host_cache();
  }

  fs::path dir_;
  DType dtype_;
  int64_t max_bytes_;
  std::vector<std::pair<std::string, Tensor>> pending_;
  int64_t pending_bytes_ = 0, total_bytes_ = 0, tensors_ = 0;
  std::vector<std::vector<std::string>> shards_;
};

// The part of the model (ckpt::megaton_to_hf's `part`) a Megaton tensor belongs to:
// decoder layer i, else the globals.
int64_t part_of(const std::string& name) {
  const std::string prefix = "decoder.layers.";
  if (name.starts_with(prefix) && name.size() > prefix.size() &&
      std::isdigit(static_cast<unsigned char>(name[prefix.size()])))
    return std::atoll(name.c_str() + prefix.size());
  return ckpt::kHFGlobals;
}

// The run's tokenizer files, as a Hugging Face directory names them: source -> file name.
std::vector<std::pair<fs::path, std::string>> tokenizer_files(const nlohmann::json& meta,
                                                              const ConvertLog& log) {
  const std::string type = meta.value("tokenizer_type", "");
  const std::string model = meta.value("tokenizer_model", "");
  std::vector<std::pair<fs::path, std::string>> want;
  if (type == "HuggingFaceTokenizer") {
    const fs::path p(model);
    const fs::path dir = fs::is_directory(p) ? p : p.parent_path();
    want.emplace_back(fs::is_directory(p) ? dir / "tokenizer.json" : p, "tokenizer.json");
    for (const char* f : {"tokenizer_config.json", "special_tokens_map.json"})
      if (fs::exists(dir / f)) want.emplace_back(dir / f, f);
  } else if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer") {
    want.emplace_back(model, "tokenizer.model");
  } else if (type == "GPT2BPETokenizer") {
    want.emplace_back(meta.value("tokenizer_vocab_file", ""), "vocab.json");
    want.emplace_back(meta.value("tokenizer_merge_file", ""), "merges.txt");
  } else {
    log(fmt::format("warning: the run's tokenizer is {}: no tokenizer files written",
                    type.empty() ? "unrecorded" : type));
    return {};
  }
  std::vector<std::pair<fs::path, std::string>> out;
  for (auto& [from, name] : want) {
    if (!from.empty() && fs::is_regular_file(from))
      out.emplace_back(from, name);
    else
      log(fmt::format("warning: the run's tokenizer file '{}' is missing: {} not written",
                      from.string(), name));
  }
  return out;
}

}  // namespace

void export_hf_checkpoint(const HFExportOptions& o, const ConvertLog& log) {
  const ckpt::LoadedCheckpoint head = ckpt::read_checkpoint_metadata(o.load_dir);
  nlohmann::json meta;
  RawOptions raw;
  try {
    meta = nlohmann::json::parse(head.metadata_json);
    if (!meta.contains("args") || !meta["args"].is_object())
      fail("checkpoint '{}' has no saved args (metadata.json 'args'): its model is unknown",
           head.path);
    for (const auto& [k, v] : meta["args"].items())
      raw[k] = v.is_array() ? v.get<std::vector<std::string>>()
                            : std::vector<std::string>{v.get<std::string>()};
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint metadata in '{}' is malformed: {}", head.path, e.what());
  }
  TrainArgs args = parse_model_args(raw);
  GPTConfig cfg = args.model;
  int64_t vocab = 0;
  if (meta.contains("vocab_size") && meta["vocab_size"].is_number_integer()) {
    vocab = meta["vocab_size"].get<int64_t>();
  } else {  // checkpoints from before the vocabulary was recorded
    data::TokenizerOptions tok = tokenizer_options(args);
    tok.model = meta.value("tokenizer_model", tok.model);
    vocab = data::make_tokenizer(tok)->vocab_size();
  }
  cfg.vocab_size = vocab;
  cfg.tensor_model_parallel_size = 1;
  cfg.finalize();
  HFExport exp = hf_export_config(cfg, vocab);
  for (const std::string& w : exp.warnings) log("warning: " + w);
  StagedDirectory out(o.out_dir, "--to hf");

  // One part of the model at a time (the globals, then each decoder layer): read, mapped
  // to Hugging Face names and handed to the shard writer, so the export holds one layer and
  // one output shard at a time.
  ModelTensors model(o.load_dir, head.path);
  std::map<int64_t, std::vector<std::string>> parts;
  for (const std::string& name : model.names())
    if (!name.starts_with("mtp.")) parts[part_of(name)].push_back(name);
  for (int64_t i = 0; i < cfg.num_layers; ++i)
    if (!parts.count(i)) fail("checkpoint '{}' has no tensors of decoder layer {}", head.path, i);
  if (o.max_shard_bytes <= 0) fail("--max-shard-size must be positive (got {})", o.max_shard_bytes);
  const fs::path dir(out.path());
  ShardWriter shards(dir, o.dtype, o.max_shard_bytes);
  for (const auto& [part, names] : parts) {
    if (part >= cfg.num_layers)
      fail("checkpoint '{}' has decoder layer {}, its args say {} layers", head.path, part,
           cfg.num_layers);
    std::map<std::string, Tensor> tensors;
    for (const std::string& name : names) tensors[name] = model.read(name);
    model.release();
    for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
      auto it = tensors.find(name);
      if (it == tensors.end()) continue;
      if (it->second.ndim() != 2 || it->second.dim(0) < vocab)
        fail("checkpoint '{}': tensor 'model.{}' is {}, fewer rows than the vocabulary's {}",
             head.path, name, shape_str(it->second.shape()), vocab);
      it->second = it->second.rows(0, vocab).clone();  // the padding rows are not exported
    }
    if (exp.zero_expert_bias && part >= 0 && cfg.is_moe_layer(part))
      tensors["decoder.layers." + std::to_string(part) + ".mlp.router.expert_bias"] =
          Tensor::zeros({cfg.num_experts});
    for (const auto& [name, t] : ckpt::megaton_to_hf(tensors, exp.layout, exp.naming, part))
      shards.add(name, t);
    tensors.clear();
    empty_host_cache();  // the part's blocks back to the OS: one part held at a time
  }

  nlohmann::json& config = exp.config;
  // Token ids: those of the Hugging Face model this checkpoint came from, else eod as eos.
  if (meta.contains("hf_config") && meta["hf_config"].is_object()) {
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
      if (meta["hf_config"].contains(key)) config[key] = meta["hf_config"][key];
  } else if (meta.value("tokenizer_type", "") == "HuggingFaceTokenizer" ||
             meta.value("tokenizer_type", "") == "SentencePieceTokenizer") {
    try {
      data::TokenizerOptions tok = tokenizer_options(args);
      tok.type = meta["tokenizer_type"].get<std::string>();
      tok.model = meta.value("tokenizer_model", tok.model);
      config["eos_token_id"] = data::make_tokenizer(tok)->eod();
    } catch (const Error& e) {
      log(fmt::format("warning: eos_token_id not written: {}", e.what()));
    }
  }
  // The family's fields the model flags do not determine, from the model it came from (a
  // null, or a list holding one, is Python's Infinity or NaN lost on import: not carried).
  if (meta.contains("hf_config") && meta["hf_config"].is_object() &&
      meta["hf_config"].value("model_type", "") == hf_model_type(exp.family))
    for (const std::string& key : exp.carried_keys) {
      if (!meta["hf_config"].contains(key)) continue;
      const nlohmann::json& value = meta["hf_config"][key];
      const bool lost =
          value.is_null() ||
          (value.is_array() && std::any_of(value.begin(), value.end(),
                                           [](const nlohmann::json& v) { return v.is_null(); }));
      if (!lost) config[key] = value;
    }
  const char* dtype_name_hf = o.dtype == DType::BF16 ? "bfloat16" : "float32";
  config["torch_dtype"] = dtype_name_hf;  // transformers 4
  config["dtype"] = dtype_name_hf;        // transformers 5
  {
    std::ofstream f(dir / "config.json");
    f << config.dump(2) << "\n";
    if (!f.flush()) fail("cannot write {}", (dir / "config.json").string());
  }
  const int64_t files = shards.finish();
  for (const auto& [from, name] : tokenizer_files(meta, log)) {
    std::error_code ec;
    fs::copy_file(from, dir / name, ec);
    if (ec) fail("cannot copy {} to {}: {}", from.string(), (dir / name).string(), ec.message());
  }
  out.commit();
  log(fmt::format("exported {} ({}) to {}: {} tensors in {} safetensors file(s), {}, vocabulary {}",
                  head.path, hf_model_type(exp.family), out.final_path(), shards.tensors(), files,
                  dtype_name_hf, vocab));
}

}  // namespace megaton
