// DistributedDataParallel: buckets start their reduction as soon as their gradients are
// final (overlap), the rest at finish; results are sums over the ranks; all-gathers run in the
// order the forward reads the buckets and are waited for bucket by bucket. A recording
// Comm stands in for the other data-parallel rank, which holds the same gradients.
#include <gtest/gtest.h>

#include <climits>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "optim/distributed_data_parallel.h"

namespace megaton::optim {
namespace {

// Rank 0 of a data-parallel group of two, in one process: every collective behaves as if
// the other rank passed the same tensors, and is logged.
class RecordingComm final : public dist::Comm {
 public:
  std::vector<std::string> log;
  Device device() const override { return Device::CPU; }

 protected:
  class Work final : public dist::CommWork {
   public:
    Work(RecordingComm& c, std::string name) : c_(c), name_(std::move(name)) {}
    void wait() override {
      if (!waited_) c_.log.push_back("wait " + name_);
      waited_ = true;
    }

   private:
    RecordingComm& c_;
    std::string name_;
    bool waited_ = false;
  };
  // "<name>:<element offset>" of t in one of `buffers`, else its element offset in `base`,
  // or (FSDP's per-bucket storage) "n=<numel>".
  std::string where(const Tensor& t) const {
    for (const auto& [name, whole] : buffers) {
      const int64_t at = static_cast<const char*>(t.raw()) - static_cast<const char*>(whole.raw());
      const int64_t size = dtype_size(whole.dtype());
      if (at >= 0 && at < whole.numel() * size) return name + ":" + std::to_string(at / size);
    }
    const int64_t bytes = static_cast<const char*>(t.raw()) - base;
    if (!base || bytes < 0 || bytes >= base_bytes) return "n=" + std::to_string(t.numel());
    return std::to_string(bytes / int64_t(dtype_size(t.dtype())));
  }

 public:
  const char* base = nullptr;  // the buffer the offsets in the log are counted from
  int64_t base_bytes = INT64_MAX;
  std::vector<std::pair<std::string, Tensor>> buffers;  // named buffers, tried first

 protected:
  void prepare_group(const dist::Group&) override {}
  void do_all_reduce(Tensor&, const dist::Group&, dist::ReduceOp) override { FAIL(); }
  void do_reduce_scatter(const Tensor&, Tensor&, const dist::Group&) override { FAIL(); }
  void do_all_gather(const Tensor&, Tensor&, const dist::Group&) override { FAIL(); }
  std::unique_ptr<dist::CommWork> do_all_reduce_async(Tensor& t, const dist::Group&) override {
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] *= 2;  // two equal ranks
    log.push_back("all_reduce " + where(t));
    return std::make_unique<Work>(*this, "all_reduce " + where(t));
  }
  std::unique_ptr<dist::CommWork> do_reduce_scatter_async(const Tensor& in, Tensor& out,
                                                          const dist::Group&) override {
    // Rank 0's shard is the first chunk (in place for the distributed optimizer).
    for (int64_t i = 0; i < out.numel(); ++i) out.f32()[i] = 2 * in.f32()[i];
    log.push_back("reduce_scatter " + where(in));
    return std::make_unique<Work>(*this, "reduce_scatter " + where(in));
  }
  std::unique_ptr<dist::CommWork> do_all_gather_async(const Tensor& in, Tensor& out,
                                                      const dist::Group&) override {
    if (in.raw() != out.raw())  // FSDP: rank 0's shard first, the other rank's alike
      for (int64_t i = 0; i < out.numel(); ++i) out.f32()[i] = in.f32()[i % in.numel()];
    log.push_back("all_gather " + where(out));
    return std::make_unique<Work>(*this, "all_gather " + where(out));
  }
  void do_all_to_allv(const Tensor&, std::span<const int64_t>, Tensor&, std::span<const int64_t>,
                      const dist::Group&) override {
    FAIL();
  }
  void do_send_recv(const Tensor*, int, Tensor*, int, const dist::Group&) override { FAIL(); }
  void do_broadcast(Tensor&, int, const dist::Group&) override { FAIL(); }
  void do_barrier(const dist::Group&) override { FAIL(); }
};

Param make(const std::string& name, int64_t n, float value) {
  Param p;
  p.name = name;
  p.weight = Tensor::empty({n});
  p.weight.fill(value);
  p.main_param = p.weight;
  return p;
}

struct Fixture {
  // Forward order a, b, c; bucket size 100 puts each in its own bucket, in reverse:
  // bucket 0 = c (backward finishes it first) at [0, 128), 1 = b at [128, 384) (192
  // elements padded to a multiple of 64 x 2 shards), 2 = a at [384, 512).
  Param a = make("a", 100, 1), b = make("b", 130, 2), c = make("c", 70, 3);
  dist::Grid grid{[] {
                    dist::ParallelSizes s;
                    return s;
                  }(),
                  2, 0};
  RecordingComm comm;
  ParamAndGradBuffer buffer{{&a, &b, &c}, 2, false, 100};
  Fixture() { comm.base = static_cast<const char*>(buffer.grads().raw()); }
};

TEST(DistributedDataParallel, BucketsReverseTheForwardOrder) {
  Fixture f;
  ASSERT_EQ(f.buffer.buckets().size(), 3u);
  EXPECT_EQ(f.buffer.buckets()[0].params, std::vector<Param*>{&f.c});
  EXPECT_EQ(f.buffer.buckets()[2].params, std::vector<Param*>{&f.a});
  for (const BufferBucket& bucket : f.buffer.buckets()) EXPECT_EQ(bucket.numel() % 128, 0);
  EXPECT_EQ(f.buffer.offset(2), 0);  // c first
  EXPECT_EQ(f.buffer.bucket_of(&f.b), 1);
}

TEST(DistributedDataParallel, OverlapStartsBucketsWhenTheirGradientsAreFinal) {
  Fixture f;
  DataParallelConfig config;
  config.use_distributed_optimizer = true;
  config.overlap_grad_reduce = true;
  config.num_micro_batches = 2;
  DistributedDataParallel ddp({&f.buffer}, f.grid, f.comm, config);
  for (Param* p : {&f.a, &f.b, &f.c}) p->main_grad.fill(0.5f);
  ddp.start_grad_sync_step();
  Param* c[] = {&f.c};
  Param* ab[] = {&f.b, &f.a};
  ddp.grads_ready(c);  // first micro-batch: not final yet
  EXPECT_TRUE(f.comm.log.empty());
  ddp.grads_ready(ab);
  ddp.grads_ready(c);  // second micro-batch: bucket 0 is final
  ASSERT_EQ(f.comm.log.size(), 1u);
  EXPECT_EQ(f.comm.log[0], "reduce_scatter 0");
  ddp.finish_grad_sync();  // b and a started now, then everything waited for
  const std::vector<std::string> want = {"reduce_scatter 0",        "reduce_scatter 128",
                                         "reduce_scatter 384",      "wait reduce_scatter 0",
                                         "wait reduce_scatter 128", "wait reduce_scatter 384"};
  EXPECT_EQ(f.comm.log, want);
  // This rank's shards hold the sum over the two ranks (the optimizer takes the mean).
  EXPECT_FLOAT_EQ(f.c.main_grad.f32()[0], 1.0f);
  EXPECT_FLOAT_EQ(f.c.main_grad.f32()[63], 1.0f);
  // A third report of a in the next step's two micro-batches is a bug in the caller.
  ddp.start_grad_sync_step();
  Param* a[] = {&f.a};
  ddp.grads_ready(a);
  ddp.grads_ready(a);
  EXPECT_THROW(ddp.grads_ready(a), InternalError);
}

TEST(DistributedDataParallel, WithoutOverlapEverythingStartsAtFinish) {
  Fixture f;
  DataParallelConfig config;  // all-reduce, no overlap
  DistributedDataParallel ddp({&f.buffer}, f.grid, f.comm, config);
  for (Param* p : {&f.a, &f.b, &f.c}) p->main_grad.fill(0.25f);
  ddp.start_grad_sync_step();
  Param* all[] = {&f.c, &f.b, &f.a};
  ddp.grads_ready(all);
  EXPECT_TRUE(f.comm.log.empty());
  ddp.finish_grad_sync();
  ASSERT_EQ(f.comm.log.size(), 6u);
  EXPECT_EQ(f.comm.log[0], "all_reduce 0");
  for (Param* p : {&f.a, &f.b, &f.c})
    for (int64_t i = 0; i < p->main_grad.numel(); ++i) ASSERT_FLOAT_EQ(p->main_grad.f32()[i], 0.5f);
}

TEST(DistributedDataParallel, ParamGatherRunsInForwardOrderAndIsWaitedPerBucket) {
  Fixture f;
  f.comm.base = static_cast<const char*>(f.buffer.weights().raw());
  DataParallelConfig config;
  config.use_distributed_optimizer = true;
  config.overlap_grad_reduce = true;
  config.overlap_param_gather = true;
  DistributedDataParallel ddp({&f.buffer}, f.grid, f.comm, config);
  ddp.start_param_sync();
  const std::vector<std::string> started = {"all_gather 384", "all_gather 128", "all_gather 0"};
  EXPECT_EQ(f.comm.log, started);
  Param* b[] = {&f.b};
  ddp.wait_param_sync(b);
  ASSERT_EQ(f.comm.log.size(), 4u);
  EXPECT_EQ(f.comm.log[3], "wait all_gather 128");
  ddp.wait_param_sync(b);  // already waited for
  EXPECT_EQ(f.comm.log.size(), 4u);
  ddp.finish_param_sync();
  EXPECT_EQ(f.comm.log.size(), 6u);
}

// The layer-wise distributed optimizer: a flat buffer (embedding e, norms n1 and n2 of
// layers 1 and 2, tail t) and a WholeParams one (two matrices per layer). The all-gathers
// start in the order the forward first reads the buckets, not buffer after buffer, and each
// is waited for at the before_forward of the first unit that reads it, not earlier.
TEST(DistributedDataParallel, LayerWiseBucketsAreWaitedForAtFirstUse) {
  Param e = make("e", 100, 1), n1 = make("n1", 100, 2), n2 = make("n2", 100, 3),
        t = make("t", 100, 4);
  auto matrix = [](const std::string& name, float value) {
    Param p;
    p.name = name;
    p.weight = Tensor::empty({16, 16});
    p.weight.fill(value);
    p.main_param = p.weight;
    return p;
  };
  Param m1a = matrix("m1a", 5), m1b = matrix("m1b", 6), m2a = matrix("m2a", 7),
        m2b = matrix("m2b", 8);
  // Flat: a bucket each, in reverse: t [0, 128), n2 [128, 256), n1 [256, 384), e [384, 512).
  ParamAndGradBuffer flat({&e, &n1, &n2, &t}, 2, false, 100);
  // Whole params: a bucket per layer (two matrices fill two shards), layer 2's first.
  ParamAndGradBuffer muon({&m1a, &m1b, &m2a, &m2b}, 2, false, 512, {}, DType::F32, {}, {},
                          BufferLayout::WholeParams);
  ASSERT_EQ(muon.buckets().size(), 2u);
  ASSERT_EQ(muon.bucket_of(&m2a), 0);
  ASSERT_EQ(muon.buckets()[1].begin, 512);
  dist::Grid grid{dist::ParallelSizes{}, 2, 0};
  RecordingComm comm;
  comm.buffers = {{"flat", flat.weights()}, {"muon", muon.weights()}};
  DataParallelConfig config;
  config.use_distributed_optimizer = config.overlap_grad_reduce = true;
  config.overlap_param_gather = true;
  DistributedDataParallel ddp({&flat, &muon}, grid, comm, config);
  Param* u0[] = {&e};
  Param* u1[] = {&n1, &m1a, &m1b};
  Param* u2[] = {&m2a, &n2, &m2b};
  Param* u3[] = {&t};
  ddp.set_units({{u0, u1, u2, u3}});
  ddp.start_param_sync();
  std::vector<std::string> want = {"all_gather flat:384", "all_gather flat:256",
                                   "all_gather muon:512", "all_gather muon:0",
                                   "all_gather flat:128", "all_gather flat:0"};
  EXPECT_EQ(comm.log, want);
  const std::vector<std::vector<std::string>> waits = {
      {"wait all_gather flat:384"},
      {"wait all_gather flat:256", "wait all_gather muon:512"},
      {"wait all_gather muon:0", "wait all_gather flat:128"},
      {"wait all_gather flat:0"}};
  const std::span<Param* const> units[] = {u0, u1, u2, u3};
  for (size_t u = 0; u < 4; ++u) {
    ddp.before_forward(units[u]);
    want.insert(want.end(), waits[u].begin(), waits[u].end());
    EXPECT_EQ(comm.log, want) << "after unit " << u;
  }
  ddp.finish_param_sync();  // nothing left
  EXPECT_EQ(comm.log, want);
}

// FSDP (optim_grads_params): per-bucket storage, released between uses.
struct FsdpFixture {
  Param a = make("a", 100, 1), b = make("b", 130, 2), c = make("c", 70, 3);
  dist::Grid grid{dist::ParallelSizes{}, 2, 0};
  RecordingComm comm;
  ParamAndGradBuffer buffer{
      {&a, &b, &c}, 2,
      false,        0,
      {},           DType::F32,
      {0, 1, 2},    BufferSharding{ShardingStrategy::OptimGradsParams, 0, DType::F32}};
  Param* units[3] = {&a, &b, &c};
};

TEST(DistributedDataParallel, FsdpBuffersKeepTheirShardAndReleaseTheRest) {
  FsdpFixture f;
  ASSERT_EQ(f.buffer.buckets().size(), 3u);  // one per unit, without a bucket size
  const size_t ba = size_t(f.buffer.bucket_of(&f.a));
  EXPECT_TRUE(f.buffer.weights_live(ba));
  EXPECT_FALSE(f.buffer.grads_live(ba));  // allocated for a backward only
  EXPECT_THROW(f.buffer.weights(), InternalError);
  // The own shard of a's bucket (128 elements, 2 shards): a's first 64 elements.
  const Tensor shard = f.buffer.own_weight_shard(ba);
  ASSERT_EQ(shard.numel(), 64);
  EXPECT_FLOAT_EQ(shard.f32()[63], 1.0f);
  f.buffer.release_weights(ba);
  EXPECT_FALSE(f.buffer.weights_live(ba));
  EXPECT_THROW(f.a.weight.raw(), InternalError);                  // read outside a gather: refused
  EXPECT_FLOAT_EQ(f.buffer.own_weight_shard(ba).f32()[0], 1.0f);  // the shard stays
  f.buffer.restore_grads(ba);
  EXPECT_FLOAT_EQ(f.a.main_grad.f32()[99], 0.0f);  // zeroed
}

TEST(DistributedDataParallel, FsdpGathersByUnitPrefetchesOneAndReducesEachMicroBatch) {
  FsdpFixture f;
  DataParallelConfig config;
  config.use_distributed_optimizer = config.overlap_grad_reduce = config.use_megatron_fsdp = true;
  config.num_micro_batches = 2;
  DistributedDataParallel ddp({&f.buffer}, f.grid, f.comm, config);
  ddp.set_units({{std::span<Param* const>(&f.units[0], 1), std::span<Param* const>(&f.units[1], 1),
                  std::span<Param* const>(&f.units[2], 1)}});
  ddp.release_all_weights();
  for (size_t b = 0; b < 3; ++b) EXPECT_FALSE(f.buffer.weights_live(b));
  std::span<Param*const> a(&f.units[0], 1), c(&f.units[2], 1);
  ddp.before_forward(a);  // a gathered and waited for, b prefetched
  const std::vector<std::string> fwd = {"all_gather n=128", "wait all_gather n=128",
                                        "all_gather n=256"};
  EXPECT_EQ(f.comm.log, fwd);
  EXPECT_FLOAT_EQ(f.a.weight.f32()[99], 1.0f);
  ddp.after_forward(a);
  EXPECT_FALSE(f.buffer.weights_live(size_t(f.buffer.bucket_of(&f.a))));
  ddp.start_grad_sync_step();
  for (int mb = 0; mb < 2; ++mb) {
    ddp.before_backward(c);  // c's gradients allocated zeroed (the last one's added first)
    EXPECT_FLOAT_EQ(f.c.main_grad.f32()[0], 0.0f);
    f.c.main_grad.fill(0.5f);
    ddp.grads_ready(c);  // reduce-scattered now; c's weights released
    EXPECT_FALSE(f.buffer.weights_live(size_t(f.buffer.bucket_of(&f.c))));
  }
  Param* ab[] = {&f.b, &f.a};
  for (int mb = 0; mb < 2; ++mb) {
    ddp.before_backward(std::span<Param* const>(&f.units[1], 1));
    ddp.before_backward(a);
    ddp.grads_ready(ab);
  }
  ddp.finish_grad_sync();
  // c's own shard: each micro-batch's sum over the two ranks (2 x 0.5), added twice.
  const Tensor shard = f.buffer.own_grad_shard(size_t(f.buffer.bucket_of(&f.c)));
  EXPECT_FLOAT_EQ(shard.f32()[0], 2.0f);
  EXPECT_FLOAT_EQ(shard.f32()[63], 2.0f);
  for (size_t b = 0; b < 3; ++b) EXPECT_FALSE(f.buffer.grads_live(b));
}

// --fsdp-double-buffer: four layer-sized units (and one other) on two shards. Buckets of
// the common size lend their memory from slot b % 2 while it is free; a bucket whose slot
// is taken, or of another size, allocates as without the flag; a release frees the slot.
TEST(DistributedDataParallel, FsdpDoubleBufferAlternatesTwoSlots) {
  Param p[5] = {make("p0", 100, 1), make("p1", 100, 2), make("p2", 100, 3), make("p3", 100, 4),
                make("big", 300, 5)};
  BufferSharding sharding{ShardingStrategy::OptimGradsParams, 0, DType::F32};
  sharding.double_buffer = true;
  ParamAndGradBuffer buffer({&p[0], &p[1], &p[2], &p[3], &p[4]}, 2, false, 0, {}, DType::F32,
                            {0, 1, 2, 3, 4}, sharding);
  ASSERT_EQ(buffer.buckets().size(), 5u);
  EXPECT_EQ(buffer.slot_numel(), 128);  // four buckets of 128 (100 rounded up), one of 384
  auto bucket = [&](int i) { return size_t(buffer.bucket_of(&p[i])); };
  for (size_t b = 0; b < 5; ++b) buffer.release_weights(b);
  const size_t b0 = bucket(0), b2 = bucket(2), big = bucket(4);
  ASSERT_EQ(b0 % 2, b2 % 2);  // reverse order: p0..p3 in buckets 4..1, big in bucket 0
  buffer.restore_weights(b0);
  EXPECT_EQ(buffer.weight_slot_user(int(b0 % 2)), int(b0));
  const void* slot = buffer.bucket_weights(b0).raw();
  buffer.restore_weights(b2);  // its slot is taken: allocated
  EXPECT_EQ(buffer.weight_slot_user(int(b2 % 2)), int(b0));
  EXPECT_NE(buffer.bucket_weights(b2).raw(), slot);
  buffer.release_weights(b0);
  EXPECT_EQ(buffer.weight_slot_user(int(b0 % 2)), -1);
  EXPECT_THROW(p[0].weight.raw(), InternalError);  // released: no data
  buffer.release_weights(b2);
  buffer.restore_weights(b2);  // now the slot's
  EXPECT_EQ(buffer.bucket_weights(b2).raw(), slot);
  EXPECT_EQ(buffer.weight_slot_user(int(b2 % 2)), int(b2));
  buffer.restore_weights(big);  // another size: allocated, no slot
  EXPECT_NE(buffer.weight_slot_user(int(big % 2)), int(big));
  // Gradients likewise, zeroed when restored from a slot.
  buffer.restore_grads(bucket(1));
  EXPECT_EQ(buffer.grad_slot_user(int(bucket(1) % 2)), int(bucket(1)));
  EXPECT_FLOAT_EQ(p[1].main_grad.f32()[99], 0.0f);
  p[1].main_grad.fill(3.0f);
  buffer.release_grads(bucket(1));
  buffer.restore_grads(bucket(3));  // the same slot, zeroed again
  EXPECT_EQ(buffer.grad_slot_user(int(bucket(3) % 2)), int(bucket(3)));
  EXPECT_FLOAT_EQ(p[3].main_grad.f32()[0], 0.0f);
}

}  // namespace
}  // namespace megaton::optim
