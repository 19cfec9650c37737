// --cuda-graph-impl full_iteration (train/step_graph.h).
#include "train/step_graph.h"

#include "core/error.h"
#include "ops/profiler.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/graph.h"
#endif

namespace megaton {

void check_full_iteration_graph(const TrainArgs& a, int64_t world_size) {
  if (a.cuda_graph_impl != "full_iteration") return;
  constexpr const char* kFlag = "cuda-graph-impl full_iteration";
  const GPTConfig& m = a.model;
  if (m.device != Device::CUDA) fail("{} needs a GPU (device cuda)", kFlag);
  if (world_size != 1)
    fail("{} runs on one GPU (this run has {} ranks): the multi-rank step's collectives are "
         "not captured yet", kFlag, world_size);
  if (m.hidden_dropout > 0 || m.attention_dropout > 0)
    fail("{} needs hidden-dropout 0 and attention-dropout 0 (the dropout masks are keyed by "
         "the iteration on the host, which a replayed graph cannot change)", kFlag);
  if (m.moe_input_jitter_eps > 0 || m.moe_router_force_load_balancing)
    fail("{}: moe-input-jitter-eps and moe-router-force-load-balancing draw random numbers "
         "keyed by the iteration on the host, which a replayed graph cannot change", kFlag);
  if (m.num_experts > 0 && m.fp8.enabled)
    fail("{}: FP8 experts size their padded rows on the host each step (a host "
         "synchronization); run them without CUDA graphs", kFlag);
  if (m.num_experts > 0 && m.moe_expert_capacity_factor > 0)
    fail("{}: moe-expert-capacity-factor sizes the experts' rows on the host each step (a host "
         "synchronization); run it without CUDA graphs", kFlag);
  if (a.calculate_per_token_loss && a.eod_mask_loss)
    fail(
        "{}: calculate-per-token-loss with eod-mask-loss divides the gradients by each "
        "step's loss tokens, a host value a replayed graph cannot change",
        kFlag);
  if (m.mtp_num_layers > 0)
    fail("{}: mtp-num-layers builds each micro-batch's shifted tokens and masks on the host, "
         "which a replayed graph cannot change; run it without CUDA graphs", kFlag);
  if (a.reset_attention_mask)
    fail(
        "{}: reset-attention-mask's document boundaries (how many, the longest) change with "
        "every micro-batch, host values a replayed graph cannot change; run it without CUDA "
        "graphs",
        kFlag);
  if (a.log_num_zeros_in_grad)
    fail("{}: log-num-zeros-in-grad reads the gradients between backward and the update, "
         "inside the captured step", kFlag);
  if (ops::profile_enabled())
    fail("{}: MEGATON_OP_PROFILE=1 times each op from the host, which a replayed graph "
         "does not reach; profile without CUDA graphs", kFlag);
}

#ifdef MEGATON_WITH_CUDA
struct FullIterationGraph::Impl {
  int64_t warmup_steps = 0;
  int64_t eager_steps = 0;
  cuda::StepGraph graph;
};

FullIterationGraph::FullIterationGraph(int64_t warmup_steps) : impl_(std::make_unique<Impl>()) {
  MEGATON_CHECK(warmup_steps > 0, "FullIterationGraph: warmup_steps {}", warmup_steps);
  impl_->warmup_steps = warmup_steps;
}

FullIterationGraph::~FullIterationGraph() = default;

void FullIterationGraph::run(const std::function<void()>& body) {
  Impl& g = *impl_;
  if (!g.graph.captured() && g.eager_steps < g.warmup_steps) {
    ++g.eager_steps;
    body();
    return;
  }
  if (!g.graph.captured()) {
    try {
      g.graph.capture("cuda-graph-impl full_iteration", body);
    } catch (const OutOfMemoryError&) {
      throw;
    } catch (const Error& e) {
      fail("cuda-graph-impl full_iteration: {}; this configuration needs the step without "
           "CUDA graphs", e.what());
    }
  }
  g.graph.replay();
}

bool FullIterationGraph::captured() const { return impl_->graph.captured(); }
int64_t FullIterationGraph::pool_bytes() const { return impl_->graph.pool_bytes(); }
int64_t FullIterationGraph::num_nodes() const { return impl_->graph.num_nodes(); }
#else
struct FullIterationGraph::Impl {};
FullIterationGraph::FullIterationGraph(int64_t) {
  throw InternalError("FullIterationGraph: this build has no CUDA backend");
}
FullIterationGraph::~FullIterationGraph() = default;
void FullIterationGraph::run(const std::function<void()>&) {}
bool FullIterationGraph::captured() const { return false; }
int64_t FullIterationGraph::pool_bytes() const { return 0; }
int64_t FullIterationGraph::num_nodes() const { return 0; }
#endif

}  // namespace megaton
