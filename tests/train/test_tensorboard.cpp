// TensorBoardWriter: CRC-32C, and event files decoded record by record by an independent
// reader (TFRecord framing + the protobuf wire format) in this test.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "train/tensorboard.h"
#include "tensorboard_testing.h"

namespace megaton {
namespace {

namespace fs = std::filesystem;
using testing::read_events;

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
