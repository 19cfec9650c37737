// A reader of TensorBoard event files for the tests, independent of the writer: TFRecord
// framing with its CRCs checked, and the protobuf wire format of the scalar events.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "train/tensorboard.h"

namespace megaton::testing {

struct Scalar {
  std::string tag;
  float value = 0;
  int64_t step = 0;
  double wall_time = 0;
  std::string file_version;
};

// A protobuf reader for the fields the writer uses (varint, fixed64, fixed32, bytes).
struct Wire {
  std::string_view s;
  size_t at = 0;
  bool done() const { return at >= s.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = static_cast<unsigned char>(s.at(at++));
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  }
  template <class T>
  T fixed() {
    T v;
    std::memcpy(&v, s.substr(at, sizeof(T)).data(), sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string_view bytes() {
    const size_t n = varint();
    std::string_view out = s.substr(at, n);
    at += n;
    return out;
  }
};

inline Scalar decode_event(std::string_view event) {
  Scalar out;
  Wire w{event};
  while (!w.done()) {
    const uint64_t key = w.varint();
    switch (key) {
      case (1 << 3) | 1: out.wall_time = w.fixed<double>(); break;
      case (2 << 3) | 0: out.step = int64_t(w.varint()); break;
      case (3 << 3) | 2: out.file_version = std::string(w.bytes()); break;
      case (5 << 3) | 2: {
        Wire summary{w.bytes()};
        EXPECT_EQ(summary.varint(), uint64_t((1 << 3) | 2));
        Wire value{summary.bytes()};
        EXPECT_TRUE(summary.done()) << "one value per summary";
        EXPECT_EQ(value.varint(), uint64_t((1 << 3) | 2));
        out.tag = std::string(value.bytes());
        EXPECT_EQ(value.varint(), uint64_t((2 << 3) | 5));
        out.value = value.fixed<float>();
        break;
      }
      default: ADD_FAILURE() << "unexpected field key " << key; return out;
    }
  }
  return out;
}

inline std::vector<Scalar> read_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Scalar> out;
  for (size_t at = 0; at < data.size();) {
    uint64_t length;
    uint32_t length_crc, data_crc;
    std::memcpy(&length, data.data() + at, 8);
    std::memcpy(&length_crc, data.data() + at + 8, 4);
    EXPECT_EQ(length_crc, masked_crc32c(std::string_view(data).substr(at, 8)));
    const std::string_view event = std::string_view(data).substr(at + 12, length);
    std::memcpy(&data_crc, data.data() + at + 12 + length, 4);
    EXPECT_EQ(data_crc, masked_crc32c(event));
    out.push_back(decode_event(event));
    at += 12 + length + 4;
  }
  return out;
}

}  // namespace megaton::testing
