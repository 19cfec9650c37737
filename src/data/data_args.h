// Megatron's file forms of the data blend: --data-args-path and --per-split-data-args-path.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <vector>

namespace megaton::data {

// --data-args-path: a text file holding what --data-path would (a prefix, or "weight
// prefix" pairs), whitespace-separated over any number of lines (Megatron's
// get_blend_and_blend_per_split reads it as f.read().split()). Returns the tokens, for
// parse_data_path. Throws megaton::Error naming the flag and the file when it cannot be read
// or holds no token.
std::vector<std::string> read_data_args_path(const std::string& path);

// --per-split-data-args-path: a JSON object with keys "train", "valid" and "test", each a
// string of --data-path tokens (split on whitespace), a list of such tokens, or null (no
// dataset for that split), as Megatron reads it. Returns the three token lists in that
// order (nullopt for null). Throws megaton::Error naming the flag, the file and the key for
// unreadable JSON, a missing key, or a value of another type.
std::array<std::optional<std::vector<std::string>>, 3> read_per_split_data_args_path(
    const std::string& path);

}  // namespace megaton::data
