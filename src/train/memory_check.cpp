// Memory check: the lower bound of a run's memory, and the comparison with the machine.
#include "train/memory_check.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "model/param_buffer.h"

#ifdef MEGATON_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "core/error.h"

namespace megaton {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// Per-layer parameter elements and activation bytes of the two kinds of layer.
struct LayerTerms {
  double dense_params = 0;   // elements in the dense buffer (attention, router, shared expert)
  double expert_params = 0;  // elements in the expert buffer
  double activation_bytes = 0;
};

}  // namespace

MemoryLowerBound memory_lower_bound(const TrainArgs& args, const dist::ParallelSizes& sizes) {
  const GPTConfig& m = args.model;
  MEGATON_CHECK(m.padded_vocab_size > 0, "memory_lower_bound: GPTConfig not finalized");
  MemoryLowerBound out;
  out.device = m.device;

  const double tp = double(sizes.tp), pp = double(sizes.pp);
  const double ep = double(std::max<int64_t>(sizes.ep, 1));
  const double etp = double(sizes.etp > 0 ? sizes.etp : sizes.tp);
  const bool distributed = args.parallel.use_distributed_optimizer;
  // The distributed optimizer shards dense state over dp x cp and expert state over edp.
  const double dense_shards = distributed ? double(std::max<int64_t>(sizes.dp * sizes.cp, 1)) : 1;
  const double expert_shards = distributed ? double(std::max<int64_t>(sizes.edp, 1)) : 1;
  const double cb = double(dtype_size(m.compute_dtype()));  // the compute weights' bytes
  // Bytes per parameter element: compute weight + main grad (whole, every rank) + Adam's
  // exp_avg and exp_avg_sq (sharded) + the main param where the compute weight is not fp32
  // (sharded), each in its dtype (fp32 unless the precision-aware optimizer says otherwise:
  // --exp-avg-dtype bf16 stores 2 bytes, docs/memory.md); beside bf16 weights the main
  // param is a 2-byte remainder (store_param_remainders; --fp8-param-gather keeps fp32 main
  // params for its FP8 weights, which a lower bound may count at 2).
  const optim::AdamWConfig& adam = args.adam;
  const double grad_b = double(dtype_size(m.main_grads_dtype));  // the grad buffers' dtype
  const double moments_b =
      double(dtype_size(adam.exp_avg_dtype) + dtype_size(adam.exp_avg_sq_dtype));
  const double main_b = adam.store_param_remainders && m.compute_dtype() == DType::BF16 &&
                                adam.main_params_dtype == DType::F32
                            ? 2.0
                            : double(dtype_size(adam.main_params_dtype));
  // --optimizer-cpu-offload: that fraction of the moments and main params is on the host.
  const double on_device = adam.optimizer_cpu_offload ? 1.0 - adam.optimizer_offload_fraction : 1.0;
  // Megatron-FSDP's sharded gradients: only the rank's shard is held between backward
  // passes (a lower bound: the buckets in flight are left out; the whole weights are still
  // needed at initialisation).
  const bool fsdp_grads = args.parallel.use_megatron_fsdp &&
                          parse_sharding_strategy(args.parallel.data_parallel_sharding_strategy) >=
                              ShardingStrategy::OptimGrads;
  // The optimizer state of an element by its param's rule (DistributedAdamW::rule_of): Adam
  // the two moments and the main param above; Muon, SGD and Lion one fp32 state (momentum
  // buffer, Lion's exp_avg) and an fp32 main param (never remainders). The layers' matrices
  // and the learned position embeddings take Muon, SGD or Lion under those optimizers; the
  // word embeddings and output layer Adam (SGD under sgd, Lion under muon with
  // --muon-scalar-optimizer lion).
  const double adam_state = moments_b + (cb < 4 ? main_b : 0.0);
  const double rule_state = 4.0 + (cb < 4 ? 4.0 : 0.0);
  const optim::OptimizerKind kind = args.optimizer.kind;
  const double matrix_state = kind == optim::OptimizerKind::Adam ? adam_state : rule_state;
  const bool vocab_adam = kind == optim::OptimizerKind::Adam ||
                          kind == optim::OptimizerKind::Lion ||
                          (kind == optim::OptimizerKind::Muon &&
                           args.optimizer.muon.scalar_optimizer == optim::OptimizerKind::Adam);
  const double vocab_state = vocab_adam ? adam_state : rule_state;
  auto bytes_per_element = [&](double shards, double state) {
    return cb + (fsdp_grads ? grad_b / shards : grad_b) + on_device * state / shards;
  };
  const double dense_b = bytes_per_element(dense_shards, matrix_state);
  const double expert_b = bytes_per_element(expert_shards, matrix_state);
  const double vocab_b = bytes_per_element(dense_shards, vocab_state);

  const double h = double(m.hidden_size), V = double(m.padded_vocab_size);
  const double heads = double(m.num_attention_heads), groups = double(m.num_query_groups);
  const double d = double(m.kv_channels);
  const double ffn = double(m.ffn_hidden_size), fc1 = m.swiglu ? 2 * ffn : ffn;

  // Tokens of one micro-batch on this rank (seq-length / cp under context parallelism);
  // this rank's rows of the residual stream under SP.
  const double tokens =
      double(args.micro_batch_size) * double(m.seq_length) / double(std::max<int64_t>(sizes.cp, 1));
  const bool sp = args.parallel.sequence_parallel && sizes.tp > 1;
  const double tokens_local = sp ? tokens / tp : tokens;

  // Attention (model/attention.cpp): linear_qkv [(heads + 2 groups) d, h] column-parallel,
  // linear_proj [h, heads d] row-parallel. Saved per layer: the layer input and the
  // attention residual (the norms' inputs), the two norm outputs (linear_qkv's input;
  // linear_fc1's or the router's), q, k, v and the attention output.
  const double attention_params = ((heads + 2 * groups) * d * h + h * heads * d) / tp;
  const double common_activations =
      cb * (4 * tokens_local * h + tokens * (2 * heads + 2 * groups) / tp * d);

  LayerTerms dense_layer;
  dense_layer.dense_params = attention_params + (fc1 + ffn) * h / tp;  // fc1 [fc1, h], fc2 [h, ffn]
  dense_layer.activation_bytes = common_activations + cb * tokens * fc1 / tp;  // fc1's output

  LayerTerms moe_layer;
  const bool moe = m.num_experts > 0;
  if (moe) {
    const double experts = double(m.num_experts), f = double(m.moe_ffn_hidden_size);
    const double f1 = m.swiglu ? 2 * f : f;
    const double shared = double(m.moe_shared_expert_intermediate_size);
    const double shared1 = m.swiglu ? 2 * shared : shared;
    // Router [experts, h] (replicated), the shared expert as a dense MLP over tp, and this
    // rank's experts/ep local experts, each fc1 [f1, h] and fc2 [h, f] split over etp.
    moe_layer.dense_params = attention_params + experts * h + (shared1 + shared) * h / tp;
    moe_layer.expert_params = experts / ep * (f1 + f) * h / etp;
    moe_layer.activation_bytes = common_activations;
  }
  // Layers by kind: GPTConfig::is_moe_layer without a loop over num-layers (which may be
  // absurd): every freq-th layer from 0, or the pattern's ones.
  const double num_layers = double(m.num_layers);
  double moe_layers = 0;
  if (moe) {
    if (!m.moe_layer_pattern.empty())
      moe_layers = double(std::count(m.moe_layer_pattern.begin(), m.moe_layer_pattern.end(), 1));
    else
      moe_layers = double((m.num_layers - 1) / std::max<int64_t>(m.moe_layer_freq, 1) + 1);
  }
  const double dense_layers = num_layers - moe_layers;
  auto layer_state = [&](const LayerTerms& t) {
    return t.dense_params * dense_b + t.expert_params * expert_b;
  };
  // A rank whose layers' kinds are unknown here holds at least its count of the lighter kind.
  const bool mixed = moe_layers > 0 && dense_layers > 0;
  const LayerTerms& only = moe_layers > 0 ? moe_layer : dense_layer;
  double min_layer_state =
      mixed ? std::min(layer_state(dense_layer), layer_state(moe_layer)) : layer_state(only);
  double min_layer_params = mixed ? std::min(dense_layer.dense_params + dense_layer.expert_params,
                                             moe_layer.dense_params + moe_layer.expert_params)
                                  : only.dense_params + only.expert_params;
  double min_layer_activations =
      mixed ? std::min(dense_layer.activation_bytes, moe_layer.activation_bytes)
            : only.activation_bytes;
  // A hybrid model's layers are one part each (a Mamba or attention mixer, an MLP, an MoE
  // layer), lighter than the attention + MLP layers above: the bound leaves its layers out
  // (the memory plan, train/memory_plan.h, counts them exactly).
  const double hybrid_zero = m.is_hybrid() ? 0.0 : 1.0;
  min_layer_state *= hybrid_zero;
  min_layer_params *= hybrid_zero;
  min_layer_activations *= hybrid_zero;

  // First stage: word embeddings [V, h] (vocab-parallel), learned position embeddings
  // [max-position-embeddings, h] (replicated). Last stage: the output layer [V, h] when
  // untied, else with pp > 1 the tied embeddings' copy; the logits [T, V / tp].
  const double vocab_params = V * h / tp;
  const double position_params = m.position_embedding_type == PositionEmbedding::LearnedAbsolute
                                     ? double(m.max_position_embeddings) * h
                                     : 0.0;
  const double tail_params =
      m.untie_embeddings_and_output_weights || sizes.pp > 1 ? vocab_params : 0.0;
  const double logits_bytes = cb * tokens * V / tp;

  // The busiest rank: at least the largest per-stage bound (its layers of the lighter
  // kind), and at least the stages' average (exact sums over all layers / pp).
  const std::vector<int64_t> layers_per_stage =
      check_parallel_layout(args, sizes.world).layers_per_stage;
  struct Candidate {
    int64_t stage;
    double params, state, activations, vocab_state, position_state, layer_state;
  };
  std::vector<Candidate> candidates;
  for (size_t r = 0; r < layers_per_stage.size(); ++r) {
    const double n = double(layers_per_stage[r]);
    const bool first = r == 0, last = r + 1 == layers_per_stage.size();
    Candidate c{int64_t(r), 0, 0, 0, 0, 0, 0};
    const double vocab = (first ? vocab_params : 0.0) + (last ? tail_params : 0.0);
    const double position = first ? position_params : 0.0;
    c.params = vocab + position + n * min_layer_params;
    c.vocab_state = vocab * vocab_b;
    c.position_state = position * dense_b;
    c.layer_state = n * min_layer_state;
    c.state = c.vocab_state + c.position_state + c.layer_state;
    c.activations = n * min_layer_activations + (last ? logits_bytes : 0.0);
    candidates.push_back(c);
  }
  {
    Candidate avg{-1, 0, 0, 0, 0, 0, 0};
    avg.vocab_state = (vocab_params + tail_params) * vocab_b / pp;
    avg.position_state = position_params * dense_b / pp;
    avg.layer_state =
        hybrid_zero *
        (dense_layers * layer_state(dense_layer) + moe_layers * layer_state(moe_layer)) / pp;
    avg.state = avg.vocab_state + avg.position_state + avg.layer_state;
    avg.params =
        (vocab_params + tail_params + position_params +
         hybrid_zero * (dense_layers * (dense_layer.dense_params + dense_layer.expert_params) +
                        moe_layers * (moe_layer.dense_params + moe_layer.expert_params))) /
        pp;
    avg.activations = (hybrid_zero * (dense_layers * dense_layer.activation_bytes +
                                      moe_layers * moe_layer.activation_bytes) +
                       logits_bytes) /
                      pp;
    candidates.push_back(avg);
  }
  const Candidate& best = *std::max_element(
      candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
        return a.state + a.activations < b.state + b.activations;
      });
  out.busiest_stage = best.stage;
  out.parameters = best.params;
  out.parameter_state_bytes = best.state;
  out.activation_bytes = best.activations;

  // Name the block that dominates the parameter state.
  if (best.vocab_state >= best.layer_state && best.vocab_state >= best.position_state) {
    out.parameter_flags = fmt::format("vocab-size {} (padded to {}) x hidden-size {}", m.vocab_size,
                                      m.padded_vocab_size, m.hidden_size);
  } else if (best.position_state >= best.layer_state) {
    out.parameter_flags = fmt::format("max-position-embeddings {} x hidden-size {}",
                                      m.max_position_embeddings, m.hidden_size);
  } else {
    out.parameter_flags =
        fmt::format("num-layers {} x hidden-size {}", m.num_layers, m.hidden_size);
    if (moe && moe_layer.expert_params * expert_b >= moe_layer.dense_params * dense_b)
      out.parameter_flags += fmt::format(" with num-experts {} x moe-ffn-hidden-size {}",
                                         m.num_experts, m.moe_ffn_hidden_size);
    else if (dense_layers > 0)
      out.parameter_flags += fmt::format(" (ffn-hidden-size {})", m.ffn_hidden_size);
  }
  out.activation_flags =
      fmt::format("micro-batch-size {} x seq-length {}{}", args.micro_batch_size, m.seq_length,
                  sizes.cp > 1 ? fmt::format(" / context-parallel-size {}", sizes.cp) : "");

  // GPT dataset indices (data/gpt_dataset.cpp build_sample_index, build_shuffle_index;
  // blended_dataset.cpp): the train split only, the others may be empty.
  if (!args.mock_data && !args.data_path.empty()) {
    const int64_t gbs = args.global_batch_size > 0
                            ? args.global_batch_size
                            : args.micro_batch_size * std::max<int64_t>(sizes.dp, 1);
    const double samples = double(args.train_iters) * double(gbs);
    // One prefix (a weight may precede it): sample and shuffle index; a blend: its
    // dataset index (int16) and dataset sample index (int64).
    const bool blend = args.data_path.size() > 2;
    out.dataset_index_bytes = blend ? 10 * samples : 24 * samples + 16;
    out.dataset_flags = fmt::format("train-iters {} x global-batch-size {}", args.train_iters, gbs);
  }
  return out;
}

MemoryAvailable memory_available(Device device) {
  MemoryAvailable out;
  const HostMemoryAvailable host = host_memory_available();
  const int64_t physical = host.physical();
  out.host_physical =
      physical == std::numeric_limits<int64_t>::max() ? kInfinity : double(physical);
  out.host_physical_source = host.physical_limit();
  out.host_address_space =
      host.address_space_left >= 0 ? double(host.address_space_left) : kInfinity;
  out.device_free = kInfinity;
#ifdef MEGATON_WITH_CUDA
  if (device == Device::CUDA) {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
      out.device_free = double(free_bytes);
    else
      (void)cudaGetLastError();  // unknown: no device check
  }
#else
  (void)device;
#endif
  return out;
}

namespace {

// One comparison: the terms that must fit one kind of memory at once.
struct Term {
  double bytes;
  const std::string* flags;
  const char* what;
};

[[noreturn]] void refuse(const std::vector<Term>& terms, double available, const char* memory,
                         const std::string& source) {
  double total = 0;
  const Term* dominant = &terms[0];
  for (const Term& t : terms) {
    total += t.bytes;
    if (t.bytes > dominant->bytes) dominant = &t;
  }
  std::string others;  // "one micro-batch's activations (1.2 GB) and ..."
  for (const Term& t : terms)
    if (&t != dominant && t.bytes > 0)
      others +=
          fmt::format("{}{} ({})", others.empty() ? "" : " and ", t.what, human_bytes(t.bytes));
  const std::string in_all =
      others.empty() ? std::string()
                     : fmt::format(", {} in all with {}", human_bytes_exact(total), others);
  throw OutOfMemoryError(fmt::format(
      "{}: {} need at least {}{}; {} of {} is available ({})", *dominant->flags, dominant->what,
      human_bytes_exact(dominant->bytes), in_all, human_bytes_exact(available), memory, source));
}

}  // namespace

void check_memory_fits(const MemoryLowerBound& b, const MemoryAvailable& a) {
  const char* params_what = b.busiest_stage < 0
                                ? "the parameters and optimizer state of an average pipeline stage"
                                : "the parameters and optimizer state of the busiest rank";
  const Term params{b.parameter_state_bytes, &b.parameter_flags, params_what};
  const Term activations{b.activation_bytes, &b.activation_flags, "one micro-batch's activations"};
  const Term dataset{b.dataset_index_bytes, &b.dataset_flags,
                     "the GPT dataset's sample and shuffle indices"};
  const std::string ulimit = "ulimit -v, less what this process maps already";
  if (b.device == Device::CUDA) {
    if (b.model_bytes() > a.device_free)
      refuse({params, activations}, a.device_free, "device memory", "cudaMemGetInfo");
    if (b.dataset_index_bytes > a.host_physical)
      refuse({dataset}, a.host_physical, "host memory", a.host_physical_source);
    if (b.dataset_index_bytes > a.host_address_space)
      refuse({dataset}, a.host_address_space, "address space", ulimit);
    return;
  }
  // The index is built (and freed) before the model: the two need not fit at once in
  // physical memory, but its cache stays mapped, so they must in the address space. The
  // tighter limit is checked first, so that the message names the one to raise.
  const auto check_address_space = [&] {
    if (b.model_bytes() + b.dataset_index_bytes > a.host_address_space)
      refuse({params, activations, dataset}, a.host_address_space, "address space", ulimit);
  };
  if (a.host_address_space <= a.host_physical) check_address_space();
  if (b.dataset_index_bytes > a.host_physical)
    refuse({dataset}, a.host_physical, "host memory", a.host_physical_source);
  if (b.model_bytes() > a.host_physical)
    refuse({params, activations}, a.host_physical, "host memory", a.host_physical_source);
  check_address_space();
}

void check_memory_fits(const TrainArgs& args, const dist::ParallelSizes& sizes) {
  check_memory_fits(memory_lower_bound(args, sizes), memory_available(args.model.device));
}

}  // namespace megaton
