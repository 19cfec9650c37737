// megaton convert --load CKPT --to hf OUT: a Megaton checkpoint (either format, any layout)
// -> a Hugging Face model directory.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

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

// The checkpoint's "model.<name>" tensors by <name>, as stored (sharded: only those are
// read; the single-file format is read whole).
std::map<std::string, Tensor> read_model_tensors(const std::string& load_dir,
                                                 const std::string& iteration_dir) {
  std::map<std::string, Tensor> out;
  if (ckpt::is_sharded_checkpoint(iteration_dir)) {
    ckpt::ShardedCheckpointReader reader(iteration_dir);
    for (const auto& [name, info] : reader.tensors())
      if (name.starts_with("model.")) out[name.substr(6)] = reader.read(name);
    return out;
  }
  ckpt::LoadedCheckpoint ck = ckpt::load_checkpoint(load_dir);
  for (auto& [name, t] : ck.tensors)
    if (name.starts_with("model.")) out[name.substr(6)] = std::move(t);
  return out;
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

// Writes `tensors` (cast to `dtype`) as model.safetensors, or as shards of at most
// max_bytes each with model.safetensors.index.json. Returns the number of files.
int64_t write_safetensors_shards(const fs::path& dir, const std::map<std::string, Tensor>& tensors,
                                 DType dtype, int64_t max_bytes) {
  std::vector<std::vector<std::string>> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const int64_t bytes = t.numel() * int64_t(dtype_size(dtype));
    if (!shards.back().empty() && shard_bytes + bytes > max_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(name);
    shard_bytes += bytes;
    total += bytes;
  }
  const size_t n = shards.size();
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < n; ++i) {
    const std::string file =
        n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    std::vector<std::pair<std::string, Tensor>> part;
    for (const std::string& name : shards[i]) {
      const Tensor& t = tensors.at(name);
      part.emplace_back(name, t.dtype() == dtype ? t : t.to(dtype));
      weight_map[name] = file;
    }
    ckpt::save_safetensors((dir / file).string(), part, {{"format", "pt"}});
  }
  if (n > 1) {
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream f(dir / "model.safetensors.index.json");
    f << index.dump(2) << "\n";
    if (!f.flush()) fail("cannot write {}", (dir / "model.safetensors.index.json").string());
  }
  return int64_t(n);
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

  std::map<std::string, Tensor> model = read_model_tensors(o.load_dir, head.path);
  std::erase_if(model, [](const auto& e) { return e.first.starts_with("mtp."); });
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
    auto it = model.find(name);
    if (it == model.end()) continue;
    if (it->second.ndim() != 2 || it->second.dim(0) < vocab)
      fail("checkpoint '{}': tensor 'model.{}' is {}, fewer rows than the vocabulary's {}",
           head.path, name, shape_str(it->second.shape()), vocab);
    it->second = it->second.rows(0, vocab).clone();  // the padding rows are not exported
  }
  if (exp.zero_expert_bias)
    for (int64_t i = 0; i < cfg.num_layers; ++i)
      if (cfg.is_moe_layer(i))
        model["decoder.layers." + std::to_string(i) + ".mlp.router.expert_bias"] =
            Tensor::zeros({cfg.num_experts});
  const std::map<std::string, Tensor> hf = ckpt::megaton_to_hf(model, exp.layout, exp.naming);
  model.clear();

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
  const char* dtype_name_hf = o.dtype == DType::BF16 ? "bfloat16" : "float32";
  config["torch_dtype"] = dtype_name_hf;  // transformers 4
  config["dtype"] = dtype_name_hf;        // transformers 5
  const fs::path dir(out.path());
  {
    std::ofstream f(dir / "config.json");
    f << config.dump(2) << "\n";
    if (!f.flush()) fail("cannot write {}", (dir / "config.json").string());
  }
  if (o.max_shard_bytes <= 0) fail("--max-shard-size must be positive (got {})", o.max_shard_bytes);
  const int64_t files = write_safetensors_shards(dir, hf, o.dtype, o.max_shard_bytes);
  for (const auto& [from, name] : tokenizer_files(meta, log)) {
    std::error_code ec;
    fs::copy_file(from, dir / name, ec);
    if (ec) fail("cannot copy {} to {}: {}", from.string(), (dir / name).string(), ec.message());
  }
  out.commit();
  log(fmt::format("exported {} ({}) to {}: {} tensors in {} safetensors file(s), {}, vocabulary {}",
                  head.path, hf_model_type(exp.family), out.final_path(), hf.size(), files,
                  dtype_name_hf, vocab));
}

}  // namespace megaton
