// ArgReader's typed reads and the shared range checks.
#include "train/args/arg_reader.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "core/error.h"
#include "core/printable.h"

namespace megaton {

const std::string& ArgReader::one(const std::string& k) const {
  const auto& v = raw.at(k);
  if (v.size() != 1) fail("option '{}' takes exactly one value (got {})", k, v.size());
  return v[0];
}

int64_t ArgReader::integer(const std::string& k, int64_t max) const {
  const std::string& s = one(k);
  int64_t out = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  if (ec == std::errc::result_out_of_range ||
      (ec == std::errc() && p == s.data() + s.size() && (out > max || out < -max)))
    fail("option '{}' must be at most {} in magnitude (got '{}')", k, max, printable(s));
  if (ec != std::errc() || p != s.data() + s.size())
    fail("option '{}' expects an integer (got '{}')", k, printable(s));
  return out;
}

void ArgReader::get(const std::string& k, int64_t& out) const {
  if (has(k)) out = integer(k, kMaxFlagInteger);
}

void ArgReader::get(const std::string& k, uint64_t& out) const {
  if (!has(k)) return;
  const int64_t v = integer(k, std::numeric_limits<int64_t>::max());
  if (v < 0) fail("option '{}' must be >= 0 (got {})", k, v);
  out = uint64_t(v);
}

// Every float flag is a finite number: none means anything by nan or inf, and a NaN
// hyperparameter trains a model to NaN without any other error.
void ArgReader::get(const std::string& k, double& out) const {
  if (!has(k)) return;
  const std::string& s = one(k);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || std::isspace(static_cast<unsigned char>(s[0])))
    fail("option '{}' expects a number (got '{}')", k, printable(s));
  if (!std::isfinite(v)) fail("option '{}' must be a finite number (got '{}')", k, printable(s));
  out = v;
}

void ArgReader::get(const std::string& k, float& out) const {
  double v = out;
  get(k, v);
  if (std::fabs(v) > double(std::numeric_limits<float>::max()))
    fail("option '{}' must be a finite 32-bit float (got '{}')", k, one(k));
  out = float(v);
}

void ArgReader::get(const std::string& k, bool& out) const {
  if (!has(k)) return;
  std::string s = one(k);
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  if (s == "true" || s == "1" || s == "yes")
    out = true;
  else if (s == "false" || s == "0" || s == "no")
    out = false;
  else
    fail("option '{}' expects true or false (got '{}')", k, printable(s));
}

void ArgReader::get(const std::string& k, std::string& out) const {
  if (has(k)) out = one(k);
}

bool ArgReader::on(const std::string& k) const {
  bool v = false;
  get(k, v);
  return v;
}

void check_at_least(const char* key, double v, double lo) {
  if (!(v >= lo)) fail("option '{}' must be >= {} (got {})", key, lo, v);
}

void check_positive(const char* key, double v) {
  if (!(v > 0)) fail("option '{}' must be > 0 (got {})", key, v);
}

void check_fraction(const char* key, double v) {
  if (!(v >= 0 && v < 1)) fail("option '{}' must be in [0, 1) (got {})", key, v);
}

}  // namespace megaton
