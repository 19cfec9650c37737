// printable(): user-supplied text made safe to quote in a one-line error message.
#pragma once
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace megaton {

// `text` with every byte outside printable ASCII written as \xNN (and '\n', '\t' as \n,
// \t), cut to `max_chars` characters with "..." appended when longer. A key or value read
// from a binary file would otherwise put raw control bytes on the user's terminal.
inline std::string printable(std::string_view text, size_t max_chars = 80) {
  std::string out;
  for (unsigned char c : text) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c >= 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += char(c);
  }
  return out;
}

}  // namespace megaton
