// safetensors: round trips, the exact byte layout, bad files, and the golden files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "common/testing.h"
#include "core/error.h"

using namespace megaton;
using megaton::ckpt::load_safetensors;
using megaton::ckpt::SafetensorsFile;
using megaton::ckpt::save_safetensors;
using megaton::testing::test_seed;

namespace {

namespace fs = std::filesystem;

// A directory of this process's own (ctest runs each test case as a process, possibly in
// parallel), removed at exit.
struct ScratchDir {
  fs::path path =
      fs::path(::testing::TempDir()) / ("megaton_test_safetensors." + std::to_string(getpid()));
  ScratchDir() { fs::create_directories(path); }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string temp_path(const std::string& name) {
  static ScratchDir dir;
  return (dir.path / name).string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// Tensor of `dtype` whose bytes are all random (every bit pattern, NaNs included).
Tensor random_bytes(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(shape, dtype);
  std::mt19937_64 gen(seed);
  auto* p = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(gen());
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Runs f and returns the megaton::Error message (empty when none was thrown).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The 8-byte little-endian length followed by `header` and `data`.
std::string file_of(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = char(uint8_t(n >> (8 * i)));
  return out + header + data;
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDType) {
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<std::pair<std::string, Tensor>> tensors;
  int k = 0;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I32,
                  DType::I64}) {
    std::string name(dtype_name(t));
    // Odd sizes so that 1- and 2-byte tensors leave the data section unaligned behind them.
    tensors.emplace_back("layer." + name + ".weight", random_bytes({3, 5}, t, seed + k++));
    tensors.emplace_back("layer." + name + ".scalar", random_bytes({}, t, seed + k++));
    tensors.emplace_back("layer." + name + ".empty", Tensor::empty({0, 4}, t));
  }
  std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"iteration", "100"}, {"json", "{\"a\": [1, 2]}"}};
  std::string path = temp_path("roundtrip.safetensors");
  save_safetensors(path, tensors, meta);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  SafetensorsFile f = load_safetensors(path);
  EXPECT_EQ(f.metadata, meta);
  ASSERT_EQ(f.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(f.tensors.count(name)) << name;
    EXPECT_TRUE(same_bytes(f.tensors.at(name), t)) << name;
  }

  // The header is 8-byte aligned and every tensor starts at a multiple of its element size.
  std::string bytes = read_bytes(path);
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  EXPECT_EQ(header_size % 8, 0u);
  auto header = nlohmann::json::parse(bytes.substr(8, header_size));
  for (const auto& [name, t] : tensors) {
    uint64_t begin = header[name]["data_offsets"][0];
    EXPECT_EQ(begin % dtype_size(t.dtype()), 0u) << name;
  }
}

TEST(Safetensors, OverwritesAnExistingFileAndOmitsEmptyMetadata) {
  std::string path = temp_path("overwrite.safetensors");
  save_safetensors(path, {{"a", Tensor::from({2}, {1.0f, 2.0f})}}, {{"k", "v"}});
  save_safetensors(path, {{"b", Tensor::from_i32({1}, {7})}});
  SafetensorsFile f = load_safetensors(path);
  EXPECT_TRUE(f.metadata.empty());
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors.at("b").i32()[0], 7);
  EXPECT_EQ(read_bytes(path).find("__metadata__"), std::string::npos);
}

TEST(Safetensors, ByteLayoutOfATinyFile) {
  Tensor w = Tensor::from({2}, {1.0f, -2.0f}).to(DType::F16);  // 0x3C00, 0xC000
  Tensor n = Tensor::from_i32({1}, {7});
  std::string path = temp_path("tiny.safetensors");
  // Given F16 first: the writer puts the 4-byte I32 first in the data. (Python's
  // safetensors.torch.save_file writes these same bytes for these tensors.)
  save_safetensors(path, {{"w", w}, {"n", n}}, {{"format", "pt"}});

  std::string header = R"({"__metadata__":{"format":"pt"},)"
                       R"("n":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},)"
                       R"("w":{"dtype":"F16","shape":[2],"data_offsets":[4,8]}})";
  ASSERT_EQ(header.size(), 138u);
  std::string expected = std::string("\x90\0\0\0\0\0\0\0", 8) + header + "      " +
                         std::string("\x07\0\0\0\x00\x3c\x00\xc0", 8);
  std::string got = read_bytes(path);
  EXPECT_EQ(got.size(), 8u + 144u + 8u);
  EXPECT_EQ(got, expected);

  // And a file built by hand reads back.
  std::string hand = temp_path("hand.safetensors");
  write_bytes(hand, file_of(R"({"x":{"dtype":"BF16","shape":[1,2],"data_offsets":[0,4]}})",
                            std::string("\x80\x3f\x00\xc0", 4)));  // bf16 1.0, -2.0
  SafetensorsFile f = load_safetensors(hand);
  const Tensor& x = f.tensors.at("x");
  EXPECT_EQ(x.dtype(), DType::BF16);
  EXPECT_EQ(x.shape(), (Shape{1, 2}));
  EXPECT_EQ(x.item(0), 1.0f);
  EXPECT_EQ(x.item(1), -2.0f);
}

TEST(Safetensors, BadFilesRaiseAnErrorNamingTheFile) {
  std::string good_path = temp_path("good.safetensors");
  save_safetensors(good_path, {{"a", Tensor::from({2, 2}, {1, 2, 3, 4})}}, {{"k", "v"}});
  const std::string good = read_bytes(good_path);
  const std::string a = R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
  const std::string data16(16, '\x01');

  struct Case {
    std::string what;
    std::string bytes;
    std::string expect;  // a piece of the message
  };
  std::vector<Case> cases = {
      {"empty", "", "truncated"},
      {"short length", std::string("\x10\0\0", 3), "truncated"},
      {"cut in the header", good.substr(0, 20), "truncated"},
      {"cut in the data", good.substr(0, good.size() - 1), "truncated"},
      {"huge header length", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}",
       "header length"},
      {"not json", file_of("{\"a\": [", data16), "not valid JSON"},
      {"not an object", file_of("[1, 2]  ", ""), "not a JSON object"},
      {"unknown dtype",
       file_of(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", data16), "F64"},
      {"offsets do not match shape",
       file_of(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", data16), "needs 12"},
      {"negative dim",
       file_of(R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", data16), "shape"},
      {"no offsets", file_of(R"({"a":{"dtype":"F32","shape":[4]}})", data16), "data_offsets"},
      {"gap", file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data16), "gap"},
      {"trailing bytes", file_of("{" + a + "}", data16 + "xx"), "cover 16"},
      {"overlap",
       file_of("{" + a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", data16),
       "overlap"},
      {"metadata not strings", file_of(R"({"__metadata__":{"k":1},)" + a + "}", data16),
       "__metadata__"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::string path = temp_path("bad.safetensors");
    write_bytes(path, c.bytes);
    std::string e = error_of([&] { load_safetensors(path); });
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << e;
  }
  std::string missing = temp_path("does_not_exist.safetensors");
  std::string e = error_of([&] { load_safetensors(missing); });
  EXPECT_NE(e.find(missing), std::string::npos) << e;

  std::string unwritable = temp_path("no_such_dir/x.safetensors");
  e = error_of([&] { save_safetensors(unwritable, {{"a", Tensor::from({1}, {1.0f})}}); });
  EXPECT_NE(e.find(unwritable), std::string::npos) << e;
}

TEST(Safetensors, RejectsDuplicateAndReservedNames) {
  std::string path = temp_path("dup.safetensors");
  Tensor t = Tensor::from({1}, {1.0f});
  EXPECT_THROW(save_safetensors(path, {{"a", t}, {"a", t}}), InternalError);
  EXPECT_THROW(save_safetensors(path, {{"__metadata__", t}}), InternalError);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// ---- golden files written by tools/make_golden.py (Hugging Face transformers) ----

namespace {

struct Expected {
  std::string name;
  Shape shape;
};

// Parameter names and shapes a Llama/Mixtral/Qwen3-MoE checkpoint has for this config.
std::vector<Expected> expected_params(const nlohmann::json& cfg) {
  const bool qwen3_moe = cfg["model_type"] == "qwen3_moe";
  int64_t v = cfg["vocab_size"], h = cfg["hidden_size"];
  int64_t ffn = qwen3_moe ? cfg["moe_intermediate_size"] : cfg["intermediate_size"];
  int64_t heads = cfg["num_attention_heads"], groups = cfg["num_key_value_heads"];
  int64_t d = cfg.contains("head_dim") && !cfg["head_dim"].is_null()
                  ? cfg["head_dim"].get<int64_t>()
                  : h / heads;
  std::vector<Expected> out = {{"model.embed_tokens.weight", {v, h}},
                               {"model.norm.weight", {h}},
                               {"lm_head.weight", {v, h}}};
  for (int l = 0; l < int(cfg["num_hidden_layers"]); ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back({p + "input_layernorm.weight", {h}});
    out.push_back({p + "post_attention_layernorm.weight", {h}});
    out.push_back({p + "self_attn.q_proj.weight", {heads * d, h}});
    out.push_back({p + "self_attn.k_proj.weight", {groups * d, h}});
    out.push_back({p + "self_attn.v_proj.weight", {groups * d, h}});
    out.push_back({p + "self_attn.o_proj.weight", {h, heads * d}});
    if (qwen3_moe) {
      out.push_back({p + "self_attn.q_norm.weight", {d}});
      out.push_back({p + "self_attn.k_norm.weight", {d}});
      int64_t experts = cfg["num_local_experts"];
      out.push_back({p + "mlp.gate.weight", {experts, h}});
      for (int e = 0; e < experts; ++e) {
        std::string q = p + "mlp.experts." + std::to_string(e) + ".";
        out.push_back({q + "gate_proj.weight", {ffn, h}});
        out.push_back({q + "up_proj.weight", {ffn, h}});
        out.push_back({q + "down_proj.weight", {h, ffn}});
      }
    } else if (cfg.contains("num_local_experts")) {
      int64_t experts = cfg["num_local_experts"];
      out.push_back({p + "block_sparse_moe.gate.weight", {experts, h}});
      for (int e = 0; e < experts; ++e) {
        std::string q = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
        out.push_back({q + "w1.weight", {ffn, h}});
        out.push_back({q + "w2.weight", {h, ffn}});
        out.push_back({q + "w3.weight", {ffn, h}});
      }
    } else {
      out.push_back({p + "mlp.gate_proj.weight", {ffn, h}});
      out.push_back({p + "mlp.up_proj.weight", {ffn, h}});
      out.push_back({p + "mlp.down_proj.weight", {h, ffn}});
    }
  }
  return out;
}

void check_golden(const std::string& file, const std::string& model_type, int64_t experts) {
  std::string path = std::string(MEGATON_SOURCE_DIR) + "/tests/golden/" + file;
  SafetensorsFile f = load_safetensors(path);
  for (const char* key : {"config", "torch_version", "transformers_version"})
    ASSERT_TRUE(f.metadata.count(key)) << key;
  auto cfg = nlohmann::json::parse(f.metadata.at("config"));
  EXPECT_EQ(cfg["model_type"], model_type);
  EXPECT_EQ(cfg["vocab_size"], 96);
  EXPECT_EQ(cfg["hidden_size"], 64);
  EXPECT_EQ(cfg["num_hidden_layers"], 2);
  EXPECT_EQ(cfg["num_attention_heads"], 4);
  EXPECT_EQ(cfg["num_key_value_heads"], 2);
  EXPECT_EQ(cfg["tie_word_embeddings"], false);
  if (model_type == "qwen3_moe") {
    EXPECT_EQ(cfg["num_local_experts"], experts);
    EXPECT_EQ(cfg["num_experts_per_tok"], 2);
    EXPECT_EQ(cfg["moe_intermediate_size"], 48);
    EXPECT_EQ(cfg["head_dim"], 32);
    EXPECT_EQ(cfg["norm_topk_prob"], true);
  } else if (experts) {
    EXPECT_EQ(cfg["num_local_experts"], experts);
    EXPECT_EQ(cfg["num_experts_per_tok"], 2);
    EXPECT_EQ(cfg["intermediate_size"], 48);
  } else {
    EXPECT_EQ(cfg["intermediate_size"], 96);
  }

  auto params = expected_params(cfg);
  EXPECT_EQ(f.tensors.size(), 2 * params.size() + 4);  // params, grads, 2 inputs, 2 outputs
  for (const auto& [name, shape] : params) {
    for (const std::string& key : {name, "grad." + name}) {
      ASSERT_TRUE(f.tensors.count(key)) << key;
      EXPECT_EQ(f.tensors.at(key).dtype(), DType::F32) << key;
      EXPECT_EQ(f.tensors.at(key).shape(), shape) << key;
    }
  }
  const Tensor& tokens = f.tensors.at("input.tokens");
  const Tensor& labels = f.tensors.at("input.labels");
  const Tensor& logits = f.tensors.at("output.logits");
  const Tensor& loss = f.tensors.at("output.loss");
  EXPECT_EQ(tokens.dtype(), DType::I32);
  EXPECT_EQ(labels.dtype(), DType::I32);
  EXPECT_EQ(tokens.shape(), (Shape{2, 16}));
  EXPECT_EQ(labels.shape(), (Shape{2, 16}));
  EXPECT_EQ(logits.dtype(), DType::F32);
  EXPECT_EQ(logits.shape(), (Shape{2, 16, 96}));
  EXPECT_EQ(loss.dtype(), DType::F32);
  EXPECT_EQ(loss.shape(), (Shape{1}));

  // The stored loss is the mean cross entropy of the stored logits against the labels.
  double total = 0;
  for (int64_t t = 0; t < 32; ++t) {
    ASSERT_GE(labels.i32()[t], 0);
    ASSERT_LT(labels.i32()[t], 96);
    ASSERT_GE(tokens.i32()[t], 0);
    ASSERT_LT(tokens.i32()[t], 96);
    const float* row = logits.f32() + t * 96;
    double mx = -INFINITY, sum = 0;
    for (int v = 0; v < 96; ++v) mx = std::max(mx, double(row[v]));
    for (int v = 0; v < 96; ++v) sum += std::exp(double(row[v]) - mx);
    total += mx + std::log(sum) - row[labels.i32()[t]];
  }
  EXPECT_NEAR(total / 32, loss.item(0), 1e-5 * loss.item(0));
}

}  // namespace

TEST(SafetensorsGolden, LlamaTinyHasEveryParamGradInputAndOutput) {
  check_golden("llama_tiny.safetensors", "llama", 0);
}

TEST(SafetensorsGolden, MixtralTinyHasEveryParamGradInputAndOutput) {
  check_golden("mixtral_tiny.safetensors", "mixtral", 4);
}

TEST(SafetensorsGolden, Qwen3MoeTinyHasEveryParamGradInputAndOutput) {
  check_golden("qwen3_moe_tiny.safetensors", "qwen3_moe", 4);
}
