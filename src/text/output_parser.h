// Splits Qwen3.6's generated text into reasoning, answer and tool calls for the OpenAI API, on
// complete text and incrementally while tokens stream.
//
// The format mirrors what the chat template renders for assistant turns:
//   REASONING\n</think>\n\nCONTENT\n\n<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n
//   </function>\n</tool_call>\n<tool_call>...
// Rules (one state machine serves both entry points, so they cannot disagree):
// - Reasoning: when the prompt ended with "<think>\n" generation starts inside reasoning;
//   otherwise a "<think>" at the very start of the output opens it. Reasoning ends at the first
//   "</think>"; leading and trailing '\n' of the reasoning and leading '\n' of the text after
//   "</think>" are dropped (the template's own split). Text ending inside reasoning is reasoning.
// - Content is everything outside reasoning and tool calls. Whitespace right after a
//   "</tool_call>" is dropped (it separates calls).
// - A tool call exists once "<tool_call>" (optional whitespace) "<function=NAME>" is complete.
//   If the text after "<tool_call>" cannot start "<function=", that text is content after all.
//   Parameter values lose one leading and one trailing '\n'. Unrecognised text inside a function
//   body is skipped. A missing "</function>" or "</tool_call>" is tolerated; a parameter without
//   "</parameter>" when the text ends is dropped.
// - Arguments become a JSON object: a value whose tools-schema type is "string" (or a union of
//   "string" and "null") stays a string; for other schema types, and when there is no schema,
//   the value is parsed as JSON and stays a string if that fails. Serialised like Python's
//   json.dumps, as the template's tojson does, so a call renders back to the same text.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "text/chat_template.h"

namespace tansy::text {

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a JSON object, serialised
};

struct ParsedOutput {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  // OpenAI's tool_calls array: [{id, type: "function", function: {name, arguments}}].
  Json tool_calls_json() const;
};

struct Delta {
  enum class Kind { Reasoning, Content, ToolCallStart, ToolCallArguments };
  Kind kind = Kind::Content;
  std::string text;  // Reasoning / Content / ToolCallArguments
  int index = -1;    // ToolCallStart / ToolCallArguments: position in tool_calls
  std::string id;    // ToolCallStart
  std::string name;  // ToolCallStart
};

class StreamingOutputParser {
 public:
  // tools: the request's tools (null or an OpenAI tools array) for parameter types. Tool-call ids
  // are call_id_prefix + index; the server passes a prefix unique to the request.
  StreamingOutputParser(bool starts_in_reasoning, const Json& tools, std::string call_id_prefix = "call_");

  std::vector<Delta> push(std::string_view text);
  // Resolves anything held back (a partial tag, an unclosed call) at the end of generation.
  std::vector<Delta> finish();

 private:
  enum class State {
    Start,
    Reasoning,
    Content,
    ToolCallOpen,
    FunctionBody,
    Parameter,
    AfterFunction,
    AfterToolCall
  };

  // Consumes as much of buf_ as can be decided; returns false when more text is needed.
  bool step(std::vector<Delta>& out, bool at_end);
  void emit_text(std::vector<Delta>& out, Delta::Kind kind, std::string_view text);
  void add_argument(std::vector<Delta>& out, std::string_view value);
  void close_call(std::vector<Delta>& out);
  bool is_string_parameter(const std::string& param) const;

  Json tools_;
  std::string id_prefix_;
  State state_;
  std::string buf_;               // undecided text
  bool skip_newlines_ = false;    // drop leading '\n' (start of reasoning, after "</think>")
  std::string pending_newlines_;  // reasoning newlines that vanish if "</think>" follows
  std::string call_text_;         // raw text of a tool call not yet known to be one
  int call_index_ = -1;
  std::string function_;
  std::string parameter_;
  int arguments_emitted_ = 0;
  bool finished_ = false;
};

ParsedOutput parse_output(std::string_view text, bool starts_in_reasoning, const Json& tools,
                          const std::string& call_id_prefix = "call_");

}  // namespace tansy::text
