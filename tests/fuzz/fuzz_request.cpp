// libFuzzer target: the OpenAI request parser (chat and completions bodies), then the chat
// template render of what it accepts, as the server runs them. Any exception other than the
// documented ApiError / tansy::Error is a finding, as is any sanitizer report.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"
#include "server/openai.h"
#include "text/chat_template.h"

namespace {

// The server refuses bodies nested deeper than 64 before parsing (server.cpp's json_depth).
int depth(std::string_view s) {
  int d = 0, m = 0;
  bool str = false, esc = false;
  for (char c : s) {
    if (str) {
      if (esc)
        esc = false;
      else if (c == '\\')
        esc = true;
      else if (c == '"')
        str = false;
    } else if (c == '"') {
      str = true;
    } else if (c == '[' || c == '{') {
      m = std::max(m, ++d);
    } else if (c == ']' || c == '}') {
      --d;
    }
  }
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  if (size == 0 || depth(text.substr(1)) > 64) return 0;
  using tansy::server::Json;
  Json body = Json::parse(text.substr(1), nullptr, false);
  if (body.is_discarded()) return 0;
  tansy::SamplingParams defaults;
  try {
    if (data[0] & 1) {
      tansy::server::ApiRequest r = tansy::server::parse_chat_request(body, defaults, 151936);
      if (data[0] & 2) tansy::text::render_chat(r.render.messages, r.render.tools, r.render.options);
    } else {
      tansy::server::parse_completion_request(body, defaults, 151936);
    }
  } catch (const tansy::server::ApiError& e) {
    if (e.status < 400 || e.status >= 500) __builtin_trap();  // a bad body is the client's error
  } catch (const tansy::Error&) {
  }
  return 0;
}
