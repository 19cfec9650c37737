// Pipeline parallelism without MPI: the layers of each model chunk against Megatron's
// rule worked out by hand, each rank's step order against Megatron's 1F1B and interleaved
// schedules written out by hand, the plans' transfers (matched, in time, complete), and
// the schedule itself on ranks played by threads (one forward per micro-batch, the
// one-rank gradients).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <tuple>

#include "common/testing.h"
#include "core/error.h"
#include "ops/ops.h"
#include "train/pipeline_schedule.h"

namespace megaton {
namespace {

using Layers = std::vector<ChunkLayers>;  // per chunk of one rank

Layers rank_chunks(const std::vector<int64_t>& stages, int64_t vpp, int64_t rank) {
  Layers out;
  for (int64_t c = 0; c < vpp; ++c) out.push_back(chunk_layers(stages, vpp, rank, c));
  return out;
}

TEST(ChunkLayers, EvenStagesWithoutInterleaving) {
  // 8 layers, pp 2: [0, 4) and [4, 8).
  EXPECT_EQ(rank_chunks({4, 4}, 1, 0), (Layers{{0, 4}}));
  EXPECT_EQ(rank_chunks({4, 4}, 1, 1), (Layers{{4, 4}}));
  // 4 layers, pp 4: one each.
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(rank_chunks({1, 1, 1, 1}, 1, r), (Layers{{r, 1}}));
}

TEST(ChunkLayers, InterleavedAsMegatronsDocstring) {
  // Megatron's get_num_layers_to_build: 8 layers, 2 stages, 2 chunks each:
  // stage 0: [0, 1] [4, 5]; stage 1: [2, 3] [6, 7].
  EXPECT_EQ(rank_chunks({4, 4}, 2, 0), (Layers{{0, 2}, {4, 2}}));
  EXPECT_EQ(rank_chunks({4, 4}, 2, 1), (Layers{{2, 2}, {6, 2}}));
  // 4 chunks each: stage 0: [0] [2] [4] [6]; stage 1: [1] [3] [5] [7].
  EXPECT_EQ(rank_chunks({4, 4}, 4, 0), (Layers{{0, 1}, {2, 1}, {4, 1}, {6, 1}}));
  EXPECT_EQ(rank_chunks({4, 4}, 4, 1), (Layers{{1, 1}, {3, 1}, {5, 1}, {7, 1}}));
  // 8 layers, pp 4, 1 layer per virtual stage (the layouts test): stage s holds s and 4 + s.
  for (int64_t r = 0; r < 4; ++r)
    EXPECT_EQ(rank_chunks({2, 2, 2, 2}, 2, r), (Layers{{r, 1}, {4 + r, 1}}));
}

TEST(ChunkLayers, UnevenFirstAndLastStages) {
  // 10 layers, pp 4, decoder-first 1, decoder-last 3: stages 1, 3, 3, 3; offsets
  // first + (rank - 1) x 3 after the first stage.
  const std::vector<int64_t> stages{1, 3, 3, 3};
  EXPECT_EQ(rank_chunks(stages, 1, 0), (Layers{{0, 1}}));
  EXPECT_EQ(rank_chunks(stages, 1, 1), (Layers{{1, 3}}));
  EXPECT_EQ(rank_chunks(stages, 1, 2), (Layers{{4, 3}}));
  EXPECT_EQ(rank_chunks(stages, 1, 3), (Layers{{7, 3}}));
  // Only decoder-last (7 layers, pp 3, last 1): stages 3, 3, 1.
  EXPECT_EQ(rank_chunks({3, 3, 1}, 1, 0), (Layers{{0, 3}}));
  EXPECT_EQ(rank_chunks({3, 3, 1}, 1, 1), (Layers{{3, 3}}));
  EXPECT_EQ(rank_chunks({3, 3, 1}, 1, 2), (Layers{{6, 1}}));
}

TEST(ChunkLayers, UnevenInterleaved) {
  // Megatron's get_transformer_layer_offset with 14 layers, pp 4, 2 virtual stages,
  // decoder-first 2, decoder-last 4 (middle stages 4 each): chunks per round 1 + 2 + 2 + 2
  // = 7 layers; rank 0 at v x 7, middle rank m (pp rank m + 1) at v x 7 + 1 + m x 2, the
  // last rank (middle index 2) at v x 7 + 5; sizes first/2, middle/2, last/2.
  const std::vector<int64_t> stages{2, 4, 4, 4};
  EXPECT_EQ(rank_chunks(stages, 2, 0), (Layers{{0, 1}, {7, 1}}));
  EXPECT_EQ(rank_chunks(stages, 2, 1), (Layers{{1, 2}, {8, 2}}));
  EXPECT_EQ(rank_chunks(stages, 2, 2), (Layers{{3, 2}, {10, 2}}));
  EXPECT_EQ(rank_chunks(stages, 2, 3), (Layers{{5, 2}, {12, 2}}));
  // 8 layers, pp 2, decoder-last 2, 3 layers per virtual stage (2 chunks): stage 0 holds
  // [0, 3) and [4, 7), stage 1 layers 3 and 7.
  EXPECT_EQ(rank_chunks({6, 2}, 2, 0), (Layers{{0, 3}, {4, 3}}));
  EXPECT_EQ(rank_chunks({6, 2}, 2, 1), (Layers{{3, 1}, {7, 1}}));
}

TEST(ChunkLayers, EveryLayerOnceInOrderOfVirtualStages) {
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> cases = {
      {{4, 4}, 1}, {{4, 4}, 2}, {{4, 4}, 4}, {{2, 4, 4, 4}, 2}, {{6, 6, 6, 3}, 3}, {{1, 1, 1}, 1}};
  for (const auto& [stages, vpp] : cases) {
    const int64_t pp = int64_t(stages.size());
    int64_t expected_first = 0;
    for (int64_t c = 0; c < vpp; ++c)
      for (int64_t r = 0; r < pp; ++r) {  // virtual stage c x pp + r follows the previous one
        const ChunkLayers l = chunk_layers(stages, vpp, r, c);
        EXPECT_EQ(l.first_layer, expected_first) << "rank " << r << " chunk " << c;
        EXPECT_EQ(l.num_layers, stages[r] / vpp);
        expected_first += l.num_layers;
      }
  }
}

TEST(ChunkLayers, RejectsBadArguments) {
  EXPECT_THROW(chunk_layers({3, 4}, 2, 0, 0), InternalError);  // 3 layers in 2 chunks
  EXPECT_THROW(chunk_layers({4, 4}, 2, 2, 0), InternalError);  // rank out of range
  EXPECT_THROW(chunk_layers({4, 4}, 2, 0, 2), InternalError);  // chunk out of range
}

TEST(InterleavedMicroBatches, MustBeAMultipleOfPp) {
  EXPECT_NO_THROW(check_interleaved_micro_batches(8, 4, 2));
  EXPECT_NO_THROW(check_interleaved_micro_batches(3, 4, 1));  // not interleaved
  try {
    check_interleaved_micro_batches(6, 4, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "the interleaved pipeline schedule (num-layers-per-virtual-pipeline-stage) needs "
                 "the micro-batches per step, global-batch-size / (micro-batch-size x "
                 "data-parallel size) = 6, to be a multiple of pipeline-model-parallel-size (4)");
  }
}

PipelineOp F(int64_t mb, int64_t chunk = 0) { return {true, mb, chunk}; }
PipelineOp B(int64_t mb, int64_t chunk = 0) { return {false, mb, chunk}; }
using Order = std::vector<PipelineOp>;

TEST(PipelineOrder, OneFOneBByHand) {
  // pp 2, 4 micro-batches: rank 0 warms up with one forward, rank 1 with none.
  EXPECT_EQ(pipeline_rank_order(2, 1, 0, 4, false),
            (Order{F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)}));
  EXPECT_EQ(pipeline_rank_order(2, 1, 1, 4, false),
            (Order{F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)}));
  // pp 4, 2 micro-batches: the warmup (3 on rank 0) is cut to the micro-batches.
  EXPECT_EQ(pipeline_rank_order(4, 1, 0, 2, false), (Order{F(0), F(1), B(0), B(1)}));
  EXPECT_EQ(pipeline_rank_order(4, 1, 2, 2, false), (Order{F(0), F(1), B(0), B(1)}));
  EXPECT_EQ(pipeline_rank_order(4, 1, 3, 2, false), (Order{F(0), B(0), F(1), B(1)}));
  EXPECT_EQ(pipeline_rank_order(4, 1, 1, 3, true), (Order{F(0), F(1), F(2)}));
}

TEST(PipelineOrder, InterleavedByHand) {
  // pp 2, 2 chunks, 4 micro-batches. get_schedule_table with groups of 2:
  // (0,c0) (1,c0) (0,c1) (1,c1) (2,c0) (3,c0) (2,c1) (3,c1); backward k mirrors the chunk.
  // Rank 0: warmup 2 x (2 - 0 - 1) + (2 - 1) x 2 = 4.
  EXPECT_EQ(pipeline_rank_order(2, 2, 0, 4, false),
            (Order{F(0, 0), F(1, 0), F(0, 1), F(1, 1),  // warmup
                   F(2, 0), B(0, 1), F(3, 0), B(1, 1), F(2, 1), B(0, 0), F(3, 1), B(1, 0), B(2, 1),
                   B(3, 1), B(2, 0), B(3, 0)}));  // cooldown
  // Rank 1: warmup 2.
  EXPECT_EQ(pipeline_rank_order(2, 2, 1, 4, false),
            (Order{F(0, 0), F(1, 0),  // warmup
                   F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 0), B(0, 0), F(3, 0), B(1, 0), F(2, 1),
                   B(2, 1), F(3, 1), B(3, 1),  // steady
                   B(2, 0), B(3, 0)}));
  // pp 4, 2 chunks, 4 micro-batches: rank 0's warmup 2 x 3 + 4 = 10 > 8 runs every forward.
  const Order r0 = pipeline_rank_order(4, 2, 0, 4, false);
  EXPECT_EQ(Order(r0.begin(), r0.begin() + 8),
            (Order{F(0, 0), F(1, 0), F(2, 0), F(3, 0), F(0, 1), F(1, 1), F(2, 1), F(3, 1)}));
  EXPECT_EQ(Order(r0.begin() + 8, r0.end()),
            (Order{B(0, 1), B(1, 1), B(2, 1), B(3, 1), B(0, 0), B(1, 0), B(2, 0), B(3, 0)}));
  // Forward only: the table.
  EXPECT_EQ(pipeline_rank_order(2, 2, 1, 2, true), (Order{F(0, 0), F(1, 0), F(0, 1), F(1, 1)}));
}

TEST(PipelinePlan, OneFOneBByHand) {
  // pp 2, 2 micro-batches. Tick 0: rank 0 runs F0 and sends it; tick 1: F1 on rank 0, F0
  // on rank 1 (the loss); tick 2: rank 1's B0 sends its gradient; tick 3: rank 0's B0 and
  // rank 1's F1; tick 4: rank 1's B1; tick 5: rank 0's B1.
  const auto plans = pipeline_plan(2, 1, 2, false);
  ASSERT_EQ(plans.size(), 2u);
  auto describe = [](const PipelineStep& s) {
    std::string out = "t" + std::to_string(s.tick);
    if (s.op) out += std::string(s.op->forward ? " F" : " B") + std::to_string(s.op->micro_batch);
    if (s.send_next) out += " >next";
    if (s.recv_prev.defined()) out += " <prev" + std::to_string(s.recv_prev.micro_batch);
    if (s.send_prev) out += " >prev";
    if (s.recv_next.defined()) out += " <next" + std::to_string(s.recv_next.micro_batch);
    return out;
  };
  std::vector<std::string> rank0, rank1;
  for (const auto& s : plans[0]) rank0.push_back(describe(s));
  for (const auto& s : plans[1]) rank1.push_back(describe(s));
  EXPECT_EQ(rank0, (std::vector<std::string>{"t0 F0 >next", "t1 F1 >next", "t2 <next0", "t3 B0",
                                             "t4 <next1", "t5 B1"}));
  EXPECT_EQ(rank1, (std::vector<std::string>{"t0 <prev0", "t1 F0 <prev1", "t2 B0 >prev", "t3 F1",
                                             "t4 B1 >prev"}));
}

// Every plan runs each rank's order, every send meets its receive at the same tick on the
// neighbour, and every op's input arrived at an earlier tick.
void check_plan(int64_t pp, int64_t vpp, int64_t m, bool forward_only) {
  SCOPED_TRACE(::testing::Message() << "pp " << pp << " vpp " << vpp << " micro-batches " << m
                                    << (forward_only ? " forward only" : ""));
  const auto plans = pipeline_plan(pp, vpp, m, forward_only);
  ASSERT_EQ(int64_t(plans.size()), pp);
  const int64_t stages = pp * vpp;
  // (kind, rank, tick) -> slot: sends and receives; arrival tick of each input.
  std::map<std::tuple<int, int64_t, int64_t>, PipelineSlot> recvs;
  std::map<std::tuple<bool, int64_t, int64_t, int64_t>, int64_t> arrived;  // fwd, rank, chunk, mb
  for (int64_t r = 0; r < pp; ++r)
    for (const PipelineStep& s : plans[r]) {
      if (s.recv_prev.defined()) {
        recvs[{0, r, s.tick}] = s.recv_prev;
        arrived[{true, r, s.recv_prev.chunk, s.recv_prev.micro_batch}] = s.tick;
      }
      if (s.recv_next.defined()) {
        recvs[{1, r, s.tick}] = s.recv_next;
        arrived[{false, r, s.recv_next.chunk, s.recv_next.micro_batch}] = s.tick;
      }
    }
  size_t matched = 0;
  for (int64_t r = 0; r < pp; ++r) {
    Order ran;
    int64_t last_tick = -1;
    for (const PipelineStep& s : plans[r]) {
      EXPECT_GT(s.tick, last_tick);
      last_tick = s.tick;
      if (!s.op) {
        EXPECT_FALSE(s.send_next || s.send_prev);
        continue;
      }
      ran.push_back(*s.op);
      const int64_t v = s.op->chunk * pp + r;  // virtual stage
      const bool needs_input = s.op->forward ? v > 0 : v < stages - 1;
      if (needs_input) {
        auto it = arrived.find({s.op->forward, r, s.op->chunk, s.op->micro_batch});
        ASSERT_NE(it, arrived.end()) << "rank " << r << " tick " << s.tick;
        EXPECT_LT(it->second, s.tick);
      }
      const bool sends = s.op->forward ? v + 1 < stages : v > 0;
      EXPECT_EQ(s.send_next, s.op->forward && sends);
      EXPECT_EQ(s.send_prev, !s.op->forward && sends);
      if (s.send_next) {
        auto it = recvs.find({0, (r + 1) % pp, s.tick});
        ASSERT_NE(it, recvs.end());
        EXPECT_EQ(it->second, (PipelineSlot{(v + 1) / pp, s.op->micro_batch}));
        ++matched;
      }
      if (s.send_prev) {
        auto it = recvs.find({1, (r + pp - 1) % pp, s.tick});
        ASSERT_NE(it, recvs.end());
        EXPECT_EQ(it->second, (PipelineSlot{(v - 1) / pp, s.op->micro_batch}));
        ++matched;
      }
    }
    EXPECT_EQ(ran, pipeline_rank_order(pp, vpp, r, m, forward_only)) << "rank " << r;
  }
  EXPECT_EQ(matched, recvs.size());  // no receive without its send
  // Every virtual stage boundary carries each micro-batch once forward (and once back).
  EXPECT_EQ(int64_t(recvs.size()), (stages - 1) * m * (forward_only ? 1 : 2));
}

TEST(PipelinePlan, TransfersMatchAndArriveInTime) {
  for (int64_t pp : {2, 3, 4, 8})
    for (int64_t m : {1, 2, 3, 4, 5, 8, 12}) {
      check_plan(pp, 1, m, false);
      check_plan(pp, 1, m, true);
    }
  for (int64_t pp : {2, 3, 4})
    for (int64_t vpp : {2, 3, 4})
      for (int64_t m : {pp, 2 * pp, 3 * pp}) {
        check_plan(pp, vpp, m, false);
        check_plan(pp, vpp, m, true);
      }
}

// ---- the schedule run: pipeline ranks as threads of one process ----

// Messages between the threads standing in for pipeline ranks, by (from, to) world rank.
// The ranks take turns: a rank runs only while it holds `turn` (the mailboxes' lock),
// which it gives up while it waits for a message, so the CPU ops (OpenBLAS, OpenMP loops)
// never run on two threads at once.
struct Mailboxes {
  std::mutex turn;
  std::condition_variable arrived;
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> queues;
};

// A Comm for one rank of the threads: point-to-point transfers only.
class ThreadComm final : public dist::Comm {
 public:
  ThreadComm(Mailboxes& boxes, int world_rank) : boxes_(boxes), rank_(world_rank) {}
  Device device() const override { return Device::CPU; }
  std::unique_lock<std::mutex>* held = nullptr;  // this rank's turn, while it runs

 protected:
  void do_send_recv(const Tensor* send_t, int send_peer, Tensor* recv_t, int recv_peer,
                    const dist::Group& g) override {
    if (send_t) {
      const char* data = static_cast<const char*>(send_t->raw());
      boxes_.queues[{rank_, g.ranks[send_peer]}].emplace_back(data, data + send_t->nbytes());
      boxes_.arrived.notify_all();
    }
    if (recv_t) receive(*recv_t, g.ranks[recv_peer]);
  }
  // The send goes at once; the receive is made only in wait(), so a schedule that read the
  // tensor before waiting would read what Tensor::empty left there.
  std::unique_ptr<dist::CommWork> do_send_recv_async(const Tensor* send_t, int send_peer,
                                                     Tensor* recv_t, int recv_peer,
                                                     const dist::Group& g) override {
    do_send_recv(send_t, send_peer, nullptr, -1, g);
    ++started_;
    return std::make_unique<DeferredRecv>(*this, recv_t ? *recv_t : Tensor(),
                                          recv_t ? g.ranks[recv_peer] : -1, started_);
  }

 public:
  int64_t deferred = 0;  // receives waited for after a later transfer had started

 private:
  class DeferredRecv final : public dist::CommWork {
   public:
    DeferredRecv(ThreadComm& c, Tensor t, int from, int64_t number)
        : c_(c), t_(std::move(t)), from_(from), number_(number) {}
    ~DeferredRecv() override {
      try {
        wait();
      } catch (...) {  // the schedule's own waits report a missing message
      }
    }
    void wait() override {
      if (done_ || from_ < 0) return;
      done_ = true;
      if (c_.started_ > number_) ++c_.deferred;
      c_.receive(t_, from_);
    }

   private:
    ThreadComm& c_;
    Tensor t_;
    int from_;
    int64_t number_;
    bool done_ = false;
  };
  int64_t started_ = 0;

  void receive(Tensor& recv, int from) {
    Tensor* recv_t = &recv;
    {
      auto& queue = boxes_.queues[{from, rank_}];
      if (!boxes_.arrived.wait_for(*held, std::chrono::seconds(30), [&] { return !queue.empty(); }))
        throw dist::CommError("rank " + std::to_string(rank_) + ": no message from rank " +
                              std::to_string(from) + " in 30 s");
      MEGATON_CHECK(queue.front().size() == recv_t->nbytes(), "message of {} bytes for {}",
                    queue.front().size(), recv_t->nbytes());
      std::memcpy(recv_t->raw(), queue.front().data(), queue.front().size());
      queue.pop_front();
    }
  }

 protected:
  void prepare_group(const dist::Group&) override {}
  void do_all_reduce(Tensor&, const dist::Group&, dist::ReduceOp) override { unused(); }
  void do_reduce_scatter(const Tensor&, Tensor&, const dist::Group&) override { unused(); }
  void do_all_gather(const Tensor&, Tensor&, const dist::Group&) override { unused(); }
  std::unique_ptr<dist::CommWork> do_all_reduce_async(Tensor&, const dist::Group&) override {
    unused();
  }
  std::unique_ptr<dist::CommWork> do_reduce_scatter_async(const Tensor&, Tensor&,
                                                          const dist::Group&) override {
    unused();
  }
  std::unique_ptr<dist::CommWork> do_all_gather_async(const Tensor&, Tensor&,
                                                      const dist::Group&) override {
    unused();
  }
  void do_all_to_allv(const Tensor&, std::span<const int64_t>, Tensor&, std::span<const int64_t>,
                      const dist::Group&) override {
    unused();
  }
  void do_broadcast(Tensor&, int, const dist::Group&) override { unused(); }
  void do_barrier(const dist::Group&) override { unused(); }

 private:
  [[noreturn]] static void unused() { throw InternalError("ThreadComm: point to point only"); }
  Mailboxes& boxes_;
  int rank_;
};

GPTConfig schedule_config() {
  GPTConfig c;
  c.num_layers = 4;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 6;
  c.vocab_size = 23;
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = c.attention_dropout = 0.1f;  // masks keyed by micro-batch and layer
  c.init_method_std = 0.3f;
  c.untie_embeddings_and_output_weights = true;
  c.num_experts = 4;  // layers 0 and 2 MoE (routing and token counts per micro-batch)
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 12;
  c.moe_aux_loss_coeff = 1e-2f;
  c.moe_layer_freq = 2;
  c.swiglu = true;
  c.normalization = Normalization::RMSNorm;
  c.finalize();
  return c;
}

// PipelineSchedule::forward_backward on pp ranks (threads) with vpp chunks each, against
// the whole model running the micro-batches one after another: the same losses, aux
// losses and parameter gradients (bit for bit: the same ops in the same order), and each
// chunk runs exactly one forward per micro-batch (no recomputation: the stages keep
// their in-flight micro-batches' activations). Forward only: the same losses, one
// forward each, nothing kept.
// overlap_p2p: the schedule's asynchronous transfers (PipelineSchedule's overlap_p2p_comm),
// whose receives ThreadComm makes only when waited for: equal results mean every tensor is
// waited for before it is read, and in training some receives must be waited for after
// later transfers have started (the overlap).
void check_schedule_matches_one_rank(int64_t pp, int64_t vpp, int64_t m, bool forward_only,
                                     bool overlap_p2p = false) {
  const GPTConfig cfg = schedule_config();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", pp " + std::to_string(pp) + ", vpp " +
               std::to_string(vpp) + ", " + std::to_string(m) + " micro-batches" +
               (forward_only ? ", forward only" : "") + (overlap_p2p ? ", p2p overlap" : ""));
  const int64_t B = 2, S = cfg.seq_length, T = B * S;
  std::vector<Tensor> tokens, labels;
  for (int64_t mb = 0; mb < m; ++mb) {
    tokens.push_back(testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 10 * mb + 1));
    labels.push_back(testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 10 * mb + 2));
  }
  auto context = [&](int64_t mb) { return ForwardContext{!forward_only, seed, 7, mb}; };

  GPTModel whole(cfg, seed);
  double want_loss = 0, want_aux = 0;
  for (int64_t mb = 0; mb < m; ++mb) {
    MicroBatchLoss loss = whole.forward(tokens[mb], labels[mb], context(mb));
    want_loss += ops::sum(loss.losses);
    want_aux += loss.aux_loss();
    if (forward_only) continue;
    Tensor dlosses = Tensor::empty({T});
    dlosses.fill(float(1.0 / (double(T) * double(m))));
    whole.backward(dlosses, 1.0f / float(m));
  }

  const std::vector<int64_t> stages(pp, cfg.num_layers / pp);
  Mailboxes boxes;
  std::vector<std::unique_ptr<GPTModel>> models;  // rank-major, vpp per rank
  std::vector<int> forwards(pp * vpp, 0);
  for (int64_t r = 0; r < pp; ++r)
    for (int64_t c = 0; c < vpp; ++c) {
      const ChunkLayers layers = chunk_layers(stages, vpp, r, c);
      models.push_back(
          std::make_unique<GPTModel>(cfg, seed, ModelParallel{}, 1, 1,
                                     PipelineChunk{layers.first_layer, layers.num_layers,
                                                   r == 0 && c == 0, r == pp - 1 && c == vpp - 1}));
      GPTModel& model = *models.back();
      const Param* first = model.params().front();
      int& count = forwards[r * vpp + c];
      model.set_param_hooks({[first, &count](std::span<Param* const> params) {
                               if (params.front() == first) ++count;  // a forward starts
                             },
                             nullptr});
    }
  std::vector<PipelineLosses> got(pp);
  std::vector<std::exception_ptr> failed(pp);
  std::vector<int64_t> deferred(pp, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < int(pp); ++r)
    ranks.emplace_back([&, r] {
      std::unique_lock<std::mutex> turn(boxes.turn);
      try {
        dist::ParallelSizes sizes;
        sizes.pp = pp;
        const dist::Grid grid(sizes, pp, r);
        ThreadComm comm(boxes, r);
        comm.held = &turn;
        std::vector<GPTModel*> chunks;
        for (int64_t c = 0; c < vpp; ++c) chunks.push_back(models[r * vpp + c].get());
        PipelineSchedule schedule(chunks, grid, comm, overlap_p2p);
        PipelineMicroBatches mbs;
        mbs.count = m;
        mbs.batch = B;
        mbs.seq = S;
        mbs.load = [&](int64_t mb, Tensor& t, Tensor& l) {
          t = tokens[mb];
          l = labels[mb];
        };
        mbs.context = context;
        got[r] = schedule.forward_backward(mbs, forward_only);
        deferred[r] = comm.deferred;
      } catch (...) {
        failed[r] = std::current_exception();
      }
    });
  for (std::thread& t : ranks) t.join();
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
  int64_t deferred_total = 0;
  for (int64_t d : deferred) deferred_total += d;
  // (A short forward-only step may read every input at the tick after it arrives.)
  if (overlap_p2p && !forward_only) EXPECT_GT(deferred_total, 0) << "no receive left running";
  if (!overlap_p2p) EXPECT_EQ(deferred_total, 0);

  for (int64_t i = 0; i < pp * vpp; ++i) {
    EXPECT_EQ(forwards[i], m) << "rank " << i / vpp << " chunk " << i % vpp;
    EXPECT_FALSE(models[i]->holds_activations());
  }
  EXPECT_EQ(got[pp - 1].loss_sum, want_loss);
  EXPECT_EQ(got[pp - 1].num_tokens, double(T * m));
  double aux = 0;
  for (const PipelineLosses& l : got) aux += l.aux_loss_sum();
  // Summed in another order, in fp32 (the losses stay on the device until read).
  EXPECT_NEAR(aux, want_aux, 1e-6 * std::fabs(want_aux));
  // The load-balancing losses exist in training forwards only (Megatron's router).
  if (forward_only)
    EXPECT_EQ(want_aux, 0);
  else
    EXPECT_GT(want_aux, 0);
  if (forward_only) return;
  std::map<std::string, const Param*> reference;
  for (const Param* p : whole.params()) reference[p->name] = p;
  size_t compared = 0;
  for (auto& model : models)
    for (const Param* p : model->params()) {
      ASSERT_TRUE(reference.count(p->name)) << p->name;
      EXPECT_TRUE(testing::allclose(p->main_grad, reference[p->name]->main_grad, 0, 0)) << p->name;
      ++compared;
    }
  EXPECT_EQ(compared, reference.size());
}

TEST(PipelineSchedule, OneForwardPerMicroBatchAndOneRankGradients) {
  check_schedule_matches_one_rank(2, 1, 4, false);  // 1F1B: rank 0 keeps 2 in flight
  check_schedule_matches_one_rank(4, 1, 5, false);  // rank 0 keeps 4
  check_schedule_matches_one_rank(2, 2, 4, false);  // interleaved
  check_schedule_matches_one_rank(2, 1, 3, true);   // evaluation
  check_schedule_matches_one_rank(2, 2, 2, true);
}

TEST(PipelineSchedule, OverlappedTransfersAreWaitedForBeforeUse) {
  check_schedule_matches_one_rank(2, 1, 4, false, true);
  check_schedule_matches_one_rank(4, 1, 5, false, true);
  check_schedule_matches_one_rank(2, 2, 4, false, true);
  check_schedule_matches_one_rank(2, 2, 6, false, true);
  check_schedule_matches_one_rank(2, 2, 2, true, true);
}

}  // namespace
}  // namespace megaton
