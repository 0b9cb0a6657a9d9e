// The Qwen3.6 chat template, rendered by hand-written C++ that follows the Jinja source
// (tests/fixtures/qwen3.6/chat_template.jinja) statement by statement, so that the prompt is
// byte-identical to what transformers' jinja2 environment produces, errors included.
//
// JSON values must be nlohmann::ordered_json: the template's `tojson` keeps the caller's key
// order (Python dicts are insertion-ordered), which plain nlohmann::json would sort.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace tansy::text {

using Json = nlohmann::ordered_json;

// The switches the template reads. An empty optional is a variable the template never received
// (Jinja-undefined). The template only tests `enable_thinking is false` and
// `preserve_thinking is true` (identity tests), so a JSON value that is not a boolean behaves
// exactly like an absent one and maps to nullopt.
struct TemplateOptions {
  bool add_generation_prompt = true;
  std::optional<bool> enable_thinking;
  std::optional<bool> preserve_thinking;
};

// Renders messages (a JSON array) and tools (null or an array). Throws tansy::Error with the
// template's own message (e.g. "No messages provided.") or, where jinja2 would raise a Python
// TypeError / UndefinedError, with Python's message. Values are used exactly as given: an
// assistant tool call whose `arguments` is still a JSON string fails as in jinja2 ("Can only get
// item pairs from a mapping."); parse_render_request turns wire-format strings into objects.
std::string render_chat(const Json& messages, const Json& tools, const TemplateOptions& options);

// What a chat-completions request body asks the template for.
struct RenderRequest {
  Json messages;  // array; tool-call `arguments` strings already parsed into objects
  Json tools;     // null or array
  TemplateOptions options;
};

// Reads `messages`, `tools` and the switches (add_generation_prompt, enable_thinking,
// preserve_thinking) from the top level of the body or from `chat_template_kwargs`, which wins
// when both are given (as in vLLM). OpenAI's wire format sends `function.arguments` as a JSON
// string; it is parsed into an object here, and one that does not parse into an object is an
// error.
RenderRequest parse_render_request(const Json& body);

// Parses a request body (or a wire-format arguments string) into ordered JSON. Python keeps
// integers of any size exactly while nlohmann would silently round those beyond 64 bits to
// floats (changing the prompt), so such integers are an error here. `what` names the text in
// error messages.
Json parse_json_exact(std::string_view text, std::string_view what);

// Convenience: parse_render_request + render_chat.
std::string render_request(const Json& body);

// The exact template text this renderer implements (7,764 bytes, no trailing newline).
std::string_view implemented_template();

struct TemplateCheck {
  bool found = false;       // the checkpoint has a chat template at all
  bool identical = false;   // it is the template implemented here
  std::string description;  // one line for the startup log or an error message
};

// Looks for chat_template.jinja (preferred, as transformers does) or tokenizer_config.json's
// `chat_template` in model_dir and compares it with implemented_template().
TemplateCheck check_checkpoint_template(const std::filesystem::path& model_dir);

// Python's json.dumps(x, ensure_ascii=False) with default separators: the template's `tojson`
// and the serialisation used for tool-call arguments in API responses.
std::string python_json_dumps(const Json& value);

// Python's repr() of a float (shortest round-trip digits, "1.0", "1e-05", "1e+16", "inf").
std::string python_float_repr(double value);

// Python's str.strip(): removes the 29 code points for which str.isspace() is true.
std::string_view python_strip(std::string_view s);

}  // namespace tansy::text
