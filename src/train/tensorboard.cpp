// TensorBoard event files: TFRecord framing, CRC-32C and the few protobuf fields of a
// scalar Event, encoded by hand.
#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/printable.h"

namespace megaton {

namespace {

const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protobuf wire format (protobuf.dev "Encoding"): a key is (field << 3) | wire type;
// varint 0, 64-bit 1, length-delimited 2, 32-bit 5.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(v | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void put_key(std::string& out, int field, int wire_type) { put_varint(out, uint64_t(field << 3 | wire_type)); }
template <class T>
void put_fixed(std::string& out, T v) {  // little endian, as on every host Megaton runs on
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Event {wall_time = 1, step = 2, [file_version = 3 | summary = 5]}.
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, wall_time);
  if (step != 0) {
    put_key(e, 2, 0);
    put_varint(e, uint64_t(step));
  }
  return e;
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) c = crc32c_table()[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    fail("--tensorboard-dir {}: cannot create the directory{}", printable(dir),
         ec ? ": " + ec.message() : std::string());
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  path_ = (fs::path(dir) / fmt::format("events.out.tfevents.{}.{}.{}.0",
                                       int64_t(now_seconds()), host, int64_t(getpid())))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) fail("--tensorboard-dir {}: cannot open {}", printable(dir), printable(path_));
  std::string e = event_header(now_seconds(), 0);
  put_bytes(e, 3, "brain.Event:2");
  write_record(e);
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(std::string_view tag, double value, int64_t step,
                                   double wall_time) {
  std::string v;  // Summary.Value
  put_bytes(v, 1, tag);
  put_key(v, 2, 5);
  put_fixed(v, float(value));
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_time < 0 ? now_seconds() : wall_time, step);
  put_bytes(e, 5, summary);
  write_record(e);
}

void TensorBoardWriter::write_record(const std::string& event) {
  std::string record;
  const uint64_t length = event.size();
  std::string length_bytes;
  put_fixed(length_bytes, length);
  record += length_bytes;
  put_fixed(record, masked_crc32c(length_bytes));
  record += event;
  put_fixed(record, masked_crc32c(event));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size())
    fail("--tensorboard-dir: cannot write {}: {}", printable(path_), std::strerror(errno));
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0)
    fail("--tensorboard-dir: cannot write {}: {}", printable(path_), std::strerror(errno));
}

}  // namespace megaton
