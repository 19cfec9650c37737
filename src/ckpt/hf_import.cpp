// Hugging Face -> Megaton parameter mapping.
#include "ckpt/hf_import.h"

#include <cstring>
#include <set>

#include "core/error.h"

namespace megaton::ckpt {

namespace {

// Rows of `parts` stacked in order: [sum rows, cols], F32.
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

// Builds the plan: each output's inputs checked present (named in the error otherwise).
struct Planner {
  const HFHas& has_raw;
  const std::string& prefix;
  std::vector<HFMappedTensor>& out;

  bool has(const std::string& name) const { return has_raw(prefix + name); }
  std::string need(const std::string& name) const {
    if (!has(name)) fail("Hugging Face checkpoint has no tensor '{}'", prefix + name);
    return prefix + name;
  }
  // `to` = `from` as F32.
  void copy(const std::string& to, const std::string& from) {
    const std::string f = need(from);
    out.push_back({to, {f}, [f](const HFGet& get) { return get(f).to(DType::F32); }});
  }
  // `to` = the rows of `from` stacked ([gate; up]).
  void stack(const std::string& to, const std::vector<std::string>& from) {
    std::vector<std::string> inputs;
    for (const std::string& n : from) inputs.push_back(need(n));
    out.push_back({to, inputs, [inputs](const HFGet& get) {
                     std::vector<Tensor> parts;
                     for (const std::string& n : inputs) parts.push_back(get(n));
                     return stack_rows(parts);
                   }});
  }
  // `to` = row block `index` of `from` [n, rows, cols] (a fused experts tensor), as F32.
  void expert_of(const std::string& to, const std::string& from, int64_t index) {
    const std::string f = need(from);
    out.push_back({to, {f}, [f, index](const HFGet& get) {
                     const Tensor t = get(f);
                     return t.rows(index, 1).view({t.dim(1), t.dim(2)}).to(DType::F32);
                   }});
  }
};

// DeepSeek-V2/V3 multi-latent attention (HF DeepseekV3Attention) -> Megatron's
// MLASelfAttention, local-spec names. One to one, no reordering: both lay out q_b_proj's rows
// per head as [nope | rope], kv_a_proj_with_mqa's as [kv_lora_rank | rope] and kv_b_proj's
// per head as [k_nope | v], and both rotate the rope part as interleaved pairs
// (docs/research/deepseek-v3.md 6.2-6.3).
void plan_mla(Planner& in, const std::string& h, const std::string& m) {
  if (in.has(h + "q_a_proj.weight")) {
    in.copy(m + "linear_q_down_proj.weight", h + "q_a_proj.weight");
    in.copy(m + "q_layernorm.weight", h + "q_a_layernorm.weight");
    in.copy(m + "linear_q_up_proj.weight", h + "q_b_proj.weight");
  } else {
    in.copy(m + "linear_q_proj.weight", h + "q_proj.weight");  // q_lora_rank None
  }
  in.copy(m + "linear_kv_down_proj.weight", h + "kv_a_proj_with_mqa.weight");
  in.copy(m + "kv_layernorm.weight", h + "kv_a_layernorm.weight");
  in.copy(m + "linear_kv_up_proj.weight", h + "kv_b_proj.weight");
  in.copy(m + "linear_proj.weight", h + "o_proj.weight");
}
// Megatron's grouped linear_qkv from q_proj, k_proj, v_proj: per query group its query
// heads, its key head, its value head.
void plan_qkv(Planner& in, const HFLayout& L, const std::string& h, const std::string& m) {
  MEGATON_CHECK(L.num_query_groups > 0 && L.num_attention_heads % L.num_query_groups == 0,
                "hf_to_megaton: {} attention heads in {} query groups", L.num_attention_heads,
                L.num_query_groups);
  const int64_t groups = L.num_query_groups, qpg = L.num_attention_heads / groups,
                d = L.kv_channels;
  const std::vector<std::string> qkv_in = {
      in.need(h + "q_proj.weight"), in.need(h + "k_proj.weight"), in.need(h + "v_proj.weight")};
  in.out.push_back({m + "linear_qkv.weight", qkv_in, [qkv_in, groups, qpg, d](const HFGet& get) {
                      const Tensor q = get(qkv_in[0]), k = get(qkv_in[1]), v = get(qkv_in[2]);
                      std::vector<Tensor> parts;
                      for (int64_t g = 0; g < groups; ++g) {
                        parts.push_back(q.rows(g * qpg * d, qpg * d));
                        parts.push_back(k.rows(g * d, d));
                        parts.push_back(v.rows(g * d, d));
                      }
                      return stack_rows(parts);
                    }});
  in.copy(m + "linear_proj.weight", h + "o_proj.weight");
}

// NemotronH (NemotronHForCausalLM: "backbone." names; docs/golden.md "nemotron_h_tiny"):
// every layer is "norm" + "mixer", its kind told by the mixer's tensors. A Mamba-2 mixer
// maps one to one (in_proj rows [z, x, B, C, dt] and conv1d [x, B, C, 1, K] as Megatron's
// MambaMixer); attention to linear_qkv / linear_proj; an MLP layer's up_proj / down_proj
// (no gate: squared ReLU) to linear_fc1 / linear_fc2; an MoE layer's gate (and its
// e_score_correction_bias), per-expert up/down projections and shared expert likewise.
void plan_nemotron_h(Planner& in, const HFLayout& L) {
  in.copy("embedding.word_embeddings.weight", "backbone.embeddings.weight");
  in.copy("decoder.final_norm.weight", "backbone.norm_f.weight");
  if (in.has("lm_head.weight")) in.copy("output_layer.weight", "lm_head.weight");
  for (int64_t i = 0; i < L.num_layers; ++i) {
    const std::string h = "backbone.layers." + std::to_string(i) + ".";
    const std::string m = "decoder.layers." + std::to_string(i) + ".";
    const std::string x = h + "mixer.";
    if (in.has(x + "in_proj.weight")) {  // M
      in.copy(m + "norm.weight", h + "norm.weight");
      for (const char* name : {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log",
                               "D", "norm.weight", "out_proj.weight"})
        in.copy(m + "mixer." + name, x + name);
    } else if (in.has(x + "q_proj.weight")) {  // *
      in.copy(m + "input_layernorm.weight", h + "norm.weight");
      plan_qkv(in, L, x, m + "self_attention.");
    } else if (in.has(x + "gate.weight")) {  // E
      in.copy(m + "pre_mlp_layernorm.weight", h + "norm.weight");
      in.copy(m + "mlp.router.weight", x + "gate.weight");
      if (in.has(x + "gate.e_score_correction_bias"))
        in.copy(m + "mlp.router.expert_bias", x + "gate.e_score_correction_bias");
      if (in.has(x + "shared_experts.up_proj.weight")) {
        in.copy(m + "mlp.shared_experts.linear_fc1.weight", x + "shared_experts.up_proj.weight");
        in.copy(m + "mlp.shared_experts.linear_fc2.weight", x + "shared_experts.down_proj.weight");
      }
      for (int64_t e = 0; e < L.num_experts; ++e) {
        const std::string dst = m + "mlp.experts.local_experts." + std::to_string(e) + ".";
        const std::string src = x + "experts." + std::to_string(e) + ".";
        in.copy(dst + "linear_fc1.weight", src + "up_proj.weight");
        in.copy(dst + "linear_fc2.weight", src + "down_proj.weight");
      }
    } else {  // -
      in.copy(m + "pre_mlp_layernorm.weight", h + "norm.weight");
      in.copy(m + "mlp.linear_fc1.weight", x + "up_proj.weight");
      in.copy(m + "mlp.linear_fc2.weight", x + "down_proj.weight");
    }
  }
}
}  // namespace

std::vector<HFMappedTensor> hf_mapping(const HFLayout& L, const HFHas& has,
                                       const std::string& prefix) {
  std::vector<HFMappedTensor> out;
  Planner in{has, prefix, out};
  if (in.has("backbone.embeddings.weight")) {
    plan_nemotron_h(in, L);
    return out;
  }
  in.copy("embedding.word_embeddings.weight", "model.embed_tokens.weight");
  in.copy("decoder.final_layernorm.weight", "model.norm.weight");
  if (in.has("lm_head.weight")) in.copy("output_layer.weight", "lm_head.weight");
  for (int64_t i = 0; i < L.num_layers; ++i) {
    std::string h = "model.layers." + std::to_string(i) + ".";
    std::string m = "decoder.layers." + std::to_string(i) + ".";
    in.copy(m + "input_layernorm.weight", h + "input_layernorm.weight");
    in.copy(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight");
    if (in.has(h + "self_attn.kv_a_proj_with_mqa.weight")) {
      plan_mla(in, h + "self_attn.", m + "self_attention.");
    } else {
      plan_qkv(in, L, h + "self_attn.", m + "self_attention.");
    }
    // Qwen3's per-head q_norm / k_norm: Megatron's --qk-layernorm.
    if (in.has(h + "self_attn.q_norm.weight")) {
      in.copy(m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight");
      in.copy(m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight");
    }
    // Dense layers, also those of an MoE model (Qwen3-MoE's mlp_only_layers).
    if (L.num_experts == 0 || in.has(h + "mlp.gate_proj.weight")) {
      in.stack(m + "mlp.linear_fc1.weight", {h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"});
      in.copy(m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight");
      continue;
    }
    const bool fused = in.has(h + "mlp.experts.gate_up_proj");
    // Qwen3-MoE checkpoints: mlp.gate and mlp.experts.E.{gate,up,down}_proj.
    const bool qwen = in.has(h + "mlp.experts.0.gate_proj.weight");
    const std::string moe = fused || qwen ? h + "mlp." : h + "block_sparse_moe.";
    in.copy(m + "mlp.router.weight", moe + "gate.weight");
    // DeepSeek-V3's e_score_correction_bias (a buffer: no "grad." entry) is the router's
    // expert bias, Megaton's checkpoint entry "<layer>.mlp.router.expert_bias".
    if (in.has(moe + "gate.e_score_correction_bias"))
      in.copy(m + "mlp.router.expert_bias", moe + "gate.e_score_correction_bias");
    // DeepSeek-V3's shared experts (n_shared_experts of them, one MLP of their summed width).
    if (in.has(moe + "shared_experts.gate_proj.weight")) {
      in.stack(m + "mlp.shared_experts.linear_fc1.weight",
               {moe + "shared_experts.gate_proj.weight", moe + "shared_experts.up_proj.weight"});
      in.copy(m + "mlp.shared_experts.linear_fc2.weight", moe + "shared_experts.down_proj.weight");
    }
    for (int64_t e = 0; e < L.num_experts; ++e) {
      const std::string dst = m + "mlp.experts.local_experts." + std::to_string(e) + ".";
      const std::string src = moe + "experts." + std::to_string(e) + ".";
      if (fused) {
        in.expert_of(dst + "linear_fc1.weight", moe + "experts.gate_up_proj", e);  // [E, 2F, H]
        in.expert_of(dst + "linear_fc2.weight", moe + "experts.down_proj", e);     // [E, H, F]
      } else if (qwen) {
        in.stack(dst + "linear_fc1.weight", {src + "gate_proj.weight", src + "up_proj.weight"});
        in.copy(dst + "linear_fc2.weight", src + "down_proj.weight");
      } else {
        in.stack(dst + "linear_fc1.weight", {src + "w1.weight", src + "w3.weight"});
        in.copy(dst + "linear_fc2.weight", src + "w2.weight");
      }
    }
  }
  return out;
}

std::map<std::string, Tensor> hf_to_megaton(const std::map<std::string, Tensor>& hf,
                                            const HFLayout& L, const std::string& prefix,
                                            std::set<std::string>* used) {
  const std::vector<HFMappedTensor> plan = hf_mapping(
      L, [&hf](const std::string& name) { return hf.count(name) > 0; }, prefix);
  const HFGet get = [&hf](const std::string& name) { return hf.at(name); };
  std::map<std::string, Tensor> out;
  for (const HFMappedTensor& t : plan) {
    out[t.name] = t.make(get);
    if (used) used->insert(t.inputs.begin(), t.inputs.end());
  }
  return out;
}

}  // namespace megaton::ckpt
