// Hugging Face -> Megaton parameter mapping.
#include "ckpt/hf_import.h"

#include <cstring>
#include <set>

#include "core/error.h"

namespace megaton::ckpt {

namespace {
struct Lookup {
  const std::map<std::string, Tensor>& hf;
  const std::string& prefix;
  std::set<std::string>* used;
  bool has(const std::string& name) const { return hf.count(prefix + name) > 0; }
  const Tensor& at(const std::string& name) const {
    auto it = hf.find(prefix + name);
    if (it == hf.end()) fail("Hugging Face checkpoint has no tensor '{}'", prefix + name);
    if (used) used->insert(it->first);
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

// DeepSeek-V2/V3 multi-latent attention (HF DeepseekV3Attention) -> Megatron's
// MLASelfAttention, local-spec names. One to one, no reordering: both lay out q_b_proj's rows
// per head as [nope | rope], kv_a_proj_with_mqa's as [kv_lora_rank | rope] and kv_b_proj's
// per head as [k_nope | v], and both rotate the rope part as interleaved pairs
// (docs/research/deepseek-v3.md 6.2-6.3).
void map_mla(const Lookup& in, const std::string& h, const std::string& m,
             std::map<std::string, Tensor>& out) {
  auto copy = [&](const std::string& from, const std::string& to) {
    out[m + to] = in.at(h + from).to(DType::F32);
  };
  if (in.has(h + "q_a_proj.weight")) {
    copy("q_a_proj.weight", "linear_q_down_proj.weight");
    copy("q_a_layernorm.weight", "q_layernorm.weight");
    copy("q_b_proj.weight", "linear_q_up_proj.weight");
  } else {
    copy("q_proj.weight", "linear_q_proj.weight");  // q_lora_rank None
  }
  copy("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight");
  copy("kv_a_layernorm.weight", "kv_layernorm.weight");
  copy("kv_b_proj.weight", "linear_kv_up_proj.weight");
  copy("o_proj.weight", "linear_proj.weight");
}
}  // namespace

std::map<std::string, Tensor> hf_to_megaton(const std::map<std::string, Tensor>& hf,
                                            const HFLayout& L, const std::string& prefix,
                                            std::set<std::string>* used) {
  Lookup in{hf, prefix, used};
  std::map<std::string, Tensor> out;
  auto f32 = [](const Tensor& t) { return t.to(DType::F32); };
  out["embedding.word_embeddings.weight"] = f32(in.at("model.embed_tokens.weight"));
  out["decoder.final_layernorm.weight"] = f32(in.at("model.norm.weight"));
  if (in.has("lm_head.weight")) out["output_layer.weight"] = f32(in.at("lm_head.weight"));
  for (int64_t i = 0; i < L.num_layers; ++i) {
    std::string h = "model.layers." + std::to_string(i) + ".";
    std::string m = "decoder.layers." + std::to_string(i) + ".";
    out[m + "input_layernorm.weight"] = f32(in.at(h + "input_layernorm.weight"));
    out[m + "pre_mlp_layernorm.weight"] = f32(in.at(h + "post_attention_layernorm.weight"));
    if (in.has(h + "self_attn.kv_a_proj_with_mqa.weight")) {
      map_mla(in, h + "self_attn.", m + "self_attention.", out);
    } else {
      MEGATON_CHECK(L.num_query_groups > 0 && L.num_attention_heads % L.num_query_groups == 0,
                    "hf_to_megaton: {} attention heads in {} query groups", L.num_attention_heads,
                    L.num_query_groups);
      const int64_t qpg = L.num_attention_heads / L.num_query_groups, d = L.kv_channels;
      const Tensor &q = in.at(h + "self_attn.q_proj.weight"),
                   &k = in.at(h + "self_attn.k_proj.weight"),
                   &v = in.at(h + "self_attn.v_proj.weight");
      std::vector<Tensor> qkv;
      for (int64_t g = 0; g < L.num_query_groups; ++g) {
        qkv.push_back(q.rows(g * qpg * d, qpg * d));
        qkv.push_back(k.rows(g * d, d));
        qkv.push_back(v.rows(g * d, d));
      }
      out[m + "self_attention.linear_qkv.weight"] = stack_rows(qkv);
      out[m + "self_attention.linear_proj.weight"] = f32(in.at(h + "self_attn.o_proj.weight"));
    }
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
    // DeepSeek-V3's e_score_correction_bias (a buffer: no "grad." entry) is the router's
    // expert bias, Megaton's checkpoint entry "<layer>.mlp.router.expert_bias".
    if (in.has(moe + "gate.e_score_correction_bias"))
      out[m + "mlp.router.expert_bias"] = f32(in.at(moe + "gate.e_score_correction_bias"));
    // DeepSeek-V3's shared experts (n_shared_experts of them, one MLP of their summed width).
    if (in.has(moe + "shared_experts.gate_proj.weight")) {
      out[m + "mlp.shared_experts.linear_fc1.weight"] =
          stack_rows({in.at(moe + "shared_experts.gate_proj.weight"),
                      in.at(moe + "shared_experts.up_proj.weight")});
      out[m + "mlp.shared_experts.linear_fc2.weight"] =
          f32(in.at(moe + "shared_experts.down_proj.weight"));
    }
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
