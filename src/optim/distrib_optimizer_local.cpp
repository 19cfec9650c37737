// DistributedAdamW::local_state: what this rank writes to a sharded checkpoint
// (ckpt/sharded.h), its own pieces of full_state without gathering them.
#include "ops/ops.h"
#include "ops/param_remainder.h"
#include "optim/distrib_optimizer.h"

namespace megaton::optim {

std::vector<DistributedAdamW::LocalStateEntry> DistributedAdamW::local_state() {
  std::vector<LocalStateEntry> model_out, optim_out;
  auto flat = [](const Tensor& t) { return t.view({t.numel()}); };
  if (!distributed_) {
    size_t index = 0;  // target index: the buffers' params in order
    for (ParamAndGradBuffer* b : buffers_) {
      const bool writer = group_of(*b).rank == 0;
      for (Param* p : b->params()) {
        if (writer && !p->shared) {
          model_out.push_back({"model." + p->name, p, flat(main_param_value(*p)), 0});
          for (const auto& [suffix, t] : target_states_[index])
            optim_out.push_back({"optimizer." + p->name + suffix, p, flat(*t), 0});
        }
        ++index;
      }
    }
  } else {
    for (size_t i = 0; i < shard_params_.size(); ++i) {
      const BufferPiece& piece = shard_pieces_[i];
      const Param* p = piece.param;
      if (p->shared) continue;  // the first pipeline stage writes the tied embeddings
      const Param& sp = shard_params_[i];
      Tensor main;
      if (sp.main_param_remainder.defined()) {
        main = Tensor::empty({piece.numel}, DType::F32, sp.weight.device());
        ops::join_param_remainders(sp.weight, sp.main_param_remainder, main);
      } else if (sp.main_param_f16.defined()) {
        main = Tensor::empty({piece.numel}, DType::F32, sp.main_param_f16.device());
        ops::f16_main_param_dequantize(sp.main_param_f16, sp.main_param_scale, main);
      } else {
        main = flat(sp.main_param);
      }
      model_out.push_back({"model." + p->name, p, main, piece.param_offset});
      for (const auto& [suffix, t] : target_states_[i])
        optim_out.push_back({"optimizer." + p->name + suffix, p, flat(*t), piece.param_offset});
    }
  }
  // The per-parameter scales, once (rank 0 of each group; a max over it when distributed).
  std::vector<std::pair<std::string, Tensor>> scales;
  for (size_t bi = 0; bi < buffers_.size(); ++bi) {
    append_moment_scales(bi, scales);
    append_main_param_scales(bi, scales);
  }
  for (auto& [name, t] : scales) optim_out.push_back({name, nullptr, t, 0});
  for (auto& entry : optim_out) model_out.push_back(std::move(entry));
  return model_out;
}

}  // namespace megaton::optim
