// The sharded checkpoint (ckpt/sharded.h): pieces written by several "ranks" in one layout
// read back bit-exactly in another; the commit refuses pieces that do not tile a tensor;
// damaged, truncated or missing files fail the reads that need them, naming the file; a save
// that never committed leaves the previous checkpoint named by the tracker.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "ckpt/sharded.h"
#include "ckpt/sharded_layout.h"

namespace megaton::ckpt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr uint64_t kSeed = 20250611;

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* bytes = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = uint8_t(rng() % 255 + 1);  // never zero
  return t;
}

// Elements [flat_begin, flat_end) of box [offsets, offsets + box) of `global`, one element at
// a time (the reference the library's run copies are checked against).
Tensor reference_piece(const Tensor& global, const Shape& offsets, const Shape& box,
                       int64_t flat_begin, int64_t flat_end) {
  const size_t es = dtype_size(global.dtype());
  const Shape& g = global.shape();
  Tensor out = Tensor::empty({flat_end - flat_begin}, global.dtype());
  for (int64_t i = flat_begin; i < flat_end; ++i) {
    std::vector<int64_t> c(g.size());
    int64_t rem = i, index = 0;
    for (size_t d = g.size(); d-- > 0;) {
      c[d] = rem % box[d];
      rem /= box[d];
    }
    for (size_t d = 0; d < g.size(); ++d) index = index * g[d] + offsets[d] + c[d];
    std::memcpy(static_cast<char*>(out.raw()) + (i - flat_begin) * es,
                static_cast<const char*>(global.raw()) + index * es, es);
  }
  return out;
}

int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const size_t es = dtype_size(got.dtype());
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(got.raw()) + i * es,
                    static_cast<const char*>(want.raw()) + i * es, es) != 0) {
      ADD_FAILURE() << what << ": element " << i << " of " << got.numel() << " differs";
      return;
    }
}

ShardedPiece make_piece(const std::string& name, const Tensor& global, const Shape& offsets,
                        const Shape& box, int64_t flat_begin = 0, int64_t flat_end = -1) {
  const int64_t end = flat_end < 0 ? numel_of(box) : flat_end;
  return {name,
          global.shape(),
          offsets,
          box,
          flat_begin,
          flat_end,
          reference_piece(global, offsets, box, flat_begin, end)};
}

// A TP2 x DP2 distributed optimizer's layout: dim `split_dim` halved between the tensor-
// parallel ranks, each half's elements split unequally (3/7 : 4/7) between its two
// data-parallel ranks. Rank = tp * 2 + dp.
void add_tp2_dp2(std::vector<std::vector<ShardedPiece>>& ranks, const std::string& name,
                 const Tensor& global, int split_dim) {
  const Shape& g = global.shape();
  for (int tp = 0; tp < 2; ++tp) {
    Shape offsets(g.size(), 0), box = g;
    box[split_dim] = g[split_dim] / 2 + (tp == 0 ? g[split_dim] % 2 : 0);
    offsets[split_dim] = tp == 0 ? 0 : g[split_dim] - box[split_dim];
    const int64_t n = numel_of(box), split = n * 3 / 7;
    ranks[tp * 2].push_back(make_piece(name, global, offsets, box, 0, split));
    ranks[tp * 2 + 1].push_back(make_piece(name, global, offsets, box, split, n));
  }
}

class ShardedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        (fs::temp_directory_path() / fmt::format("megaton_sharded_{}_{}", getpid(), info->name()))
            .string();
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The four ranks' pieces of tensors of several dtypes and layouts (sources_ holds them).
  std::vector<std::vector<ShardedPiece>> build_pieces(std::mt19937_64& rng) {
    std::vector<std::vector<ShardedPiece>> ranks(4);
    sources_["w2d"] = random_tensor({12, 10}, DType::F32, rng);
    add_tp2_dp2(ranks, "w2d", sources_["w2d"], 0);
    sources_["w3d"] = random_tensor({4, 6, 5}, DType::BF16, rng);
    add_tp2_dp2(ranks, "w3d", sources_["w3d"], 1);
    sources_["ids"] = random_tensor({7, 9}, DType::I32, rng);  // 7 rows: halves of 4 and 3
    add_tp2_dp2(ranks, "ids", sources_["ids"], 0);
    sources_["scale"] = random_tensor({1}, DType::F32, rng);
    ranks[2].push_back(make_piece("scale", sources_["scale"], {0}, {1}));
    sources_["bias"] = random_tensor({10}, DType::BF16, rng);  // whole, by one rank
    ranks[3].push_back(make_piece("bias", sources_["bias"], {0}, {10}));
    sources_["step"] = random_tensor({}, DType::I64, rng);  // a scalar
    ranks[1].push_back(make_piece("step", sources_["step"], {}, {}));
    // A data-parallel shard that is empty (a rank past the tensor's end).
    sources_["norm"] = random_tensor({5}, DType::F32, rng);
    ranks[0].push_back(make_piece("norm", sources_["norm"], {0}, {5}, 0, 5));
    ranks[1].push_back(make_piece("norm", sources_["norm"], {0}, {5}, 5, 5));
    return ranks;
  }

  // Each rank writes its file; the records go through JSON, as gathered to rank 0.
  std::vector<RankShardRecord> write_ranks(const std::string& tmp,
                                           const std::vector<std::vector<ShardedPiece>>& ranks) {
    std::vector<RankShardRecord> records;
    for (size_t r = 0; r < ranks.size(); ++r)
      records.push_back(
          RankShardRecord::from_json(write_rank_shard(tmp, int(r), ranks[r]).to_json()));
    return records;
  }

  std::string save(int64_t iteration, const std::vector<std::vector<ShardedPiece>>& ranks,
                   const SaveOptions& options = {}) {
    const std::string tmp = begin_sharded_save(dir_, iteration);
    return commit_sharded_checkpoint(dir_, iteration, tmp, write_ranks(tmp, ranks),
                                     run_metadata(iteration), options);
  }

  static std::string run_metadata(int64_t iteration) {
    return fmt::format("{{\"iteration\": {}, \"consumed_samples\": {}}}", iteration, iteration * 8);
  }

  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string dir_;
  std::map<std::string, Tensor> sources_;
};

TEST_F(ShardedCheckpoint, ReadsBackAnyLayoutBitExactly) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  save(100, build_pieces(rng));
  ShardedCheckpointReader reader = open_sharded_checkpoint(dir_);
  ASSERT_EQ(reader.tensors().size(), sources_.size());
  for (const auto& [name, source] : sources_) {
    SCOPED_TRACE(name);
    EXPECT_EQ(reader.tensors().at(name).dtype, source.dtype());
    EXPECT_EQ(reader.tensors().at(name).global_shape, source.shape());
    Tensor whole = reader.read(name);
    EXPECT_EQ(whole.shape(), source.shape());
    expect_same_bytes(whole, source, "whole");
  }
  // Another layout: w2d split along dim 1 by 4 (widths 3, 3, 2, 2), as boxes and as odd
  // flat ranges of those boxes.
  const Tensor& w2d = sources_["w2d"];
  int64_t col = 0;
  for (int64_t width : {3, 3, 2, 2}) {
    const Shape offsets{0, col}, box{12, width};
    Tensor got = reader.read_box("w2d", offsets, box);
    EXPECT_EQ(got.shape(), box);
    expect_same_bytes(got, reference_piece(w2d, offsets, box, 0, 12 * width), "w2d column box");
    const int64_t n = 12 * width;
    for (auto [b, e] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 7}, {7, n - 5}, {n - 5, n}, {3, 4}})
      expect_same_bytes(reader.read_flat("w2d", offsets, box, b, e),
                        reference_piece(w2d, offsets, box, b, e), "w2d column flat range");
    col += width;
  }
  // Random boxes and flat ranges of every tensor: the general intersection.
  for (const auto& [name, source] : sources_) {
    SCOPED_TRACE(name);
    const Shape& g = source.shape();
    for (int trial = 0; trial < 200; ++trial) {
      Shape offsets(g.size()), box(g.size());
      for (size_t d = 0; d < g.size(); ++d) {
        offsets[d] = int64_t(rng() % g[d]);
        box[d] = 1 + int64_t(rng() % (g[d] - offsets[d]));
      }
      const int64_t n = numel_of(box);
      int64_t b = int64_t(rng() % n), e = int64_t(rng() % n);
      if (b > e) std::swap(b, e);
      ++e;
      SCOPED_TRACE(
          fmt::format("box {} at {}, flat [{}, {})", shape_str(box), shape_str(offsets), b, e));
      expect_same_bytes(reader.read_box(name, offsets, box),
                        reference_piece(source, offsets, box, 0, n), "random box");
      expect_same_bytes(reader.read_flat(name, offsets, box, b, e),
                        reference_piece(source, offsets, box, b, e), "random flat range");
    }
  }
  reader.verify_all();
  EXPECT_THROW(reader.read("absent"), Error);
  EXPECT_THROW(reader.read_box("w2d", {6, 0}, {7, 10}), Error) << "outside the global shape";
  EXPECT_THROW(reader.read_flat("w2d", {0, 0}, {2, 2}, 0, 5), Error) << "outside the box";
}

TEST_F(ShardedCheckpoint, RecordsRoundTripThroughJson) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  auto ranks = build_pieces(rng);
  const std::string tmp = begin_sharded_save(dir_, 1);
  const RankShardRecord record = write_rank_shard(tmp, 1, ranks[1]);
  const RankShardRecord back = RankShardRecord::from_json(record.to_json());
  EXPECT_EQ(back.to_json(), record.to_json());
  EXPECT_EQ(back.file, "rank_00001.safetensors");
  EXPECT_EQ(back.file_bytes, fs::file_size(fs::path(tmp) / back.file));
  ASSERT_EQ(back.pieces.size(), ranks[1].size());
  for (size_t i = 0; i < back.pieces.size(); ++i) {
    EXPECT_EQ(back.pieces[i].name, ranks[1][i].name);
    EXPECT_EQ(back.pieces[i].key, ranks[1][i].name + "#" + std::to_string(i));
    EXPECT_EQ(back.pieces[i].nbytes, ranks[1][i].data.nbytes());
  }
  // The whole-file crc32, put together from the pieces', is the file's.
  std::ifstream in(fs::path(tmp) / back.file, std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(in), {});
  EXPECT_EQ(back.file_crc32, sharded_layout::crc32_of(bytes.data(), bytes.size()));
  EXPECT_THROW(RankShardRecord::from_json("{\"rank\": 0}"), Error);
  EXPECT_THROW(RankShardRecord::from_json("not json"), Error);
}

TEST_F(ShardedCheckpoint, MetadataHoldsRunMetadataAndIndex) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  save(30, build_pieces(rng));
  const std::string iter_dir = (fs::path(dir_) / "iter_0000030").string();
  EXPECT_TRUE(is_sharded_checkpoint(iter_dir));
  // The loader of the single-file format reads the run metadata at the top level.
  LoadedCheckpoint ck = read_checkpoint_metadata(dir_);
  EXPECT_EQ(ck.iteration, 30);
  const auto meta = nlohmann::json::parse(ck.metadata_json);
  EXPECT_EQ(meta["consumed_samples"], 240);
  EXPECT_EQ(meta["checkpoint_format"], "megaton_sharded");
  EXPECT_EQ(meta["checkpoint_format_version"], 1);
  EXPECT_EQ(meta["sharded_files"].size(), 4u);
  EXPECT_EQ(meta["sharded_tensors"]["w2d"]["pieces"].size(), 4u);
  EXPECT_EQ(meta["sharded_tensors"]["w2d"]["dtype"], "F32");
  // --ckpt-step reaches it without the tracker.
  fs::remove(fs::path(dir_) / "latest_checkpointed_iteration.txt");
  EXPECT_EQ(open_sharded_checkpoint(dir_, 30).tensors().size(), sources_.size());
  EXPECT_THROW(open_sharded_checkpoint(dir_), Error) << "no tracker";
  // The single-file format is told apart.
  const std::string old_dir = dir_ + "_old";
  save_checkpoint(old_dir, 5, {{"w", sources_["w2d"]}}, "{\"iteration\": 5}");
  EXPECT_FALSE(is_sharded_checkpoint(old_dir + "/iter_0000005"));
  EXPECT_FALSE(is_sharded_checkpoint(old_dir + "/iter_0000099"));
  EXPECT_THROW(ShardedCheckpointReader(old_dir + "/iter_0000005"), Error);
  fs::remove_all(old_dir);
}

TEST_F(ShardedCheckpoint, CommitRefusesOverlapsGapsAndMismatches) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  const Tensor w = random_tensor({6, 4}, DType::F32, rng);
  auto commit_error = [&](const std::vector<std::vector<ShardedPiece>>& ranks) -> std::string {
    const std::string tmp = begin_sharded_save(dir_, 7);
    try {
      commit_sharded_checkpoint(dir_, 7, tmp, write_ranks(tmp, ranks), run_metadata(7));
    } catch (const InternalError& e) {
      return e.what();
    }
    return "";
  };
  // Replicated: both ranks write the whole tensor, identical bytes.
  EXPECT_THAT(
      commit_error({{make_piece("w", w, {0, 0}, {6, 4})}, {make_piece("w", w, {0, 0}, {6, 4})}}),
      HasSubstr("tensor 'w' [6, 4]: element [0, 0] is written by rank 0 (key 'w#0') and rank 1"));
  // Overlapping flat ranges of one box.
  EXPECT_THAT(commit_error({{make_piece("w", w, {0, 0}, {6, 4}, 0, 13)},
                            {make_piece("w", w, {0, 0}, {6, 4}, 12, 24)}}),
              HasSubstr("element [3, 0] is written by rank 0"));
  // Overlapping boxes.
  EXPECT_THAT(
      commit_error({{make_piece("w", w, {0, 0}, {4, 4})}, {make_piece("w", w, {3, 0}, {3, 4})}}),
      HasSubstr("element [3, 0] is written by rank 0"));
  // A gap: the last column is missing.
  EXPECT_THAT(
      commit_error({{make_piece("w", w, {0, 0}, {3, 3})}, {make_piece("w", w, {3, 0}, {3, 4})}}),
      HasSubstr("tensor 'w' [6, 4]: element [0, 3] is written by no rank"));
  // A gap at the end of a flat range.
  EXPECT_THAT(commit_error({{make_piece("w", w, {0, 0}, {6, 4}, 0, 23)}}),
              HasSubstr("element [5, 3] is written by no rank"));
  // The same name with another dtype.
  EXPECT_THAT(commit_error({{make_piece("w", w, {0, 0}, {3, 4})},
                            {make_piece("w", w.to(DType::BF16), {3, 0}, {3, 4})}}),
              HasSubstr("tensor 'w': rank 0 writes it as F32 [6, 4], rank 1 as BF16 [6, 4]"));
  // Reserved keys in the run metadata.
  const std::string tmp = begin_sharded_save(dir_, 7);
  EXPECT_THROW(commit_sharded_checkpoint(dir_, 7, tmp,
                                         write_ranks(tmp, {{make_piece("w", w, {0, 0}, {6, 4})}}),
                                         "{\"sharded_tensors\": 1}"),
               InternalError);
  // None of the refused commits left a checkpoint or moved the tracker.
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "iter_0000007"));
  EXPECT_EQ(tracked_iteration(dir_), -1);
  // A piece outside its tensor is refused when written.
  ShardedPiece bad = make_piece("w", w, {0, 0}, {6, 4});
  bad.offsets = {1, 0};
  EXPECT_THROW(write_rank_shard(tmp, 0, {bad}), InternalError);
}

// The record of rank 1's piece of tensor `name`.
PieceRecord rank1_piece(const std::vector<RankShardRecord>& records, const std::string& name) {
  for (const RankShardRecord& r : records)
    if (r.rank == 1)
      for (const PieceRecord& p : r.pieces)
        if (p.name == name) return p;
  ADD_FAILURE() << "no piece of " << name << " on rank 1";
  return {};
}

TEST_F(ShardedCheckpoint, FlippedByteFailsOnlyTheReadsOfItsPiece) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  const std::string tmp = begin_sharded_save(dir_, 10);
  const auto records = write_ranks(tmp, build_pieces(rng));
  commit_sharded_checkpoint(dir_, 10, tmp, records, run_metadata(10));
  // Rank 1 holds elements [25, 60) of rows 0-5 (3/7 of 60 go to rank 0).
  const PieceRecord piece = rank1_piece(records, "w2d");
  const fs::path file = fs::path(dir_) / "iter_0000010" / "rank_00001.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(piece.byte_offset + piece.nbytes / 2));
    char c;
    f.read(&c, 1);
    f.seekp(std::streamoff(piece.byte_offset + piece.nbytes / 2));
    c = char(c ^ 0x10);
    f.write(&c, 1);
  }
  ShardedCheckpointReader reader = open_sharded_checkpoint(dir_);
  try {
    reader.read("w2d");
    ADD_FAILURE() << "read of a corrupt piece succeeded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(file.string()));
    EXPECT_THAT(e.what(), HasSubstr("tensor 'w2d'"));
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
  EXPECT_THROW(reader.read("w2d"), Error) << "the verdict is kept";
  // Choice: boxes that do not touch the damaged piece still read (rows 6-11 are ranks 2
  // and 3; rows 0-1 lie in rank 0's part), as does every other piece of the same file.
  expect_same_bytes(reader.read_box("w2d", {6, 0}, {6, 10}),
                    reference_piece(sources_["w2d"], {6, 0}, {6, 10}, 0, 60), "rows 6-11");
  expect_same_bytes(reader.read_box("w2d", {0, 0}, {2, 10}),
                    reference_piece(sources_["w2d"], {0, 0}, {2, 10}, 0, 20), "rows 0-1");
  expect_same_bytes(reader.read("step"), sources_["step"], "step, in the same file");
  EXPECT_THROW(reader.verify_all(), Error);
}

TEST_F(ShardedCheckpoint, TruncatedOrMissingFileFailsNamingIt) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  save(10, build_pieces(rng));
  const fs::path iter = fs::path(dir_) / "iter_0000010";
  const fs::path rank1 = iter / "rank_00001.safetensors", rank3 = iter / "rank_00003.safetensors";
  fs::resize_file(rank1, fs::file_size(rank1) - 3);
  fs::remove(rank3);
  ShardedCheckpointReader reader(iter.string());
  for (const char* name : {"w2d", "w3d", "ids", "step"}) {
    try {
      reader.read(name);
      ADD_FAILURE() << name << " read from a truncated file";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(rank1.string()));
      EXPECT_THAT(e.what(), HasSubstr("truncated"));
    }
  }
  try {
    reader.read("bias");  // whole on rank 3
    ADD_FAILURE() << "bias read from a deleted file";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(rank3.string()));
    EXPECT_THAT(e.what(), HasSubstr("does not exist"));
  }
  // Ranks 0 and 2 are intact: what lies only in them reads.
  expect_same_bytes(reader.read("scale"), sources_["scale"], "scale (rank 2)");
  expect_same_bytes(reader.read("norm"), sources_["norm"], "norm (rank 0; rank 1's part is empty)");
  expect_same_bytes(reader.read_flat("w2d", {0, 0}, {6, 10}, 0, 25),
                    reference_piece(sources_["w2d"], {0, 0}, {6, 10}, 0, 25), "rank 0's part");
}

TEST_F(ShardedCheckpoint, MissingOrCorruptMetadataNamesTheFile) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  save(10, build_pieces(rng));
  const fs::path iter = fs::path(dir_) / "iter_0000010";
  const fs::path meta = iter / "metadata.json";
  std::ifstream in(meta);
  const std::string text(std::istreambuf_iterator<char>(in), {});
  auto error_of = [&](const std::string& contents) -> std::string {
    std::ofstream(meta, std::ios::trunc) << contents;
    try {
      ShardedCheckpointReader reader(iter.string());
      reader.read("w2d");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_THAT(error_of(text.substr(0, text.size() / 2)),
              HasSubstr(meta.string() + "' is not valid JSON"));
  EXPECT_THAT(error_of("[1, 2]"), HasSubstr(meta.string()));
  nlohmann::json j = nlohmann::json::parse(text);
  j["checkpoint_format_version"] = 2;
  EXPECT_THAT(error_of(j.dump()), HasSubstr("format version 2"));
  j = nlohmann::json::parse(text);
  j["sharded_tensors"]["w2d"]["pieces"][0]["box_shape"] = {13, 10};
  EXPECT_THAT(
      error_of(j.dump()),
      HasSubstr("tensor 'w2d' piece 0: box at offsets [0, 0] of shape [13, 10] is outside"));
  // An index that lost a piece: the reads it covered fail naming the tensor; others read.
  j = nlohmann::json::parse(text);
  j["sharded_tensors"]["w2d"]["pieces"].erase(0);  // rank 0's part of rows 0-5
  std::ofstream(meta, std::ios::trunc) << j.dump();
  ShardedCheckpointReader reader(iter.string());
  EXPECT_THROW(
      {
        try {
          reader.read_box("w2d", {0, 0}, {2, 10});
        } catch (const Error& e) {
          EXPECT_THAT(e.what(), HasSubstr("tensor 'w2d' [12, 10]: element [0, 0] is in no piece"));
          throw;
        }
      },
      Error);
  expect_same_bytes(reader.read_box("w2d", {6, 0}, {6, 10}),
                    reference_piece(sources_["w2d"], {6, 0}, {6, 10}, 0, 60), "rows 6-11");
  EXPECT_THAT(error_of(""), HasSubstr("is not valid JSON"));
  fs::remove(meta);
  try {
    ShardedCheckpointReader gone(iter.string());
    ADD_FAILURE() << "opened without metadata.json";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(meta.string() + "' does not exist"));
  }
}

TEST_F(ShardedCheckpoint, UncommittedSaveLeavesThePreviousCheckpoint) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  const auto first = build_pieces(rng);
  const Tensor first_w2d = sources_["w2d"];
  save(10, first);
  // A save of iteration 20 by a rank 0 that died after every rank wrote its file.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  const std::string tmp = sharded_tmp_iteration_dir(dir_, 20, child);
  fs::create_directories(tmp);
  write_ranks(tmp, build_pieces(rng));
  EXPECT_EQ(tracked_iteration(dir_), 10);
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "iter_0000020"));
  ShardedCheckpointReader reader = open_sharded_checkpoint(dir_);
  expect_same_bytes(reader.read("w2d"), first_w2d, "iteration 10's w2d");
  // The next save removes the dead process's directory.
  const std::string name = "iter_0000020.tmp" + std::to_string(child);
  EXPECT_EQ(remove_stale_partial_saves(dir_), std::vector<std::string>{name});
  EXPECT_EQ(entries(),
            (std::vector<std::string>{"iter_0000010", "latest_checkpointed_iteration.txt"}));
  // A live rank 0's directory stays.
  const std::string live = begin_sharded_save(dir_, 30);
  EXPECT_TRUE(remove_stale_partial_saves(dir_).empty());
  EXPECT_TRUE(fs::is_directory(live));
}

TEST_F(ShardedCheckpoint, ResaveReplacesAndRetentionRemoves) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  const std::string tracker = "latest_checkpointed_iteration.txt";
  SaveOptions retain;
  retain.save_retain_interval = 30;
  EXPECT_EQ(save(10, build_pieces(rng), retain), "");
  EXPECT_EQ(save(10, build_pieces(rng), retain), "") << "the same iteration again";
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000010", tracker}));
  expect_same_bytes(open_sharded_checkpoint(dir_).read("w3d"), sources_["w3d"],
                    "the second save's w3d");
  EXPECT_EQ(save(20, build_pieces(rng), retain), (fs::path(dir_) / "iter_0000010").string());
  save(30, build_pieces(rng), retain);
  save(40, build_pieces(rng), retain);
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000030", "iter_0000040", tracker}));
  EXPECT_EQ(tracked_iteration(dir_), 40);
  expect_same_bytes(open_sharded_checkpoint(dir_).read("ids"), sources_["ids"],
                    "iteration 40's ids");
}

TEST_F(ShardedCheckpoint, EachRankFileHoldsItsShare) {
  SCOPED_TRACE("seed " + std::to_string(kSeed));
  std::mt19937_64 rng(kSeed);
  std::vector<std::vector<ShardedPiece>> ranks(4);
  const Tensor embedding = random_tensor({256, 96}, DType::F32, rng);
  const Tensor proj = random_tensor({96, 128}, DType::BF16, rng);
  add_tp2_dp2(ranks, "embedding", embedding, 0);
  add_tp2_dp2(ranks, "proj", proj, 1);
  save(1, ranks);
  const fs::path iter = fs::path(dir_) / "iter_0000001";
  const uint64_t total = embedding.nbytes() + proj.nbytes();
  uint64_t all = 0;
  for (int r = 0; r < 4; ++r) {
    uint64_t share = 0;
    for (const ShardedPiece& p : ranks[r]) share += p.data.nbytes();
    const uint64_t bytes = fs::file_size(iter / rank_shard_file_name(r));
    EXPECT_GE(bytes, share) << "rank " << r;
    EXPECT_LE(bytes, share + 512) << "rank " << r << ": more than a header's slack";
    // 3/7 or 4/7 of a TP half.
    EXPECT_GE(double(share), total / 2 * 3 / 7.0 - 8) << "rank " << r;
    EXPECT_LE(double(share), total / 2 * 4 / 7.0 + 8) << "rank " << r;
    all += share;
  }
  EXPECT_EQ(all, total);
}

TEST(ShardedLayout, CopiesRunsAlongTheLastDimensions) {
  using sharded_layout::BoxRange;
  std::vector<sharded_layout::CommonRun> runs;
  const BoxRange whole{{0, 0}, {12, 10}, 0, 120};
  // Rows 6-11 span the last dimension: one run.
  sharded_layout::append_common_runs(whole, {{6, 0}, {6, 10}, 0, 60}, runs);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].dst, 60);
  EXPECT_EQ(runs[0].count, 60);
  // Columns 5-9: one run per row.
  runs.clear();
  sharded_layout::append_common_runs(whole, {{0, 5}, {12, 5}, 0, 60}, runs);
  ASSERT_EQ(runs.size(), 12u);
  EXPECT_EQ(runs[1].dst, 15);
  EXPECT_EQ(runs[1].src, 5);
  EXPECT_EQ(runs[1].count, 5);
  // A flat range of those columns: only the rows it reaches, cut at its ends.
  runs.clear();
  sharded_layout::append_common_runs(whole, {{0, 5}, {12, 5}, 12, 23}, runs);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].dst, 27);
  EXPECT_EQ(runs[0].src, 0);
  EXPECT_EQ(runs[0].count, 3);
  EXPECT_EQ(runs[2].dst, 45);
  EXPECT_EQ(runs[2].count, 3);
  // A 3-D box spanning the last two dimensions of both: one run.
  runs.clear();
  sharded_layout::append_common_runs({{0, 0, 0}, {4, 6, 5}, 0, 120}, {{1, 0, 0}, {2, 6, 5}, 7, 50},
                                     runs);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].dst, 37);
  EXPECT_EQ(runs[0].count, 43);
}

}  // namespace
}  // namespace megaton::ckpt
