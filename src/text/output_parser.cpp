// One state machine for streamed and complete output: parse_output is a single push + finish,
// so the two cannot disagree, and the property tests check that the way text is split into
// chunks never changes the result.
#include "text/output_parser.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/error.h"

namespace tansy::text {
namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParameterOpen = "<parameter=";
constexpr std::string_view kParameterClose = "</parameter>";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Length of the longest suffix of s that is a proper prefix of one of the tags: text that must
// be held back because the next chunk may complete the tag.
size_t held_tag_prefix(std::string_view s, std::initializer_list<std::string_view> tags) {
  size_t best = 0;
  for (std::string_view tag : tags)
    for (size_t k = std::min(s.size(), tag.size() - 1); k > best; --k)
      if (s.substr(s.size() - k) == tag.substr(0, k)) {
        best = k;
        break;
      }
  return best;
}

// True when s is a proper prefix of tag (more text could still make it the tag).
bool may_become(std::string_view s, std::string_view tag) {
  return s.size() < tag.size() && tag.starts_with(s);
}

std::string_view strip_ascii(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

Delta make_delta(Delta::Kind kind, std::string text, int index) {
  Delta d;
  d.kind = kind;
  d.text = std::move(text);
  d.index = index;
  return d;
}

bool all_finite(const Json& v) {
  if (v.is_number_float()) return std::isfinite(v.get<double>());
  if (v.is_structured())
    for (auto& x : v)
      if (!all_finite(x)) return false;
  return true;
}

}  // namespace

StreamingOutputParser::StreamingOutputParser(bool starts_in_reasoning, const Json& tools,
                                             std::string call_id_prefix)
    : tools_(tools),
      id_prefix_(std::move(call_id_prefix)),
      state_(starts_in_reasoning ? State::Reasoning : State::Start),
      skip_newlines_(starts_in_reasoning) {}

std::vector<Delta> StreamingOutputParser::push(std::string_view text) {
  if (finished_) fail("output parser: push after finish");
  buf_ += text;
  std::vector<Delta> out;
  while (step(out, false)) {
  }
  return out;
}

std::vector<Delta> StreamingOutputParser::finish() {
  if (finished_) fail("output parser: finish called twice");
  std::vector<Delta> out;
  while (step(out, true)) {
  }
  finished_ = true;
  return out;
}

void StreamingOutputParser::emit_text(std::vector<Delta>& out, Delta::Kind kind, std::string_view text) {
  if (text.empty()) return;
  out.push_back(make_delta(kind, std::string(text), -1));
}

bool StreamingOutputParser::is_string_parameter(const std::string& param) const {
  if (!tools_.is_array()) return false;
  for (const Json& tool : tools_) {
    if (!tool.is_object()) continue;
    const Json& fn = tool.contains("function") ? tool["function"] : tool;
    if (!fn.is_object() || fn.value("name", Json()) != Json(function_)) continue;
    const Json* props =
        fn.contains("parameters") && fn["parameters"].is_object() && fn["parameters"].contains("properties")
            ? &fn["parameters"]["properties"]
            : nullptr;
    if (!props || !props->is_object() || !props->contains(param) || !(*props)[param].is_object())
      return false;
    const Json type = (*props)[param].value("type", Json());
    if (type.is_string()) return type == "string";
    if (type.is_array()) {
      bool has_string = false;
      for (const Json& t : type) {
        if (t == "string")
          has_string = true;
        else if (t != "null")
          return false;
      }
      return has_string;
    }
    return false;
  }
  return false;
}

void StreamingOutputParser::add_argument(std::vector<Delta>& out, std::string_view value) {
  if (value.starts_with('\n')) value.remove_prefix(1);
  if (value.ends_with('\n')) value.remove_suffix(1);
  Json v = std::string(value);
  if (!is_string_parameter(parameter_)) {
    Json parsed = Json::parse(value, nullptr, false);
    if (!parsed.is_discarded() && all_finite(parsed)) v = std::move(parsed);
  }
  std::string text = arguments_emitted_++ ? ", " : "{";
  text += python_json_dumps(Json(parameter_)) + ": " + python_json_dumps(v);
  out.push_back(make_delta(Delta::Kind::ToolCallArguments, std::move(text), call_index_));
}

void StreamingOutputParser::close_call(std::vector<Delta>& out) {
  out.push_back(make_delta(Delta::Kind::ToolCallArguments, arguments_emitted_ ? "}" : "{}", call_index_));
}

bool StreamingOutputParser::step(std::vector<Delta>& out, bool at_end) {
  auto consume = [&](size_t n) { buf_.erase(0, n); };
  auto skip_spaces = [&](std::string* keep) {
    size_t n = 0;
    while (n < buf_.size() && is_space(buf_[n])) ++n;
    if (keep) keep->append(buf_, 0, n);
    consume(n);
  };
  switch (state_) {
    case State::Start:
      if (buf_.starts_with(kThinkOpen)) {
        consume(kThinkOpen.size());
        state_ = State::Reasoning;
        skip_newlines_ = true;
        return true;
      }
      if (may_become(buf_, kThinkOpen) && !at_end) return false;
      state_ = State::Content;
      return true;

    case State::Reasoning: {
      if (skip_newlines_) {
        consume(std::min(buf_.find_first_not_of('\n'), buf_.size()));
        if (buf_.empty()) return false;
        skip_newlines_ = false;
      }
      size_t close = buf_.find(kThinkClose);
      if (close == std::string::npos && at_end) {
        emit_text(out, Delta::Kind::Reasoning, pending_newlines_ + buf_);
        pending_newlines_.clear();
        buf_.clear();
        return false;
      }
      size_t decided =
          close != std::string::npos ? close : buf_.size() - held_tag_prefix(buf_, {kThinkClose});
      // Newlines just before "</think>" are not reasoning, so a trailing run waits to see what follows.
      std::string text = pending_newlines_ + buf_.substr(0, decided);
      size_t keep = text.find_last_not_of('\n') + 1;  // npos + 1 == 0: all newlines
      emit_text(out, Delta::Kind::Reasoning, std::string_view(text).substr(0, keep));
      pending_newlines_ = text.substr(keep);
      if (close == std::string::npos) {
        consume(decided);
        return false;
      }
      pending_newlines_.clear();
      consume(close + kThinkClose.size());
      state_ = State::Content;
      skip_newlines_ = true;
      return true;
    }

    case State::Content: {
      if (skip_newlines_) {
        consume(std::min(buf_.find_first_not_of('\n'), buf_.size()));
        if (buf_.empty()) return false;
        skip_newlines_ = false;
      }
      size_t open = buf_.find(kCallOpen);
      if (open != std::string::npos) {
        emit_text(out, Delta::Kind::Content, std::string_view(buf_).substr(0, open));
        consume(open + kCallOpen.size());
        call_text_ = kCallOpen;
        state_ = State::ToolCallOpen;
        return true;
      }
      size_t decided = at_end ? buf_.size() : buf_.size() - held_tag_prefix(buf_, {kCallOpen});
      emit_text(out, Delta::Kind::Content, std::string_view(buf_).substr(0, decided));
      consume(decided);
      return false;
    }

    case State::ToolCallOpen: {
      skip_spaces(&call_text_);
      bool undecided = buf_.empty() || may_become(buf_, kFunctionOpen);
      if (buf_.starts_with(kFunctionOpen)) {
        size_t gt = buf_.find('>');
        size_t bad = buf_.find_first_of("<\n", kFunctionOpen.size());
        if (gt != std::string::npos && (bad == std::string::npos || gt < bad)) {
          function_ = std::string(
              strip_ascii(std::string_view(buf_).substr(kFunctionOpen.size(), gt - kFunctionOpen.size())));
          consume(gt + 1);
          ++call_index_;
          arguments_emitted_ = 0;
          call_text_.clear();
          Delta start = make_delta(Delta::Kind::ToolCallStart, "", call_index_);
          start.id = id_prefix_ + std::to_string(call_index_);
          start.name = function_;
          out.push_back(std::move(start));
          state_ = State::FunctionBody;
          return true;
        }
        undecided = bad == std::string::npos;
      }
      if (undecided && !at_end) return false;
      // Not a tool call after all: what was held back is ordinary content.
      emit_text(out, Delta::Kind::Content, call_text_);
      call_text_.clear();
      state_ = State::Content;
      return true;
    }

    case State::FunctionBody: {
      skip_spaces(nullptr);
      if (buf_.starts_with(kParameterOpen)) {
        size_t gt = buf_.find('>');
        size_t bad = buf_.find_first_of("<\n", kParameterOpen.size());
        if (gt != std::string::npos && (bad == std::string::npos || gt < bad)) {
          parameter_ = std::string(
              strip_ascii(std::string_view(buf_).substr(kParameterOpen.size(), gt - kParameterOpen.size())));
          consume(gt + 1);
          state_ = State::Parameter;
          return true;
        }
        if (bad == std::string::npos && !at_end) return false;
        if (bad != std::string::npos) {
          consume(1);  // a malformed tag: skip it like any other stray text
          return true;
        }
      } else if (buf_.starts_with(kFunctionClose)) {
        consume(kFunctionClose.size());
        close_call(out);
        state_ = State::AfterFunction;
        return true;
      } else if (buf_.starts_with(kCallClose)) {
        consume(kCallClose.size());
        close_call(out);
        state_ = State::AfterToolCall;
        return true;
      } else if (!buf_.empty() && !may_become(buf_, kFunctionClose) && !may_become(buf_, kCallClose) &&
                 !may_become(buf_, kParameterOpen)) {
        // Stray text inside a function body carries no argument: skip to the next tag.
        size_t lt = buf_.find('<', 1);
        consume(lt == std::string::npos ? buf_.size() : lt);
        return true;
      }
      if (!at_end) return false;
      buf_.clear();
      close_call(out);
      state_ = State::AfterToolCall;
      return false;
    }

    case State::Parameter: {
      // The value ends at "</parameter>", or, when the model leaves that out, before the next
      // parameter or the end of the function.
      size_t end =
          std::min({buf_.find(kParameterClose), buf_.find(kParameterOpen), buf_.find(kFunctionClose)});
      if (end == std::string::npos) {
        if (!at_end) return false;
        buf_.clear();  // an unfinished value is dropped
        state_ = State::FunctionBody;
        return true;
      }
      add_argument(out, std::string_view(buf_).substr(0, end));
      consume(buf_.compare(end, kParameterClose.size(), kParameterClose) == 0 ? end + kParameterClose.size()
                                                                              : end);
      state_ = State::FunctionBody;
      return true;
    }

    case State::AfterFunction:
      skip_spaces(nullptr);
      if (buf_.starts_with(kCallClose)) {
        consume(kCallClose.size());
        state_ = State::AfterToolCall;
        return true;
      }
      if (buf_.starts_with(kFunctionOpen)) {
        // Several functions inside one <tool_call>: each becomes its own call.
        state_ = State::ToolCallOpen;
        return true;
      }
      if ((buf_.empty() || may_become(buf_, kCallClose) || may_become(buf_, kFunctionOpen)) && !at_end)
        return false;
      if (at_end && may_become(buf_, kCallClose)) buf_.clear();
      state_ = State::AfterToolCall;
      return true;

    case State::AfterToolCall:
      skip_spaces(nullptr);
      if (buf_.empty()) return false;
      state_ = State::Content;
      return true;
  }
  return false;
}

Json ParsedOutput::tool_calls_json() const {
  Json calls = Json::array();
  for (const ToolCall& c : tool_calls)
    calls.push_back(
        {{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  return calls;
}

ParsedOutput parse_output(std::string_view text, bool starts_in_reasoning, const Json& tools,
                          const std::string& call_id_prefix) {
  StreamingOutputParser parser(starts_in_reasoning, tools, call_id_prefix);
  std::vector<Delta> deltas = parser.push(text);
  for (Delta& d : parser.finish()) deltas.push_back(std::move(d));
  ParsedOutput result;
  for (const Delta& d : deltas) {
    switch (d.kind) {
      case Delta::Kind::Reasoning:
        result.reasoning += d.text;
        break;
      case Delta::Kind::Content:
        result.content += d.text;
        break;
      case Delta::Kind::ToolCallStart:
        result.tool_calls.push_back({d.id, d.name, ""});
        break;
      case Delta::Kind::ToolCallArguments:
        result.tool_calls.at(static_cast<size_t>(d.index)).arguments += d.text;
        break;
    }
  }
  return result;
}

}  // namespace tansy::text
