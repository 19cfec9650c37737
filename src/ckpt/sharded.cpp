// Sharded checkpoint, write side: each rank's file and record, rank 0's commit.
#include "ckpt/sharded.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/safetensors.h"
#include "ckpt/sharded_layout.h"
#include "core/error.h"

namespace fs = std::filesystem;

namespace megaton::ckpt {

using nlohmann::json;
using sharded_layout::BoxRange;
using sharded_layout::CoverRun;

namespace {

// metadata.json's keys that commit_sharded_checkpoint adds to the run metadata.
constexpr const char* kReservedKeys[] = {"checkpoint_format", "checkpoint_format_version",
                                         "sharded_files", "sharded_tensors"};

BoxRange range_of(const PieceRecord& p) {
  return {p.offsets, p.box_shape, p.flat_begin, p.flat_end};
}

json piece_to_json(const PieceRecord& p) {
  return {{"name", p.name},
          {"dtype", std::string(dtype_name(p.dtype))},
          {"global_shape", p.global_shape},
          {"offsets", p.offsets},
          {"box_shape", p.box_shape},
          {"flat_range", {p.flat_begin, p.flat_end}},
          {"key", p.key},
          {"byte_offset", p.byte_offset},
          {"nbytes", p.nbytes},
          {"crc32", p.crc32}};
}

// The 8-byte length and JSON header of a safetensors file, as written.
std::string read_safetensors_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint8_t length[8];
  if (!in.read(reinterpret_cast<char*>(length), 8))
    fail("sharded save: cannot read back '{}': {}", path, std::strerror(errno));
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= uint64_t(length[i]) << (8 * i);
  std::string bytes(8 + header_size, '\0');
  std::memcpy(bytes.data(), length, 8);
  if (!in.read(bytes.data() + 8, std::streamsize(header_size)))
    fail("sharded save: cannot read back the header of '{}'", path);
  return bytes;
}

void write_file_durably(const fs::path& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) fail("sharded save: cannot write '{}': {}", path.string(), std::strerror(errno));
    out << text;
    out.flush();
    if (!out) fail("sharded save: cannot write '{}' (disk full?)", path.string());
  }
  fsync_path(path.string());
}

// metadata.json's text: `meta` indented, then "sharded_files" and "sharded_tensors" with one
// line per file and per piece (indenting every number of every piece would make the index
// of a large run several times larger).
std::string metadata_text(const nlohmann::ordered_json& meta, const nlohmann::ordered_json& files,
                          const nlohmann::ordered_json& tensors) {
  std::string text = meta.dump(1);  // "{\n \"key\": value,\n ...\n}"
  text.resize(text.size() - 2);     // without "\n}"
  text += ",\n \"sharded_files\": {";
  const char* sep = "\n  ";
  for (const auto& [name, entry] : files.items()) {
    text += sep + json(name).dump() + ": " + entry.dump();
    sep = ",\n  ";
  }
  text += "\n },\n \"sharded_tensors\": {";
  sep = "\n  ";
  for (const auto& [name, entry] : tensors.items()) {
    text += sep + json(name).dump() + ": {\"dtype\": " + entry["dtype"].dump() +
            ", \"global_shape\": " + entry["global_shape"].dump() + ", \"pieces\": [";
    const char* piece_sep = "\n   ";
    for (const auto& piece : entry["pieces"]) {
      text += piece_sep + piece.dump();
      piece_sep = ",\n   ";
    }
    text += "]}";
    sep = ",\n  ";
  }
  return text + "\n }\n}\n";
}

}  // namespace

std::string RankShardRecord::to_json() const {
  json pieces_json = json::array();
  for (const PieceRecord& p : pieces) pieces_json.push_back(piece_to_json(p));
  return json{{"rank", rank},
              {"file", file},
              {"file_bytes", file_bytes},
              {"file_crc32", file_crc32},
              {"pieces", std::move(pieces_json)}}
      .dump();
}

RankShardRecord RankShardRecord::from_json(const std::string& text) {
  namespace L = sharded_layout;
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  const std::string where = "rank shard record";
  if (!j.is_object()) fail("{}: not a JSON object: '{}'", where, text.substr(0, 80));
  RankShardRecord r;
  const int64_t rank = L::json_int(j, "rank", where);
  if (rank < 0 || rank > std::numeric_limits<int>::max())
    fail("{}: 'rank' is {}, expected a rank", where, rank);
  r.rank = int(rank);
  r.file = L::json_string(j, "file", where);
  r.file_bytes = L::json_uint(j, "file_bytes", where);
  r.file_crc32 = uint32_t(L::json_uint(j, "file_crc32", where));
  const json& pieces = L::json_field(j, "pieces", where);
  if (!pieces.is_array()) fail("{} of rank {}: 'pieces' is not a list", where, r.rank);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const std::string at = fmt::format("{} of rank {}, piece {}", where, r.rank, i);
    const json& pj = pieces[i];
    PieceRecord p;
    p.name = L::json_string(pj, "name", at);
    const std::string dtype = L::json_string(pj, "dtype", at);
    try {
      p.dtype = dtype_from_name(dtype);
    } catch (const Error& e) {
      fail("{}: {}", at, e.what());
    }
    p.global_shape = L::json_int_list(pj, "global_shape", at);
    p.offsets = L::json_int_list(pj, "offsets", at);
    p.box_shape = L::json_int_list(pj, "box_shape", at);
    const std::vector<int64_t> flat = L::json_int_list(pj, "flat_range", at);
    if (flat.size() != 2) fail("{}: 'flat_range' is not [begin, end]", at);
    p.flat_begin = flat[0];
    p.flat_end = flat[1];
    p.key = L::json_string(pj, "key", at);
    p.byte_offset = L::json_uint(pj, "byte_offset", at);
    p.nbytes = L::json_uint(pj, "nbytes", at);
    p.crc32 = uint32_t(L::json_uint(pj, "crc32", at));
    r.pieces.push_back(std::move(p));
  }
  return r;
}

std::string rank_shard_file_name(int rank) { return fmt::format("rank_{:05d}.safetensors", rank); }

std::string sharded_tmp_iteration_dir(const std::string& save_dir, int64_t iteration,
                                      int64_t rank0_pid) {
  return (fs::path(save_dir) / (iteration_dir_name(iteration) + fmt::format(".tmp{}", rank0_pid)))
      .string();
}

std::string begin_sharded_save(const std::string& save_dir, int64_t iteration) {
  std::error_code ec;
  fs::create_directories(save_dir, ec);
  if (ec) fail("cannot create checkpoint directory '{}': {}", save_dir, ec.message());
  for (const std::string& name : remove_stale_partial_saves(save_dir))
    fmt::print(" removed '{}' in '{}', the partial save of a process no longer running\n", name,
               save_dir);
  const std::string tmp = sharded_tmp_iteration_dir(save_dir, iteration, getpid());
  fs::remove_all(tmp, ec);
  if (ec) fail("sharded save: cannot remove the old '{}': {}", tmp, ec.message());
  fs::create_directory(tmp, ec);
  if (ec) fail("sharded save: cannot create '{}': {}", tmp, ec.message());
  return tmp;
}

RankShardRecord write_rank_shard(const std::string& tmp_iteration_dir, int rank,
                                 const std::vector<ShardedPiece>& pieces) {
  MEGATON_CHECK(rank >= 0, "write_rank_shard: rank {} is negative", rank);
  std::error_code ec;
  if (!fs::is_directory(tmp_iteration_dir, ec))
    fail(
        "sharded save: rank {}: directory '{}' does not exist (is the save directory on a "
        "filesystem every rank shares?)",
        rank, tmp_iteration_dir);
  RankShardRecord record;
  record.rank = rank;
  record.file = rank_shard_file_name(rank);
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ShardedPiece& piece = pieces[i];
    PieceRecord p;
    p.name = piece.name;
    p.global_shape = piece.global_shape;
    p.offsets = piece.offsets;
    p.box_shape = piece.box_shape;
    const int64_t box_numel = sharded_layout::checked_numel(piece.box_shape);
    p.flat_begin = piece.flat_begin;
    p.flat_end = piece.flat_end == -1 ? box_numel : piece.flat_end;
    MEGATON_CHECK(!p.name.empty(), "write_rank_shard: rank {} piece {} has no name", rank, i);
    const std::string problem = sharded_layout::geometry_problem(p.global_shape, range_of(p));
    MEGATON_CHECK(problem.empty(), "write_rank_shard: rank {} piece {} of '{}': {}", rank, i,
                  p.name, problem);
    const int64_t numel = p.flat_end - p.flat_begin;
    const Tensor& data = piece.data;
    if (piece.produce) {
      MEGATON_CHECK(!data.defined(),
                    "write_rank_shard: rank {} piece {} of '{}': both data and "
                    "produce",
                    rank, i, p.name);
      p.dtype = piece.dtype;
    } else {
      MEGATON_CHECK(data.defined() && data.device() == Device::CPU,
                    "write_rank_shard: rank {} piece {} of '{}': data is not a CPU tensor", rank, i,
                    p.name);
      MEGATON_CHECK(data.numel() == numel,
                    "write_rank_shard: rank {} piece {} of '{}': data holds {} elements, the flat "
                    "range [{}, {}) needs {}",
                    rank, i, p.name, data.numel(), p.flat_begin, p.flat_end, numel);
      p.dtype = data.dtype();
    }
    p.key = fmt::format("{}#{}", p.name, i);
    p.nbytes = uint64_t(numel) * dtype_size(p.dtype);
    // A whole box keeps its shape in the file (for tools reading one rank's file); a flat
    // range is 1-D.
    const bool whole_box = p.flat_begin == 0 && p.flat_end == box_numel;
    const Shape shape = whole_box ? Shape(p.box_shape.begin(), p.box_shape.end()) : Shape{numel};
    tensors.push_back(
        {p.key, p.dtype, shape,
         piece.produce ? piece.produce : std::function<Tensor()>([&data] { return data; })});
    record.pieces.push_back(std::move(p));
  }
  const std::string path = (fs::path(tmp_iteration_dir) / record.file).string();
  // Each piece's crc32 from its bytes as they are written.
  save_safetensors_streamed(
      path, tensors, {{"checkpoint_format", kShardedFormatName}, {"rank", std::to_string(rank)}},
      [&](size_t i, const Tensor& t) {
        record.pieces[i].crc32 = sharded_layout::crc32_of(t.raw(), t.nbytes());
      });
  fsync_path(tmp_iteration_dir);  // the rename of the file's .tmp into place

  // Where save_safetensors put each piece: its header, read back, says.
  const std::string header = read_safetensors_header(path);
  const json parsed = json::parse(header.begin() + 8, header.end());
  const uint64_t data_start = header.size();
  record.file_bytes = fs::file_size(path);
  std::vector<PieceRecord*> by_offset;
  for (PieceRecord& p : record.pieces) {
    p.byte_offset = data_start + parsed.at(p.key).at("data_offsets").at(0).get<uint64_t>();
    by_offset.push_back(&p);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const PieceRecord* a, const PieceRecord* b) {
    // An empty piece shares its offset with the piece after it.
    return a->byte_offset != b->byte_offset ? a->byte_offset < b->byte_offset
                                            : a->nbytes < b->nbytes;
  });
  // The whole file's crc32 from the header's and the pieces' (safetensors puts the pieces
  // back to back after the header), without reading the data again.
  uLong crc = sharded_layout::crc32_of(header.data(), header.size());
  uint64_t expect = data_start;
  for (const PieceRecord* p : by_offset) {
    MEGATON_CHECK(p->byte_offset == expect, "'{}': piece '{}' at byte {}, expected {}", path,
                  p->key, p->byte_offset, expect);
    crc = crc32_combine(crc, p->crc32, z_off_t(p->nbytes));
    expect += p->nbytes;
  }
  MEGATON_CHECK(expect == record.file_bytes, "'{}' holds {} bytes, its header and pieces {}", path,
                record.file_bytes, expect);
  record.file_crc32 = uint32_t(crc);
  return record;
}

std::string commit_sharded_checkpoint(const std::string& save_dir, int64_t iteration,
                                      const std::string& tmp_iteration_dir,
                                      const std::vector<RankShardRecord>& records,
                                      const std::string& run_metadata_json,
                                      const SaveOptions& options) {
  nlohmann::ordered_json meta =
      nlohmann::ordered_json::parse(run_metadata_json, nullptr, /*allow_exceptions=*/false);
  MEGATON_CHECK(meta.is_object(), "commit_sharded_checkpoint: run metadata is not a JSON object");
  for (const char* key : kReservedKeys)
    MEGATON_CHECK(!meta.contains(key), "commit_sharded_checkpoint: run metadata holds '{}'", key);
  MEGATON_CHECK(!records.empty(), "commit_sharded_checkpoint: no rank records");
  std::error_code ec;
  fs::path tmp = fs::absolute(tmp_iteration_dir).lexically_normal();
  if (!tmp.has_filename()) tmp = tmp.parent_path();
  if (!fs::is_directory(tmp, ec))
    fail("sharded save: temporary directory '{}' does not exist", tmp.string());
  MEGATON_CHECK(fs::equivalent(tmp.parent_path(), save_dir, ec),
                "commit_sharded_checkpoint: '{}' is not in the save directory '{}'", tmp.string(),
                save_dir);

  // Every rank's file is there, as large as its rank wrote it.
  std::set<int> ranks;
  for (const RankShardRecord& r : records) {
    MEGATON_CHECK(ranks.insert(r.rank).second, "commit_sharded_checkpoint: two records of rank {}",
                  r.rank);
    MEGATON_CHECK(r.file == rank_shard_file_name(r.rank),
                  "commit_sharded_checkpoint: rank {} names file '{}'", r.rank, r.file);
    const fs::path file = tmp / r.file;
    const uint64_t bytes = fs::file_size(file, ec);
    if (ec)
      fail(
          "sharded save: rank {}'s file '{}' is missing ({}); is the save directory on a "
          "filesystem every rank shares?",
          r.rank, file.string(), ec.message());
    if (bytes != r.file_bytes)
      fail("sharded save: rank {}'s file '{}' holds {} bytes, the rank wrote {}", r.rank,
           file.string(), bytes, r.file_bytes);
  }

  // Each global tensor: one dtype and shape, tiled exactly once by its pieces.
  struct Ref {
    const RankShardRecord* record;
    const PieceRecord* piece;
  };
  std::map<std::string, std::vector<Ref>> by_tensor;
  for (const RankShardRecord& r : records)
    for (const PieceRecord& p : r.pieces) by_tensor[p.name].push_back({&r, &p});
  nlohmann::ordered_json tensors_json = nlohmann::ordered_json::object();
  for (const auto& [name, refs] : by_tensor) {
    const PieceRecord& first = *refs.front().piece;
    const int64_t numel = sharded_layout::checked_numel(first.global_shape);
    const BoxRange whole{std::vector<int64_t>(first.global_shape.size(), 0), first.global_shape, 0,
                         numel};
    std::vector<CoverRun> runs;
    std::vector<sharded_layout::CommonRun> common;
    nlohmann::ordered_json pieces_json = nlohmann::ordered_json::array();
    for (size_t i = 0; i < refs.size(); ++i) {
      const PieceRecord& p = *refs[i].piece;
      const int rank = refs[i].record->rank;
      if (p.dtype != first.dtype || p.global_shape != first.global_shape)
        throw InternalError(fmt::format(
            "sharded checkpoint: tensor '{}': rank {} writes it as {} {}, rank {} as {} {}", name,
            refs.front().record->rank, dtype_name(first.dtype), shape_str(first.global_shape), rank,
            dtype_name(p.dtype), shape_str(p.global_shape)));
      const std::string problem = sharded_layout::geometry_problem(p.global_shape, range_of(p));
      if (!problem.empty())
        throw InternalError(fmt::format("sharded checkpoint: tensor '{}', rank {}, key '{}': {}",
                                        name, rank, p.key, problem));
      MEGATON_CHECK(p.nbytes == uint64_t(p.flat_end - p.flat_begin) * dtype_size(p.dtype) &&
                        p.byte_offset + p.nbytes <= refs[i].record->file_bytes,
                    "sharded checkpoint: tensor '{}', rank {}, key '{}': {} bytes at {}", name,
                    rank, p.key, p.nbytes, p.byte_offset);
      common.clear();
      sharded_layout::append_common_runs(whole, range_of(p), common);
      for (const auto& c : common) runs.push_back({c.dst, c.count, i, c.src});
      pieces_json.push_back({{"file", refs[i].record->file},
                             {"key", p.key},
                             {"byte_offset", p.byte_offset},
                             {"offsets", p.offsets},
                             {"box_shape", p.box_shape},
                             {"flat_range", {p.flat_begin, p.flat_end}},
                             {"crc32", p.crc32}});
    }
    if (auto problem = sharded_layout::find_tiling_problem(runs, numel)) {
      const std::string element = sharded_layout::element_coordinates(whole, problem->at);
      if (!problem->overlap)
        throw InternalError(
            fmt::format("sharded checkpoint: tensor '{}' {}: element {} is written "
                        "by no rank",
                        name, shape_str(first.global_shape), element));
      const Ref& a = refs[problem->piece];
      const Ref& b = refs[problem->other_piece];
      throw InternalError(fmt::format(
          "sharded checkpoint: tensor '{}' {}: element {} is written by rank {} (key '{}') and "
          "rank {} (key '{}'); each element must be written once (a replicated tensor by one "
          "rank only)",
          name, shape_str(first.global_shape), element, a.record->rank, a.piece->key,
          b.record->rank, b.piece->key));
    }
    tensors_json[name] = {{"dtype", std::string(dtype_name(first.dtype))},
                          {"global_shape", first.global_shape},
                          {"pieces", std::move(pieces_json)}};
  }
  std::vector<const RankShardRecord*> by_rank;
  for (const RankShardRecord& r : records) by_rank.push_back(&r);
  std::sort(by_rank.begin(), by_rank.end(),
            [](const RankShardRecord* a, const RankShardRecord* b) { return a->rank < b->rank; });
  nlohmann::ordered_json files_json = nlohmann::ordered_json::object();
  for (const RankShardRecord* r : by_rank)
    files_json[r->file] = {{"rank", r->rank}, {"bytes", r->file_bytes}, {"crc32", r->file_crc32}};
  meta["checkpoint_format"] = kShardedFormatName;
  meta["checkpoint_format_version"] = kShardedFormatVersion;

  // Metadata last: a directory without it is an unfinished save.
  write_file_durably(tmp / "metadata.json", metadata_text(meta, files_json, tensors_json));
  fsync_path(tmp.string());
  const int64_t previous = tracked_iteration(save_dir);
  const fs::path final_dir = fs::path(save_dir) / iteration_dir_name(iteration);
  const bool replacing = fs::exists(fs::symlink_status(final_dir, ec));
  // Replacing a checkpoint of this iteration: swapped atomically where the filesystem can
  // (the old one is then under the temporary name, removed below or, after a crash, by the
  // next save), else removed first.
  if (replacing &&
      ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp, ec);
  } else {
    if (replacing) {
      fs::remove_all(final_dir, ec);
      if (ec)
        fail("sharded save: cannot remove the old '{}': {}", final_dir.string(), ec.message());
    }
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0)
      fail("sharded save: cannot rename '{}' to '{}': {}", tmp.string(), final_dir.string(),
           std::strerror(errno));
  }
  fsync_path(save_dir);
  write_tracker(save_dir, iteration);
  return apply_save_retention(save_dir, previous, iteration, options);
}

}  // namespace megaton::ckpt
