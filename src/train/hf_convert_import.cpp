// megaton convert --from hf DIR --save OUT: a Hugging Face model directory -> a sharded
// Megaton checkpoint (weights only) for a target parallel layout.
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "ckpt/checkpoint.h"
#include "ckpt/hf_import.h"
#include "ckpt/safetensors.h"
#include "core/error.h"
#include "data/bpe_tokenizers.h"
#include "data/tokenizer.h"
#include "train/checkpoint_args.h"
#include "train/hf_config.h"
#include "train/hf_convert.h"
#include "train/staged_directory.h"

namespace fs = std::filesystem;

namespace megaton {

namespace {

// `text` with Python's non-standard JSON numbers (Infinity, -Infinity, NaN, which
// json.dumps writes by default: NemotronH's "time_step_limit": [0.0, Infinity]) outside
// strings replaced by null, which nlohmann's strict parser accepts.
std::string python_json_numbers_as_null(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size())
        out += text[++i];
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (const std::string_view word : {"-Infinity", "Infinity", "NaN"})
      if (text.compare(i, word.size(), word) == 0) {
        out += "null";
        i += word.size() - 1;
        replaced = true;
        break;
      }
    if (!replaced) out += c;
  }
  return out;
}

nlohmann::json read_json_file(const fs::path& path, const std::string& missing_hint) {
  std::ifstream in(path);
  if (!in) fail("{}: missing{}", path.string(), missing_hint);
  const std::string text(std::istreambuf_iterator<char>(in), {});
  try {
    return nlohmann::json::parse(python_json_numbers_as_null(text));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", path.string(), e.what());
  }
}

// The checkpoint's safetensors files: those model.safetensors.index.json names, else
// model.safetensors, else every *.safetensors of the directory. `index` receives the
// index's weight_map (tensor -> file) when there is one.
std::vector<fs::path> shard_files(const fs::path& dir, std::map<std::string, std::string>& index) {
  const fs::path index_path = dir / "model.safetensors.index.json";
  std::vector<fs::path> out;
  if (fs::exists(index_path)) {
    const nlohmann::json j = read_json_file(index_path, "");
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      fail("{}: no 'weight_map' object", index_path.string());
    std::set<std::string> files;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string())
        fail("{}: weight_map '{}' is not a file name", index_path.string(), name);
      index[name] = file.get<std::string>();
      files.insert(file.get<std::string>());
    }
    for (const std::string& f : files) {
      if (!fs::exists(dir / f))
        fail("{}: names '{}', which is missing", index_path.string(), (dir / f).string());
      out.push_back(dir / f);
    }
    return out;
  }
  if (fs::exists(dir / "model.safetensors")) return {dir / "model.safetensors"};
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  if (out.empty())
    fail("{}: no *.safetensors files (only safetensors checkpoints are read)", dir.string());
  return out;
}

// Every tensor of the checkpoint, as stored (BF16, F16 or F32): views of the files mapped
// read-only (`mappings` keeps them), so nothing is read until a tensor is used; `file_of`
// names each tensor's file.
std::map<std::string, Tensor> map_hf_tensors(const fs::path& dir,
                                             std::map<std::string, std::string>& file_of,
                                             std::vector<std::shared_ptr<void>>& mappings) {
  std::map<std::string, std::string> index;
  std::map<std::string, Tensor> out;
  for (const fs::path& file : shard_files(dir, index)) {
    ckpt::SafetensorsFile f = ckpt::map_safetensors(file.string());
    mappings.push_back(f.mapping);
    for (auto& [name, t] : f.tensors) {
      if (t.dtype() != DType::BF16 && t.dtype() != DType::F16 && t.dtype() != DType::F32)
        fail("{}: tensor '{}' is {} (BF16, F16 or F32 are converted)", file.string(), name,
             dtype_name(t.dtype()));
      if (out.count(name))
        fail("{}: tensor '{}' is also in {}", file.string(), name, file_of.at(name));
      file_of[name] = file.string();
      out.emplace(name, std::move(t));
    }
  }
  for (const auto& [name, file] : index)
    if (!out.count(name))
      fail("{}: has no tensor '{}' (model.safetensors.index.json names it)", (dir / file).string(),
           name);
  return out;
}

// The tokenizer the converted checkpoint records, and the files copied for it to `target`
// (an empty `target`: none copied, the checkpoint names the files in `dir`).
struct TokenizerChoice {
  std::string type;             // tokenizer-type
  std::string model;            // tokenizer-model, the copy under OUT/tokenizer ("" for none)
  std::vector<fs::path> files;  // copied to OUT/tokenizer/
  int64_t vocab_size = 0;
  RawOptions flags;
};

TokenizerChoice choose_tokenizer(const fs::path& dir, int64_t hf_vocab, const fs::path& target,
                                 const ConvertLog& log) {
  TokenizerChoice c;
  if (fs::exists(dir / "tokenizer.json")) {
    try {
      c.vocab_size = data::make_huggingface_tokenizer(dir.string())->vocab_size();
      c.type = "HuggingFaceTokenizer";
      c.model = target.empty() ? fs::absolute(dir).string() : target.string();
      if (!target.empty())
        for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
          if (fs::exists(dir / f)) c.files.push_back(dir / f);
    } catch (const Error& e) {
      log(fmt::format("warning: {}/tokenizer.json is not usable by Megaton: {}", dir.string(),
                      e.what()));
    }
  }
  if (c.type.empty() && fs::exists(dir / "tokenizer.model")) {
    try {
      data::TokenizerOptions o;
      o.type = "SentencePieceTokenizer";
      o.model = (dir / "tokenizer.model").string();
      c.vocab_size = data::make_tokenizer(o)->vocab_size();
      c.type = o.type;
      c.model =
          target.empty() ? fs::absolute(o.model).string() : (target / "tokenizer.model").string();
      if (!target.empty()) c.files.push_back(dir / "tokenizer.model");
    } catch (const Error& e) {
      log(fmt::format("warning: {}/tokenizer.model is not usable by Megaton: {}", dir.string(),
                      e.what()));
    }
  }
  if (c.type.empty()) {
    // NullTokenizer --vocab-size N: ids 0..N-1 and eod N, config.json's vocabulary.
    log(fmt::format(
        "warning: {} has no tokenizer Megaton reads (tokenizer.json or tokenizer.model): the "
        "checkpoint records NullTokenizer with config.json's {} tokens; train with your "
        "tokenizer's flags",
        dir.string(), hf_vocab));
    c.type = "NullTokenizer";
    c.vocab_size = hf_vocab;
    c.flags["vocab-size"] = {std::to_string(hf_vocab - 1)};
  } else {
    c.flags["tokenizer-model"] = {c.model};
  }
  c.flags["tokenizer-type"] = {c.type};
  return c;
}

// `t` [rows, ...] with `rows` rows: the first ones kept, new ones zero (padding).
Tensor fit_rows(const Tensor& t, int64_t rows) {
  Shape shape = t.shape();
  shape[0] = rows;
  Tensor out = Tensor::zeros(shape, t.dtype());
  const int64_t kept = std::min(rows, t.dim(0));
  out.rows(0, kept).copy_from(t.rows(0, kept));
  return out;
}

// DeepSeek-V3's multi-token prediction layers: model.layers.<n> with n >= num_hidden_layers
// (NemotronH's are "mtp.*").
bool is_mtp_layer(const std::string& name, int64_t num_layers) {
  const std::string prefix = "model.layers.";
  if (!name.starts_with(prefix)) return false;
  return std::atoll(name.c_str() + prefix.size()) >= num_layers;
}

}  // namespace

void import_hf_checkpoint(const HFImportOptions& o, const ConvertLog& log) {
  const fs::path dir(o.hf_dir);
  if (!fs::is_directory(dir)) fail("--from hf {}: not a directory", o.hf_dir);
  const fs::path config_path = dir / "config.json";
  const nlohmann::json config =
      read_json_file(config_path, " (a Hugging Face model directory holds config.json)");
  const HFImport spec = hf_import_config(config, config_path.string());
  for (const std::string& w : spec.warnings) log("warning: " + w);
  StagedDirectory out(o.save_dir, "--save");
  const fs::path tokenizer_dir =
      o.tokenizer_in_place ? fs::path() : fs::path(out.final_path()) / "tokenizer";
  const TokenizerChoice tok = choose_tokenizer(dir, spec.vocab_size, tokenizer_dir, log);
  if (tok.vocab_size > spec.vocab_size)
    fail("{}: the tokenizer has {} tokens, the model's vocab_size is {}", dir.string(),
         tok.vocab_size, spec.vocab_size);

  // The flags the checkpoint records, and the model they make (before the long read, so a
  // bad layout fails fast).
  RawOptions args = spec.flags;
  for (const auto& [key, value] : tok.flags) args[key] = value;
  const TargetLayout& t = o.target;
  args["make-vocab-size-divisible-by"] = {std::to_string(o.make_vocab_size_divisible_by)};
  args["tensor-model-parallel-size"] = {std::to_string(t.tp)};
  args["pipeline-model-parallel-size"] = {std::to_string(t.pp)};
  args["expert-model-parallel-size"] = {std::to_string(t.ep)};
  if (t.etp > 0) args["expert-tensor-parallel-size"] = {std::to_string(t.etp)};
  GPTConfig cfg = parse_model_args(args).model;
  cfg.vocab_size = tok.vocab_size;
  cfg.tensor_model_parallel_size = t.tp;
  cfg.finalize();
  const dist::ValidatedLayout layout = resolve_target_layout(cfg, t);

  // The model's tensors made one at a time from the mapped files as the rank files are
  // written (train/layout_writer.h), so a model larger than memory converts.
  std::map<std::string, std::string> file_of;
  std::vector<std::shared_ptr<void>> mappings;
  const std::map<std::string, Tensor> hf = map_hf_tensors(dir, file_of, mappings);
  std::map<std::string, ckpt::HFMappedTensor> plan;
  {
    std::set<std::string> used;
    for (ckpt::HFMappedTensor& t :
         ckpt::hf_mapping(spec.layout, [&hf](const std::string& n) { return hf.count(n) > 0; })) {
      used.insert(t.inputs.begin(), t.inputs.end());
      plan.emplace(t.name, std::move(t));
    }
    int64_t mtp_tensors = 0;
    for (const auto& [name, tensor] : hf) {
      if (used.count(name) || name.ends_with("rotary_emb.inv_freq")) continue;
      if ((spec.family == HFFamily::DeepseekV3 && is_mtp_layer(name, spec.layout.num_layers)) ||
          (spec.family == HFFamily::NemotronH && name.starts_with("mtp."))) {
        ++mtp_tensors;
        continue;
      }
      fail("{}: tensor '{}' is not part of the {} model config.json describes (not converted)",
           file_of.at(name), name, hf_model_type(spec.family));
    }
    if (mtp_tensors > 0)
      log(fmt::format("warning: {} multi-token prediction tensors left out", mtp_tensors));
  }
  // Tied embeddings: some checkpoints store lm_head.weight anyway; the model has none.
  if (spec.tie_word_embeddings) plan.erase("output_layer.weight");
  TensorSource source;
  for (const auto& [name, t] : plan) source.names.push_back(name);
  const ckpt::HFGet get = [&hf](const std::string& name) { return hf.at(name); };
  source.make = [&](const std::string& name) {
    const ckpt::HFMappedTensor& entry = plan.at(name);
    Tensor t = entry.make(get);
    // An F32 input may come back as a view into the mapped file (the tensor itself, or an
    // expert's rows of a fused one): copy it, then let the mapped pages go (the process
    // holds one tensor's worth of the files at a time).
    for (const std::string& input : entry.inputs) {
      const Tensor& in = hf.at(input);
      const auto* begin = static_cast<const uint8_t*>(in.raw());
      const auto* at = static_cast<const uint8_t*>(t.raw());
      if (at >= begin && at < begin + in.nbytes()) {
        t = t.clone();
        break;
      }
    }
    for (const std::string& input : entry.inputs) ckpt::release_mapped_pages(hf.at(input));
    if (name == "embedding.word_embeddings.weight" || name == "output_layer.weight") {
      if (t.ndim() != 2 || t.dim(0) != spec.vocab_size)
        fail("{}: the weights of '{}' are {}, its vocab_size is {}", config_path.string(), name,
             shape_str(t.shape()), spec.vocab_size);
      t = fit_rows(t, cfg.padded_vocab_size);
    }
    return t;
  };

  nlohmann::json meta;
  meta["iteration"] = 0;
  meta["consumed_samples"] = 0;
  meta["optimizer_step"] = 0;
  meta["world_size"] = layout.sizes.world;
  meta["floating_point_operations_so_far"] = 0.0;
  meta["skipped_iterations"] = 0;
  meta["nan_iterations"] = 0;
  meta["scheduler_samples"] = 0;
  meta["rng_seed"] = 1234;
  nlohmann::json json_args = nlohmann::json::object();
  for (const auto& [k, v] : args)
    json_args[k] = v.size() == 1 ? nlohmann::json(v[0]) : nlohmann::json(v);
  meta["args"] = json_args;
  meta["tokenizer_type"] = tok.type;
  meta["tokenizer_model"] = tok.model;
  meta["tokenizer_vocab_file"] = "";
  meta["tokenizer_merge_file"] = "";
  meta["vocab_size"] = cfg.vocab_size;
  meta["padded_vocab_size"] = cfg.padded_vocab_size;
  // A load needs --finetune or --no-load-optim: there are no moments to resume.
  meta["optimizer_state"] = false;
  meta["converted_from"] = {{"format", "huggingface"},
                            {"path", fs::absolute(dir).lexically_normal().string()},
                            {"model_type", hf_model_type(spec.family)}};
  meta["hf_config"] = config;
  write_checkpoint_for_layout(out.path(), 0, source, cfg, layout, meta.dump(1));
  if (!tok.files.empty()) {
    const fs::path copy_to = fs::path(out.path()) / "tokenizer";
    fs::create_directories(copy_to);
    for (const fs::path& f : tok.files) {
      std::error_code ec;
      fs::copy_file(f, copy_to / f.filename(), ec);
      if (ec) fail("cannot copy {} to {}: {}", f.string(), copy_to.string(), ec.message());
    }
  }
  out.commit();
  log(fmt::format(
      "converted {} model {} -> {}/{}: {} tensors, vocabulary {} (padded {}), {} rank file(s) "
      "for tensor-parallel {}, pipeline-parallel {}, expert-parallel {}, expert-tensor-parallel "
      "{}; tokenizer {}",
      hf_model_type(spec.family), dir.string(), out.final_path(), ckpt::iteration_dir_name(0),
      plan.size(), cfg.vocab_size, cfg.padded_vocab_size, layout.sizes.world, layout.sizes.tp,
      layout.sizes.pp, layout.sizes.ep, layout.sizes.etp, tok.type));
  log("no optimizer state: load it with --finetune (weights only, iteration 0) or "
      "--no-load-optim");
}

}  // namespace megaton
