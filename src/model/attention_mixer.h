// An attention class behind the Mixer interface (model/layer_spec.h): SelfAttention
// (attention_mixer.cpp) and MLASelfAttention (mla.cpp) share this adapter.
#pragma once
#include <any>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "model/layer_spec.h"

namespace megaton {

// Attention provides forward, backward, forward_inference, collect_params, linear_proj,
// take_saved / restore_saved of its Activations; the kind's own parts are found by ADL in
// namespace megaton: mixer_linears(Attention&) (its Linear layers),
// apply_recompute(Attention&, const RecomputeConfig&) (what it keeps), and
// for_each_tensor(Attention::Activations&, visitor) (its saved tensors).
template <typename Attention>
class AttentionMixer final : public Mixer {
 public:
  AttentionMixer(const std::string& prefix, const GPTConfig& cfg, int64_t layer, uint64_t seed,
                 const ModelParallel& mp)
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
  std::vector<Linear*> linears() override { return mixer_linears(attention_); }
  Linear& output_linear() override { return attention_.linear_proj; }
  void set_recompute(const RecomputeConfig& rc) override { apply_recompute(attention_, rc); }
  std::any take_saved() override { return attention_.take_saved(); }
  void restore_saved(std::any&& saved) override {
    attention_.restore_saved(
        std::any_cast<typename Attention::Activations&&>(std::move(saved)));
  }
  void for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) override {
    for_each_tensor(std::any_cast<typename Attention::Activations&>(saved), fn);
  }

 private:
  Attention attention_;
};

}  // namespace megaton
