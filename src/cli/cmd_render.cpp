// tansy render --model DIR: a chat-completions request body on stdin -> the exact prompt on stdout,
// rendered by the checkpoint's own chat template (the path `tansy serve` uses).
// The hidden --jsonl switch renders one request per input line and prints one JSON object per
// line ({"prompt": ...} or {"error": ...}), so comparison tests need not launch a process per case;
// with --ids each object also carries the prompt's token ids ("ids", from DIR/tokenizer.json), and
// --special-tokens-in-content plain|parse chooses how special tokens inside content are encoded.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "text/chat_template.h"

namespace {

using tansy::text::Json;

struct Setup {
  tansy::text::ChatTemplate tmpl;
  std::optional<tansy::Tokenizer> tok;
  bool parse_special = false;
};

Json render_one(const Setup& s, const std::string& input) {
  Json result = Json::object();
  try {
    auto req = tansy::text::parse_render_request(tansy::text::parse_json_exact(input, "request body"));
    auto rendered = s.tmpl.render(req);
    result["prompt"] = rendered.text;
    if (s.tok) result["ids"] = tansy::text::encode_prompt(*s.tok, rendered, s.parse_special);
  } catch (const tansy::Error& e) {
    result["error"] = e.what();
  }
  return result;
}

int run(const std::vector<std::string>& args) {
  tansy::cli::Flags flags(args, {"model", "special-tokens-in-content"}, {"jsonl", "ids"});
  const std::string dir = flags.get("model");
  Setup s{tansy::text::ChatTemplate::load(dir), std::nullopt, false};
  const std::string special = flags.get("special-tokens-in-content", "plain");
  if (special != "plain" && special != "parse")
    tansy::fail("--special-tokens-in-content must be plain or parse, got '{}'", special);
  s.parse_special = special == "parse";
  if (flags.has("ids")) s.tok = tansy::Tokenizer::load(dir);
  if (flags.has("jsonl")) {
    std::string line;
    while (std::getline(std::cin, line))
      std::cout << render_one(s, line).dump(-1, ' ', false, Json::error_handler_t::replace) << '\n';
    return 0;
  }
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  auto rendered =
      s.tmpl.render(tansy::text::parse_render_request(tansy::text::parse_json_exact(input, "request body")));
  std::fwrite(rendered.text.data(), 1, rendered.text.size(), stdout);
  return 0;
}

tansy::cli::Register reg("render", "render a chat-completions request with the checkpoint's chat template",
                         run);

}  // namespace
