// Hugging Face config.json <-> Megatron's model flags, for `megaton convert`.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "model/config.h"
#include "train/arguments.h"

namespace megaton {

// The Hugging Face model classes `megaton convert` reads and writes.
enum class HFFamily { Llama, Qwen3, Mixtral, Qwen3Moe, DeepseekV3, NemotronH };

// config.json's "model_type" ("llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3",
// "nemotron_h") and its "architectures" entry ("LlamaForCausalLM", ...,
// "NemotronHForCausalLM").
const char* hf_model_type(HFFamily family);
const char* hf_architecture(HFFamily family);

// What a config.json says, in Megaton's terms.
struct HFImport {
  HFFamily family = HFFamily::Llama;
  // The model flags of `megaton train` (names without dashes, values as strings, switches
  // "true"), as a checkpoint's metadata "args" holds them: the shape (num-layers,
  // hidden-size, ffn-hidden-size, num-attention-heads, group-query-attention,
  // num-query-groups, kv-channels, seq-length = min(max_position_embeddings, 4096),
  // max-position-embeddings), normalization RMSNorm, norm-epsilon, swiglu, rope with
  // rotary-base, untie-embeddings-and-output-weights, disable-bias-linear, dropouts,
  // qk-layernorm (Qwen3), the MoE flags (num-experts, moe-router-topk, moe-ffn-hidden-size,
  // moe-layer-freq as a pattern when some layers are dense, moe-router-pre-softmax,
  // moe-shared-expert-intermediate-size, moe-router-score-function,
  // moe-router-enable-expert-bias, moe-router-num-groups / group-topk,
  // moe-router-topk-scaling-factor) and the MLA and YaRN flags (DeepSeek-V3).
  // NemotronH instead: hybrid-layer-pattern (no num-layers: the pattern's length),
  // squared-relu (no swiglu), position-embedding-type none, the mamba-* sizes and, with E
  // layers, the sigmoid router with expert bias and the shared expert.
  // No tokenizer and no vocabulary flags: those are the caller's.
  RawOptions flags;
  ckpt::HFLayout layout;   // for hf_to_megaton
  int64_t vocab_size = 0;  // config.json's vocab_size: the rows of embed_tokens
  bool tie_word_embeddings = false;
  // Lines for the user: what is ignored or only approximately the same (e.g. a sliding
  // window, DeepSeek-V3's MTP layers, its group score).
  std::vector<std::string> warnings;
};

// Reads a parsed config.json. `source` names the file in messages. Throws megaton::Error
// with one line naming the file and the key when model_type is missing or not one of the
// families above (qwen2 is refused: its q/k/v biases need --add-qkv-bias, which Megaton
// does not have), a required key is missing or of the wrong type, or the model uses what
// Megaton's model cannot express (biases, an activation other than silu, RoPE scaling other
// than DeepSeek-V3's YaRN, partial RoPE, non-renormalised sigmoid top-k, ...; for
// nemotron_h: an unknown layer type, mlp_hidden_act other than relu2, mamba_hidden_act
// other than silu, conv_kernel other than 4, use_conv_bias false, use_bias / mlp_bias /
// attention_bias true, a moe_latent_size).
HFImport hf_import_config(const nlohmann::json& config, const std::string& source);

// A config.json for a Megaton model.
struct HFExport {
  HFFamily family = HFFamily::Llama;
  nlohmann::json config;  // the whole config.json object (no dtype keys: the caller's)
  ckpt::HFLayout layout;  // for megaton_to_hf
  ckpt::HFExpertNaming naming = ckpt::HFExpertNaming::PerExpertProjections;
  // DeepSeek-V3 always applies e_score_correction_bias: a model without
  // --moe-router-enable-expert-bias exports zeros (the caller adds them).
  bool zero_expert_bias = false;
  // config.json keys the model flags do not determine (NemotronH's SSD chunk_size and dt
  // limits, ...): the caller takes them from the Hugging Face config the checkpoint was
  // converted from, when it holds them, over the defaults written here.
  std::vector<std::string> carried_keys;
  std::vector<std::string> warnings;  // e.g. MTP layers left out
};

// The family of `cfg` and its config.json. The family rule: a hybrid model
// (--hybrid-layer-pattern) -> nemotron_h; multi-latent attention -> deepseek_v3; otherwise
// MoE (num-experts > 0) -> qwen3_moe with --qk-layernorm, else mixtral; otherwise dense ->
// qwen3 with --qk-layernorm, else llama. `vocab_size` is the real vocabulary (the exported
// rows). Throws megaton::Error with one line naming the flag when the model cannot be
// expressed in that family: learned absolute positions, LayerNorm, no --swiglu, linear
// biases, partial RoPE, and for the MoE families what their router or layers cannot do
// (e.g. mixtral with dense layers or a shared expert, a sigmoid router outside deepseek_v3,
// deepseek_v3 without a shared expert or with dense layers after MoE ones); for nemotron_h:
// positions other than none, no --squared-relu, + (multi-latent attention) layers,
// --qk-layernorm, MoE without the sigmoid router or the shared expert, a shared expert
// gate.
HFExport hf_export_config(const GPTConfig& cfg, int64_t vocab_size);

}  // namespace megaton
