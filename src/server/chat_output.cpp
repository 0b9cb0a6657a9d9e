#include "server/chat_output.h"

#include "text/output_parser.h"

namespace tansy::server {

struct ChatOutput::Impl {
  text::StreamingOutputParser parser;
  std::string reasoning, content;
  struct Call {
    std::string id, name, arguments;
  };
  std::vector<Call> calls;

  // Without tools, the parser only splits off the reasoning: once "</think>" has gone through
  // it, later text is content verbatim (minus the newlines that follow "</think>").
  bool passthrough = false, skip_newlines = false;
  std::string tail;  // the last bytes given to the parser, to see a "</think>" split across pushes

  Impl(bool starts_in_reasoning, const Json& tools, std::string prefix)
      : parser(starts_in_reasoning, tools, std::move(prefix)),
        passthrough(tools.is_null() && !starts_in_reasoning) {}

  std::vector<Json> push(std::string_view text, bool parse_tools) {
    if (parse_tools) return convert(parser.push(text));
    std::vector<Json> out;
    if (!passthrough) {
      static constexpr std::string_view kEnd = "</think>";
      std::string window = tail + std::string(text);
      size_t p = window.find(kEnd);
      if (p == std::string::npos) {
        tail = window.substr(window.size() - std::min(window.size(), kEnd.size() - 1));
        return convert(parser.push(text));
      }
      size_t cut = p + kEnd.size() - tail.size();  // end of "</think>" within text
      out = convert(parser.push(text.substr(0, cut)));
      auto rest = convert(parser.finish());
      out.insert(out.end(), rest.begin(), rest.end());
      passthrough = skip_newlines = true;
      text = text.substr(cut);
    }
    if (skip_newlines) {
      while (!text.empty() && text.front() == '\n') text.remove_prefix(1);
      if (!text.empty()) skip_newlines = false;
    }
    if (!text.empty()) {
      content += text;
      out.push_back({{"content", std::string(text)}});
    }
    return out;
  }

  std::vector<Json> convert(const std::vector<text::Delta>& deltas) {
    std::vector<Json> out;
    for (const text::Delta& d : deltas) {
      switch (d.kind) {
        case text::Delta::Kind::Reasoning:
          if (d.text.empty()) break;
          reasoning += d.text;
          out.push_back({{"reasoning_content", d.text}});
          break;
        case text::Delta::Kind::Content:
          if (d.text.empty()) break;
          content += d.text;
          out.push_back({{"content", d.text}});
          break;
        case text::Delta::Kind::ToolCallStart:
          if (size_t(d.index) >= calls.size()) calls.resize(size_t(d.index) + 1);
          calls[size_t(d.index)].id = d.id;
          calls[size_t(d.index)].name = d.name;
          out.push_back({{"tool_calls",
                          {{{"index", d.index},
                            {"id", d.id},
                            {"type", "function"},
                            {"function", {{"name", d.name}, {"arguments", ""}}}}}}});
          break;
        case text::Delta::Kind::ToolCallArguments:
          if (size_t(d.index) >= calls.size()) calls.resize(size_t(d.index) + 1);
          calls[size_t(d.index)].arguments += d.text;
          out.push_back({{"tool_calls", {{{"index", d.index}, {"function", {{"arguments", d.text}}}}}}});
          break;
      }
    }
    return out;
  }
};

ChatOutput::ChatOutput(bool starts_in_reasoning, const Json& tools, std::string id_prefix)
    : impl_(std::make_unique<Impl>(starts_in_reasoning, tools,
                                   "call_" + id_prefix.substr(id_prefix.find('-') + 1) + "_")),
      parse_tools_(!tools.is_null()) {}

ChatOutput::~ChatOutput() = default;

std::vector<Json> ChatOutput::push(std::string_view text) {
  if (text.empty()) return {};
  return impl_->push(text, parse_tools_);
}

std::vector<Json> ChatOutput::finish() {
  if (impl_->passthrough && !parse_tools_) return {};
  return impl_->convert(impl_->parser.finish());
}

bool ChatOutput::has_tool_calls() const { return !impl_->calls.empty(); }

Json ChatOutput::message() const {
  Json m{{"role", "assistant"}};
  const bool calls = !impl_->calls.empty();
  m["content"] = impl_->content.empty() && calls ? Json(nullptr) : Json(impl_->content);
  m["reasoning_content"] = impl_->reasoning.empty() ? Json(nullptr) : Json(impl_->reasoning);
  if (calls) {
    Json a = Json::array();
    for (auto& c : impl_->calls)
      a.push_back(
          {{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    m["tool_calls"] = a;
  }
  return m;
}

}  // namespace tansy::server
