// Reading and writing tensors in the safetensors format (Hugging Face).
//
// Layout: u64 little-endian header length N; N bytes of JSON
// {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..],
// "data_offsets": [begin, end]}, ...}, padded with spaces so the data starts 8-byte
// aligned; then the tensors' raw little-endian bytes, back to back, offsets relative to
// the data start. Dtype strings are dtype_name()'s (F32 BF16 F16 F8_E4M3 F8_E5M2 I32 I64).
#pragma once
#include <map>
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

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // CPU tensors, dtype and shape as stored
  std::map<std::string, std::string> metadata;
};

// Reads a whole safetensors file into CPU tensors. Throws megaton::Error, with one line
// naming the file and the problem, when it is missing or unreadable, shorter than its
// header says, has a header that is not valid JSON or not of the shape above, names a
// dtype Megaton does not hold (e.g. F64, BOOL), or has data offsets that do not match the
// shape or do not tile the data section exactly.
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace megaton::ckpt
