// `megaton convert` on the golden Hugging Face models (tests/golden/*_tiny.safetensors,
// docs/golden.md): HF -> Megaton -> HF gives every tensor back bit for bit; the converted
// checkpoint, under one rank or written for TP2 (x EP2, x PP2) and read under one rank,
// gives the golden logits through generation's loader and the first training loss of the HF
// weights through `train --finetune`; a load without --finetune is refused; bad input is
// one line, exit 2, nothing written. The goldens include a hybrid Mamba-2 model (NemotronH).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "ckpt/hf_import.h"
#include "ckpt/safetensors.h"
#include "common/testing.h"
#include "core/error.h"
#include "data/mock_dataset.h"
#include "model/gpt.h"
#include "ops/ops.h"
#include "train/checkpoint_args.h"
#include "train/generate.h"
#include "train/hf_convert.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

struct Golden {
  nlohmann::json config;
  std::map<std::string, Tensor> weights;  // HF names, F32
  Tensor tokens, logits;                  // [2, S] I32, [2, S, 96] F32 (S: 16, nemotron_h 20)
  std::string hybrid_layer_pattern;       // the file's metadata (nemotron_h), else empty
};

Golden read_golden(const std::string& name) {
  ckpt::SafetensorsFile f = ckpt::load_safetensors(std::string(MEGATON_SOURCE_DIR) +
                                                   "/tests/golden/" + name + ".safetensors");
  Golden g;
  g.config = nlohmann::json::parse(f.metadata.at("config"));
  if (f.metadata.count("hybrid_layer_pattern"))
    g.hybrid_layer_pattern = f.metadata.at("hybrid_layer_pattern");
  for (auto& [k, t] : f.tensors) {
    const std::string head = k.substr(0, k.find('.'));
    if (head != "grad" && head != "input" && head != "output") g.weights[k] = t;
  }
  g.tokens = f.tensors.at("input.tokens");
  g.logits = f.tensors.at("output.logits");
  return g;
}

// The golden as a Hugging Face model directory: config.json and the weights in `shards`
// files (with model.safetensors.index.json when more than one).
void write_hf_dir(const Golden& g, const fs::path& dir, int shards) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << g.config.dump(1);
  std::vector<std::vector<std::pair<std::string, Tensor>>> parts(static_cast<size_t>(shards));
  nlohmann::json weight_map;
  size_t i = 0;
  for (const auto& [name, t] : g.weights) {
    const size_t s = i++ % size_t(shards);
    parts[s].emplace_back(name, t);
    weight_map[name] = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards);
  }
  if (shards == 1) {
    ckpt::save_safetensors((dir / "model.safetensors").string(), parts[0], {{"format", "pt"}});
    return;
  }
  for (int s = 0; s < shards; ++s)
    ckpt::save_safetensors(
        (dir / fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards)).string(),
        parts[size_t(s)], {{"format", "pt"}});
  std::ofstream(dir / "model.safetensors.index.json")
      << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump();
}

// Every tensor of an exported directory's *.safetensors files.
std::map<std::string, Tensor> read_hf_dir(const fs::path& dir) {
  std::map<std::string, Tensor> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors")
      for (auto& [k, t] : ckpt::load_safetensors(e.path().string()).tensors) out[k] = t;
  return out;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

const std::vector<std::string> kGoldens = {"llama_tiny", "mixtral_tiny", "qwen3_moe_tiny",
                                           "deepseek_v3_tiny", "nemotron_h_tiny"};

// A target layout other than one rank: TP2 for all, x EP2 for MoE, x PP2 for dense models.
TargetLayout sharded_target(const std::string& name) {
  TargetLayout t;
  t.tp = 2;
  if (name == "llama_tiny")
    t.pp = 2;
  else
    t.ep = 2;
  return t;
}

class HFConvert : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_hf_convert_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // Converts golden `name` (as an HF directory of `shards` files) to a Megaton checkpoint.
  fs::path import(const Golden& g, const std::string& tag, const TargetLayout& target,
                  int64_t divisible_by, int shards = 1) {
    const fs::path hf = dir / (tag + "_hf");
    if (!fs::exists(hf)) write_hf_dir(g, hf, shards);
    HFImportOptions o;
    o.hf_dir = hf.string();
    o.save_dir = (dir / (tag + "_ckpt")).string();
    o.target = target;
    o.make_vocab_size_divisible_by = divisible_by;
    import_hf_checkpoint(o, [](const std::string&) {});
    return o.save_dir;
  }
  fs::path export_to(const fs::path& ckpt, const std::string& tag, DType dtype,
                     int64_t max_shard_bytes = 5'000'000'000) {
    HFExportOptions o;
    o.load_dir = ckpt.string();
    o.out_dir = (dir / tag).string();
    o.dtype = dtype;
    o.max_shard_bytes = max_shard_bytes;
    export_hf_checkpoint(o, [](const std::string&) {});
    return o.out_dir;
  }

  // Runs the binary; returns its exit status and fills stderr_lines.
  int run(const std::string& args) {
    const fs::path err = dir / "stderr.txt";
    const std::string cmd =
        std::string(MEGATON_BINARY) + " " + args + " > /dev/null 2> " + err.string();
    const int status = std::system(cmd.c_str());
    std::ifstream in(err);
    stderr_lines.clear();
    for (std::string line; std::getline(in, line);) stderr_lines.push_back(line);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path dir;
  std::vector<std::string> stderr_lines;
};

// HF -> Megaton (one rank, and the sharded target) -> HF: the same tensor names, every
// fp32 tensor bit for bit, the bf16 export the golden rounded to bf16, and config.json
// holding the golden config's model fields.
TEST_F(HFConvert, RoundTripGivesEveryTensorBack) {
  for (const std::string& name : kGoldens) {
    SCOPED_TRACE(name);
    const Golden g = read_golden(name);
    for (const bool sharded : {false, true}) {
      SCOPED_TRACE(sharded ? "sharded target" : "one rank");
      const std::string tag = name + (sharded ? "_sharded" : "_one");
      // Megatron's padding (128 x TP): the padded rows must not come back.
      const fs::path ckpt =
          import(g, tag, sharded ? sharded_target(name) : TargetLayout{}, 128, sharded ? 2 : 1);
      // Several output files (a small shard limit) on the sharded path.
      const fs::path out32 =
          export_to(ckpt, tag + "_fp32", DType::F32, sharded ? 200'000 : 5'000'000'000);
      EXPECT_EQ(fs::exists(fs::path(out32) / "model.safetensors.index.json"), sharded);
      const std::map<std::string, Tensor> back = read_hf_dir(out32);
      ASSERT_EQ(back.size(), g.weights.size());
      for (const auto& [k, t] : g.weights) {
        ASSERT_TRUE(back.count(k)) << k;
        EXPECT_TRUE(bitwise_equal(back.at(k), t)) << k;
      }
      const std::map<std::string, Tensor> bf16 =
          read_hf_dir(export_to(ckpt, tag + "_bf16", DType::BF16));
      for (const auto& [k, t] : g.weights) {
        ASSERT_TRUE(bf16.count(k)) << k;
        EXPECT_TRUE(bitwise_equal(bf16.at(k), t.to(DType::BF16))) << k;
      }
      std::ifstream in(fs::path(out32) / "config.json");
      const nlohmann::json config = nlohmann::json::parse(in);
      for (const auto& [key, want] : g.config.items()) {
        // Not model fields, or written in another (equivalent) form.
        static const std::set<std::string> skip = {"architectures",
                                                   "dtype",
                                                   "_name_or_path",
                                                   "transformers_version",
                                                   "id2label",
                                                   "label2id",
                                                   "chunk_size_feed_forward",
                                                   "is_encoder_decoder",
                                                   "output_attentions",
                                                   "output_hidden_states",
                                                   "problem_type",
                                                   "return_dict",
                                                   "qk_head_dim",
                                                   "pretraining_tp",
                                                   "rope_parameters",
                                                   "intermediate_size"};
        if (skip.count(key) || want.is_null()) continue;
        ASSERT_TRUE(config.contains(key)) << key;
        EXPECT_EQ(config[key], want) << key;
      }
      if (g.config.contains("rope_parameters")) {  // NemotronH has no positions
        for (const auto& [key, want] : g.config.at("rope_parameters").items())
          EXPECT_EQ(config.at("rope_parameters").at(key), want) << "rope_parameters." << key;
      }
      EXPECT_EQ(
          config.at("architectures")[0].get<std::string>().find("ForCausalLM") != std::string::npos,
          true);
      // Mixtral's experts are intermediate_size wide; the others' dense layers are.
      EXPECT_EQ(config.at("intermediate_size"), g.config.at("intermediate_size"));
    }
  }
}

// The converted checkpoint through generation's loader (ckpt::load_checkpoint assembles any
// layout; the vocabulary padded for TP2 refitted to one rank): the golden logits.
TEST_F(HFConvert, ConvertedCheckpointGivesTheGoldenLogits) {
  for (const std::string& name : kGoldens) {
    SCOPED_TRACE(name);
    const Golden g = read_golden(name);
    for (const bool sharded : {false, true}) {
      SCOPED_TRACE(sharded ? "sharded target" : "one rank");
      const fs::path ckpt = import(g, name + (sharded ? "_sharded" : "_one"),
                                   sharded ? sharded_target(name) : TargetLayout{}, 128);
      LoadedModel lm = load_model_for_inference(ckpt.string());
      const GPTConfig& cfg = lm.model->config();
      EXPECT_EQ(cfg.vocab_size, 96);
      EXPECT_EQ(cfg.padded_vocab_size, 128);
      EXPECT_EQ(cfg.hybrid_layer_pattern, g.hybrid_layer_pattern);
      const int64_t rows = g.tokens.numel();
      const Tensor logits = lm.model->logits(g.tokens);  // [rows, 128]
      Tensor real = Tensor::empty({rows, 96});
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(real.f32() + r * 96, logits.f32() + r * 128, 96 * sizeof(float));
      const double error = testing::rel_error(real, g.logits.view({rows, 96}));
      EXPECT_LE(error, 1e-4);
      std::printf("%s (%s): logits relative error %.2e\n", name.c_str(),
                  sharded ? "TP2 target" : "one rank", error);
    }
  }
}

// The trainer's first loss from the converted checkpoint (--finetune --use-checkpoint-args,
// mock data) equals the loss of the HF weights loaded directly into the model (as the
// golden test loads them) on the same batch; the TP2-target checkpoint loaded under one
// rank gives the same loss. Without --finetune or --no-load-optim the load is refused.
TEST_F(HFConvert, FinetuneLossEqualsTheHuggingFaceWeights) {
  for (const std::string& name : kGoldens) {
    SCOPED_TRACE(name);
    const Golden g = read_golden(name);
    // How the weights are loaded: "finetune", "no-load-optim" or "" (with optimizer state).
    const auto first_loss = [&](const fs::path& ckpt, const std::string& tag,
                                const std::string& mode) -> double {
      RawOptions raw = {{"load", {ckpt.string()}},
                        {"use-checkpoint-args", {"true"}},
                        {"device", {"cpu"}},
                        {"mock-data", {"true"}},
                        {"seq-length", {"16"}},
                        {"make-vocab-size-divisible-by", {"1"}},
                        {"micro-batch-size", {"2"}},
                        {"global-batch-size", {"2"}},
                        {"train-iters", {"1"}},
                        {"lr", {"1e-4"}},
                        {"eval-iters", {"0"}},
                        {"log-interval", {"1"}},
                        {"log-metrics-file", {(dir / (tag + ".jsonl")).string()}}};
      if (!mode.empty()) raw[mode] = {"true"};
      const CheckpointArgs from = apply_checkpoint_args(raw);
      {
        TrainArgs args = parse_train_args(from.raw);
        Trainer(args, from.raw).train();
      }
      std::ifstream in(dir / (tag + ".jsonl"));
      std::string line;
      std::getline(in, line);
      return nlohmann::json::parse(line).at("lm_loss").get<double>();
    };
    const fs::path one = import(g, name + "_one", {}, 128);
    const double loss = first_loss(one, name + "_one", "finetune");
    const double loss_sharded = first_loss(import(g, name + "_sharded", sharded_target(name), 128),
                                           name + "_sharded", "finetune");
    EXPECT_EQ(loss, loss_sharded);

    // The reference: the checkpoint's model flags, the HF weights mapped as the golden test
    // maps them, the trainer's first batch (mock samples 0 and 1, seed 1234).
    RawOptions model_flags;
    const nlohmann::json meta =
        nlohmann::json::parse(ckpt::read_checkpoint_metadata(one.string()).metadata_json);
    for (const auto& [k, v] : meta.at("args").items()) model_flags[k] = {v.get<std::string>()};
    model_flags["make-vocab-size-divisible-by"] = {"1"};
    model_flags["seq-length"] = {"16"};
    GPTConfig cfg = parse_model_args(model_flags).model;
    cfg.device = Device::CPU;
    cfg.vocab_size = 96;
    cfg.finalize();
    GPTModel model(cfg, 1);
    ckpt::HFLayout layout{cfg.num_layers, cfg.num_attention_heads, cfg.num_query_groups,
                          cfg.kv_channels, cfg.num_experts};
    std::map<std::string, Tensor> w = ckpt::hf_to_megaton(g.weights, layout);
    for (const auto& layer : model.layers())
      if (MoELayer* moe = layer->moe(); moe && moe->router.expert_bias.defined()) {
        std::string bias = moe->router.weight.name;
        bias.replace(bias.size() - 6, 6, "expert_bias");
        moe->router.expert_bias.copy_from(w.at(bias));
      }
    for (Param* p : model.params()) p->weight.copy_from(w.at(p->name));
    data::MockGPTDataset mock(2, 16, 96, 1234, 0);
    std::vector<int32_t> tokens, labels;
    for (int64_t i = 0; i < 2; ++i) {
      std::vector<int32_t> sample(17);
      mock.get(i, sample.data());
      tokens.insert(tokens.end(), sample.begin(), sample.end() - 1);
      labels.insert(labels.end(), sample.begin() + 1, sample.end());
    }
    ForwardContext ctx{false, 1, 0, 0};
    MicroBatchLoss out =
        model.forward(Tensor::from_i32({2, 16}, tokens), Tensor::from_i32({2, 16}, labels), ctx);
    const double want = ops::sum(out.losses) / 32.0;
    EXPECT_NEAR(loss, want, 1e-6 * std::fabs(want))
        << "trainer " << loss << " vs HF weights " << want;
    std::printf("%s: first finetune loss %.7f, HF weights %.7f\n", name.c_str(), loss, want);

    if (name != "llama_tiny") continue;
    // --no-load-optim: iteration 0 and the seed from the checkpoint, the same first step.
    EXPECT_EQ(first_loss(one, name + "_no_optim", "no-load-optim"), loss);
    try {
      first_loss(one, name + "_resume", "");
      ADD_FAILURE() << "a load with optimizer state of a converted checkpoint did not fail";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--finetune"), std::string::npos) << e.what();
    }
  }
}

// A NemotronH config.json as Python's json.dumps writes it ("time_step_limit": [0.0,
// Infinity], not standard JSON) converts; the export does not carry the lost limit
// (transformers' default is the same) but does carry the source's other fields the model
// flags do not determine (chunk_size 8, not Megaton's 128).
TEST_F(HFConvert, NemotronHConfigWithPythonInfinity) {
  Golden g = read_golden("nemotron_h_tiny");
  const fs::path hf = dir / "hf";
  write_hf_dir(g, hf, 1);
  g.config["time_step_limit"] = "LIMIT";
  std::string text = g.config.dump(1);
  text.replace(text.find("\"LIMIT\""), 7, "[0.0, Infinity]");
  std::ofstream(hf / "config.json", std::ios::trunc) << text;
  ASSERT_EQ(run("convert --from hf " + hf.string() + " --save " + (dir / "ck").string()), 0)
      << (stderr_lines.empty() ? "" : stderr_lines[0]);
  const fs::path out = export_to(dir / "ck", "export", DType::F32);
  std::ifstream in(out / "config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_FALSE(config.contains("time_step_limit"));
  EXPECT_EQ(config.at("chunk_size"), 8);
  EXPECT_EQ(config.at("hybrid_override_pattern"), g.hybrid_layer_pattern);
  EXPECT_EQ(config.at("num_hidden_layers"), int64_t(g.hybrid_layer_pattern.size()));

  // A NemotronH Megatron's hybrid model cannot express: one line naming the key, exit 2,
  // nothing written.
  g.config["conv_kernel"] = 3;
  std::ofstream(hf / "config.json", std::ios::trunc) << g.config.dump(1);
  EXPECT_EQ(run("convert --from hf " + hf.string() + " --save " + (dir / "ck3").string()), 2);
  ASSERT_EQ(stderr_lines.size(), 1u);
  EXPECT_NE(stderr_lines[0].find("'conv_kernel' 3"), std::string::npos) << stderr_lines[0];
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_FALSE(e.path().filename().string().starts_with("ck3")) << e.path();
}

// A model directory with a tokenizer Megaton reads (tests/golden/tokenizers/gpt2: 533
// tokens) and a config.json vocabulary padded beyond it (540 rows, as Qwen's are): the
// checkpoint records the tokenizer (copied to OUT/tokenizer) and its 533 tokens, padded to
// 640 rows (128); `megaton generate` runs on it; the export trims to 533 rows and copies
// the tokenizer files.
TEST_F(HFConvert, TokenizerTravelsWithTheCheckpoint) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const fs::path tokenizer = fs::path(MEGATON_SOURCE_DIR) / "tests/golden/tokenizers/gpt2";
  Golden g;
  const int64_t V = 540, H = 16, F = 24;
  g.config = {{"model_type", "llama"},
              {"vocab_size", V},
              {"hidden_size", H},
              {"intermediate_size", F},
              {"num_hidden_layers", 1},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 8},
              {"max_position_embeddings", 32},
              {"rms_norm_eps", 1e-5},
              {"tie_word_embeddings", false},
              {"eos_token_id", 0}};
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"model.embed_tokens.weight", {V, H}},
      {"lm_head.weight", {V, H}},
      {"model.norm.weight", {H}},
      {"model.layers.0.input_layernorm.weight", {H}},
      {"model.layers.0.post_attention_layernorm.weight", {H}},
      {"model.layers.0.self_attn.q_proj.weight", {16, H}},
      {"model.layers.0.self_attn.k_proj.weight", {8, H}},
      {"model.layers.0.self_attn.v_proj.weight", {8, H}},
      {"model.layers.0.self_attn.o_proj.weight", {H, 16}},
      {"model.layers.0.mlp.gate_proj.weight", {F, H}},
      {"model.layers.0.mlp.up_proj.weight", {F, H}},
      {"model.layers.0.mlp.down_proj.weight", {H, F}}};
  for (size_t i = 0; i < shapes.size(); ++i)
    g.weights[shapes[i].first] = testing::randn(shapes[i].second, seed + i, 0.02f);
  write_hf_dir(g, dir / "hf", 1);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(tokenizer / f, dir / "hf" / f);
  ASSERT_EQ(run("convert --from hf " + (dir / "hf").string() + " --save " + (dir / "ck").string()),
            0);
  const nlohmann::json meta =
      nlohmann::json::parse(ckpt::read_checkpoint_metadata((dir / "ck").string()).metadata_json);
  EXPECT_EQ(meta.at("tokenizer_type"), "HuggingFaceTokenizer");
  EXPECT_EQ(meta.at("tokenizer_model"), (dir / "ck" / "tokenizer").string());
  EXPECT_EQ(meta.at("vocab_size"), 533);
  EXPECT_EQ(meta.at("padded_vocab_size"), 640);
  EXPECT_TRUE(fs::exists(dir / "ck" / "tokenizer" / "tokenizer.json"));
  ASSERT_EQ(run("generate --load " + (dir / "ck").string() +
                " --prompt hello --greedy --tokens-to-generate 4"),
            0)
      << (stderr_lines.empty() ? "" : stderr_lines[0]);
  const fs::path out = export_to(dir / "ck", "export", DType::F32);
  const std::map<std::string, Tensor> back = read_hf_dir(out);
  for (const auto& [k, t] : g.weights) {
    const Tensor want = t.dim(0) == V ? t.rows(0, 533).clone() : t;
    EXPECT_TRUE(bitwise_equal(back.at(k), want)) << k;
  }
  std::ifstream in(out / "config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_EQ(config.at("vocab_size"), 533);
  EXPECT_EQ(config.at("eos_token_id"), 0);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    std::ifstream a(tokenizer / f), b(out / f);
    ASSERT_TRUE(b) << f << " not exported";
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}),
              std::string(std::istreambuf_iterator<char>(b), {}))
        << f;
  }
}

// Bad input: one line, exit 2, nothing written (no OUT, no OUT.tmp*).
TEST_F(HFConvert, BadInputIsOneLineAndWritesNothing) {
  const Golden g = read_golden("llama_tiny");
  write_hf_dir(g, dir / "hf", 1);
  const fs::path out = dir / "out";
  const auto nothing_written = [&] {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().starts_with("out")) return false;
    return true;
  };
  const auto expect_error = [&](const std::string& args, const std::string& needle) {
    SCOPED_TRACE(args);
    EXPECT_EQ(run("convert " + args), 2);
    ASSERT_EQ(stderr_lines.size(), 1u) << (stderr_lines.empty() ? "" : stderr_lines[0]);
    EXPECT_NE(stderr_lines[0].find(needle), std::string::npos) << stderr_lines[0];
    EXPECT_TRUE(nothing_written());
  };
  const std::string hf = (dir / "hf").string(), save = " --save " + out.string();
  const auto variant = [&](const std::string& tag, auto&& edit) {
    const fs::path d = dir / tag;
    fs::copy(dir / "hf", d);
    edit(d);
    return d.string();
  };
  expect_error("--from hf " + (dir / "nowhere").string() + save, "not a directory");
  expect_error("--from hf " +
                   variant("no_config", [](const fs::path& d) { fs::remove(d / "config.json"); }) +
                   save,
               "config.json: missing");
  const auto with_config = [&](const std::string& tag, const std::string& key,
                               const nlohmann::json& value) {
    return variant(tag, [&](const fs::path& d) {
      nlohmann::json c = g.config;
      c[key] = value;
      std::ofstream(d / "config.json") << c.dump();
    });
  };
  expect_error("--from hf " + with_config("gpt2", "model_type", "gpt2") + save,
               "model_type 'gpt2' is not supported");
  expect_error("--from hf " + with_config("qwen2", "model_type", "qwen2") + save, "add-qkv-bias");
  expect_error("--from hf " + with_config("gelu", "hidden_act", "gelu") + save, "hidden_act");
  expect_error("--from hf " +
                   with_config("llama31", "rope_parameters",
                               {{"rope_type", "llama3"}, {"rope_theta", 5e5}, {"factor", 8.0}}) +
                   save,
               "RoPE scaling 'llama3'");
  expect_error("--from hf " + with_config("wide", "hidden_size", 128) + save,
               "model's flags make it");
  expect_error("--from hf " +
                   variant("missing",
                           [&](const fs::path& d) {
                             std::vector<std::pair<std::string, Tensor>> t;
                             for (const auto& [k, v] : g.weights)
                               if (k != "model.layers.1.mlp.up_proj.weight") t.emplace_back(k, v);
                             ckpt::save_safetensors((d / "model.safetensors").string(), t);
                           }) +
                   save,
               "model.layers.1.mlp.up_proj.weight");
  expect_error("--from hf " +
                   variant("extra",
                           [&](const fs::path& d) {
                             std::vector<std::pair<std::string, Tensor>> t(g.weights.begin(),
                                                                           g.weights.end());
                             t.emplace_back("model.layers.0.mlp.extra.weight", Tensor::zeros({2}));
                             ckpt::save_safetensors((d / "model.safetensors").string(), t);
                           }) +
                   save,
               "model.layers.0.mlp.extra.weight");
  expect_error("--from hf " +
                   variant("garbage",
                           [](const fs::path& d) {
                             std::ofstream(d / "model.safetensors", std::ios::trunc)
                                 << "not a safetensors file";
                           }) +
                   save,
               "model.safetensors");
  expect_error(
      "--from hf " +
          variant("empty", [](const fs::path& d) { fs::remove(d / "model.safetensors"); }) + save,
      "no *.safetensors");
  expect_error("--from hf " + hf + save + " --target-tensor-model-parallel-size 3",
               "tensor-model-parallel-size (3)");
  expect_error("--from hf " + hf, "--save");
  expect_error("--from pt " + hf + save, "only hf");
  expect_error("--load " + (dir / "nowhere").string() + " --to hf " + out.string(), "nowhere");
  // An output directory that holds something.
  fs::create_directories(dir / "busy");
  std::ofstream(dir / "busy" / "file") << "x";
  EXPECT_EQ(run("convert --from hf " + hf + " --save " + (dir / "busy").string()), 2);
  ASSERT_EQ(stderr_lines.size(), 1u);
  EXPECT_NE(stderr_lines[0].find("not an empty directory"), std::string::npos) << stderr_lines[0];
  EXPECT_EQ(std::distance(fs::directory_iterator(dir / "busy"), fs::directory_iterator{}), 1);

  // A model Hugging Face's families cannot express: LayerNorm (the checkpoint's args edited).
  ASSERT_EQ(run("convert --from hf " + hf + " --save " + (dir / "ck").string()), 0);
  const fs::path meta_path = dir / "ck" / "iter_0000000" / "metadata.json";
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
  meta["args"]["normalization"] = "LayerNorm";
  std::ofstream(meta_path, std::ios::trunc) << meta.dump(1);
  expect_error("--load " + (dir / "ck").string() + " --to hf " + out.string(),
               "normalization LayerNorm");
}

}  // namespace
}  // namespace megaton
