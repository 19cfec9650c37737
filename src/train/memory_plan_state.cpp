// Memory plan: parameter counts and the persistent state of a rank (weights, main grads,
// main params, Adam moments), laid out as ParamAndGradBuffer and the optimizers lay them.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "model/layer_spec.h"
#include "optim/adamw.h"
#include "optim/distrib_optimizer.h"
#include "train/data_parallel_setup.h"
#include "train/memory_plan.h"
#include "train/memory_plan_params.h"
#include "train/pipeline_schedule.h"

namespace megaton {

namespace memory_plan_detail {

namespace {

// The parameters of one layer on one rank, in the order TransformerLayer::collect_params
// gives them (model/gpt.cpp, attention.cpp, layers.cpp, moe.cpp, shared_experts.cpp), each
// weight with its local shape and tensor-parallel split (Linear's Column: dim 0, Row: 1).
// full: the unsharded tensors (tp = etp = ep = 1) for the model's counts.
void layer_params(const GPTConfig& m, int64_t layer, double tp, double etp, double ep,
                  std::vector<ParamShape>& out) {
  const double H = double(m.hidden_size), d = double(m.kv_channels);
  const double np = double(m.num_attention_heads), ng = double(m.num_query_groups);
  const bool bias = !m.disable_bias_linear, ln = m.normalization == Normalization::LayerNorm;
  const bool fp8 = m.fp8.enabled && m.fp8.param_gather && m.fp8.layer_in_fp8(layer, m.num_layers);
  auto add = [&](double n, bool expert = false) {  // a vector (norm, bias)
    ParamShape p;
    p.numel = n;
    p.expert = expert;
    out.push_back(p);
  };
  // A 2-D weight [rows, cols] (local), split along `split` (-1: replicated).
  auto matrix = [&](double rows, double cols, int split, bool expert = false,
                    bool fp8_weight = false) -> ParamShape& {
    ParamShape p;
    p.numel = rows * cols;
    p.expert = expert;
    p.fp8 = fp8_weight;
    p.rows = rows;
    p.cols = cols;
    p.tp_split_dim = split;
    out.push_back(p);
    return out.back();
  };
  auto norm = [&](double width) {
    add(width);
    if (ln) add(width);
  };
  auto mlp = [&](double ffn, bool with_bias) {
    const double f1 = (m.swiglu ? 2 : 1) * ffn;
    matrix(f1 / tp, H, tp > 1 ? 0 : -1, false, fp8);
    if (with_bias) add(f1 / tp);
    matrix(H, ffn / tp, tp > 1 ? 1 : -1, false, fp8);
    if (with_bias) add(H);
  };
  const int column = tp > 1 ? 0 : -1, row = tp > 1 ? 1 : -1;
  const LayerSpec spec = decoder_layer_spec(m, layer);
  if (spec.mixer == MixerKind::Mamba) {  // norm, then MambaMixer::collect_params's order
    const double d = double(m.mamba_d_inner()), conv = double(m.mamba_conv_dim());
    const double heads = double(m.mamba_num_heads);
    norm(H);
    matrix(double(m.mamba_in_proj_size()) / tp, H, column, false, fp8).use_muon = false;
    add(conv / tp * double(m.mamba_conv_kernel));  // conv1d weight [conv, 1, K], bias
    add(conv / tp);
    for (int i = 0; i < 3; ++i) add(heads / tp);  // dt_bias, A_log, D
    add(d / tp);                                  // norm
    matrix(H, d / tp, row, false, fp8);           // out_proj
    return;
  }
  if (spec.mixer != MixerKind::None) norm(H);  // input_layernorm
  if (spec.mixer == MixerKind::None) {
    // An MLP / MoE layer of a hybrid model: its MLP below.
  } else if (m.multi_latent_attention) {  // model/mla.cpp's collect_params order
    const double dq = double(m.qk_head_dim + m.qk_pos_emb_head_dim), v = double(m.v_head_dim);
    const double rq = double(m.q_lora_rank), rkv = double(m.kv_lora_rank);
    if (rq == 0) {
      matrix(np * dq / tp, H, column, false, fp8);  // linear_q_proj
    } else {
      matrix(rq, H, -1, false, fp8);  // linear_q_down_proj (replicated)
      if (m.qk_layernorm) norm(rq);
      matrix(np * dq / tp, rq, column, false, fp8);
    }
    matrix(rkv + double(m.qk_pos_emb_head_dim), H, -1, false, fp8);
    if (m.qk_layernorm) norm(rkv);
    matrix(np * (double(m.qk_head_dim) + v) / tp, rkv, column, false, fp8);
    matrix(H, np * v / tp, row, false, fp8);  // linear_proj
    if (bias) add(H);
  } else {
    matrix((np + 2 * ng) * d / tp, H, column, false, fp8).qkv = true;
    if (bias) add((np + 2 * ng) * d / tp);
    matrix(H, np * d / tp, row, false, fp8);
    if (bias) add(H);
    if (m.qk_layernorm) {
      norm(d);
      norm(d);
    }
  }
  if (spec.mlp == MlpKind::None) return;
  norm(H);  // pre_mlp_layernorm
  if (!m.is_moe_layer(layer)) {
    mlp(double(m.ffn_hidden_size), bias);
    return;
  }
  matrix(double(m.num_experts), H, -1);  // router
  if (m.moe_shared_expert_intermediate_size > 0) {
    mlp(double(m.moe_shared_expert_intermediate_size), false);
    if (m.moe_shared_expert_gate) matrix(1, H, -1);
  }
  const double f = double(m.moe_ffn_hidden_size), f1 = (m.swiglu ? 2 : 1) * f;
  const bool fp8_experts =
      m.fp8.enabled && m.fp8.param_gather && m.fp8.layer_in_fp8(layer, m.num_layers);
  for (int64_t e = 0; e < int64_t(double(m.num_experts) / ep); ++e) {
    matrix(f1 / etp, H, etp > 1 ? 0 : -1, true, fp8_experts);
    if (bias) add(f1 / etp, true);
    matrix(H, f / etp, etp > 1 ? 1 : -1, true, fp8_experts);
    if (bias) add(H, true);
  }
}

}  // namespace

std::vector<ParamShape> chunk_params(const GPTConfig& m, const ChunkLayers& layers, bool pre,
                                     bool post, double tp, double etp, double ep) {
  std::vector<ParamShape> out;
  const double H = double(m.hidden_size), V = double(m.padded_vocab_size);
  auto vector = [&](double n) {
    ParamShape p;
    p.numel = n;
    out.push_back(p);
  };
  auto matrix = [&](double rows, double cols, bool vocab, bool word_embeddings = false) {
    ParamShape p;
    p.numel = rows * cols;
    p.rows = rows;
    p.cols = cols;
    p.vocab = vocab;
    p.word_embeddings = word_embeddings;
    p.tp_split_dim = vocab && tp > 1 ? 0 : -1;
    out.push_back(p);
  };
  if (pre) {
    matrix(V / tp, H, true, true);
    if (m.position_embedding_type == PositionEmbedding::LearnedAbsolute)
      matrix(double(m.max_position_embeddings), H, false);
  }
  for (int64_t l = layers.first_layer; l < layers.first_layer + layers.num_layers; ++l) {
    const size_t first = out.size();
    layer_params(m, l, tp, etp, ep, out);
    for (size_t i = first; i < out.size(); ++i) out[i].unit = int(l - layers.first_layer) + 1;
  }
  const size_t tail = out.size();
  if (post) {
    const bool ln = m.normalization == Normalization::LayerNorm;
    vector(H);
    if (ln) vector(H);
    // MTP depths (model/mtp.h): enorm, hnorm, eh_proj [H, 2H] (replicated), a layer of the
    // last decoder layer's kind, final_layernorm.
    for (int64_t k = 0; k < m.mtp_num_layers; ++k) {
      for (int i = 0; i < 2; ++i) {
        vector(H);
        if (ln) vector(H);
      }
      matrix(H, 2 * H, false);
      std::vector<ParamShape> layer;
      layer_params(m, m.num_layers - 1, tp, etp, ep, layer);
      out.insert(out.end(), layer.begin(), layer.end());
      vector(H);
      if (ln) vector(H);
    }
    // The word embeddings' copy: tied output layer, or the MTP depths' lookups.
    if (!pre && (!m.untie_embeddings_and_output_weights || m.mtp_num_layers > 0))
      matrix(V / tp, H, true, true);
    if (m.untie_embeddings_and_output_weights) matrix(V / tp, H, true);
  }
  for (size_t i = tail; i < out.size(); ++i) out[i].unit = int(layers.num_layers) + 1;
  return out;
}

ParamRule rule_of(const optim::OptimizerConfig& optimizer, const ParamShape& p) {
  // Only the dimension count, use_muon and padded_vocab_rows are read: an unallocated
  // [1, 1] or [1] weight stands in.
  Param stand_in;
  stand_in.weight =
      Tensor::unallocated(p.matrix() ? Shape{1, 1} : Shape{1}, DType::F32, Device::CPU);
  stand_in.use_muon = p.use_muon;
  stand_in.padded_vocab_rows = p.vocab;
  switch (optim::DistributedAdamW::rule_of(optimizer, stand_in)) {
    case optim::DistributedAdamW::Rule::Adam:
      return ParamRule::Adam;
    case optim::DistributedAdamW::Rule::Muon:
      return ParamRule::Muon;
    case optim::DistributedAdamW::Rule::Sgd:
      return ParamRule::Sgd;
    case optim::DistributedAdamW::Rule::Lion:
      return ParamRule::Lion;
  }
  return ParamRule::Adam;
}

}  // namespace memory_plan_detail

namespace {

using namespace memory_plan_detail;

double round_up(double n, double multiple) { return std::ceil(n / multiple) * multiple; }

constexpr int64_t kTrackedShards = 4096;

// The optimizer state of each shard index of a data-parallel group's buffers (dense: dp_cp,
// experts: edp), each tensor in its block, and the layer-wise Muon matrices it updates.
struct GroupState {
  std::vector<double> main, exp_avg, exp_avg_sq, momentum, adam_params;
  std::vector<std::vector<ParamShape>> muon;
  void resize(int64_t shards) {
    for (std::vector<double>* v : {&main, &exp_avg, &exp_avg_sq, &momentum, &adam_params})
      v->assign(size_t(shards), 0);
    muon.assign(size_t(shards), {});
  }
  double total(size_t s) const { return main[s] + exp_avg[s] + exp_avg_sq[s] + momentum[s]; }
  double least() const {
    double out = total(0);
    for (size_t s = 1; s < main.size(); ++s) out = std::min(out, total(s));
    return out;
  }
};

// Elements of model/main_grad.h's fp32 scratch with BF16 main grads: the largest set of
// gradients one accumulation into them goes through it for (the pool grows to it and is
// kept). On the CPU every gradient does (its GEMMs are fp32-only); on CUDA the bf16 GEMMs
// (linear layers, router, output layer) and the FP8 wgrads accumulate straight into the
// bf16 main grads, leaving the embeddings' scatter-adds, the norms and biases (at most
// the widest of H and a fc1 bias) and the experts' grouped wgrads (one layer's fc1 of
// all local experts: the CUTLASS grouped GEMM writes fp32 only).
double main_grad_scratch_numel(const GPTConfig& m, const ChunkLayers& cl,
                               const std::vector<ParamShape>& params, bool pre, double tp,
                               double etp, double ep) {
  const double H = double(m.hidden_size);
  double scratch = 0;
  if (m.device != Device::CUDA) {
    for (const ParamShape& p : params)
      if (!p.expert) scratch = std::max(scratch, p.numel);
  } else {
    scratch = std::max(H, (m.swiglu ? 2.0 : 1.0) * double(m.ffn_hidden_size) / tp);
    if (pre) scratch = std::max(scratch, double(m.padded_vocab_size) / tp * H);
    if (pre && m.position_embedding_type == PositionEmbedding::LearnedAbsolute)
      scratch = std::max(scratch, double(m.max_position_embeddings) * H);
  }
  const double f1 = (m.swiglu ? 2 : 1) * double(m.moe_ffn_hidden_size);
  for (int64_t l = cl.first_layer; l < cl.first_layer + cl.num_layers; ++l)
    if (m.is_moe_layer(l) && !(m.fp8.enabled && m.fp8.layer_in_fp8(l, m.num_layers)))
      scratch = std::max(scratch, std::floor(double(m.num_experts) / ep) * f1 / etp * H);
  return scratch;
}

}  // namespace

void plan_parameter_counts(const GPTConfig& m, MemoryPlan& plan) {
  const ChunkLayers all{0, m.num_layers};
  double total = 0;
  for (const ParamShape& p : chunk_params(m, all, true, true, 1, 1, 1)) total += p.numel;
  // Active: each MoE layer's top-k experts of num-experts (train/flops.cpp's convention).
  const double f = double(m.moe_ffn_hidden_size), H = double(m.hidden_size);
  const double per_expert =
      ((m.swiglu ? 2 : 1) * f + f) * H + (m.disable_bias_linear ? 0 : (m.swiglu ? 2 : 1) * f + H);
  const double idle = std::max<double>(double(m.num_experts - m.moe_router_topk), 0);
  plan.total_parameters = total;
  // MTP depths are MoE layers when the last decoder layer is.
  const double moe_layers = double(m.num_moe_layers()) +
                            (m.is_moe_layer(m.num_layers - 1) ? double(m.mtp_num_layers) : 0.0);
  plan.active_parameters = total - moe_layers * idle * per_expert;
}

void plan_parameter_state(const TrainArgs& args, const dist::ValidatedLayout& layout, int64_t stage,
                          double activation_peak, MemoryPlan& plan) {
  const GPTConfig& m = args.model;
  const dist::ParallelSizes& z = layout.sizes;
  const Device dev = m.device;
  const double tp = double(z.tp), etp = double(z.etp > 0 ? z.etp : z.tp), ep = double(z.ep);
  const int64_t vpp = z.vpp.value_or(1);
  const bool distributed = args.parallel.use_distributed_optimizer;
  const double cb = double(dtype_size(m.compute_dtype()));
  const double main_b = double(dtype_size(args.adam.main_params_dtype));
  // Beside BF16 weights the main param is its 16-bit remainder (store_param_remainders,
  // DistributedAdamW); beside FP8 and fp16 weights it stays fp32. --main-params-dtype fp16:
  // 2 bytes beside BF16 and F16 weights (no remainders), FP8 weights keep fp32. Only Adam's
  // params: Muon, SGD and Lion keep fp32 main params (finish_args turns remainders off for
  // SGD and Lion; the distributed optimizer keeps them only in buffers all of whose params
  // take Adam).
  const bool f16_main = args.adam.main_params_dtype == DType::F16 && cb != 4;
  const bool remainders =
      args.adam.store_param_remainders && !f16_main && m.compute_dtype() == DType::BF16;
  const double avg_b = double(dtype_size(args.adam.exp_avg_dtype));
  const double sq_b = double(dtype_size(args.adam.exp_avg_sq_dtype));
  const double grad_b = double(dtype_size(m.main_grads_dtype));
  // --use-megatron-fsdp: its strategy and the dtypes of its gradient shards and buckets.
  const ChunkSharding fsdp_sharding = chunk_sharding(args, nullptr);
  const ShardingStrategy fsdp = fsdp_sharding.strategy;
  const double fsdp_grad_b = double(dtype_size(fsdp_sharding.main_grad_dtype));
  const double fsdp_comm_b = double(dtype_size(fsdp_sharding.grad_comm_dtype));
  // Muon under the distributed optimizer: its params in WholeParams buffers (model/gpt.cpp)
  // when the buffers are sharded, with the trainer's bucket size (train/trainer.cpp).
  const int64_t dense_shards = std::max<int64_t>(z.dp * z.cp, 1);
  const int64_t expert_shards = std::max<int64_t>(z.edp, 1);
  const bool layer_wise =
      fsdp_sharding.layer_wise && distributed && (dense_shards > 1 || expert_shards > 1);
  const int64_t bucket_size = !args.parallel.overlap_grad_reduce ? 0
                              : args.parallel.ddp_bucket_size > 0
                                  ? args.parallel.ddp_bucket_size
                                  : std::max<int64_t>(40000000, 1000000 * dense_shards);
  double scratch = 0;  // main_grad_scratch_numel over the chunks (BF16 main grads)
  const bool scaled_moments = optim::scaled_moment_dtype(args.adam.exp_avg_dtype) ||
                              optim::scaled_moment_dtype(args.adam.exp_avg_sq_dtype);
  const bool scaled_states = scaled_moments || f16_main;
  auto block = [&](double bytes) { return memory_plan_block_bytes(bytes, dev); };
  plan.weights = plan.main_grads = plan.main_params = plan.exp_avg = plan.exp_avg_sq = 0;
  plan.momentum = plan.other_state = 0;
  plan.rank_parameters = plan.rank_expert_parameters = 0;
  plan.optimizer = optim::optimizer_kind_name(args.optimizer.kind);
  plan.muon_step_scratch = plan.grad_sync_scratch = 0;
  plan.muon_step_what.clear();
  plan.muon_layout.clear();
  // The optimizer state a rank keeps by its shard index in the dense buffers' group (dp_cp)
  // and the expert buffers' (edp) under the distributed optimizer (one index without), and
  // the Muon matrices the layer-wise optimizer has it update.
  GroupState groups[2];
  // (Past kTrackedShards data-parallel ranks only the first so many shard indices are
  // weighed: each then holds a sliver of the state, and the dry run stays small and quick.)
  groups[0].resize(std::min(distributed ? dense_shards : 1, kTrackedShards));
  groups[1].resize(std::min(distributed ? expert_shards : 1, kTrackedShards));
  std::vector<ParamShape> muon_matrices;  // the rank's Muon params (not layer-wise)
  for (int64_t c = 0; c < vpp; ++c) {
    const ChunkLayers cl = chunk_layers(layout.layers_per_stage, vpp, stage, c);
    const std::vector<ParamShape> params =
        chunk_params(m, cl, stage == 0 && c == 0, stage == z.pp - 1 && c == vpp - 1, tp, etp, ep);
    if (m.main_grads_dtype == DType::BF16)
      scratch = std::max(scratch,
                         main_grad_scratch_numel(m, cl, params, stage == 0 && c == 0, tp, etp, ep));
    std::vector<ParamRule> rules;
    for (const ParamShape& p : params) {
      rules.push_back(rule_of(args.optimizer, p));
      if (rules.back() == ParamRule::Muon && !layer_wise) muon_matrices.push_back(p);
    }
    // The layer-wise Muon buffers, dense then expert: whole params, the owner's state; the
    // CPU's reduce-scatter of each bucket reads a copy of it (dist/comm_mpi.cpp).
    for (int kind = 0; layer_wise && kind < 2; ++kind) {
      const bool expert = kind == 1;
      std::vector<ParamShape> muon;
      for (size_t k = 0; k < params.size(); ++k)
        if (rules[k] == ParamRule::Muon && params[k].expert == expert) muon.push_back(params[k]);
      if (muon.empty()) continue;
      for (const ParamShape& p : muon) {
        plan.rank_parameters += p.numel;
        if (expert) plan.rank_expert_parameters += p.numel;
      }
      const int64_t shards = expert ? expert_shards : dense_shards;
      const MuonBufferPlan b = plan_muon_buffer(muon, shards, bucket_size, cb != 4, dev);
      plan.muon_bounded = plan.muon_bounded || b.bounded;
      plan.weights += block(b.numel * cb);
      plan.main_grads += block(b.numel * grad_b);
      if (shards > 1)
        for (double bucket : b.bucket_numels)
          plan.grad_sync_scratch += grad_sync_copy(bucket, double(shards), grad_b, dev);
      GroupState& g = groups[kind];
      for (size_t s = 0; s < g.main.size(); ++s) {
        g.momentum[s] += b.momentum[s];
        g.main[s] += b.main_params[s];
      }
      for (size_t i = 0; i < muon.size(); ++i)
        if (size_t(b.owner[i]) < g.main.size()) g.muon[size_t(b.owner[i])].push_back(muon[i]);
    }
    // GPTModel's buffers: dense, dense FP8, expert, expert FP8 (ParamAndGradBuffer), each
    // laid out in reverse order (flat_layout; Megatron-FSDP: a bucket per unit).
    for (int kind = 0; kind < 4; ++kind) {
      const bool expert = kind >= 2, fp8 = kind % 2 == 1;
      const double shards = distributed ? double(expert ? expert_shards : dense_shards) : 1;
      const bool pre = stage == 0 && c == 0, post = stage == z.pp - 1 && c == vpp - 1;
      std::vector<double> sizes;
      std::vector<bool> alone;
      std::vector<ParamRule> buffer_rules;
      for (size_t k = params.size(); k-- > 0;) {
        const ParamShape& p = params[k];
        if (p.expert != expert || p.fp8 != fp8) continue;
        if (layer_wise && rules[k] == ParamRule::Muon) continue;  // in a Muon buffer
        sizes.push_back(p.numel);
        // The word embeddings tied across pipeline stages: a bucket of their own, so that
        // both stages shard them alike (model/gpt.cpp own_bucket).
        alone.push_back(p.word_embeddings && pre != post && shards > 1);
        buffer_rules.push_back(rules[k]);
        plan.rank_parameters += p.numel;
        if (expert) plan.rank_expert_parameters += p.numel;
        if (fp8) plan.other_state += block(2 * 4);  // Param::fp8_scales
      }
      if (sizes.empty()) continue;
      // fp16 / fp8 moments, fp16 main params: DistributedAdamW's absmax of each buffer
      // param (F32 [params, 3]).
      if (scaled_states) plan.other_state += block(double(sizes.size()) * 12);
      const FlatLayout flat = flat_layout(
          sizes, alone, fsdp_sharding.use_megatron_fsdp ? 0 : double(bucket_size), shards);
      if (fsdp_sharding.use_megatron_fsdp) {
        // Megatron-FSDP: a bucket per unit, each padded to 64 x shards.
        std::map<int, double> units;
        for (const ParamShape& p : params)
          if (p.expert == expert && p.fp8 == fp8) units[p.unit] += round_up(p.numel, 64);
        double largest = 0, total = 0;
        for (auto& [unit, n] : units) {
          n = round_up(n, 64 * shards);
          total += n;
          largest = std::max(largest, n);
        }
        // Sharded (more than one shard): the own shard, plus the buckets held at once
        // (weights: the unit computing, the one prefetched and the tail kept from its
        // forward to its backward; gradients: the unit in backward, the embedding's
        // accumulating the tied output layer's and the two whose reduce-scatter runs).
        // A full-recompute group keeps its layers gathered: not counted.
        const bool grads_sharded = fsdp >= ShardingStrategy::OptimGrads && shards > 1;
        const bool params_sharded = fsdp == ShardingStrategy::OptimGradsParams && shards > 1;
        plan.weights += params_sharded ? block(total / shards * cb) + 3 * block(largest * cb)
                                       : block(total * (fp8 ? 1 : cb));
        plan.main_grads +=
            grads_sharded ? block(total / shards * fsdp_grad_b) + 4 * block(largest * fsdp_comm_b)
                          : block(total * grad_b);
      } else {
        plan.weights += block(flat.numel * (fp8 ? 1 : cb));
        plan.main_grads += block(flat.numel * grad_b);
        // The CPU's gradient sync: the distributed optimizer's reduce-scatter reads a copy
        // of each bucket; the replicated all-reduce of BF16 gradients sums an F32 copy.
        const int64_t group = expert ? expert_shards : dense_shards;
        for (const auto& [begin, end] : flat.buckets)
          if (shards > 1)
            plan.grad_sync_scratch += grad_sync_copy(end - begin, shards, grad_b, dev);
          else if (group > 1 && grad_b == 2 && dev != Device::CUDA)
            plan.grad_sync_scratch += block((end - begin) * 4);
      }
      // Remainders: per Adam param when replicated; distributed, in a buffer whose params
      // all take Adam (DistributedAdamW's buffer_remainders_).
      const bool all_adam = std::all_of(buffer_rules.begin(), buffer_rules.end(),
                                        [](ParamRule r) { return r == ParamRule::Adam; });
      const bool buffer_remainders = remainders && (!distributed || all_adam);
      // Main params and states: per param, or per piece of each shard of its bucket under
      // the distributed optimizer (DistributedAdamW's shard params).
      GroupState& g = groups[expert ? 1 : 0];
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (sizes[i] <= 0) continue;
        const auto [begin, end] = flat.buckets[flat.bucket[i]];
        const double shard = (end - begin) / shards, at = flat.offsets[i] - begin;
        const double first = distributed ? std::floor(at / shard) : 0;
        const double last = distributed ? std::floor((at + sizes[i] - 1) / shard) : 0;
        for (double sh = first; sh <= last; ++sh) {
          const double n =
              distributed ? std::min(at + sizes[i], (sh + 1) * shard) - std::max(at, sh * shard)
                          : sizes[i];
          const size_t s = size_t(sh);
          if (s >= g.main.size()) break;
          const bool adam = buffer_rules[i] == ParamRule::Adam;
          // Muon, SGD and Lion: an fp32 main param (beside any weight not fp32) and one
          // fp32 state (Muon's and SGD's momentum_buffer, Lion's exp_avg).
          const double main_bytes = fp8 || !adam ? 4 : buffer_remainders ? 2 : main_b;
          if (cb != 4 || fp8) g.main[s] += block(n * main_bytes);
          if (!adam) {
            g.momentum[s] += block(n * 4);
            continue;
          }
          g.adam_params[s] += 1;
          // Param::main_param_scale, F32 [1] each.
          if (f16_main && !fp8) g.main[s] += block(4);
          g.exp_avg[s] += block(n * avg_b);
          g.exp_avg_sq[s] += block(n * sq_b);
        }
      }
    }
  }
  // The busiest rank of the stage: its dense shard index is its dp_cp rank (tp fastest, then
  // cp, then dp: dist/grid.cpp), its expert one its edp rank (etp, then ep, then edp); its
  // load the state of both and the largest of the activations' peak, the CPU's gradient
  // copies (the same on every rank) and the step scratch of the Muon matrices it updates
  // (layer-wise; otherwise the rank's all).
  const int64_t stage_ranks = z.tp * std::max<int64_t>(z.cp, 1) * std::max<int64_t>(z.dp, 1);
  const int64_t expert_mp =
      std::max<int64_t>(z.etp > 0 ? z.etp : z.tp, 1) * std::max<int64_t>(z.ep, 1);
  const int64_t dense_group = distributed ? dense_shards : 1;
  const int64_t expert_group = distributed ? expert_shards : 1;
  std::set<std::pair<size_t, size_t>> pairs;  // (dense, expert) shard indices of the ranks
  for (int64_t r = 0; r < std::min<int64_t>(stage_ranks, int64_t(1) << 22); ++r) {
    const size_t d = size_t((r / z.tp) % dense_group), e = size_t((r / expert_mp) % expert_group);
    if (d < groups[0].main.size() && e < groups[1].main.size()) pairs.insert({d, e});
  }
  std::pair<size_t, size_t> busiest{0, 0};
  double most = -1;
  for (const auto& [d, e] : pairs) {
    double step = 0;
    if (layer_wise) {
      std::vector<ParamShape> owned = groups[0].muon[d];
      owned.insert(owned.end(), groups[1].muon[e].begin(), groups[1].muon[e].end());
      step = muon_step_scratch(args, owned, tp, etp).bytes;
    }
    const double load = groups[0].total(d) + groups[1].total(e) +
                        std::max({activation_peak, plan.grad_sync_scratch, step});
    if (load > most) {
      most = load;
      busiest = {d, e};
    }
  }
  double adam_params = 0;
  for (int kind = 0; kind < 2; ++kind) {
    const GroupState& g = groups[kind];
    const size_t s = kind == 0 ? busiest.first : busiest.second;
    plan.main_params += g.main[s];
    plan.exp_avg += g.exp_avg[s];
    plan.exp_avg_sq += g.exp_avg_sq[s];
    plan.momentum += g.momentum[s];
    adam_params += g.adam_params[s];
    muon_matrices.insert(muon_matrices.end(), g.muon[s].begin(), g.muon[s].end());
    if (layer_wise && g.main.size() > 1 && g.total(s) > 0)
      plan.muon_layout += fmt::format(
          "{}{} shard {} of {}: {:.3f} MiB of optimizer state (the "
          "least {:.3f})",
          plan.muon_layout.empty() ? "" : "; ", kind == 0 ? "dense" : "expert", s, g.main.size(),
          g.total(s) / double(1 << 20), g.least() / double(1 << 20));
  }
  if (!muon_matrices.empty()) {
    const MuonStepScratch step = muon_step_scratch(args, muon_matrices, tp, etp);
    plan.muon_step_scratch = step.bytes;
    plan.muon_step_what = step.what;
  }
  if (scratch > 0) plan.main_grads += block(scratch * 4);
  // fp16 / fp8 moments: AdamW's scales, F32 [params, 2]; with fp16 main params too, its
  // absmax, F32 [params, 3] (optim/adamw.cpp).
  if (scaled_moments) plan.other_state += block(std::max(adam_params, 1.0) * 8);
  if (scaled_states) plan.other_state += block(std::max(adam_params, 1.0) * 12);
  // --optimizer-cpu-offload: the offloaded fraction's main params and moments are on the
  // host (whole params are chosen, so the device keeps up to one param less than this).
  if (args.adam.optimizer_cpu_offload) {
    const double keep = 1.0 - args.adam.optimizer_offload_fraction;
    plan.offloaded_optimizer_bytes =
        (plan.main_params + plan.exp_avg + plan.exp_avg_sq) * (1 - keep);
    plan.main_params *= keep;
    plan.exp_avg *= keep;
    plan.exp_avg_sq *= keep;
  }
  // Other state made with the model and the trainer: the AdamW step state (I64 [2]), the
  // learning rate, the batch buffers of every local micro-batch (no pipeline), each MoE
  // layer's router statistics (tokens per expert, metric sums, the last loss, the expert
  // bias) and each FP8 linear's quantizer state (amax history and scales per operand).
  plan.other_state += block(16) + block(4);
  if (z.pp == 1)
    plan.other_state +=
        2 * double(plan.micro_batches) * block(double(args.micro_batch_size * m.seq_length) * 4);
  for (int64_t c = 0; c < vpp; ++c) {
    const ChunkLayers cl = chunk_layers(layout.layers_per_stage, vpp, stage, c);
    for (int64_t l = cl.first_layer; l < cl.first_layer + cl.num_layers; ++l) {
      if (m.is_moe_layer(l))
        plan.other_state +=
            2 * block(double(m.num_experts) * 4) + block(16) + block(4) +
            (m.moe_router_enable_expert_bias ? block(double(m.num_experts) * 4) : 0);
      if (m.fp8.enabled && m.fp8.layer_in_fp8(l, m.num_layers)) {
        double linears = 4;
        if (m.is_moe_layer(l))
          linears = 2 + (m.moe_shared_expert_intermediate_size > 0 ? 2 : 0) +
                    2 * double(m.num_experts) / ep;
        plan.other_state += linears * 3 * (block(double(m.fp8.amax_history_len) * 4) + block(8));
      }
    }
  }
}

}  // namespace megaton
