// Sharded checkpoint, read side: metadata.json's index, files mapped on demand, any box or
// flat range assembled from the pieces it overlaps.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/sharded.h"
#include "ckpt/sharded_layout.h"
#include "core/error.h"

namespace fs = std::filesystem;

namespace megaton::ckpt {

using nlohmann::json;
using sharded_layout::BoxRange;

namespace {

struct MappedFile {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  MappedFile(const uint8_t* d, size_t n) : data(d), bytes(n) {}
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data) ::munmap(const_cast<uint8_t*>(data), bytes);
  }
};

struct FileEntry {
  std::string name;  // within the iteration directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
  std::unique_ptr<MappedFile> map;  // null until a read needs the file
};

struct PieceEntry {
  BoxRange range;
  size_t file = 0;
  std::string key;
  uint64_t byte_offset = 0, nbytes = 0;
  uint32_t crc32 = 0;
  int8_t verdict = 0;  // crc32 check: 0 not yet made, 1 passed, -1 failed
};

DType parse_dtype(const std::string& name, const std::string& where) {
  try {
    return dtype_from_name(name);
  } catch (const Error& e) {
    fail("{}: {}", where, e.what());
  }
}

uint32_t parse_crc32(const json& j, const char* key, const std::string& where) {
  const uint64_t v = sharded_layout::json_uint(j, key, where);
  if (v > 0xFFFFFFFFu) fail("{}: '{}' is {}, more than 32 bits", where, key, v);
  return uint32_t(v);
}

}  // namespace

struct ShardedCheckpointReader::Impl {
  std::string path, metadata_path, metadata_json;
  std::map<std::string, TensorInfo> infos;
  std::map<std::string, std::vector<PieceEntry>> pieces;  // the same names as infos
  std::vector<FileEntry> files;
  int64_t bytes_read = 0;  // bytes copied out by read_flat

  std::string file_path(size_t f) const { return (fs::path(path) / files[f].name).string(); }

  // File f mapped, after checking that it exists and has its recorded size.
  const uint8_t* file_data(size_t f) {
    FileEntry& file = files[f];
    if (file.map) return file.map->data;
    const std::string fpath = file_path(f);
    const int fd = ::open(fpath.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) fail("sharded checkpoint file '{}' does not exist", fpath);
      fail("sharded checkpoint file '{}': cannot open: {}", fpath, std::strerror(errno));
    }
    struct stat st {};
    const int64_t size = ::fstat(fd, &st) == 0 ? int64_t(st.st_size) : -1;
    if (size < 0 || uint64_t(size) != file.bytes) {
      ::close(fd);
      fail(
          "sharded checkpoint file '{}' holds {} bytes, but metadata.json records {} "
          "(truncated or overwritten?)",
          fpath, size, file.bytes);
    }
    void* data = file.bytes ? ::mmap(nullptr, file.bytes, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
    const int err = errno;
    ::close(fd);
    if (data == MAP_FAILED)
      fail("sharded checkpoint file '{}': cannot map it: {}", fpath, std::strerror(err));
    file.map = std::make_unique<MappedFile>(static_cast<const uint8_t*>(data), file.bytes);
    return file.map->data;
  }

  // The bytes of `piece` of tensor `name`, their crc32 checked the first time.
  const uint8_t* piece_bytes(const std::string& name, PieceEntry& piece) {
    const uint8_t* data = file_data(piece.file) + piece.byte_offset;
    if (piece.verdict == 0)
      piece.verdict = sharded_layout::crc32_of(data, piece.nbytes) == piece.crc32 ? 1 : -1;
    if (piece.verdict < 0)
      fail(
          "sharded checkpoint file '{}' is corrupt: tensor '{}' (key '{}', bytes [{}, {})) fails "
          "its crc32 check",
          file_path(piece.file), name, piece.key, piece.byte_offset,
          piece.byte_offset + piece.nbytes);
    return data;
  }

  void parse(const json& j);
};

void ShardedCheckpointReader::Impl::parse(const json& j) {
  namespace L = sharded_layout;
  const std::string where_meta = fmt::format("sharded checkpoint metadata '{}'", metadata_path);
  const json& format = L::json_field(j, "checkpoint_format", where_meta);
  if (!format.is_string() || format.get<std::string>() != kShardedFormatName)
    fail("{}: 'checkpoint_format' is {}, expected \"{}\"", where_meta, format.dump(),
         kShardedFormatName);
  const int64_t version = L::json_int(j, "checkpoint_format_version", where_meta);
  if (version < 1 || version > kShardedFormatVersion)
    fail("{}: format version {}; this Megaton reads versions 1 to {}", where_meta, version,
         kShardedFormatVersion);

  const json& files_json = L::json_field(j, "sharded_files", where_meta);
  if (!files_json.is_object()) fail("{}: 'sharded_files' is not an object", where_meta);
  std::map<std::string, size_t> file_index;
  for (const auto& [name, entry] : files_json.items()) {
    const std::string at = fmt::format("{}: file '{}'", where_meta, name);
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      fail("{}: not a file name within the iteration directory", at);
    file_index[name] = files.size();
    FileEntry file;
    file.name = name;
    file.bytes = L::json_uint(entry, "bytes", at);
    file.crc32 = parse_crc32(entry, "crc32", at);
    files.push_back(std::move(file));
  }

  const json& tensors_json = L::json_field(j, "sharded_tensors", where_meta);
  if (!tensors_json.is_object()) fail("{}: 'sharded_tensors' is not an object", where_meta);
  for (const auto& [name, entry] : tensors_json.items()) {
    const std::string at = fmt::format("{}: tensor '{}'", where_meta, name);
    TensorInfo info;
    info.dtype = parse_dtype(L::json_string(entry, "dtype", at), at);
    info.global_shape = L::json_int_list(entry, "global_shape", at);
    if (L::checked_numel(info.global_shape) < 0)
      fail("{}: global shape {} is negative or too large", at, shape_str(info.global_shape));
    const json& list = L::json_field(entry, "pieces", at);
    if (!list.is_array()) fail("{}: 'pieces' is not a list", at);
    std::vector<PieceEntry>& entries = pieces[name];
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string piece_at = fmt::format("{} piece {}", at, i);
      const json& pj = list[i];
      PieceEntry piece;
      const std::string file = L::json_string(pj, "file", piece_at);
      auto found = file_index.find(file);
      if (found == file_index.end())
        fail("{}: file '{}' is not in 'sharded_files'", piece_at, file);
      piece.file = found->second;
      piece.key = L::json_string(pj, "key", piece_at);
      piece.byte_offset = L::json_uint(pj, "byte_offset", piece_at);
      piece.crc32 = parse_crc32(pj, "crc32", piece_at);
      piece.range.offsets = L::json_int_list(pj, "offsets", piece_at);
      piece.range.box_shape = L::json_int_list(pj, "box_shape", piece_at);
      const std::vector<int64_t> flat = L::json_int_list(pj, "flat_range", piece_at);
      if (flat.size() != 2) fail("{}: 'flat_range' is not [begin, end]", piece_at);
      piece.range.flat_begin = flat[0];
      piece.range.flat_end = flat[1];
      const std::string problem = L::geometry_problem(info.global_shape, piece.range);
      if (!problem.empty()) fail("{}: {}", piece_at, problem);
      piece.nbytes = uint64_t(flat[1] - flat[0]) * dtype_size(info.dtype);
      const uint64_t file_bytes = files[piece.file].bytes;
      if (piece.byte_offset > file_bytes || piece.nbytes > file_bytes - piece.byte_offset)
        fail("{}: bytes [{}, {}) lie outside file '{}' of {} bytes", piece_at, piece.byte_offset,
             piece.byte_offset + piece.nbytes, file, file_bytes);
      entries.push_back(std::move(piece));
    }
    infos[name] = std::move(info);
  }
}

ShardedCheckpointReader::ShardedCheckpointReader(const std::string& iteration_dir)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = iteration_dir;
  impl_->metadata_path = (fs::path(iteration_dir) / "metadata.json").string();
  std::ifstream in(impl_->metadata_path, std::ios::binary);
  if (!in)
    fail("sharded checkpoint metadata '{}' does not exist (unfinished save?)",
         impl_->metadata_path);
  impl_->metadata_json.assign(std::istreambuf_iterator<char>(in), {});
  const json j = json::parse(impl_->metadata_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    fail("sharded checkpoint metadata '{}' is not valid JSON", impl_->metadata_path);
  if (!j.is_object())
    fail("sharded checkpoint metadata '{}' is not a JSON object", impl_->metadata_path);
  impl_->parse(j);
}

ShardedCheckpointReader::~ShardedCheckpointReader() = default;
ShardedCheckpointReader::ShardedCheckpointReader(ShardedCheckpointReader&&) noexcept = default;
ShardedCheckpointReader& ShardedCheckpointReader::operator=(ShardedCheckpointReader&&) noexcept =
    default;

const std::string& ShardedCheckpointReader::path() const { return impl_->path; }
const std::string& ShardedCheckpointReader::metadata_json() const { return impl_->metadata_json; }
int64_t ShardedCheckpointReader::bytes_read() const { return impl_->bytes_read; }

void ShardedCheckpointReader::release_mapped_pages() {
  for (const FileEntry& file : impl_->files)
    if (file.map && file.map->data && file.bytes > 0)
      ::madvise(const_cast<uint8_t*>(file.map->data), file.bytes, MADV_DONTNEED);
}
const std::map<std::string, ShardedCheckpointReader::TensorInfo>& ShardedCheckpointReader::tensors()
    const {
  return impl_->infos;
}

Tensor ShardedCheckpointReader::read_flat(const std::string& name,
                                          const std::vector<int64_t>& offsets,
                                          const std::vector<int64_t>& box_shape, int64_t flat_begin,
                                          int64_t flat_end) {
  auto found = impl_->pieces.find(name);
  if (found == impl_->pieces.end())
    fail("sharded checkpoint '{}' has no tensor '{}'", impl_->path, name);
  std::vector<PieceEntry>& pieces = found->second;
  const TensorInfo& info = impl_->infos.at(name);
  const BoxRange request{offsets, box_shape, flat_begin, flat_end};
  const std::string problem = sharded_layout::geometry_problem(info.global_shape, request);
  if (!problem.empty())
    fail("sharded checkpoint '{}': tensor '{}' {}: cannot read: {}", impl_->path, name,
         shape_str(info.global_shape), problem);

  std::vector<sharded_layout::CoverRun> runs;
  std::vector<sharded_layout::CommonRun> common;
  for (size_t i = 0; i < pieces.size(); ++i) {
    common.clear();
    sharded_layout::append_common_runs(request, pieces[i].range, common);
    for (const auto& c : common) runs.push_back({c.dst, c.count, i, c.src});
  }
  // Checked before any file is touched: a hole is an error of the checkpoint's layout.
  if (auto gap = sharded_layout::find_tiling_problem(runs, flat_end - flat_begin)) {
    const std::string element = sharded_layout::element_coordinates(request, flat_begin + gap->at);
    if (!gap->overlap)
      fail("sharded checkpoint '{}': tensor '{}' {}: element {} is in no piece", impl_->path, name,
           shape_str(info.global_shape), element);
    fail(
        "sharded checkpoint metadata '{}' is corrupt: tensor '{}': element {} is in two pieces "
        "(keys '{}' and '{}')",
        impl_->metadata_path, name, element, pieces[gap->piece].key, pieces[gap->other_piece].key);
  }
  const size_t element_size = dtype_size(info.dtype);
  Tensor out = Tensor::empty({flat_end - flat_begin}, info.dtype);
  auto* dst = static_cast<uint8_t*>(out.raw());
  for (const sharded_layout::CoverRun& run : runs) {
    const uint8_t* src = impl_->piece_bytes(name, pieces[run.piece]);
    std::memcpy(dst + run.begin * element_size, src + run.src * element_size,
                run.count * element_size);
  }
  impl_->bytes_read += out.nbytes();
  return out;
}

Tensor ShardedCheckpointReader::read_box(const std::string& name,
                                         const std::vector<int64_t>& offsets,
                                         const std::vector<int64_t>& box_shape) {
  const int64_t numel = sharded_layout::checked_numel(box_shape);
  if (numel < 0)
    fail("sharded checkpoint '{}': tensor '{}': box shape {} is negative or too large", impl_->path,
         name, shape_str(box_shape));
  return read_flat(name, offsets, box_shape, 0, numel).view(box_shape);
}

Tensor ShardedCheckpointReader::read(const std::string& name) {
  auto found = impl_->infos.find(name);
  if (found == impl_->infos.end())
    fail("sharded checkpoint '{}' has no tensor '{}'", impl_->path, name);
  const std::vector<int64_t> shape = found->second.global_shape;
  return read_box(name, std::vector<int64_t>(shape.size(), 0), shape);
}

void ShardedCheckpointReader::verify_all() {
  for (auto& [name, pieces] : impl_->pieces)
    for (PieceEntry& piece : pieces) impl_->piece_bytes(name, piece);
  for (size_t f = 0; f < impl_->files.size(); ++f) {
    const uint8_t* data = impl_->file_data(f);
    if (sharded_layout::crc32_of(data, impl_->files[f].bytes) != impl_->files[f].crc32)
      fail("sharded checkpoint file '{}' is corrupt: it fails its whole-file crc32 check",
           impl_->file_path(f));
  }
}

bool is_sharded_checkpoint(const std::string& iteration_dir) {
  std::ifstream in(fs::path(iteration_dir) / "metadata.json", std::ios::binary);
  if (!in) return false;
  const std::string text(std::istreambuf_iterator<char>(in), {});
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  auto format = j.find("checkpoint_format");
  return format != j.end() && format->is_string() &&
         format->get<std::string>() == kShardedFormatName;
}

ShardedCheckpointReader open_sharded_checkpoint(const std::string& load_dir, int64_t iteration) {
  return ShardedCheckpointReader(read_checkpoint_metadata(load_dir, iteration).path);
}

}  // namespace megaton::ckpt
