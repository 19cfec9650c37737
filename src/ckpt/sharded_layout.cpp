// Box and flat-range geometry of the sharded checkpoint, the tiling check, crc32, JSON fields.
#include "ckpt/sharded_layout.h"

#include <zlib.h>

#include <algorithm>

#include "core/error.h"
#include "core/tensor.h"

namespace megaton::ckpt::sharded_layout {

int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && numel > (int64_t(1) << 62) / d) return -1;
    numel *= d;
  }
  return numel;
}

std::string geometry_problem(const std::vector<int64_t>& global_shape, const BoxRange& range) {
  const size_t n = global_shape.size();
  if (checked_numel(global_shape) < 0)
    return fmt::format("global shape {} is negative or too large", shape_str(global_shape));
  if (range.offsets.size() != n || range.box_shape.size() != n)
    return fmt::format("offsets {} and box shape {} must have the {} dimensions of global shape {}",
                       shape_str(range.offsets), shape_str(range.box_shape), n,
                       shape_str(global_shape));
  for (size_t d = 0; d < n; ++d)
    if (range.offsets[d] < 0 || range.box_shape[d] < 0 ||
        range.offsets[d] > global_shape[d] - range.box_shape[d])
      return fmt::format("box at offsets {} of shape {} is outside global shape {} (dimension {})",
                         shape_str(range.offsets), shape_str(range.box_shape),
                         shape_str(global_shape), d);
  const int64_t box_numel = checked_numel(range.box_shape);
  if (range.flat_begin < 0 || range.flat_begin > range.flat_end || range.flat_end > box_numel)
    return fmt::format("flat range [{}, {}) is outside the box's {} elements", range.flat_begin,
                       range.flat_end, box_numel);
  return "";
}

void append_common_runs(const BoxRange& a, const BoxRange& b, std::vector<CommonRun>& out) {
  if (a.flat_begin >= a.flat_end || b.flat_begin >= b.flat_end) return;
  const size_t n = a.offsets.size();
  if (n == 0) {  // a scalar: both non-empty ranges hold its one element
    out.push_back({0, 0, 1});
    return;
  }
  std::vector<int64_t> lo(n), extent(n);
  for (size_t d = 0; d < n; ++d) {
    lo[d] = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.box_shape[d], b.offsets[d] + b.box_shape[d]);
    if (hi <= lo[d]) return;
    extent[d] = hi - lo[d];
  }
  // Dimensions after k are spanned whole by the intersection and by both boxes, so a run
  // (extent[k] x ... x extent[n-1] elements) is contiguous in both flat orders.
  size_t k = n - 1;
  while (k > 0 && extent[k] == a.box_shape[k] && extent[k] == b.box_shape[k]) --k;
  int64_t run = 1;
  for (size_t d = k; d < n; ++d) run *= extent[d];
  std::vector<int64_t> a_stride(n), b_stride(n);
  a_stride[n - 1] = b_stride[n - 1] = 1;
  for (size_t d = n - 1; d-- > 0;) {
    a_stride[d] = a_stride[d + 1] * a.box_shape[d + 1];
    b_stride[d] = b_stride[d + 1] * b.box_shape[d + 1];
  }
  int64_t a_base = 0, b_base = 0, runs = 1;
  for (size_t d = 0; d <= k; ++d) {
    a_base += (lo[d] - a.offsets[d]) * a_stride[d];
    b_base += (lo[d] - b.offsets[d]) * b_stride[d];
  }
  for (size_t d = 0; d < k; ++d) runs *= extent[d];
  // Box-flat index of run r's first element in a and in b; both increase with r.
  auto starts = [&](int64_t r, int64_t& a_start, int64_t& b_start) {
    a_start = a_base;
    b_start = b_base;
    for (size_t d = k; d-- > 0;) {
      const int64_t i = r % extent[d];
      r /= extent[d];
      a_start += i * a_stride[d];
      b_start += i * b_stride[d];
    }
  };
  // The first run for which `pred` holds (pred is false then true along r).
  auto first_run = [&](auto pred) {
    int64_t lo_r = 0, hi_r = runs;
    while (lo_r < hi_r) {
      const int64_t mid = lo_r + (hi_r - lo_r) / 2;
      int64_t as, bs;
      starts(mid, as, bs);
      if (pred(as, bs))
        hi_r = mid;
      else
        lo_r = mid + 1;
    }
    return lo_r;
  };
  const int64_t r_begin = first_run(
      [&](int64_t as, int64_t bs) { return as + run > a.flat_begin && bs + run > b.flat_begin; });
  const int64_t r_end =
      first_run([&](int64_t as, int64_t bs) { return as >= a.flat_end || bs >= b.flat_end; });
  const size_t first_new = out.size();
  for (int64_t r = r_begin; r < r_end; ++r) {
    int64_t as, bs;
    starts(r, as, bs);
    const int64_t j0 = std::max({int64_t(0), a.flat_begin - as, b.flat_begin - bs});
    const int64_t j1 = std::min({run, a.flat_end - as, b.flat_end - bs});
    if (j0 >= j1) continue;
    const CommonRun next{as + j0 - a.flat_begin, bs + j0 - b.flat_begin, j1 - j0};
    if (out.size() > first_new) {
      CommonRun& last = out.back();
      if (last.dst + last.count == next.dst && last.src + last.count == next.src) {
        last.count += next.count;
        continue;
      }
    }
    out.push_back(next);
  }
}

std::optional<TilingProblem> find_tiling_problem(std::vector<CoverRun>& runs, int64_t total) {
  std::sort(runs.begin(), runs.end(), [](const CoverRun& x, const CoverRun& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.piece < y.piece;
  });
  int64_t covered = 0;  // [0, covered) is held exactly once so far
  size_t last_piece = 0;
  for (const CoverRun& r : runs) {
    if (r.count <= 0) continue;
    if (r.begin > covered) return TilingProblem{false, covered, 0, 0};
    if (r.begin < covered) return TilingProblem{true, r.begin, last_piece, r.piece};
    covered = r.begin + r.count;
    last_piece = r.piece;
  }
  if (covered < total) return TilingProblem{false, covered, 0, 0};
  return std::nullopt;
}

std::string element_coordinates(const BoxRange& range, int64_t flat_index) {
  const size_t n = range.box_shape.size();
  std::vector<int64_t> coords(n);
  for (size_t d = n; d-- > 0;) {
    const int64_t extent = std::max<int64_t>(range.box_shape[d], 1);
    coords[d] = range.offsets[d] + flat_index % extent;
    flat_index /= extent;
  }
  return shape_str(coords);
}

uint32_t crc32_of(const void* data, uint64_t bytes) {
  const auto* p = static_cast<const Bytef*>(data);
  uLong crc = crc32_z(0L, Z_NULL, 0);
  // crc32_z takes a z_size_t; chunks keep any size within it.
  constexpr uint64_t kChunk = uint64_t(1) << 30;
  while (bytes > 0) {
    const uint64_t chunk = std::min(bytes, kChunk);
    crc = crc32_z(crc, p, z_size_t(chunk));
    p += chunk;
    bytes -= chunk;
  }
  return uint32_t(crc);
}

const nlohmann::json& json_field(const nlohmann::json& j, const char* key,
                                 const std::string& where) {
  if (!j.is_object()) fail("{}: not a JSON object", where);
  auto it = j.find(key);
  if (it == j.end()) fail("{}: '{}' is missing", where, key);
  return *it;
}

int64_t json_int(const nlohmann::json& j, const char* key, const std::string& where) {
  const nlohmann::json& v = json_field(j, key, where);
  if (!v.is_number_integer()) fail("{}: '{}' is {}, expected an integer", where, key, v.dump());
  return v.get<int64_t>();
}

uint64_t json_uint(const nlohmann::json& j, const char* key, const std::string& where) {
  const nlohmann::json& v = json_field(j, key, where);
  if (!v.is_number_unsigned())
    fail("{}: '{}' is {}, expected a non-negative integer", where, key, v.dump());
  return v.get<uint64_t>();
}

std::string json_string(const nlohmann::json& j, const char* key, const std::string& where) {
  const nlohmann::json& v = json_field(j, key, where);
  if (!v.is_string()) fail("{}: '{}' is {}, expected a string", where, key, v.dump());
  return v.get<std::string>();
}

std::vector<int64_t> json_int_list(const nlohmann::json& j, const char* key,
                                   const std::string& where) {
  const nlohmann::json& v = json_field(j, key, where);
  std::vector<int64_t> out;
  if (v.is_array()) {
    for (const nlohmann::json& e : v) {
      if (!e.is_number_integer()) break;
      out.push_back(e.get<int64_t>());
    }
    if (out.size() == v.size()) return out;
  }
  fail("{}: '{}' is {}, expected a list of integers", where, key, v.dump());
}

}  // namespace megaton::ckpt::sharded_layout
