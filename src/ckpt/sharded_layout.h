// Internal to the sharded checkpoint (sharded.cpp, sharded_read.cpp): the geometry of boxes
// and flat ranges of a global tensor, the tiling check, crc32, and checked JSON fields.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace megaton::ckpt::sharded_layout {

// A box [offsets, offsets + box_shape) of a global tensor (elements, global coordinates),
// restricted to the flat range [flat_begin, flat_end) of the box's elements in row-major
// order. offsets and box_shape have the tensor's rank (0 for a scalar, whose box holds one
// element).
struct BoxRange {
  std::vector<int64_t> offsets, box_shape;
  int64_t flat_begin = 0, flat_end = 0;
};

// The product of `shape`, or -1 when a dimension is negative or the product passes 2^62.
int64_t checked_numel(const std::vector<int64_t>& shape);

// "" when `range` is a valid piece of a tensor of `global_shape` (same rank, box inside the
// tensor, 0 <= flat_begin <= flat_end <= box numel), else what is wrong, for a message.
std::string geometry_problem(const std::vector<int64_t>& global_shape, const BoxRange& range);

// A run of elements that two BoxRanges share: elements [dst, dst + count) of the first's
// flat range (counted from its flat_begin) are elements [src, src + count) of the second's.
struct CommonRun {
  int64_t dst = 0, src = 0, count = 0;
};

// Appends to `out` the elements `a` and `b` (of one tensor, valid) have in common, as runs
// that are contiguous in both: whole rows of the last dimensions where both boxes span the
// intersection, merged across rows where both stay contiguous. Only the rows inside both
// flat ranges are visited (found by bisection), so the cost is the number of runs.
void append_common_runs(const BoxRange& a, const BoxRange& b, std::vector<CommonRun>& out);

// Elements [begin, begin + count) of a target range, taken from piece `piece`.
struct CoverRun {
  int64_t begin = 0, count = 0;
  size_t piece = 0;
  int64_t src = 0;  // first element within the piece's flat range
};

// What keeps runs from covering [0, total) exactly once.
struct TilingProblem {
  bool overlap = false;               // false: element `at` is in no run
  int64_t at = 0;                     // the first element missing or held twice
  size_t piece = 0, other_piece = 0;  // for an overlap: the two pieces holding `at`
};

// Sorts `runs` by begin and returns the first problem, or nullopt when they tile [0, total).
std::optional<TilingProblem> find_tiling_problem(std::vector<CoverRun>& runs, int64_t total);

// The coordinates "[i, j, k]" of element `flat_index` (row-major) of box `range`
// (offsets added).
std::string element_coordinates(const BoxRange& range, int64_t flat_index);

// zlib crc32 of `bytes` bytes (any size).
uint32_t crc32_of(const void* data, uint64_t bytes);

// Checked reads of a JSON object's fields. Each throws megaton::Error "<where>: '<key>' is
// missing or not <what>" (`where` names the file and entry).
int64_t json_int(const nlohmann::json& j, const char* key, const std::string& where);
uint64_t json_uint(const nlohmann::json& j, const char* key, const std::string& where);
std::string json_string(const nlohmann::json& j, const char* key, const std::string& where);
std::vector<int64_t> json_int_list(const nlohmann::json& j, const char* key,
                                   const std::string& where);
const nlohmann::json& json_field(const nlohmann::json& j, const char* key,
                                 const std::string& where);

}  // namespace megaton::ckpt::sharded_layout
