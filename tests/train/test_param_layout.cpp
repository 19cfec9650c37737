// train/param_layout.h's table (what `megaton convert` writes for each rank) against the
// Params a GPTModel builds under tensor and expert parallelism (built per rank of a grid,
// no communication), and hf_export_config's refusals of models Hugging Face's families
// cannot express.
#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "core/error.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "model/gpt.h"
#include "train/hf_config.h"
#include "train/param_layout.h"

namespace megaton {
namespace {

// A Comm the model may hold but never uses here (building a model moves no data).
class UnusedComm final : public dist::Comm {
 public:
  Device device() const override { return Device::CPU; }

 protected:
  [[noreturn]] static void used() { throw InternalError("UnusedComm: a collective was called"); }
  void prepare_group(const dist::Group&) override {}
  void do_all_reduce(Tensor&, const dist::Group&, dist::ReduceOp) override { used(); }
  void do_reduce_scatter(const Tensor&, Tensor&, const dist::Group&) override { used(); }
  void do_all_gather(const Tensor&, Tensor&, const dist::Group&) override { used(); }
  std::unique_ptr<dist::CommWork> do_all_reduce_async(Tensor&, const dist::Group&) override {
    used();
  }
  std::unique_ptr<dist::CommWork> do_reduce_scatter_async(const Tensor&, Tensor&,
                                                          const dist::Group&) override {
    used();
  }
  std::unique_ptr<dist::CommWork> do_all_gather_async(const Tensor&, Tensor&,
                                                      const dist::Group&) override {
    used();
  }
  void do_all_to_allv(const Tensor&, std::span<const int64_t>, Tensor&, std::span<const int64_t>,
                      const dist::Group&) override {
    used();
  }
  void do_send_recv(const Tensor*, int, Tensor*, int, const dist::Group&) override { used(); }
  void do_broadcast(Tensor&, int, const dist::Group&) override { used(); }
  void do_barrier(const dist::Group&) override { used(); }
};

GPTConfig base_config() {
  GPTConfig c;
  c.num_layers = 3;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.num_attention_heads = 4;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.seq_length = 8;
  c.vocab_size = 50;
  c.normalization = Normalization::RMSNorm;
  c.swiglu = true;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.disable_bias_linear = true;
  c.untie_embeddings_and_output_weights = true;
  return c;
}

struct Variant {
  const char* name;
  GPTConfig cfg;
  int64_t ep, etp;
};

std::vector<Variant> variants() {
  std::vector<Variant> out;
  out.push_back({"llama", base_config(), 1, 0});
  GPTConfig tied = base_config();
  tied.untie_embeddings_and_output_weights = false;
  tied.qk_layernorm = true;
  out.push_back({"qwen3_tied", tied, 1, 0});
  GPTConfig moe = base_config();
  moe.num_experts = 4;
  moe.moe_ffn_hidden_size = 16;
  moe.moe_layer_pattern = {0, 1, 1};
  moe.moe_shared_expert_intermediate_size = 16;
  moe.moe_shared_expert_gate = true;
  moe.moe_router_enable_expert_bias = true;
  moe.moe_router_score_function = "sigmoid";
  out.push_back({"moe_ep2_etp2", moe, 2, 2});
  out.push_back({"moe_ep2_etp1", moe, 2, 1});
  GPTConfig mla = moe;
  mla.multi_latent_attention = true;
  mla.group_query_attention = false;
  mla.num_query_groups = 0;
  mla.qk_layernorm = true;
  mla.q_lora_rank = 12;
  mla.kv_lora_rank = 8;
  mla.qk_head_dim = 8;
  mla.qk_pos_emb_head_dim = 4;
  mla.v_head_dim = 6;
  mla.moe_shared_expert_gate = false;
  out.push_back({"mla_q_lora", mla, 2, 2});
  mla.q_lora_rank = 0;
  out.push_back({"mla_no_q_lora", mla, 1, 2});
  // A hybrid model: Mamba layers (in_proj's five blocks, conv1d's three), attention, MLP
  // and MoE layers alone, no position embedding, decoder.final_norm.
  GPTConfig hybrid = moe;
  hybrid.moe_layer_pattern.clear();
  hybrid.num_layers = 0;
  hybrid.hybrid_layer_pattern = "M*M-E";
  hybrid.position_embedding_type = PositionEmbedding::None;
  hybrid.mamba_head_dim = 8;
  hybrid.mamba_num_groups = 2;
  hybrid.mamba_state_dim = 4;
  out.push_back({"hybrid_ep2", hybrid, 2, 1});
  return out;
}

// Every rank of TP2 (x the variant's EP/ETP): the model's params are the table's entries
// of this rank (its experts), with the same full shape and split rules wherever the rule
// splits (a group of one keeps the whole tensor either way).
TEST(ParamLayout, TableMatchesTheModelUnderTensorAndExpertParallelism) {
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    GPTConfig cfg = v.cfg;
    cfg.tensor_model_parallel_size = 2;
    cfg.finalize();
    const std::vector<ParamSpec> specs = model_param_specs(cfg);
    std::map<std::string, const ParamSpec*> by_name;
    for (const ParamSpec& s : specs) by_name[s.name] = &s;
    dist::ParallelSizes sizes;
    sizes.tp = 2;
    sizes.ep = v.ep;
    sizes.etp = v.etp;
    const int64_t world = std::lcm(int64_t(2), v.ep * (v.etp > 0 ? v.etp : 2));
    for (int rank = 0; rank < world; ++rank) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      const dist::Grid grid(sizes, world, rank);
      UnusedComm comm;
      ModelParallel mp;
      mp.grid = &grid;
      mp.comm = &comm;
      mp.sequence_parallel = true;
      GPTModel model(cfg, 1, mp);
      size_t experts_here = 0, routers = 0;
      for (const Param* p : model.params()) {
        ASSERT_TRUE(by_name.count(p->name)) << p->name << " is not in the table";
        const ParamSpec& s = *by_name[p->name];
        const int group = s.is_expert ? grid.etp().size() : grid.tp().size();
        const Shape full = p->full_shape.empty() ? p->weight.shape() : p->full_shape;
        EXPECT_EQ(full, s.full_shape) << p->name;
        EXPECT_EQ(p->is_expert, s.is_expert) << p->name;
        EXPECT_EQ(p->padded_vocab_rows, s.padded_vocab_rows) << p->name;
        EXPECT_FALSE(s.router_state) << p->name;
        if (group > 1) {
          EXPECT_EQ(p->tp_split_dim, s.tp_split_dim) << p->name;
          EXPECT_EQ(p->tp_blocks, s.tp_blocks) << p->name;
        }
        if (s.is_expert) {
          ++experts_here;
          EXPECT_EQ(s.expert / (cfg.num_experts / grid.ep().size()), grid.ep().rank) << p->name;
        }
      }
      for (const auto& layer : model.layers())
        if (MoELayer* moe = layer->moe(); moe && moe->router.expert_bias.defined()) {
          std::string bias = moe->router.weight.name;
          bias.replace(bias.size() - 6, 6, "expert_bias");
          ASSERT_TRUE(by_name.count(bias)) << bias;
          EXPECT_TRUE(by_name[bias]->router_state);
          EXPECT_EQ(by_name[bias]->full_shape, moe->router.expert_bias.shape());
          ++routers;
        }
      size_t experts_in_table = 0, routers_in_table = 0, others = 0;
      for (const ParamSpec& s : specs) {
        if (s.router_state)
          ++routers_in_table;
        else if (s.is_expert)
          experts_in_table += s.expert / (cfg.num_experts / grid.ep().size()) == grid.ep().rank;
        else
          ++others;
      }
      EXPECT_EQ(experts_here, experts_in_table);
      EXPECT_EQ(routers, routers_in_table);
      EXPECT_EQ(model.params().size(), others + experts_in_table);
    }
  }
}

TEST(ParamLayout, RefusesWhatItDoesNotDescribe) {
  GPTConfig c = base_config();
  c.normalization = Normalization::LayerNorm;
  c.finalize();
  EXPECT_THROW(model_param_specs(c), Error);
}

// What a family cannot express: one line naming the flag.
TEST(HFExportConfig, RefusesModelsHuggingFaceCannotExpress) {
  const auto refused = [](GPTConfig c, const std::string& needle) {
    c.finalize();
    try {
      hf_export_config(c, c.vocab_size);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  GPTConfig c = base_config();
  c.position_embedding_type = PositionEmbedding::LearnedAbsolute;
  refused(c, "learned_absolute");
  c = base_config();
  c.normalization = Normalization::LayerNorm;
  refused(c, "LayerNorm");
  c = base_config();
  c.swiglu = false;
  refused(c, "--swiglu");
  c = base_config();
  c.disable_bias_linear = false;
  refused(c, "--disable-bias-linear");
  c = base_config();
  c.rotary_percent = 0.5;
  refused(c, "--rotary-percent");
  GPTConfig moe = base_config();
  moe.num_experts = 4;
  moe.moe_layer_pattern = {0, 1, 1};
  refused(moe, "mixtral: dense layers");
  moe.moe_layer_pattern = {};
  moe.moe_router_score_function = "sigmoid";
  refused(moe, "--moe-router-score-function sigmoid");
  moe.moe_router_score_function = "softmax";
  moe.moe_shared_expert_intermediate_size = 16;
  moe.qk_layernorm = true;
  refused(moe, "qwen3_moe: --moe-shared-expert-intermediate-size");
  // The family rule.
  GPTConfig ok = base_config();
  ok.finalize();
  EXPECT_EQ(hf_export_config(ok, 50).family, HFFamily::Llama);
  ok.qk_layernorm = true;
  EXPECT_EQ(hf_export_config(ok, 50).family, HFFamily::Qwen3);
  ok.num_experts = 4;
  EXPECT_EQ(hf_export_config(ok, 50).family, HFFamily::Qwen3Moe);
  ok.qk_layernorm = false;
  EXPECT_EQ(hf_export_config(ok, 50).family, HFFamily::Mixtral);
}

}  // namespace
}  // namespace megaton
