// A Jinja interpreter for the subset of Jinja that chat templates use, rendering as Python jinja2
// does in the environment Hugging Face transformers sets up for chat templates
// (ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks, loopcontrols, transformers' own
// tojson, raise_exception and strftime_now). The subset is documented in docs/API.md; a construct
// outside it is an error when the template is loaded, never a silent difference at render time.
//
// The output records which bytes came from the render context (messages, tools, ...) rather than
// from the template's own text, so the tokenizer can encode special-token spellings inside
// message content as plain text while the template's control tokens stay control tokens.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tansy::text::jinja {

using Json = nlohmann::ordered_json;

// Bounds that keep a hostile template from hanging or exhausting memory; exceeding one is a
// render error naming the bound.
struct Limits {
  size_t max_output = size_t(64) << 20;  // bytes of rendered text, and of any one string value
  uint64_t max_steps = 5'000'000;        // loop iterations + macro calls + output writes
  int max_call_depth = 100;              // nested macro calls
};

struct Rendered {
  std::string text;
  // Sorted, disjoint [begin, end) byte ranges of `text` that came from context values.
  std::vector<std::pair<size_t, size_t>> data;
};

struct Program;

class Template {
 public:
  // Parses template source. Throws tansy::Error naming the line and the construct at fault for
  // a syntax error or anything outside the supported subset.
  static Template parse(std::string_view source);

  // Renders with the variables of `context` (a JSON object). Throws tansy::Error carrying the
  // message jinja2's exception would have (raise_exception's text, Python's TypeError text,
  // jinja2's UndefinedError text).
  Rendered render(const Json& context, const Limits& limits = {}) const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace tansy::text::jinja
