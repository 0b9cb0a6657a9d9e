// Chat templates: the checkpoint's own Jinja template, rendered by the interpreter in
// text/jinja.h exactly as transformers' jinja2 environment renders it, errors included; the
// request-side preparation (switches, wire-format tool-call arguments) shared by every caller.
//
// JSON values must be nlohmann::ordered_json: the template's `tojson` keeps the caller's key
// order (Python dicts are insertion-ordered), which plain nlohmann::json would sort.
#pragma once
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja.h"
#include "text/tokenizer.h"

namespace tansy::text {

using Json = nlohmann::ordered_json;

// The switches a request passes to the template. An empty optional is a variable the template
// never receives (Jinja-undefined); a present one is passed exactly as the client sent it, so
// the template's own tests (`is false`, truthiness, ...) decide what a non-boolean means.
struct TemplateOptions {
  bool add_generation_prompt = true;
  std::optional<Json> enable_thinking;
  std::optional<Json> preserve_thinking;
  // Every other key of chat_template_kwargs (as vLLM passes them), e.g. Qwen's add_vision_id; a
  // key naming messages, tools or documents is ignored.
  Json extra = Json::object();
};

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

// A rendered prompt: the text, and the byte ranges of it that came from the request (message
// content, tool definitions, ...) rather than from the template's own text.
using RenderedPrompt = jinja::Rendered;

// A checkpoint's chat template, compiled by the Jinja interpreter (text/jinja.h) and rendered
// with the variables transformers passes: messages, tools, documents (None), add_generation_prompt
// and the switches a request sets, plus the tokenizer's special-token strings when known.
class ChatTemplate {
 public:
  // chat_template.jinja (preferred, as transformers does) or tokenizer_config.json's
  // `chat_template` (a string, or the list of named templates, taking "default"). Throws Error
  // when there is none or it uses a construct outside the supported subset.
  static ChatTemplate load(const std::filesystem::path& model_dir);
  static ChatTemplate from_source(std::string source, std::string origin);
  // The Qwen3.6 template (implemented_template()), compiled once.
  static const ChatTemplate& qwen36();

  RenderedPrompt render(const RenderRequest& req) const;
  std::string render_text(const RenderRequest& req) const { return render(req).text; }

  const std::string& source() const { return source_; }
  const std::string& sha256() const { return sha256_; }  // hex of the source as loaded
  bool is_qwen36() const { return is_qwen36_; }
  // One line for the startup log: where the template came from, its hash, known or not.
  std::string describe() const;

 private:
  std::string source_, origin_, sha256_;
  bool is_qwen36_ = false;
  Json special_tokens_ = Json::object();
  std::shared_ptr<const jinja::Template> compiled_;
};

// The token ids of a rendered prompt. Special tokens (<|im_start|>, <|im_end|>, ...) are matched
// only in the template's own text; spelled inside message content or tools they are encoded as
// plain text, so a message cannot open a turn of another role. parse_special_in_content restores
// Hugging Face's behaviour of matching them everywhere.
std::vector<int32_t> encode_prompt(const Tokenizer& tok, const RenderedPrompt& prompt,
                                   bool parse_special_in_content = false);

// Renders messages (a JSON array) and tools (null or an array) with the Qwen3.6 template.
// Throws tansy::Error with the template's own message (e.g. "No messages provided.") or, where
// jinja2 would raise a Python TypeError / UndefinedError, with Python's message.
std::string render_chat(const Json& messages, const Json& tools, const TemplateOptions& options);

// Convenience: parse_render_request + the Qwen3.6 template.
std::string render_request(const Json& body);

// The exact text of the Qwen3.6 template (7,764 bytes, no trailing newline).
std::string_view implemented_template();

// sha256 of bytes, lowercase hex.
std::string sha256_hex(std::string_view bytes);

// Python's json.dumps(x, ensure_ascii=False) with default separators: the template's `tojson`
// and the serialisation used for tool-call arguments in API responses.
std::string python_json_dumps(const Json& value);

// Python's repr() of a float (shortest round-trip digits, "1.0", "1e-05", "1e+16", "inf").
std::string python_float_repr(double value);

// Python's repr() of a str.
std::string python_str_repr(std::string_view s);

// Python's str.strip(): removes the 29 code points for which str.isspace() is true.
std::string_view python_strip(std::string_view s);

}  // namespace tansy::text
