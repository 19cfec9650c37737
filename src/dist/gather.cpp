// gather_named_tensors: a JSON directory of names, dtypes and shapes, then the tensors.
#include "dist/gather.h"

#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace megaton::dist {

namespace {

// The directory as int32 words (the Comm moves typed tensors): [byte length, bytes...].
Tensor pack_string(const std::string& s) {
  const int64_t words = 1 + (int64_t(s.size()) + 3) / 4;
  Tensor t = Tensor::zeros({words}, DType::I32);
  t.i32()[0] = int32_t(s.size());
  std::memcpy(t.i32() + 1, s.data(), s.size());
  return t;
}

std::string unpack_string(const Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.i32() + 1), size_t(t.i32()[0]));
}

}  // namespace

NamedTensors gather_named_tensors(Comm& comm, const Group& g, const NamedTensors& mine,
                                  int root) {
  MEGATON_CHECK(g.is_member() && root >= 0 && root < g.size(),
                "gather_named_tensors: root {} of group {}", root, g.describe());
  const Device dev = comm.device();
  if (g.rank != root) {
    nlohmann::json directory = nlohmann::json::array();
    for (const auto& [name, t] : mine)
      directory.push_back({name, std::string(dtype_name(t.dtype())), t.shape()});
    Tensor packed = pack_string(directory.dump());
    Tensor length = Tensor::empty({1}, DType::I64);
    length.i64()[0] = packed.numel();
    comm.send(length.to(dev), root, g);
    comm.send(packed.to(dev), root, g);
    for (const auto& [name, t] : mine) comm.send(t.to(dev), root, g);
    return {};
  }
  NamedTensors out;
  for (int member = 0; member < g.size(); ++member) {
    if (member == root) {
      // The root's own tensors stay where they are (host ones, e.g. offloaded optimizer
      // state, are not copied to the device only to be written from the host).
      for (const auto& [name, t] : mine) out.emplace_back(name, t);
      continue;
    }
    Tensor length = Tensor::empty({1}, DType::I64, dev);
    comm.recv(length, member, g);
    Tensor packed = Tensor::empty({length.to(Device::CPU).i64()[0]}, DType::I32, dev);
    comm.recv(packed, member, g);
    const nlohmann::json directory = nlohmann::json::parse(unpack_string(packed.to(Device::CPU)));
    for (const auto& entry : directory) {
      Tensor t = Tensor::empty(entry[2].get<Shape>(), dtype_from_name(entry[1].get<std::string>()), dev);
      comm.recv(t, member, g);
      out.emplace_back(entry[0].get<std::string>(), std::move(t));
    }
  }
  return out;
}

}  // namespace megaton::dist
