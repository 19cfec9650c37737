// Errors: megaton::Error for what a user can cause (exit 2), checks for internal bugs (exit 1).
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace megaton {

// A mistake the user can fix: a bad flag, config key, data file or checkpoint.
// The message is one line naming the key, file or value and what was expected.
// The CLI prints it and exits with status 2.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Memory the run needs and the machine does not have: a host or device allocation that
// failed or would exceed what is available, or a size check made before allocating
// (train/memory_check.h). The user fixes it with smaller sizes (flags) or a bigger
// machine, so it is an Error (exit 2); the message names the bytes requested and the
// bytes available.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

// A broken internal invariant (a bug in Megaton, not in the input). Exit status 1.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace megaton

// MEGATON_CHECK(cond, "fmt", args...): throws InternalError naming file, line and the
// condition when an internal invariant does not hold.
#define MEGATON_CHECK(cond, ...)                                                        \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      throw ::megaton::InternalError(::fmt::format("{}:{}: check `{}` failed: {}",      \
                                                   __FILE__, __LINE__, #cond,           \
                                                   ::fmt::format(__VA_ARGS__)));        \
    }                                                                                   \
  } while (0)
