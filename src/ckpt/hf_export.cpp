// Megaton -> Hugging Face parameter mapping (the inverse of hf_import.cpp).
#include "ckpt/hf_export.h"

#include <set>

#include "core/error.h"

namespace megaton::ckpt {

namespace {

// The Megaton tensors, each taken at most once; what is left at the end had no HF name.
class Source {
 public:
  explicit Source(const std::map<std::string, Tensor>& tensors) : tensors_(tensors) {}
  bool has(const std::string& name) const { return tensors_.count(name) > 0; }
  const Tensor& take(const std::string& name) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("Megaton checkpoint has no tensor 'model.{}'", name);
    taken_.insert(name);
    return it->second;
  }
  void check_all_taken() const {
    for (const auto& [name, t] : tensors_)
      if (!taken_.count(name))
        fail("Megaton tensor 'model.{}' has no Hugging Face counterpart in this model family",
             name);
  }

 private:
  const std::map<std::string, Tensor>& tensors_;
  std::set<std::string> taken_;
};

// Rows [start, start + count) of a 2-D tensor, as its own tensor.
Tensor row_block(const Tensor& t, int64_t start, int64_t count) {
  return t.rows(start, count).clone();
}

// [gate; up] stacked along rows -> the two halves.
std::pair<Tensor, Tensor> split_halves(const Tensor& fc1, const std::string& name) {
  if (fc1.ndim() != 2 || fc1.dim(0) % 2 != 0)
    fail("Megaton tensor 'model.{}' is {}: expected [2 x ffn, hidden] ([gate; up], --swiglu)", name,
         shape_str(fc1.shape()));
  const int64_t f = fc1.dim(0) / 2;
  return {row_block(fc1, 0, f), row_block(fc1, f, f)};
}

// linear_qkv (`qkv_name`) [groups x (q_per_group + 2) x d, H] in Megatron's grouped order
// -> `h` + q_proj / k_proj / v_proj.
void split_qkv(Source& in, const HFLayout& L, const std::string& qkv_name, const std::string& h,
               std::map<std::string, Tensor>& out) {
  MEGATON_CHECK(L.num_query_groups > 0 && L.num_attention_heads % L.num_query_groups == 0 &&
                    L.kv_channels > 0,
                "megaton_to_hf: {} attention heads in {} query groups of {} channels",
                L.num_attention_heads, L.num_query_groups, L.kv_channels);
  const int64_t qpg = L.num_attention_heads / L.num_query_groups, d = L.kv_channels;
  const Tensor& qkv = in.take(qkv_name);
  if (qkv.ndim() != 2 || qkv.dim(0) != L.num_query_groups * (qpg + 2) * d)
    fail(
        "Megaton tensor 'model.{}' is {}: expected [{} rows, hidden] ({} query groups of {} "
        "query heads + key + value, {} channels each)",
        qkv_name, shape_str(qkv.shape()), L.num_query_groups * (qpg + 2) * d, L.num_query_groups,
        qpg, d);
  const int64_t cols = qkv.dim(1);
  Tensor q = Tensor::empty({L.num_attention_heads * d, cols}, qkv.dtype());
  Tensor k = Tensor::empty({L.num_query_groups * d, cols}, qkv.dtype());
  Tensor v = Tensor::empty({L.num_query_groups * d, cols}, qkv.dtype());
  // Per query group: its query heads, its key head, its value head (Megatron's order).
  for (int64_t g = 0; g < L.num_query_groups; ++g) {
    const int64_t at = g * (qpg + 2) * d;
    q.rows(g * qpg * d, qpg * d).copy_from(qkv.rows(at, qpg * d));
    k.rows(g * d, d).copy_from(qkv.rows(at + qpg * d, d));
    v.rows(g * d, d).copy_from(qkv.rows(at + (qpg + 1) * d, d));
  }
  out[h + "q_proj.weight"] = q;
  out[h + "k_proj.weight"] = k;
  out[h + "v_proj.weight"] = v;
}

// A Megatron hybrid layer (one norm, one mixer) -> NemotronH's "backbone.layers.<i>." names
// (the inverse of hf_import.cpp's plan_nemotron_h), its kind told by its tensors.
void nemotron_h_layer(Source& in, const HFLayout& L, const std::string& m, const std::string& h,
                      std::map<std::string, Tensor>& out) {
  auto copy = [&](const std::string& from, const std::string& to) {
    out[to] = in.take(from).clone();
  };
  const std::string x = h + "mixer.";
  if (in.has(m + "mixer.in_proj.weight")) {  // M
    copy(m + "norm.weight", h + "norm.weight");
    for (const char* name : {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log",
                             "D", "norm.weight", "out_proj.weight"})
      copy(m + "mixer." + name, x + name);
    return;
  }
  if (in.has(m + "input_layernorm.weight")) {  // *
    copy(m + "input_layernorm.weight", h + "norm.weight");
    split_qkv(in, L, m + "self_attention.linear_qkv.weight", x, out);
    copy(m + "self_attention.linear_proj.weight", x + "o_proj.weight");
    return;
  }
  copy(m + "pre_mlp_layernorm.weight", h + "norm.weight");
  if (!in.has(m + "mlp.router.weight")) {  // -
    copy(m + "mlp.linear_fc1.weight", x + "up_proj.weight");
    copy(m + "mlp.linear_fc2.weight", x + "down_proj.weight");
    return;
  }
  const Tensor& router = in.take(m + "mlp.router.weight");  // E
  out[x + "gate.weight"] = router.clone();
  if (in.has(m + "mlp.router.expert_bias"))
    copy(m + "mlp.router.expert_bias", x + "gate.e_score_correction_bias");
  if (in.has(m + "mlp.shared_experts.linear_fc1.weight")) {
    copy(m + "mlp.shared_experts.linear_fc1.weight", x + "shared_experts.up_proj.weight");
    copy(m + "mlp.shared_experts.linear_fc2.weight", x + "shared_experts.down_proj.weight");
  }
  for (int64_t e = 0; e < router.dim(0); ++e) {
    const std::string src = m + "mlp.experts.local_experts." + std::to_string(e) + ".";
    const std::string dst = x + "experts." + std::to_string(e) + ".";
    copy(src + "linear_fc1.weight", dst + "up_proj.weight");
    copy(src + "linear_fc2.weight", dst + "down_proj.weight");
  }
}

}  // namespace

std::map<std::string, Tensor> megaton_to_hf(const std::map<std::string, Tensor>& megaton,
                                            const HFLayout& L, HFExpertNaming naming,
                                            int64_t part) {
  MEGATON_CHECK(part >= kHFGlobals && part < L.num_layers, "megaton_to_hf: part {} of {} layers",
                part, L.num_layers);
  Source in(megaton);
  std::map<std::string, Tensor> out;
  if (part == kHFWholeModel || part == kHFGlobals) {
    // A hybrid model (NemotronH, "backbone." names) has decoder.final_norm.
    const bool hybrid = in.has("decoder.final_norm.weight");
    out[hybrid ? "backbone.embeddings.weight" : "model.embed_tokens.weight"] =
        in.take("embedding.word_embeddings.weight").clone();
    out[hybrid ? "backbone.norm_f.weight" : "model.norm.weight"] =
        in.take(hybrid ? "decoder.final_norm.weight" : "decoder.final_layernorm.weight").clone();
    if (in.has("output_layer.weight")) {
      out["lm_head.weight"] = in.take("output_layer.weight").clone();
    } else if (hybrid) {
      // transformers' NemotronHForCausalLM ties nothing (its lm_head would be left random):
      // a model with tied embeddings writes its output layer, the embedding.
      out["lm_head.weight"] = out.at("backbone.embeddings.weight").clone();
    }
  }
  const int64_t first = part >= 0 ? part : 0;
  const int64_t end = part >= 0 ? part + 1 : part == kHFWholeModel ? L.num_layers : 0;
  auto copy = [&](const std::string& from, const std::string& to) {
    out[to] = in.take(from).clone();
  };
  auto mlp = [&](const std::string& m, const std::string& h, const char* gate, const char* up,
                 const char* down) {
    auto [g, u] = split_halves(in.take(m + "linear_fc1.weight"), m + "linear_fc1.weight");
    out[h + gate + ".weight"] = g;
    out[h + up + ".weight"] = u;
    copy(m + "linear_fc2.weight", h + down + ".weight");
  };
  for (int64_t i = first; i < end; ++i) {
    const std::string h = "model.layers." + std::to_string(i) + ".";
    const std::string m = "decoder.layers." + std::to_string(i) + ".";
    // A hybrid layer: one norm (a Mamba layer's "norm", or one of the two a transformer
    // layer has).
    if (in.has(m + "norm.weight") ||
        in.has(m + "input_layernorm.weight") != in.has(m + "pre_mlp_layernorm.weight")) {
      nemotron_h_layer(in, L, m, "backbone.layers." + std::to_string(i) + ".", out);
      continue;
    }
    copy(m + "input_layernorm.weight", h + "input_layernorm.weight");
    copy(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight");
    const std::string a = m + "self_attention.", ha = h + "self_attn.";
    if (in.has(a + "linear_kv_down_proj.weight")) {
      // Multi-latent attention: one to one (hf_import.h's table).
      if (in.has(a + "linear_q_down_proj.weight")) {
        copy(a + "linear_q_down_proj.weight", ha + "q_a_proj.weight");
        copy(a + "q_layernorm.weight", ha + "q_a_layernorm.weight");
        copy(a + "linear_q_up_proj.weight", ha + "q_b_proj.weight");
      } else {
        copy(a + "linear_q_proj.weight", ha + "q_proj.weight");
      }
      copy(a + "linear_kv_down_proj.weight", ha + "kv_a_proj_with_mqa.weight");
      copy(a + "kv_layernorm.weight", ha + "kv_a_layernorm.weight");
      copy(a + "linear_kv_up_proj.weight", ha + "kv_b_proj.weight");
      copy(a + "linear_proj.weight", ha + "o_proj.weight");
    } else {
      split_qkv(in, L, a + "linear_qkv.weight", ha, out);
      copy(a + "linear_proj.weight", ha + "o_proj.weight");
      if (in.has(a + "q_layernorm.weight")) {  // Qwen3's per-head q_norm / k_norm
        copy(a + "q_layernorm.weight", ha + "q_norm.weight");
        copy(a + "k_layernorm.weight", ha + "k_norm.weight");
      }
    }
    if (!in.has(m + "mlp.router.weight")) {  // a dense layer
      mlp(m + "mlp.", h + "mlp.", "gate_proj", "up_proj", "down_proj");
      continue;
    }
    const bool mixtral = naming == HFExpertNaming::Mixtral;
    const std::string moe = h + (mixtral ? "block_sparse_moe." : "mlp.");
    const Tensor& router = in.take(m + "mlp.router.weight");
    out[moe + "gate.weight"] = router.clone();
    if (in.has(m + "mlp.router.expert_bias"))
      copy(m + "mlp.router.expert_bias", moe + "gate.e_score_correction_bias");
    if (in.has(m + "mlp.shared_experts.linear_fc1.weight"))
      mlp(m + "mlp.shared_experts.", moe + "shared_experts.", "gate_proj", "up_proj", "down_proj");
    for (int64_t e = 0; e < router.dim(0); ++e) {
      const std::string src = m + "mlp.experts.local_experts." + std::to_string(e) + ".";
      const std::string dst = moe + "experts." + std::to_string(e) + ".";
      if (mixtral)
        mlp(src, dst, "w1", "w3", "w2");
      else
        mlp(src, dst, "gate_proj", "up_proj", "down_proj");
    }
  }
  in.check_all_taken();
  return out;
}

}  // namespace megaton::ckpt
