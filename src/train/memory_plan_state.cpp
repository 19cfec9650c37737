// Memory plan: parameter counts and the persistent state of a rank (weights, main grads,
// main params, Adam moments), laid out as ParamAndGradBuffer and the optimizers lay them.
#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "model/layer_spec.h"
#include "optim/adamw.h"
#include "train/data_parallel_setup.h"
#include "train/memory_plan.h"
#include "train/pipeline_schedule.h"

namespace megaton {

namespace {

// One parameter tensor of a rank: its elements, kind and dtype of its weight.
struct ParamShape {
  double numel = 0;
  bool expert = false;  // in the expert buffer (reduced over edp)
  bool fp8 = false;     // an FP8 weight (--fp8-param-gather)
  int unit = 0;         // GPTModel::param_units: 0 the embedding, 1 + i layer i, then the tail
};

// The parameters of one layer on one rank, in the order TransformerLayer::collect_params
// gives them (model/gpt.cpp, attention.cpp, layers.cpp, moe.cpp, shared_experts.cpp).
// full: the unsharded tensors (tp = etp = ep = 1) for the model's counts.
void layer_params(const GPTConfig& m, int64_t layer, double tp, double etp, double ep,
                  std::vector<ParamShape>& out) {
  const double H = double(m.hidden_size), d = double(m.kv_channels);
  const double np = double(m.num_attention_heads), ng = double(m.num_query_groups);
  const bool bias = !m.disable_bias_linear, ln = m.normalization == Normalization::LayerNorm;
  const bool fp8 = m.fp8.enabled && m.fp8.param_gather && m.fp8.layer_in_fp8(layer, m.num_layers);
  auto add = [&](double n, bool expert = false, bool fp8_weight = false) {
    out.push_back({n, expert, fp8_weight});
  };
  auto norm = [&](double width) {
    add(width);
    if (ln) add(width);
  };
  auto mlp = [&](double ffn, bool with_bias) {
    const double f1 = (m.swiglu ? 2 : 1) * ffn;
    add(f1 / tp * H, false, fp8);
    if (with_bias) add(f1 / tp);
    add(H * ffn / tp, false, fp8);
    if (with_bias) add(H);
  };
  const LayerSpec spec = decoder_layer_spec(m, layer);
  if (spec.mixer == MixerKind::Mamba) {  // norm, then MambaMixer::collect_params's order
    const double d = double(m.mamba_d_inner()), conv = double(m.mamba_conv_dim());
    const double heads = double(m.mamba_num_heads);
    norm(H);
    add(double(m.mamba_in_proj_size()) / tp * H, false, fp8);  // in_proj
    add(conv / tp * double(m.mamba_conv_kernel));              // conv1d weight, bias
    add(conv / tp);
    for (int i = 0; i < 3; ++i) add(heads / tp);  // dt_bias, A_log, D
    add(d / tp);                                  // norm
    add(H * d / tp, false, fp8);                  // out_proj
    return;
  }
  if (spec.mixer != MixerKind::None) norm(H);  // input_layernorm
  if (spec.mixer == MixerKind::None) {
    // An MLP / MoE layer of a hybrid model: its MLP below.
  } else if (m.multi_latent_attention) {  // model/mla.cpp's collect_params order
    const double dq = double(m.qk_head_dim + m.qk_pos_emb_head_dim), v = double(m.v_head_dim);
    const double rq = double(m.q_lora_rank), rkv = double(m.kv_lora_rank);
    if (rq == 0) {
      add(np * dq / tp * H, false, fp8);  // linear_q_proj
    } else {
      add(rq * H, false, fp8);  // linear_q_down_proj (replicated)
      if (m.qk_layernorm) norm(rq);
      add(np * dq / tp * rq, false, fp8);
    }
    add((rkv + double(m.qk_pos_emb_head_dim)) * H, false, fp8);
    if (m.qk_layernorm) norm(rkv);
    add(np * (double(m.qk_head_dim) + v) / tp * rkv, false, fp8);
    add(H * np * v / tp, false, fp8);  // linear_proj
    if (bias) add(H);
  } else {
    add((np + 2 * ng) * d / tp * H, false, fp8);
    if (bias) add((np + 2 * ng) * d / tp);
    add(H * np * d / tp, false, fp8);
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
  add(double(m.num_experts) * H);  // router
  if (m.moe_shared_expert_intermediate_size > 0) {
    mlp(double(m.moe_shared_expert_intermediate_size), false);
    if (m.moe_shared_expert_gate) add(H);
  }
  const double f = double(m.moe_ffn_hidden_size), f1 = (m.swiglu ? 2 : 1) * f;
  const bool fp8_experts =
      m.fp8.enabled && m.fp8.param_gather && m.fp8.layer_in_fp8(layer, m.num_layers);
  for (int64_t e = 0; e < int64_t(double(m.num_experts) / ep); ++e) {
    add(f1 / etp * H, true, fp8_experts);
    if (bias) add(f1 / etp, true);
    add(H * f / etp, true, fp8_experts);
    if (bias) add(H, true);
  }
}

// The parameters of model chunk `layers` (GPTModel's constructor order: embedding, layers,
// final norm, the tied embeddings' copy, the output layer).
std::vector<ParamShape> chunk_params(const GPTConfig& m, const ChunkLayers& layers, bool pre,
                                     bool post, double tp, double etp, double ep) {
  std::vector<ParamShape> out;
  const double H = double(m.hidden_size), V = double(m.padded_vocab_size);
  if (pre) {
    out.push_back({V / tp * H});
    if (m.position_embedding_type == PositionEmbedding::LearnedAbsolute)
      out.push_back({double(m.max_position_embeddings) * H});
  }
  for (int64_t l = layers.first_layer; l < layers.first_layer + layers.num_layers; ++l) {
    const size_t first = out.size();
    layer_params(m, l, tp, etp, ep, out);
    for (size_t i = first; i < out.size(); ++i) out[i].unit = int(l - layers.first_layer) + 1;
  }
  const size_t tail = out.size();
  if (post) {
    const bool ln = m.normalization == Normalization::LayerNorm;
    out.push_back({H});
    if (ln) out.push_back({H});
    // MTP depths (model/mtp.h): enorm, hnorm, eh_proj [H, 2H], a layer of the last decoder
    // layer's kind, final_layernorm.
    for (int64_t k = 0; k < m.mtp_num_layers; ++k) {
      for (int i = 0; i < 2; ++i) {
        out.push_back({H});
        if (ln) out.push_back({H});
      }
      out.push_back({2 * H * H});
      std::vector<ParamShape> layer;
      layer_params(m, m.num_layers - 1, tp, etp, ep, layer);
      out.insert(out.end(), layer.begin(), layer.end());
      out.push_back({H});
      if (ln) out.push_back({H});
    }
    // The word embeddings' copy: tied output layer, or the MTP depths' lookups.
    if (!pre && (!m.untie_embeddings_and_output_weights || m.mtp_num_layers > 0))
      out.push_back({V / tp * H});
    if (m.untie_embeddings_and_output_weights) out.push_back({V / tp * H});
  }
  for (size_t i = tail; i < out.size(); ++i) out[i].unit = int(layers.num_layers) + 1;
  return out;
}

double round_up(double n, double multiple) { return std::ceil(n / multiple) * multiple; }

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
                          MemoryPlan& plan) {
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
  // 2 bytes beside BF16 and F16 weights (no remainders), FP8 weights keep fp32.
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
  double scratch = 0;  // main_grad_scratch_numel over the chunks (BF16 main grads)
  // AdamW's params (pieces under the distributed optimizer) and whether its moments are
  // scaled (optim::scaled_moment_dtype).
  double adam_params = 0;
  const bool scaled_moments = optim::scaled_moment_dtype(args.adam.exp_avg_dtype) ||
                              optim::scaled_moment_dtype(args.adam.exp_avg_sq_dtype);
  const bool scaled_states = scaled_moments || f16_main;
  auto block = [&](double bytes) { return memory_plan_block_bytes(bytes, dev); };
  plan.weights = plan.main_grads = plan.main_params = plan.exp_avg = plan.exp_avg_sq = 0;
  plan.other_state = 0;
  plan.rank_parameters = plan.rank_expert_parameters = 0;
  for (int64_t c = 0; c < vpp; ++c) {
    const ChunkLayers cl = chunk_layers(layout.layers_per_stage, vpp, stage, c);
    const std::vector<ParamShape> params =
        chunk_params(m, cl, stage == 0 && c == 0, stage == z.pp - 1 && c == vpp - 1, tp, etp, ep);
    if (m.main_grads_dtype == DType::BF16)
      scratch = std::max(scratch,
                         main_grad_scratch_numel(m, cl, params, stage == 0 && c == 0, tp, etp, ep));
    // GPTModel's buffers: dense, dense FP8, expert, expert FP8 (ParamAndGradBuffer), each
    // laid out in reverse order, every param at a multiple of 64 elements, padded to
    // 64 x shards (one bucket: --overlap-grad-reduce cuts more, each padded alike).
    for (int kind = 0; kind < 4; ++kind) {
      const bool expert = kind >= 2, fp8 = kind % 2 == 1;
      const double shards =
          distributed ? double(std::max<int64_t>(expert ? z.edp : z.dp * z.cp, 1)) : 1;
      std::vector<double> offsets, sizes;
      double total = 0;
      for (size_t k = params.size(); k-- > 0;) {
        const ParamShape& p = params[k];
        if (p.expert != expert || p.fp8 != fp8) continue;
        offsets.push_back(total);
        sizes.push_back(p.numel);
        total += round_up(p.numel, 64);
        plan.rank_parameters += p.numel;
        if (expert) plan.rank_expert_parameters += p.numel;
        if (fp8) plan.other_state += block(2 * 4);  // Param::fp8_scales
      }
      if (sizes.empty()) continue;
      // fp16 / fp8 moments, fp16 main params: DistributedAdamW's absmax of each buffer
      // param (F32 [params, 3]).
      if (scaled_states) plan.other_state += block(double(sizes.size()) * 12);
      if (fsdp_sharding.use_megatron_fsdp) {
        // Megatron-FSDP: a bucket per unit, each padded to 64 x shards.
        std::map<int, double> units;
        for (const ParamShape& p : params)
          if (p.expert == expert && p.fp8 == fp8) units[p.unit] += round_up(p.numel, 64);
        double largest = 0;
        total = 0;
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
        total = round_up(total, 64 * shards);
        plan.weights += block(total * (fp8 ? 1 : cb));
        plan.main_grads += block(total * grad_b);
      }
      // Main params and moments: per param, or per piece of shard 0 under the distributed
      // optimizer (DistributedAdamW: every rank's shard has the same length).
      const double shard = total / shards;
      for (size_t i = 0; i < sizes.size(); ++i) {
        const double n = distributed
                             ? std::max(0.0, std::min(offsets[i] + sizes[i], shard) - offsets[i])
                             : sizes[i];
        if (n <= 0) continue;
        ++adam_params;
        if (cb != 4 || fp8) plan.main_params += block(n * (fp8 ? 4 : remainders ? 2 : main_b));
        // Param::main_param_scale, F32 [1] each.
        if (f16_main && !fp8) plan.main_params += block(4);
        plan.exp_avg += block(n * avg_b);
        plan.exp_avg_sq += block(n * sq_b);
      }
    }
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
