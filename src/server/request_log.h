// tansy serve's log: one line per request with its outcome, built from escaped values so that
// nothing a client sends (paths, field names, model names) can start a line of its own.
#pragma once
#include <chrono>
#include <string>
#include <string_view>

namespace tansy::server {

// Control characters, backslashes and bytes that are not valid UTF-8 as \n, \t, \\, \xNN.
std::string log_escape(std::string_view s);

// Writes one line to stderr; any line break left in it is escaped.
void log_line(std::string_view line);

// What a request's handler learned about its outcome, for the request's log line. One per
// connection thread: httplib processes a request, its handler and its streamed response on the
// thread of its connection.
struct RequestNote {
  std::chrono::steady_clock::time_point start{};
  int status = 0;      // overrides the response's status when set (499: the client left mid-stream)
  std::string detail;  // already escaped
};
RequestNote& request_note();

}  // namespace tansy::server
