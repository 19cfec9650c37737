// TensorBoardWriter: CRC-32C, and event files decoded record by record by an independent
// reader (TFRecord framing + the protobuf wire format) in this test.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "train/tensorboard.h"

namespace megaton {
namespace {

namespace fs = std::filesystem;

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

Scalar decode_event(std::string_view event) {
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

std::vector<Scalar> read_events(const std::string& path) {
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

TEST(TensorBoard, Crc32cCheckValue) {
  // The CRC-32C check value of "123456789" (RFC 3720 B.4; the CRC catalogue's CRC-32/ISCSI).
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
}

TEST(TensorBoard, ScalarsRoundTrip) {
  const fs::path dir = fs::temp_directory_path() / ("megaton_tb_" + std::to_string(getpid()));
  fs::remove_all(dir);
  {
    TensorBoardWriter w((dir / "sub").string());
    EXPECT_EQ(fs::path(w.path()).filename().string().rfind("events.out.tfevents.", 0), 0u);
    w.add_scalar("lm loss", 10.5, 1, 1000.25);
    w.add_scalar("learning-rate", 3e-4, 1, 1000.25);
    w.add_scalar("lm loss", 9.75, 300, 1001.0);
    w.add_scalar("grad-norm", -2.0, int64_t(1) << 40, 1002.0);
    w.flush();
    const auto events = read_events(w.path());
    ASSERT_EQ(events.size(), 5u);
    EXPECT_EQ(events[0].file_version, "brain.Event:2");
    EXPECT_GT(events[0].wall_time, 1.7e9) << "seconds since the epoch";
    EXPECT_EQ(events[1].tag, "lm loss");
    EXPECT_EQ(events[1].value, 10.5f);
    EXPECT_EQ(events[1].step, 1);
    EXPECT_EQ(events[1].wall_time, 1000.25);
    EXPECT_EQ(events[2].tag, "learning-rate");
    EXPECT_EQ(events[2].value, 3e-4f);
    EXPECT_EQ(events[3].step, 300);
    EXPECT_EQ(events[3].value, 9.75f);
    EXPECT_EQ(events[4].step, int64_t(1) << 40);
    EXPECT_EQ(events[4].value, -2.0f);
  }
  fs::remove_all(dir);
}

TEST(TensorBoard, UnwritableDirectoryIsAUserError) {
  const fs::path file = fs::temp_directory_path() / ("megaton_tb_file_" + std::to_string(getpid()));
  std::ofstream(file) << "x";
  try {
    TensorBoardWriter w((file / "dir").string());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--tensorboard-dir"), std::string::npos) << e.what();
  }
  fs::remove(file);
}

}  // namespace
}  // namespace megaton
