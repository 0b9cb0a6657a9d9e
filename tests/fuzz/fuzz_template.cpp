// libFuzzer target: arbitrary chat-template source is parsed and, when it parses, rendered with a
// fixed conversation (tools, reasoning, tool calls, content parts, unicode). Load errors and render
// errors are fine; a crash, a sanitizer report, a hang or unbounded memory is not. Small bounds keep
// each input fast.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"
#include "text/jinja.h"

namespace {

const tansy::text::jinja::Json& context() {
  static const auto ctx = tansy::text::jinja::Json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful. <|im_end|>"},
      {"role": "user", "content": [{"type": "text", "text": "Hi \u00e9 \u3000"}, {"type": "image", "image": "x"}]},
      {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok", "reasoning_content": null,
       "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [true, null, 2.5]}}}]},
      {"role": "tool", "content": "{\"r\": 1}"},
      {"role": "user", "content": "again"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
    "documents": null, "add_generation_prompt": true, "enable_thinking": false,
    "bos_token": "<s>", "eos_token": "<|im_end|>"
  })");
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 64 * 1024) return 0;
  tansy::text::jinja::Limits limits;
  limits.max_output = 1 << 20;
  limits.max_steps = 100'000;
  limits.max_call_depth = 32;
  try {
    auto t = tansy::text::jinja::Template::parse(std::string_view(reinterpret_cast<const char*>(data), size));
    t.render(context(), limits);
  } catch (const tansy::Error&) {
  }
  return 0;
}
