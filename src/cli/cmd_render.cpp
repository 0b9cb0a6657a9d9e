// tansy render --model DIR: a chat-completions request body on stdin -> the exact prompt on stdout.
// The hidden --jsonl switch renders one request per input line and prints one JSON object per
// line ({"prompt": ...} or {"error": ...}), so comparison tests need not launch a process per case.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "text/chat_template.h"

namespace {

using tansy::text::Json;

int run_jsonl() {
  std::string line;
  while (std::getline(std::cin, line)) {
    Json result = Json::object();
    try {
      result["prompt"] = tansy::text::render_request(tansy::text::parse_json_exact(line, "request body"));
    } catch (const tansy::Error& e) {
      result["error"] = e.what();
    }
    std::cout << result.dump(-1, ' ', false, Json::error_handler_t::replace) << '\n';
  }
  return 0;
}

int run(const std::vector<std::string>& args) {
  tansy::cli::Flags flags(args, {"model"}, {"jsonl"});
  auto check = tansy::text::check_checkpoint_template(flags.get("model"));
  if (!check.identical) tansy::fail("{}", check.description);
  if (flags.has("jsonl")) return run_jsonl();
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::string prompt = tansy::text::render_request(tansy::text::parse_json_exact(input, "request body"));
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  return 0;
}

tansy::cli::Register reg("render", "render a chat-completions request with the Qwen3.6 chat template", run);

}  // namespace
