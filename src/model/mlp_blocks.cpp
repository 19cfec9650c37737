// The dense and MoE MLP blocks: the MlpBlock interface over MLP and MoELayer.
#include "model/mlp_blocks.h"

#include "model/moe.h"
#include "model/saved_tensors.h"

namespace megaton {

namespace {

class DenseMlpBlock final : public MlpBlock {
 public:
  DenseMlpBlock(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                const ModelParallel& mp)
      : mlp_(prefix, cfg.hidden_size, cfg.ffn_hidden_size, mlp_activation_of(cfg),
             !cfg.disable_bias_linear, cfg.init_method_std, cfg.scaled_init_method_std(), seed,
             Placement::of(cfg), mp) {}
  Tensor forward(const Tensor& x, const ForwardContext&) override { return mlp_.forward(x); }
  Tensor backward(const Tensor& dy, const std::function<Tensor()>& input) override {
    return mlp_.backward(dy, input);
  }
  Tensor forward_inference(const Tensor& x) override { return mlp_.forward_inference(x); }
  void collect_params(std::vector<Param*>& out) override { mlp_.collect_params(out); }
  std::vector<Linear*> linears() override { return {&mlp_.linear_fc1, &mlp_.linear_fc2}; }
  Linear* output_linear() override { return &mlp_.linear_fc2; }
  // The layernorm recompute remakes the input; the mlp recompute fc1's output.
  void set_recompute(const RecomputeConfig& rc) override {
    mlp_.set_recompute(!rc.selective(kRecomputeLayernorm), !rc.selective(kRecomputeMlp));
  }
  std::any take_saved() override { return mlp_.take_saved(); }
  void restore_saved(std::any&& saved) override {
    mlp_.restore_saved(std::any_cast<MLP::Activations&&>(std::move(saved)));
  }
  void for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) override {
    for_each_tensor(std::any_cast<MLP::Activations&>(saved), fn);
  }

 private:
  MLP mlp_;
};

class MoEMlpBlock final : public MlpBlock {
 public:
  MoEMlpBlock(const std::string& prefix, const GPTConfig& cfg, int64_t layer, uint64_t seed,
              const ModelParallel& mp)
      : moe_(prefix, cfg, seed, mp, layer) {}
  Tensor forward(const Tensor& x, const ForwardContext& ctx) override {
    return moe_.forward(x, ctx);
  }
  // The MoE layer keeps its input whatever the recompute (its router and dispatcher read
  // it), so `input` is not needed.
  Tensor backward(const Tensor& dy, const std::function<Tensor()>&) override {
    return moe_.backward(dy);
  }
  Tensor forward_inference(const Tensor& x) override {
    ForwardContext eval;
    eval.training = false;  // no jitter, no aux losses, no token counts
    return moe_.forward(x, eval);
  }
  void collect_params(std::vector<Param*>& out) override { moe_.collect_params(out); }
  std::vector<Linear*> linears() override {
    if (!moe_.shared_expert) return {};
    MLP& dense = moe_.shared_expert->mlp;
    return {&dense.linear_fc1, &dense.linear_fc2};
  }
  Linear* output_linear() override { return nullptr; }
  void enable_expert_fp8(const Fp8Config& config) override { moe_.enable_fp8(config); }
  std::vector<std::pair<std::string, Tensor*>> expert_fp8_state() override {
    return moe_.fp8_state();
  }
  void set_recompute(const RecomputeConfig& rc) override {
    if (moe_.shared_expert)
      moe_.shared_expert->mlp.set_recompute(true, !rc.selective(kRecomputeSharedExperts));
  }
  std::any take_saved() override { return moe_.take_saved(); }
  void restore_saved(std::any&& saved) override {
    moe_.restore_saved(std::any_cast<MoELayer::Activations&&>(std::move(saved)));
  }
  void for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) override {
    moe_.for_each_saved_tensor(std::any_cast<MoELayer::Activations&>(saved), fn);
  }
  void keep_after_discard(std::any&& saved) override {
    moe_.keep_routing(std::any_cast<MoELayer::Activations&&>(std::move(saved)));
  }
  MoELayer* moe() override { return &moe_; }

 private:
  MoELayer moe_;
};

}  // namespace

std::unique_ptr<MlpBlock> make_dense_mlp_block(const std::string& prefix, const GPTConfig& cfg,
                                               uint64_t seed, const ModelParallel& mp) {
  return std::make_unique<DenseMlpBlock>(prefix, cfg, seed, mp);
}

std::unique_ptr<MlpBlock> make_moe_mlp_block(const std::string& prefix, const GPTConfig& cfg,
                                             int64_t layer, uint64_t seed,
                                             const ModelParallel& mp) {
  return std::make_unique<MoEMlpBlock>(prefix, cfg, layer, seed, mp);
}

}  // namespace megaton
