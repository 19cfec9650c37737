// Memory plan: the parameter state and the activations of the busiest rank, counted from
// what the model code allocates (sources named at each term; docs/memory.md).
#include "train/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "train/memory_plan_layers.h"
#include "train/pipeline_schedule.h"

namespace megaton {

double memory_plan_block_bytes(double bytes, Device device) {
  if (!(bytes > 0)) return 0;
  const double small = device == Device::CUDA ? double(1 << 20) : 4096.0;
  const double unit = device == Device::CUDA ? 512.0 : 64.0;
  if (bytes <= small) return std::ceil(bytes / unit) * unit;
  // The largest power of two below `bytes`, cut in 8 steps.
  int exponent = 0;
  std::frexp(bytes - 1, &exponent);
  const double step = std::ldexp(1.0, exponent - 1) / 8;
  return std::ceil(bytes / step) * step;
}

namespace {

using namespace memory_plan_detail;

// One model chunk's activations for one micro-batch and its peak moments
// (GPTModel::forward_chunk / backward_chunk).
struct ChunkMemory {
  double saved = 0;           // held from its forward to its backward
  double forward_logits = 0;  // at the end of the forward (post_process): logits, loss
  double forward_other = 0;   //   and the rest of the moment's transients
  double backward_logits = 0, backward_other = 0;  // the highest moment of its backward
  std::string forward_at = "the end of a forward (logits and loss)";
  std::string backward_at;
  double offloaded = 0;  // --cpu-offloading: bytes its forward moves to host memory
};

ChunkMemory chunk_memory(const Dims& x, const ChunkLayers& layers, bool pre, bool post,
                         bool training) {
  const GPTConfig& m = x.m;
  const RecomputeConfig& rc = m.recompute;
  const bool full = training && rc.granularity == RecomputeGranularity::Full;
  const int64_t n = layers.num_layers;
  std::vector<LayerMemory> lm;
  for (int64_t i = 0; i < n; ++i) lm.push_back(layer_memory(x, layers.first_layer + i, training));
  // Held per layer: all it saved, or under full recompute its group's input (first layer)
  // and its MoE routing; nothing for a layer --cpu-offloading moves to the host
  // (model/activation_offload.h).
  std::vector<double> held(size_t(n), 0);
  ChunkMemory out;
  auto offloaded = [&](int64_t i) { return training && m.cpu_offloading.offloads(i); };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t group = full ? rc.full_group_start(i, n) : -1;
    held[size_t(i)] = group < 0 ? lm[size_t(i)].saved
                                : lm[size_t(i)].kept_full + (group == i ? lm[size_t(i)].input : 0);
    if (offloaded(i)) {
      out.offloaded += held[size_t(i)];
      held[size_t(i)] = 0;
    }
  }
  for (double h : held) out.saved += h;
  if (pre) out.saved += x.bytes(x.T, kI32);  // the token ids
  // Offloading: during layer l's forward the previous layer's tensors wait for their copy
  // (released after layer l's forward), beside layer l's own and the layers kept before.
  double offload_forward = 0, kept_before = pre ? x.bytes(x.T, kI32) : 0;
  for (int64_t l = 1; l < n; ++l) {
    kept_before += held[size_t(l - 1)];
    if (offloaded(l - 1))
      offload_forward =
          std::max(offload_forward, kept_before + lm[size_t(l - 1)].saved + lm[size_t(l)].saved);
  }
  double tail = 0;
  if (post) {
    // The final norm's input and statistics, the output layer's input (gathered under SP)
    // and the labels.
    tail = x.act(x.Tl, x.H) + x.norm_stats(x.Tl) + x.act(x.T, x.H) + x.bytes(x.T, kI32);
    out.saved += tail;
    const double logits = x.act(x.T, x.V / x.tp);
    // lse, the per-token losses, the loss gradient; vocab-parallel: four [T] statistics.
    const double vectors = 3 * x.bytes(x.T, kF32) + (x.tp > 1 ? 4 * x.bytes(x.T, kF32) : 0);
    out.forward_logits = logits + vectors;
    out.forward_other = x.sp ? x.act(x.Tl, x.H) : 0;  // the final norm's local output
    // output_loss_backward: dlogits in place of the logits, then d hidden [T, H].
    out.backward_logits = logits + vectors;
    out.backward_other = x.act(x.T, x.H) + (x.sp ? x.act(x.Tl, x.H) : 0);
    out.backward_at = "the output layer's backward (logits and d hidden)";
    // Multi-token prediction (model/gpt_mtp.cpp): per depth its layer's saved state, the
    // embedding, the two norms' and final norm's inputs and statistics, eh_proj's input
    // [Tl, 2H], its output layer's input, shifted tokens and labels, all held to backward;
    // and its logits and loss vectors, alive beside the main ones at the end of the forward.
    const double D = double(m.mtp_num_layers);
    if (D > 0) {
      const double depth = layer_memory(x, m.num_layers - 1, training).saved +
                           3 * (x.act(x.Tl, x.H) + x.norm_stats(x.Tl)) + x.act(x.Tl, 2 * x.H) +
                           x.act(x.T, x.H) + 2 * x.bytes(x.T, kI32);
      tail += D * depth;
      out.saved += D * depth;
      out.forward_logits += D * (logits + vectors);
      out.backward_logits += D * (logits + vectors);
    }
  }
  if (offload_forward > out.saved + out.forward_logits + out.forward_other) {
    out.forward_logits = 0;
    out.forward_other = offload_forward - out.saved;
    out.forward_at = "a forward, two offloaded layers' tensors on the device (one being copied)";
  }
  // The layers' backward, last first: a full-recompute group re-runs its forward when its
  // last layer's backward starts; each layer frees what it saved when its backward ends.
  double live = out.saved - tail;  // the final norm's state is gone by then
  double best = post ? out.backward_logits + out.backward_other : -1;
  for (int64_t i = n; i-- > 0;) {
    const int64_t group = full ? rc.full_group_start(i, n) : -1;
    if (group >= 0 && i + 1 == rc.full_group_end(i, n))
      for (int64_t j = group; j <= i; ++j) live += lm[size_t(j)].saved - held[size_t(j)];
    // Offloading: layer i - 1's tensors come back at the start of layer i's backward.
    if (i >= 1 && offloaded(i - 1)) live += lm[size_t(i - 1)].saved;
    const double moment = live + lm[size_t(i)].backward;
    if (moment - out.saved > best) {
      best = moment - out.saved;
      out.backward_logits = 0;
      out.backward_other = best;
      out.backward_at = fmt::format("the backward of layer {}{}", layers.first_layer + i,
                                    m.is_moe_layer(layers.first_layer + i) ? " (MoE)" : "");
    }
    live -= lm[size_t(i)].saved;
  }
  return out;
}

}  // namespace

// Parameters and the persistent state are in memory_plan_state.cpp.
// activation_peak: the stage's highest activation bytes, to weigh each data-parallel shard's
// optimizer state against its Muon step scratch when choosing the busiest.
void plan_parameter_state(const TrainArgs& args, const dist::ValidatedLayout& layout, int64_t stage,
                          double activation_peak, MemoryPlan& plan);
void plan_parameter_counts(const GPTConfig& m, MemoryPlan& plan);

MemoryPlan plan_memory(const TrainArgs& args, const dist::ValidatedLayout& layout) {
  const GPTConfig& m = args.model;
  MEGATON_CHECK(m.padded_vocab_size > 0, "plan_memory: GPTConfig not finalized");
  MemoryPlan plan;
  plan.device = m.device;
  plan.compute_dtype = m.compute_dtype();
  plan.main_grads_dtype = m.main_grads_dtype;
  if (args.parallel.use_megatron_fsdp) plan.fsdp = args.parallel.data_parallel_sharding_strategy;
  plan.main_params_dtype = args.adam.main_params_dtype;
  plan.sizes = layout.sizes;
  plan.sequence_parallel = layout.sequence_parallel;
  const dist::ParallelSizes& z = layout.sizes;
  const int64_t pp = z.pp, vpp = z.vpp.value_or(1);
  const int64_t gbs = args.global_batch_size > 0 ? args.global_batch_size : args.micro_batch_size;
  plan.micro_batches =
      std::max<int64_t>(gbs / (args.micro_batch_size * std::max<int64_t>(z.dp, 1)), 1);
  const int64_t M = plan.micro_batches;

  Dims x{args, m, m.device, double(dtype_size(m.compute_dtype())), double(z.tp), double(z.ep),
         double(z.etp > 0 ? z.etp : z.tp), 0, layout.sequence_parallel && z.tp > 1,
         m.normalization == Normalization::LayerNorm,
         // Under context parallelism a rank holds S / cp rows of each sample (the CP
         // attention's own K/V buffers are not counted).
         double(args.micro_batch_size), double(m.seq_length / std::max<int64_t>(z.cp, 1)), 0, 0, 0,
         double(m.hidden_size), double(m.padded_vocab_size), double(m.num_attention_heads),
         double(m.num_query_groups), double(m.kv_channels), 0, double(m.ffn_hidden_size)};
  x.G = x.ep * x.etp;
  x.T = x.B * x.S;
  x.Tl = x.sp ? x.T / x.tp : x.T;
  x.Tm = x.T / x.tp;
  plan_parameter_counts(m, plan);

  const std::string recompute_modules = recompute_module_names(m.recompute.modules);
  switch (m.recompute.granularity) {
    case RecomputeGranularity::None:
      plan.recompute = "none";
      break;
    case RecomputeGranularity::Selective:
      plan.recompute = "selective: " + recompute_modules;
      break;
    case RecomputeGranularity::Full:
      plan.recompute =
          fmt::format("full, {}, {} layers",
                      m.recompute.method == RecomputeMethod::Uniform ? "uniform" : "block",
                      m.recompute.num_layers);
  }
  plan.schedule = pp == 1    ? "no pipeline"
                  : vpp == 1 ? "1F1B"
                             : fmt::format("interleaved 1F1B, {} chunks per stage", vpp);

  double best_total = -1;
  for (int64_t s = 0; s < pp; ++s) {
    MemoryPlan sp = plan;  // this stage's candidate
    std::vector<ChunkMemory> chunks;
    double per_micro_batch = 0;
    sp.stage_layers = sp.stage_moe_layers = 0;
    for (int64_t c = 0; c < vpp; ++c) {
      const ChunkLayers cl = chunk_layers(layout.layers_per_stage, vpp, s, c);
      for (int64_t l = cl.first_layer; l < cl.first_layer + cl.num_layers; ++l) {
        ++sp.stage_layers;
        sp.stage_moe_layers += m.is_moe_layer(l);
      }
      chunks.push_back(chunk_memory(x, cl, s == 0 && c == 0, s == pp - 1 && c == vpp - 1, true));
      per_micro_batch += chunks.back().saved;
    }
    sp.activations_per_micro_batch = per_micro_batch;
    // Walk this stage's schedule (pipeline_rank_order): at each forward's end and each
    // backward's highest moment, the held activations of every live (micro-batch, chunk).
    std::vector<PipelineOp> order;
    if (pp == 1) {
      order = {{true, 0, 0}, {false, 0, 0}};  // every micro-batch alike, one at a time
    } else {
      order = pipeline_rank_order(pp, vpp, s, M, false);
    }
    std::vector<int64_t> live(size_t(vpp), 0);
    double best = -1;
    for (const PipelineOp& op : order) {
      const ChunkMemory& c = chunks[size_t(op.chunk)];
      if (op.forward) ++live[size_t(op.chunk)];
      double others = 0;
      int64_t pairs = 0;
      for (int64_t k = 0; k < vpp; ++k) {
        others += double(live[size_t(k)]) * chunks[size_t(k)].saved;
        pairs += live[size_t(k)];
      }
      others -= c.saved;
      const double logits = op.forward ? c.forward_logits : c.backward_logits;
      const double other = op.forward ? c.forward_other : c.backward_other;
      if (others + c.saved + logits + other > best) {
        best = others + c.saved + logits + other;
        sp.activations = c.saved;
        sp.in_flight_activations = others;
        sp.logits_and_loss = logits;
        sp.working_set = other;
        sp.in_flight = pairs;
        sp.peak_at = op.forward ? c.forward_at : c.backward_at;
        if (pp > 1)
          sp.peak_at += fmt::format(", micro-batch {} of model chunk {}", op.micro_batch, op.chunk);
      }
      if (!op.forward) --live[size_t(op.chunk)];
    }
    // Evaluation (pp 1): a forward-only pass (ForwardContext::forward_only) in which each
    // layer drops what it saved right after its forward, but an MoE layer's routing: one
    // layer's activations at a time on top of the routing kept so far, then the final
    // norm, the output layer and the logits.
    if (pp == 1 && args.eval_iters > 0) {
      const ChunkLayers cl = chunk_layers(layout.layers_per_stage, 1, 0, 0);
      const ChunkMemory e = chunk_memory(x, cl, true, true, false);
      double routing = 0, layers_saved = 0, in_layer = 0, in_layer_saved = 0;
      for (int64_t i = 0; i < cl.num_layers; ++i) {
        const LayerMemory l = layer_memory(x, cl.first_layer + i, false);
        if (routing + l.saved > in_layer) {
          in_layer = routing + l.saved;
          in_layer_saved = l.saved;
        }
        routing += l.kept_full;
        layers_saved += l.saved;
      }
      const double fixed = e.saved - layers_saved;  // token ids, the tail's inputs, labels
      const double at_loss = routing + fixed + e.forward_logits + e.forward_other;
      const double during = std::max(at_loss, in_layer + x.bytes(x.T, kI32));
      if (during > best) {
        best = during;
        const bool loss = at_loss >= in_layer + x.bytes(x.T, kI32);
        sp.activations = loss ? routing + fixed : in_layer_saved + x.bytes(x.T, kI32);
        sp.in_flight_activations = loss ? 0 : in_layer - in_layer_saved;
        sp.logits_and_loss = loss ? e.forward_logits : 0;
        sp.working_set = loss ? e.forward_other : 0;
        sp.in_flight = 1;
        sp.peak_at = loss ? "an evaluation forward's loss (each layer's state dropped after it)"
                          : "an evaluation forward's largest layer";
      }
    }
    plan_parameter_state(args, layout, s, best, sp);
    // After the backward every activation is gone: the CPU's gradient reduce-scatter holds
    // its copies of the buckets, then Muon's step its scratch for one batch or matrix.
    if (sp.grad_sync_scratch > best) {
      best = sp.grad_sync_scratch;
      sp.activations = sp.in_flight_activations = sp.logits_and_loss = 0;
      sp.working_set = sp.grad_sync_scratch;
      sp.in_flight = 0;
      sp.peak_at = "the gradients' reduce-scatter (the CPU's copies of the buckets)";
    }
    if (sp.muon_step_scratch > best) {
      best = sp.muon_step_scratch;
      sp.activations = sp.in_flight_activations = sp.logits_and_loss = 0;
      sp.working_set = sp.muon_step_scratch;
      sp.in_flight = 0;
      sp.peak_at = "the optimizer step (Muon's scratch: " + sp.muon_step_what + ")";
    }
    if (m.device == Device::CUDA) {
      // cuBLASLt's workspace (ops/cuda/gemm.cpp lt_context, 32 MiB) and the cuDNN SDPA
      // workspace, grown to the largest need (ops/cuda/attention.cpp): estimated as the
      // backward's fp32 dQ accumulator [B, heads / tp, S, d] and its [B, heads / tp, S]
      // statistics.
      const double heads = x.np / x.tp;
      sp.workspaces = memory_plan_block_bytes(double(32 << 20), Device::CUDA) +
                      x.bytes(x.B * heads * x.S * (x.d + 1), kF32);
    }
    sp.stage = s;
    plan.stage_totals.push_back(sp.total());
    if (sp.total() > best_total) {
      best_total = sp.total();
      std::vector<double> totals = std::move(plan.stage_totals);
      plan = sp;
      plan.stage_totals = std::move(totals);
    }
  }
  auto& notes = plan.assumptions;
  if (m.num_experts > 0)
    notes.push_back(fmt::format(
        "MoE: balanced routing, each rank's experts get {} of the {} copies per token{}",
        z.etp > 1 ? fmt::format("etp ({}) x their share", z.etp) : std::string("their share"),
        m.moe_router_topk,
        m.moe_expert_capacity_factor > 0 ? ", at most the capacity"
                                         : " (dropless: a skewed "
                                           "step holds more)"));
  if (m.cpu_offloading.enabled && m.cpu_offloading.num_layers > 0) {
    const ChunkLayers cl = chunk_layers(layout.layers_per_stage, 1, 0, 0);
    notes.push_back(fmt::format(
        "CPU offloading: the first {} layers' activations, {:.2f} GiB per micro-batch, in "
        "pinned host memory between forward and backward (not counted above)",
        m.cpu_offloading.num_layers,
        chunk_memory(x, cl, true, pp == 1, true).offloaded / double(1 << 30)));
  }
  if (args.adam.optimizer_cpu_offload)
    notes.push_back(fmt::format(
        "optimizer CPU offload: {:.0f}% of the elements' main params and Adam moments, {:.2f} "
        "GiB, in pinned host memory (not counted above; whole params, so the device keeps up "
        "to one param more or less)",
        100 * args.adam.optimizer_offload_fraction,
        plan.offloaded_optimizer_bytes / double(1 << 30)));
  if (!plan.muon_layout.empty())
    notes.push_back(
        "layer-wise distributed optimizer (Muon's matrices whole in their shards): " +
        plan.muon_layout +
        (plan.muon_bounded
             ? "; a Muon buffer bounded (sizes past 64-bit integers or over 65536 shards)"
             : ""));
  if (plan.muon_step_scratch > 0)
    notes.push_back(fmt::format("Muon step: {:.3f} MiB of scratch at most ({}){}{}",
                                plan.muon_step_scratch / double(1 << 20), plan.muon_step_what,
                                plan.peak_at.starts_with("the optimizer step") ? " (the peak)" : "",
                                m.device == Device::CPU
                                    ? "; the CPU's fp64 Newton-Schulz vectors (outside the tensor "
                                      "allocator) not counted"
                                    : ""));
  if (m.fp8.enabled)
    notes.push_back(
        "FP8: saved inputs as FP8 x^T, each expert padded to the FP8 multiple on "
        "average; the transient quantized copies are not counted");
  if (m.device == Device::CUDA)
    notes.push_back(
        "CUDA: tensors counted in the caching allocator's blocks; the CUDA context "
        "and cuBLAS's own workspace (outside the allocator) are not counted");
  return plan;
}

}  // namespace megaton
