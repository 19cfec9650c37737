// Reading and writing tensors in the safetensors format (Hugging Face).
//
// Layout: u64 little-endian header length N; N bytes of JSON
// {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..],
// "data_offsets": [begin, end]}, ...}, padded with spaces so the data starts 8-byte
// aligned; then the tensors' raw little-endian bytes, back to back, offsets relative to
// the data start. Dtype strings are dtype_name()'s (F32 BF16 F16 F8_E4M3 F8_E5M2 I32 I64).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace megaton::ckpt {

// Writes `tensors` (CPU, any DType; names unique and not "__metadata__") and `metadata`
// (omitted from the header when empty) to `path`. The file is written as path + ".tmp",
// flushed to disk, then renamed over `path`, so a reader never sees a partial file. Header
// entries follow the data order: tensors sorted by element size, largest first (so every
// tensor is aligned to its element size), in the given order within a size.
// Throws megaton::Error naming the path when the file cannot be written; InternalError
// for duplicate or reserved names or a non-CPU tensor.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// A tensor for save_safetensors_streamed: its dtype and shape known up front, its bytes
// made when the file reaches it (so a writer holds one tensor at a time).
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  // Returns a CPU tensor of `dtype` with shape's element count (any shape, contiguous). It
  // is called once, in the file's order, and the tensor is released after it is written.
  std::function<Tensor()> produce;
};

// save_safetensors for tensors made on demand; the same file, order and errors, plus
// InternalError when a produced tensor is not of its declared dtype and size.
// `written(i, t)` (optional) sees each produced tensor (index into `tensors`) just after its
// bytes are written, e.g. for a checksum.
void save_safetensors_streamed(const std::string& path, const std::vector<TensorToWrite>& tensors,
                               const std::map<std::string, std::string>& metadata = {},
                               const std::function<void(size_t, const Tensor&)>& written = nullptr);

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // CPU tensors, dtype and shape as stored
  std::map<std::string, std::string> metadata;
  // map_safetensors: the file's read-only mapping, which `tensors` view (keep it while they
  // are used; copies of it keep the mapping alive).
  std::shared_ptr<void> mapping;
};

// Reads a whole safetensors file into CPU tensors. Throws megaton::Error, with one line
// naming the file and the problem, when it is missing or unreadable, shorter than its
// header says, has a header that is not valid JSON or not of the shape above, names a
// dtype Megaton does not hold (e.g. F64, BOOL), or has data offsets that do not match the
// shape or do not tile the data section exactly.
SafetensorsFile load_safetensors(const std::string& path);

// load_safetensors without reading the data: the same checks of the header and sizes, then
// the tensors are views of the file mapped read-only (mmap): reading one touches only its
// pages. The tensors must not be written. Same errors, and megaton::Error naming the file
// when it cannot be mapped.
SafetensorsFile map_safetensors(const std::string& path);

// Lets the kernel drop this process's pages of `view` (a tensor of map_safetensors) once it
// has been used: the whole pages inside its bytes are unmapped from the process
// (madvise MADV_DONTNEED; the file and the page cache are untouched, a later read maps them
// again), so reading a large file tensor by tensor does not keep all of it resident.
void release_mapped_pages(const Tensor& view);

}  // namespace megaton::ckpt
