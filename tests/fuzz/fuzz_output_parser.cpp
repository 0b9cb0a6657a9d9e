// libFuzzer target: the model-output parser (reasoning, content, <tool_call> blocks). The same text
// pushed in arbitrary pieces to the streaming parser must give the same content, reasoning and tool
// call names and arguments as the whole-text parse.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "text/output_parser.h"

using tansy::text::Delta;
using tansy::text::Json;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const bool reasoning = data[0] & 1;
  const uint8_t cut = data[1];
  std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  static const Json tools = Json::parse(R"([{"type": "function", "function": {"name": "get", "parameters":
      {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}])");
  const Json& t = (data[0] & 2) ? tools : Json();
  tansy::text::ParsedOutput whole;
  try {
    whole = tansy::text::parse_output(text, reasoning, t);
  } catch (const tansy::Error&) {
    return 0;
  }
  tansy::text::StreamingOutputParser p(reasoning, t);
  std::string content, thought;
  std::vector<std::string> names, args;
  auto take = [&](const std::vector<Delta>& ds) {
    for (const Delta& d : ds) {
      if (d.kind == Delta::Kind::Content) content += d.text;
      if (d.kind == Delta::Kind::Reasoning) thought += d.text;
      if (d.kind == Delta::Kind::ToolCallStart) {
        names.push_back(d.name);
        args.emplace_back();
      }
      if (d.kind == Delta::Kind::ToolCallArguments && d.index >= 0 && size_t(d.index) < args.size())
        args[size_t(d.index)] += d.text;
    }
  };
  const size_t step = 1 + cut % 17;
  for (size_t i = 0; i < text.size(); i += step) take(p.push(text.substr(i, step)));
  take(p.finish());
  if (content != whole.content || thought != whole.reasoning) __builtin_trap();
  if (names.size() != whole.tool_calls.size()) __builtin_trap();
  return 0;
}
