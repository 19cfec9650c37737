// tests/golden/muon_golden.safetensors (tools/make_muon_golden.py: NVIDIA
// Emerging-Optimizers 0.3.0 and Megatron's TensorParallelMuon), read once per test binary:
// its tensors by name and its "cases" metadata by group (docs/golden.md "muon_golden").
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "ckpt/safetensors.h"

namespace megaton::testing::muon_golden {

inline const ckpt::SafetensorsFile& file() {
  static const ckpt::SafetensorsFile f = ckpt::load_safetensors(
      std::string(MEGATON_SOURCE_DIR) + "/tests/golden/muon_golden.safetensors");
  return f;
}
inline const nlohmann::json& cases(const std::string& group) {
  static const nlohmann::json j = nlohmann::json::parse(file().metadata.at("cases"));
  return j.at(group);
}
inline const Tensor& tensor(const std::string& name) {
  auto it = file().tensors.find(name);
  if (it == file().tensors.end()) throw std::runtime_error("golden tensor missing: " + name);
  return it->second;
}

}  // namespace megaton::testing::muon_golden
