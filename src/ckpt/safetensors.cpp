// safetensors reader and writer.
#include "ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace megaton::ckpt {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

namespace {

// The reference implementation refuses headers above 100 MB; so do we, which also keeps
// a corrupt length from turning into a huge allocation.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void write_all(std::FILE* f, const void* data, size_t bytes, const std::string& path) {
  if (bytes && std::fwrite(data, 1, bytes, f) != bytes)
    fail("safetensors file '{}': write failed: {}", path, std::strerror(errno));
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<TensorToWrite> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    MEGATON_CHECK(t.defined(), "tensor '{}' for {} is undefined", name, path);
    MEGATON_CHECK(t.device() == Device::CPU, "tensor '{}' is not on the CPU", name);
    specs.push_back({name, t.dtype(), t.shape(), [&t] { return t; }});
  }
  save_safetensors_streamed(path, specs, metadata);
}

void save_safetensors_streamed(const std::string& path, const std::vector<TensorToWrite>& tensors,
                               const std::map<std::string, std::string>& metadata,
                               const std::function<void(size_t, const Tensor&)>& written) {
  // Largest element size first: the data section starts 8-byte aligned, so every tensor
  // then starts at a multiple of its element size.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].dtype) > dtype_size(tensors[b].dtype);
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (size_t i : order) {
    const TensorToWrite& t = tensors[i];
    MEGATON_CHECK(t.name != "__metadata__", "a tensor may not be named __metadata__ ({})", path);
    MEGATON_CHECK(names.insert(t.name).second, "tensor '{}' given twice for {}", t.name, path);
    const uint64_t bytes = uint64_t(numel_of(t.shape)) * dtype_size(t.dtype);
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');

  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("safetensors file '{}': cannot create: {}", tmp, std::strerror(errno));
  try {
    uint8_t length[8];
    uint64_t n = json.size();
    for (int i = 0; i < 8; ++i) length[i] = uint8_t(n >> (8 * i));
    write_all(f, length, 8, tmp);
    write_all(f, json.data(), json.size(), tmp);
    for (size_t i : order) {
      const TensorToWrite& spec = tensors[i];
      const Tensor t = spec.produce();
      MEGATON_CHECK(t.defined() && t.device() == Device::CPU && t.dtype() == spec.dtype &&
                        t.numel() == numel_of(spec.shape),
                    "tensor '{}' for {}: produced {} elements of {}, declared {} of {}", spec.name,
                    path, t.defined() ? t.numel() : 0,
                    t.defined() ? dtype_name(t.dtype()) : "nothing", numel_of(spec.shape),
                    dtype_name(spec.dtype));
      write_all(f, t.raw(), t.nbytes(), tmp);
      if (written) written(i, t);
    }
    if (std::fflush(f) != 0 || ::fsync(fileno(f)) != 0)
      fail("safetensors file '{}': flush failed: {}", tmp, std::strerror(errno));
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (std::fclose(f) != 0) {
    std::remove(tmp.c_str());
    fail("safetensors file '{}': close failed: {}", tmp, std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    fail("safetensors file '{}': cannot rename from {}: {}", path, tmp, std::strerror(err));
  }
}

namespace {

// A read-only mapping of a whole file, unmapped when the last holder lets go.
std::shared_ptr<void> map_file(const std::string& path, uint64_t size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("safetensors file '{}': cannot open: {}", path, std::strerror(errno));
  // The size the header was checked against: a file that changed since would fault (SIGBUS)
  // where it became shorter.
  struct stat st {};
  if (::fstat(fd, &st) != 0 || uint64_t(st.st_size) != size) {
    ::close(fd);
    fail("safetensors file '{}': changed while being read ({} bytes, was {})", path,
         uint64_t(st.st_size), size);
  }
  void* data = size == 0 ? nullptr : ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) fail("safetensors file '{}': cannot map: {}", path, std::strerror(err));
  return std::shared_ptr<void>(data, [size](void* p) {
    if (p) ::munmap(p, size);
  });
}

// load_safetensors (mapped false) or map_safetensors (true).
SafetensorsFile read_safetensors(const std::string& path, bool mapped) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("safetensors file '{}': cannot open: {}", path, std::strerror(errno));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = uint64_t(in.tellg());
  in.seekg(0);
  if (file_size < 8)
    fail("safetensors file '{}': truncated: {} bytes, less than the 8-byte header length", path,
         file_size);
  uint8_t length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= uint64_t(length[i]) << (8 * i);
  if (header_size > kMaxHeaderBytes)
    fail("safetensors file '{}': header length {} is over the {}-byte limit (corrupt file?)", path,
         header_size, kMaxHeaderBytes);
  if (header_size > file_size - 8)
    fail("safetensors file '{}': truncated: header length {} but only {} bytes follow", path,
         header_size, file_size - 8);
  std::string json(header_size, '\0');
  in.read(json.data(), std::streamsize(header_size));
  if (!in) fail("safetensors file '{}': read failed in the header", path);

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(json);
  } catch (const nlohmann::json::exception& e) {
    fail("safetensors file '{}': header is not valid JSON: {}", path, e.what());
  }
  if (!header.is_object()) fail("safetensors file '{}': header is not a JSON object", path);

  const uint64_t data_start = 8 + header_size, data_size = file_size - data_start;
  SafetensorsFile out;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  std::map<std::string, std::pair<Shape, DType>> shapes;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("safetensors file '{}': __metadata__ is not an object", path);
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          fail("safetensors file '{}': __metadata__ value for '{}' is not a string", path, key);
        out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    auto bad = [&](std::string_view what) {
      fail("safetensors file '{}': tensor '{}': {}", path, name, what);
    };
    if (!entry.is_object()) bad("entry is not an object");
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) bad("no string 'dtype'");
    if (!entry.contains("shape") || !entry["shape"].is_array()) bad("no array 'shape'");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2 || !entry["data_offsets"][0].is_number_unsigned() ||
        !entry["data_offsets"][1].is_number_unsigned())
      bad("'data_offsets' is not [begin, end] of non-negative integers");
    std::string dtype_str = entry["dtype"].get<std::string>();
    DType dtype;
    try {
      dtype = dtype_from_name(dtype_str);
    } catch (const Error& e) {
      fail("safetensors file '{}': tensor '{}': {}", path, name, e.what());
    }
    Shape shape;
    uint64_t numel = 1;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) bad("shape holds something not a non-negative integer");
      uint64_t v = d.get<uint64_t>();
      if (v != 0 && numel > (uint64_t(1) << 62) / v) bad("shape too large");
      numel *= v;
      shape.push_back(int64_t(v));
    }
    uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    if (end < begin || end - begin != numel * dtype_size(dtype))
      fail(
          "safetensors file '{}': tensor '{}': data_offsets [{}, {}] hold {} bytes, but {} {} "
          "needs {}",
          path, name, begin, end, end - begin, dtype_str, shape_str(shape),
          numel * dtype_size(dtype));
    if (end > data_size)
      fail(
          "safetensors file '{}': truncated: tensor '{}' ends at data byte {}, but the file "
          "holds {} data bytes",
          path, name, end, data_size);
    out.tensors[name] = mapped ? Tensor() : Tensor::empty(shape, dtype);
    shapes[name] = {shape, dtype};
    spans.push_back({begin, end, name});
  }
  // The reference reader demands that the tensors tile the data section exactly: no gap,
  // no overlap, nothing after the last one.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  for (const Span& s : spans) {
    if (s.begin != expect)
      fail(
          "safetensors file '{}': tensor '{}' starts at data byte {}, expected {} (gap or "
          "overlap)",
          path, s.name, s.begin, expect);
    expect = s.end;
  }
  if (expect != data_size)
    fail("safetensors file '{}': tensors cover {} data bytes but the file holds {}", path, expect,
         data_size);

  if (mapped) {
    // Views over the mapping (a const mapping: the tensors are read only).
    out.mapping = map_file(path, file_size);
    auto* base = static_cast<uint8_t*>(out.mapping.get());
    for (const Span& s : spans) {
      const auto& [shape, dtype] = shapes.at(s.name);
      uint8_t* at = base + data_start + s.begin;
      if (s.end == s.begin) {
        out.tensors[s.name] = Tensor::empty(shape, dtype);
      } else if (uintptr_t(at) % dtype_size(dtype) != 0) {
        // A header not padded to 8 bytes leaves this tensor misaligned: copied (aligned).
        Tensor t = Tensor::empty(shape, dtype);
        std::memcpy(t.raw(), at, s.end - s.begin);
        out.tensors[s.name] = std::move(t);
      } else {
        out.tensors[s.name] = Tensor::borrow(at, shape, dtype, Device::CPU);
      }
    }
    return out;
  }
  for (const Span& s : spans) {
    Tensor& t = out.tensors[s.name];
    if (s.end == s.begin) continue;
    in.seekg(std::streamoff(data_start + s.begin));
    in.read(static_cast<char*>(t.raw()), std::streamsize(s.end - s.begin));
    if (!in) fail("safetensors file '{}': read failed in tensor '{}'", path, s.name);
  }
  return out;
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path) { return read_safetensors(path, false); }

SafetensorsFile map_safetensors(const std::string& path) { return read_safetensors(path, true); }

void release_mapped_pages(const Tensor& view) {
  if (!view.defined() || view.nbytes() == 0) return;
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (uintptr_t(view.raw()) + page - 1) / page * page;
  const uintptr_t end = (uintptr_t(view.raw()) + view.nbytes()) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace megaton::ckpt
