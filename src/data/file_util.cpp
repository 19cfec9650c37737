// File helpers: read-only memory maps and atomically written files.
#include "data/file_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "core/error.h"

namespace megaton::data {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail("{}: cannot stat: {}", path, std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail("{}: cannot mmap {} bytes: {}", path, size_, std::strerror(e));
    }
    data_ = static_cast<std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
}

MappedFile::~MappedFile() { release(); }

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MappedFile::release() {
  if (data_) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

namespace {
std::atomic<uint64_t> temp_counter{0};
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  temp_path_ = fmt::format("{}.tmp.{}.{}", path_, ::getpid(), temp_counter++);
  file_ = std::fopen(temp_path_.c_str(), "wb");
  if (!file_) fail("{}: cannot create {}: {}", path_, temp_path_, std::strerror(errno));
  // Large sequential writes: a bigger stdio buffer halves the syscalls.
  std::setvbuf(file_, nullptr, _IOFBF, 1 << 20);
}

AtomicFile::~AtomicFile() { abandon(); }

void AtomicFile::write(const void* data, size_t bytes) {
  MEGATON_CHECK(file_ != nullptr, "write to {} after commit or abandon", path_);
  if (bytes == 0) return;
  if (std::fwrite(data, 1, bytes, file_) != bytes)
    fail("{}: write failed after {} bytes: {}", path_, offset_, std::strerror(errno));
  offset_ += bytes;
}

void AtomicFile::close() {
  MEGATON_CHECK(file_ != nullptr, "close of {} twice, or after commit or abandon", path_);
  errno = 0;
  bool ok = std::fflush(file_) == 0;
  int e = errno;
  ok = (std::fclose(file_) == 0) && ok;
  if (!e) e = errno;
  file_ = nullptr;
  if (!ok) {
    std::remove(temp_path_.c_str());
    temp_path_.clear();
    fail("{}: write failed: {}", path_, std::strerror(e ? e : EIO));
  }
}

void AtomicFile::commit() {
  MEGATON_CHECK(!committed_ && !temp_path_.empty(), "commit of {} twice, or after abandon", path_);
  if (file_) close();
  if (std::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    std::remove(temp_path_.c_str());
    const std::string temp = std::exchange(temp_path_, std::string());
    fail("{}: cannot rename {} into place: {}", path_, temp, std::strerror(e));
  }
  committed_ = true;
}

void AtomicFile::abandon() {
  if (file_) {
    std::fclose(file_);
    file_ = nullptr;
  }
  if (!committed_ && !temp_path_.empty()) {
    std::remove(temp_path_.c_str());
    temp_path_.clear();
  }
}

void write_file_atomic(const std::string& path, const void* data, size_t bytes) {
  AtomicFile f(path);
  f.write(data, bytes);
  f.commit();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{}: read failed", path);
  return std::move(ss).str();
}

std::string fnv1a_hex(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return fmt::format("{:016x}", h);
}

}  // namespace megaton::data
