#include "server/request_log.h"

#include <fmt/format.h>

#include <cstdio>
#include <mutex>

namespace tansy::server {

namespace {

// Length of the valid UTF-8 sequence at s[i], or 0.
size_t utf8_len(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  if (n == 2 && c < 0xC2) return 0;  // overlong
  return n;
}

}  // namespace

std::string log_escape(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      o += "\\n";
    } else if (c == '\r') {
      o += "\\r";
    } else if (c == '\t') {
      o += "\\t";
    } else if (c == '\\') {
      o += "\\\\";
    } else if (c < 0x20 || c == 0x7f) {
      o += fmt::format("\\x{:02x}", c);
    } else if (size_t n = utf8_len(s, i); n > 0) {
      o.append(s.substr(i, n));
      i += n;
      continue;
    } else {
      o += fmt::format("\\x{:02x}", c);
    }
    ++i;
  }
  return o;
}

void log_line(std::string_view line) {
  std::string out;
  out.reserve(line.size() + 1);
  for (char c : line) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else
      out += c;
  }
  out += '\n';
  static std::mutex mu;
  std::lock_guard lk(mu);
  std::fwrite(out.data(), 1, out.size(), stderr);
  std::fflush(stderr);
}

RequestNote& request_note() {
  thread_local RequestNote note;
  return note;
}

}  // namespace tansy::server
