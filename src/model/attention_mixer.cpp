// SelfAttention behind the Mixer interface (model/layer_spec.h).
#include "model/attention.h"
#include "model/saved_tensors.h"

namespace megaton {

namespace {

class SelfAttentionMixer final : public Mixer {
 public:
  SelfAttentionMixer(const std::string& prefix, const GPTConfig& cfg, int64_t layer,
                     uint64_t seed, const ModelParallel& mp)
      : attention_(prefix, cfg, layer, seed, mp) {}
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq,
                 const ForwardContext& ctx) override {
    return attention_.forward(x, batch, seq, ctx);
  }
  Tensor backward(const Tensor& dy, const std::function<Tensor()>& input) override {
    return attention_.backward(dy, input);
  }
  Tensor forward_inference(const Tensor& x, int64_t first_position, Tensor& key_cache,
                           Tensor& value_cache) const override {
    return attention_.forward_inference(x, first_position, key_cache, value_cache);
  }
  void collect_params(std::vector<Param*>& out) override { attention_.collect_params(out); }
  std::vector<Linear*> linears() override {
    return {&attention_.linear_qkv, &attention_.linear_proj};
  }
  Linear& output_linear() override { return attention_.linear_proj; }
  // The layernorm recompute remakes linear_qkv's input; core_attn the attention output.
  void set_recompute(const RecomputeConfig& rc) override {
    attention_.set_recompute(!rc.selective(kRecomputeLayernorm),
                             !rc.selective(kRecomputeCoreAttn));
  }
  std::any take_saved() override { return attention_.take_saved(); }
  void restore_saved(std::any&& saved) override {
    attention_.restore_saved(std::any_cast<SelfAttention::Activations&&>(std::move(saved)));
  }
  void for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) override {
    for_each_tensor(std::any_cast<SelfAttention::Activations&>(saved), fn);
  }

 private:
  SelfAttention attention_;
};

}  // namespace

std::unique_ptr<Mixer> make_self_attention_mixer(const std::string& prefix, const GPTConfig& cfg,
                                                 int64_t layer, uint64_t seed,
                                                 const ModelParallel& mp) {
  return std::make_unique<SelfAttentionMixer>(prefix, cfg, layer, seed, mp);
}

}  // namespace megaton
