// Turns the generated text of a chat completion into OpenAI message parts: reasoning_content,
// content and tool calls, both as streaming deltas and as the final message. The Qwen3.6
// format itself (<think>, <tool_call><function=...>) is parsed by text/output_parser.h.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/openai.h"

namespace tansy::server {

class ChatOutput {
 public:
  // starts_in_reasoning: the prompt ended inside an open <think> block.
  // tools: the request's tools; null when the request offers none (or tool_choice is "none"):
  // then tool-call markup after the reasoning is plain content, as OpenAI would never return
  // tool_calls to a request without tools.
  ChatOutput(bool starts_in_reasoning, const Json& tools, std::string id_prefix);
  ~ChatOutput();

  // Feeds generated text; returns OpenAI chat.completion.chunk `delta` objects, in order.
  std::vector<Json> push(std::string_view text);
  // End of generation: deltas for anything still held back.
  std::vector<Json> finish();

  // The whole message so far: {"role", "content", "reasoning_content", ["tool_calls"]}.
  Json message() const;
  bool has_tool_calls() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  bool parse_tools_;
};

}  // namespace tansy::server
