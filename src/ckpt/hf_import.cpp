// Hugging Face -> Megaton parameter mapping.
#include "ckpt/hf_import.h"

#include <cstring>

#include "core/error.h"

namespace megaton::ckpt {

namespace {
struct Lookup {
  const std::map<std::string, Tensor>& hf;
  const std::string& prefix;
  bool has(const std::string& name) const { return hf.count(prefix + name) > 0; }
  const Tensor& at(const std::string& name) const {
    auto it = hf.find(prefix + name);
    if (it == hf.end()) fail("Hugging Face checkpoint has no tensor '{}'", prefix + name);
    return it->second;
  }
};

// Rows of `parts` stacked in order: [sum rows, cols].
Tensor stack_rows(const std::vector<Tensor>& parts) {
  int64_t rows = 0, cols = parts[0].numel() / parts[0].dim(0);
  for (const Tensor& p : parts) rows += p.dim(0);
  Tensor out = Tensor::empty({rows, cols});
  int64_t at = 0;
  for (const Tensor& p : parts) {
    out.rows(at, p.dim(0)).copy_from(p.view({p.dim(0), cols}).to(DType::F32));
    at += p.dim(0);
  }
  return out;
}
}  // namespace

std::map<std::string, Tensor> hf_to_megaton(const std::map<std::string, Tensor>& hf,
                                            const HFLayout& L, const std::string& prefix) {
  Lookup in{hf, prefix};
  std::map<std::string, Tensor> out;
  auto f32 = [](const Tensor& t) { return t.to(DType::F32); };
  out["embedding.word_embeddings.weight"] = f32(in.at("model.embed_tokens.weight"));
  out["decoder.final_layernorm.weight"] = f32(in.at("model.norm.weight"));
  if (in.has("lm_head.weight")) out["output_layer.weight"] = f32(in.at("lm_head.weight"));
  int64_t qpg = L.num_attention_heads / L.num_query_groups, d = L.kv_channels;
  for (int64_t i = 0; i < L.num_layers; ++i) {
    std::string h = "model.layers." + std::to_string(i) + ".";
    std::string m = "decoder.layers." + std::to_string(i) + ".";
    out[m + "input_layernorm.weight"] = f32(in.at(h + "input_layernorm.weight"));
    out[m + "pre_mlp_layernorm.weight"] = f32(in.at(h + "post_attention_layernorm.weight"));
    const Tensor &q = in.at(h + "self_attn.q_proj.weight"), &k = in.at(h + "self_attn.k_proj.weight"),
                 &v = in.at(h + "self_attn.v_proj.weight");
    std::vector<Tensor> qkv;
    for (int64_t g = 0; g < L.num_query_groups; ++g) {
      qkv.push_back(q.rows(g * qpg * d, qpg * d));
      qkv.push_back(k.rows(g * d, d));
      qkv.push_back(v.rows(g * d, d));
    }
    out[m + "self_attention.linear_qkv.weight"] = stack_rows(qkv);
    out[m + "self_attention.linear_proj.weight"] = f32(in.at(h + "self_attn.o_proj.weight"));
    // Qwen3's per-head q_norm / k_norm: Megatron's --qk-layernorm.
    if (in.has(h + "self_attn.q_norm.weight")) {
      out[m + "self_attention.q_layernorm.weight"] = f32(in.at(h + "self_attn.q_norm.weight"));
      out[m + "self_attention.k_layernorm.weight"] = f32(in.at(h + "self_attn.k_norm.weight"));
    }
    // Dense layers, also those of an MoE model (Qwen3-MoE's mlp_only_layers).
    if (L.num_experts == 0 || in.has(h + "mlp.gate_proj.weight")) {
      out[m + "mlp.linear_fc1.weight"] =
          stack_rows({in.at(h + "mlp.gate_proj.weight"), in.at(h + "mlp.up_proj.weight")});
      out[m + "mlp.linear_fc2.weight"] = f32(in.at(h + "mlp.down_proj.weight"));
      continue;
    }
    bool fused = in.has(h + "mlp.experts.gate_up_proj");
    // Qwen3-MoE checkpoints: mlp.gate and mlp.experts.E.{gate,up,down}_proj.
    bool qwen = in.has(h + "mlp.experts.0.gate_proj.weight");
    std::string moe = fused || qwen ? h + "mlp." : h + "block_sparse_moe.";
    out[m + "mlp.router.weight"] = f32(in.at(moe + "gate.weight"));
    for (int64_t e = 0; e < L.num_experts; ++e) {
      std::string dst = m + "mlp.experts.local_experts." + std::to_string(e) + ".";
      if (fused) {
        const Tensor& gu = in.at(moe + "experts.gate_up_proj");  // [E, 2F, H]
        const Tensor& down = in.at(moe + "experts.down_proj");   // [E, H, F]
        out[dst + "linear_fc1.weight"] = f32(gu.rows(e, 1).view({gu.dim(1), gu.dim(2)}));
        out[dst + "linear_fc2.weight"] = f32(down.rows(e, 1).view({down.dim(1), down.dim(2)}));
      } else if (qwen) {
        std::string src = moe + "experts." + std::to_string(e) + ".";
        out[dst + "linear_fc1.weight"] =
            stack_rows({in.at(src + "gate_proj.weight"), in.at(src + "up_proj.weight")});
        out[dst + "linear_fc2.weight"] = f32(in.at(src + "down_proj.weight"));
      } else {
        std::string src = moe + "experts." + std::to_string(e) + ".";
        out[dst + "linear_fc1.weight"] =
            stack_rows({in.at(src + "w1.weight"), in.at(src + "w3.weight")});
        out[dst + "linear_fc2.weight"] = f32(in.at(src + "w2.weight"));
      }
    }
  }
  return out;
}

}  // namespace megaton::ckpt
