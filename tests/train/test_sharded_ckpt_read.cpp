// Reading a rank's tensor-parallel slice, and flat ranges of it, from a sharded checkpoint
// (train/sharded_ckpt.h): read_tensor_parallel_slice equals tensor_parallel_slice of the
// whole tensor, and read_tensor_parallel_range equals every flat range of that slice (the
// distributed optimizer's shards) while returning only the range's bytes; across the two
// boxes of a SwiGLU fc1 slice and pieces saved in another split.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "ckpt/sharded.h"
#include "dist/grid.h"
#include "train/sharded_ckpt.h"
#include "train/tensor_parallel_ckpt.h"

namespace megaton {
namespace {

namespace fs = std::filesystem;

// A tensor of `shape` whose element i is i + 0.5 (F32).
Tensor counting(const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = float(i) + 0.5f;
  return t;
}

// Writes `whole` as tensor `name` of a one-file sharded checkpoint in three flat pieces
// (cut at 2/7 and 5/7 of its elements: not where any tensor-parallel slice starts).
std::string save_in_three_pieces(const fs::path& dir, const std::string& name,
                                 const Tensor& whole) {
  const std::vector<int64_t> shape(whole.shape().begin(), whole.shape().end());
  const int64_t n = whole.numel();
  const int64_t cuts[4] = {0, 2 * n / 7, 5 * n / 7, n};
  std::vector<ckpt::ShardedPiece> pieces;
  Tensor flat = whole.view({n});
  for (int i = 0; i < 3; ++i) {
    ckpt::ShardedPiece p;
    p.name = name;
    p.global_shape = shape;
    p.offsets = std::vector<int64_t>(shape.size(), 0);
    p.box_shape = shape;
    p.flat_begin = cuts[i];
    p.flat_end = cuts[i + 1];
    p.data = flat.rows(cuts[i], cuts[i + 1] - cuts[i]).clone();
    pieces.push_back(std::move(p));
  }
  const std::string save_dir = (dir / name).string();
  const std::string tmp = ckpt::begin_sharded_save(save_dir, 1);
  std::vector<ckpt::RankShardRecord> records{ckpt::write_rank_shard(tmp, 0, pieces)};
  nlohmann::json meta;
  meta["iteration"] = 1;
  ckpt::commit_sharded_checkpoint(save_dir, 1, tmp, records, meta.dump());
  return save_dir + "/" + ckpt::iteration_dir_name(1);
}

class ShardedSliceRead : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("megaton-sharded-read-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // For each TP rank of 2 (or 3): the slice and every flat range of it read from the
  // checkpoint equal the same cut of the whole tensor.
  void check_every_range(Param p, int tp) {
    const Tensor whole = counting(p.full_shape);
    const std::string iter_dir = save_in_three_pieces(dir_, p.name, whole);
    for (int r = 0; r < tp; ++r) {
      dist::ParallelSizes sizes;
      sizes.tp = tp;
      dist::Grid grid(sizes, tp, r);
      ModelParallel mp;
      mp.grid = &grid;
      Shape slice_shape = p.full_shape;
      slice_shape[size_t(p.tp_split_dim)] /= tp;
      p.weight = Tensor::empty(slice_shape);
      const Tensor want = tensor_parallel_slice(whole, p, mp);
      ckpt::ShardedCheckpointReader reader(iter_dir);
      const Tensor slice = read_tensor_parallel_slice(reader, p.name, p, mp, 0, 0);
      ASSERT_EQ(slice.shape(), want.shape()) << p.name << " tp rank " << r;
      const int64_t n = want.numel();
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(slice.f32()[i], want.f32()[i]) << p.name << " tp rank " << r << " element " << i;
      for (int64_t offset = 0; offset <= n; ++offset)
        for (int64_t numel = 0; offset + numel <= n; ++numel) {
          const int64_t before = reader.bytes_read();
          const Tensor range =
              read_tensor_parallel_range(reader, p.name, p, mp, 0, 0, offset, numel);
          ASSERT_EQ(range.numel(), numel);
          EXPECT_EQ(reader.bytes_read() - before, numel * 4)
              << p.name << " [" << offset << ", " << offset + numel << ")";
          for (int64_t i = 0; i < numel; ++i)
            ASSERT_EQ(range.f32()[i], want.f32()[offset + i])
                << p.name << " tp rank " << r << " range [" << offset << ", " << offset + numel
                << ") element " << i;
        }
    }
  }

  fs::path dir_;
};

TEST_F(ShardedSliceRead, SwigluFc1RangesCrossTheGateAndUpBoxes) {
  Param p;
  p.name = "fc1";
  p.full_shape = {12, 5};  // [gate 6; up 6] x 5: TP rank r holds gate rows and up rows
  p.tp_split_dim = 0;
  p.tp_blocks = swiglu_blocks(12);
  check_every_range(p, 2);
  p.name = "fc1_tp3";
  check_every_range(p, 3);
}

TEST_F(ShardedSliceRead, MambaInProjRangesCrossBlocksOfDifferentSizes) {
  Param p;
  p.name = "in_proj";
  p.full_shape = {20, 3};  // [z 6; x 6; B 2; C 2; dt 4]: TP rank r holds its rows of each
  p.tp_split_dim = 0;
  p.tp_blocks = {6, 6, 2, 2, 4};
  check_every_range(p, 2);
}

TEST_F(ShardedSliceRead, ColumnSplitRangesCrossRows) {
  Param p;
  p.name = "proj";
  p.full_shape = {5, 8};  // row-parallel: each TP rank holds 4 columns of every row
  p.tp_split_dim = 1;
  check_every_range(p, 2);
}

}  // namespace
}  // namespace megaton
