#include "server/anthropic.h"

#include <fmt/format.h>

#include <limits>
#include <set>

#include "text/chat_template.h"

namespace tansy::server {

using namespace fe;

namespace {

const char* error_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 504:
      return "timeout_error";
    case 529:
      return "overloaded_error";
    default:
      return status >= 500 ? "api_error" : "invalid_request_error";
  }
}

Json error_json(int status, const std::string& message) {
  return Json{{"type", "error"},
              {"error", {{"type", error_type(anthropic_status(status))}, {"message", message}}}};
}

bool valid_tool_name(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

// Text of a system prompt or a tool_result: a string or an array of text blocks.
std::string text_of(const Json& v, const std::string& path) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) bad_type(path, v, "a string or an array of text blocks");
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    std::string p = join(path, i);
    const Json& b = object(v[i], p);
    std::string type = str(require(b, "type", join(p, "type")), join(p, "type"));
    if (type != "text")
      bad(join(p, "type"), fmt::format("'{}.type' is '{}': only text blocks are supported here", p, type));
    if (i) out += "\n\n";
    out += str(require(b, "text", join(p, "text")), join(p, "text"));
  }
  return out;
}

// Anthropic messages -> OpenAI chat messages (system first).
Json translate_messages(const Json& body) {
  Json out = Json::array();
  const Json& system = get(body, "system");
  if (!system.is_null()) out.push_back({{"role", "system"}, {"content", text_of(system, "system")}});

  const Json& msgs = array(require(body, "messages", "messages"), "messages");
  if (msgs.empty()) bad("messages", "'messages' must not be empty");
  for (size_t i = 0; i < msgs.size(); ++i) {
    std::string w = join("messages", i);
    const Json& m = object(msgs[i], w);
    std::string role = str(require(m, "role", join(w, "role")), join(w, "role"));
    if (role != "user" && role != "assistant")
      bad(join(w, "role"), fmt::format("'{}.role' must be \"user\" or \"assistant\", got '{}'", w, role));
    const Json& content = require(m, "content", join(w, "content"));
    std::string cw = join(w, "content");
    if (content.is_string()) {
      out.push_back({{"role", role}, {"content", content}});
      continue;
    }
    if (!content.is_array()) bad_type(cw, content, "a string or an array of content blocks");
    if (content.empty()) bad(cw, fmt::format("'{}' must not be empty", cw));
    if (role == "user") {
      Json parts = Json::array();
      auto flush = [&] {
        if (!parts.empty()) out.push_back({{"role", "user"}, {"content", parts}});
        parts = Json::array();
      };
      for (size_t k = 0; k < content.size(); ++k) {
        std::string p = join(cw, k);
        const Json& b = object(content[k], p);
        std::string type = str(require(b, "type", join(p, "type")), join(p, "type"));
        if (type == "text") {
          parts.push_back(
              {{"type", "text"}, {"text", str(require(b, "text", join(p, "text")), join(p, "text"))}});
        } else if (type == "tool_result") {
          flush();
          std::string id = str(require(b, "tool_use_id", join(p, "tool_use_id")), join(p, "tool_use_id"));
          const Json& c = get(b, "content");
          std::string text = c.is_null() ? "" : text_of(c, join(p, "content"));
          const Json& err = get(b, "is_error");
          // The template has no notion of a failed call: the model reads it in the text.
          if (!err.is_null() && boolean(err, join(p, "is_error"))) text = "Error: " + text;
          out.push_back({{"role", "tool"}, {"tool_call_id", id}, {"content", text}});
        } else if (type == "tool_use" || type == "thinking" || type == "redacted_thinking") {
          bad(join(p, "type"),
              fmt::format("'{}.type' is '{}': such blocks belong in assistant messages", p, type));
        } else {
          bad(join(p, "type"),
              fmt::format("'{}.type' is '{}', which is not supported (tansy serves a text-only model)", p,
                          type));
        }
      }
      flush();
      continue;
    }
    // assistant
    std::string text, reasoning;
    Json calls = Json::array();
    for (size_t k = 0; k < content.size(); ++k) {
      std::string p = join(cw, k);
      const Json& b = object(content[k], p);
      std::string type = str(require(b, "type", join(p, "type")), join(p, "type"));
      if (type == "text") {
        text += str(require(b, "text", join(p, "text")), join(p, "text"));
      } else if (type == "thinking") {
        reasoning += str(require(b, "thinking", join(p, "thinking")), join(p, "thinking"));
        const Json& sig = get(b, "signature");
        if (!sig.is_null()) str(sig, join(p, "signature"));
      } else if (type == "redacted_thinking") {
        // Encrypted by another server: nothing tansy can read back.
      } else if (type == "tool_use") {
        std::string id = str(require(b, "id", join(p, "id")), join(p, "id"));
        std::string name = str(require(b, "name", join(p, "name")), join(p, "name"));
        const Json& input = object(require(b, "input", join(p, "input")), join(p, "input"));
        calls.push_back(
            {{"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", input}}}});
      } else if (type == "tool_result") {
        bad(join(p, "type"),
            fmt::format("'{}.type' is 'tool_result': such blocks belong in user messages", p));
      } else {
        bad(join(p, "type"), fmt::format("'{}.type' is '{}', which is not supported", p, type));
      }
    }
    Json msg{{"role", "assistant"}, {"content", text}};
    if (!reasoning.empty()) msg["reasoning_content"] = reasoning;
    if (!calls.empty()) msg["tool_calls"] = calls;
    out.push_back(msg);
  }
  if (msgs.back().is_object() && get(msgs.back(), "role") == "assistant")
    bad("messages",
        "'messages': a final assistant message (prefill) is not supported; the last message must be the "
        "user's");
  return out;
}

// Fields shared by /v1/messages and count_tokens: messages, system, tools, tool_choice, thinking.
Json translate_common(const Json& body, bool& thinking) {
  object(body, "");
  Json chat{{"model", str(require(body, "model", "model"), "model")}};
  chat["messages"] = translate_messages(body);

  std::set<std::string> names;
  const Json& tools = get(body, "tools");
  if (!tools.is_null()) {
    array(tools, "tools");
    Json t = Json::array();
    for (size_t i = 0; i < tools.size(); ++i) {
      std::string w = join("tools", i);
      const Json& x = object(tools[i], w);
      const Json& type = get(x, "type");
      if (!type.is_null() && str(type, join(w, "type")) != "custom")
        bad(join(w, "type"),
            fmt::format("'{}.type' is '{}': only custom tools (with an input_schema) are supported", w,
                        type.get<std::string>()));
      std::string name = str(require(x, "name", join(w, "name")), join(w, "name"));
      if (!valid_tool_name(name))
        bad(join(w, "name"), fmt::format("'{}.name' must match ^[a-zA-Z0-9_-]{{1,128}}$, got '{}'", w, name));
      if (!names.insert(name).second)
        bad(join(w, "name"), fmt::format("'{}.name': tool name '{}' is used twice", w, name));
      Json fn{{"name", name}};
      const Json& desc = get(x, "description");
      if (!desc.is_null()) fn["description"] = str(desc, join(w, "description"));
      fn["parameters"] = object(require(x, "input_schema", join(w, "input_schema")), join(w, "input_schema"));
      t.push_back({{"type", "function"}, {"function", fn}});
    }
    if (!t.empty()) chat["tools"] = t;
  }

  const Json& tc = get(body, "tool_choice");
  if (!tc.is_null()) {
    object(tc, "tool_choice");
    std::string type = str(require(tc, "type", "tool_choice.type"), "tool_choice.type");
    const Json& dp = get(tc, "disable_parallel_tool_use");
    if (!dp.is_null() && boolean(dp, "tool_choice.disable_parallel_tool_use"))
      chat["parallel_tool_calls"] = false;
    if (type == "auto") {
      if (!names.empty()) chat["tool_choice"] = "auto";
    } else if (type == "none") {
      chat["tool_choice"] = "none";
    } else if (type == "any") {
      if (names.empty()) bad("tool_choice", "'tool_choice' 'any' needs at least one tool in 'tools'");
      chat["tool_choice"] = "required";
    } else if (type == "tool") {
      std::string name = str(require(tc, "name", "tool_choice.name"), "tool_choice.name");
      if (!names.count(name))
        bad("tool_choice.name", fmt::format("'tool_choice.name' is '{}', which is not in 'tools'", name));
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", name}}}};
    } else {
      bad("tool_choice.type",
          fmt::format("'tool_choice.type' must be auto, any, tool or none, got '{}'", type));
    }
  }

  thinking = false;
  const Json& th = get(body, "thinking");
  if (!th.is_null()) {
    object(th, "thinking");
    std::string type = str(require(th, "type", "thinking.type"), "thinking.type");
    if (type == "enabled") {
      thinking = true;
    } else if (type != "disabled") {
      bad("thinking.type",
          fmt::format("'thinking.type' must be \"enabled\" or \"disabled\", got '{}'", type));
    }
  }
  chat["chat_template_kwargs"] = {{"enable_thinking", thinking}};
  return chat;
}

class AnthropicFrontend : public ChatFrontend {
 public:
  const char* endpoint() const override { return "/v1/messages"; }
  std::string make_id(const std::string& hex) const override { return "msg_" + hex; }
  bool stream() const override { return stream_; }

  Json chat_body(const Json& body) override {
    bool thinking = false;
    Json chat = translate_common(body, thinking);
    chat["max_tokens"] = integer(require(body, "max_tokens", "max_tokens"), "max_tokens", 1,
                                 std::numeric_limits<int32_t>::max());
    const int64_t max_tokens = chat["max_tokens"].get<int64_t>();
    const Json& th = get(body, "thinking");
    if (thinking) {
      const Json& budget = require(th, "budget_tokens", "thinking.budget_tokens");
      int64_t b = integer(budget, "thinking.budget_tokens", 1, std::numeric_limits<int32_t>::max());
      if (b >= max_tokens)
        bad("thinking.budget_tokens",
            fmt::format("'thinking.budget_tokens' ({}) must be less than 'max_tokens' ({})", b, max_tokens));
      thinking_budget = int(b);
    } else if (th.is_object() && !get(th, "budget_tokens").is_null()) {
      integer(get(th, "budget_tokens"), "thinking.budget_tokens", 0, std::numeric_limits<int32_t>::max());
    }
    const Json& stream = get(body, "stream");
    stream_ = !stream.is_null() && boolean(stream, "stream");
    chat["stream"] = stream_;
    if (stream_) chat["stream_options"] = {{"include_usage", true}};
    const Json& stop = get(body, "stop_sequences");
    if (!stop.is_null()) {
      array(stop, "stop_sequences");
      Json s = Json::array();
      for (size_t i = 0; i < stop.size(); ++i) {
        std::string v = str(stop[i], join("stop_sequences", i));
        if (v.empty())
          bad(join("stop_sequences", i), fmt::format("'{}' must not be empty", join("stop_sequences", i)));
        s.push_back(v);
      }
      if (s.size() > 16) bad("stop_sequences", "'stop_sequences' may hold at most 16 strings");
      if (!s.empty()) chat["stop"] = s;
    }
    const Json& temperature = get(body, "temperature");
    if (!temperature.is_null()) chat["temperature"] = number(temperature, "temperature", 0, 1);
    const Json& top_p = get(body, "top_p");
    if (!top_p.is_null()) {
      double p = number(top_p, "top_p", 0, 1);
      if (p <= 0) bad("top_p", "'top_p' must be greater than 0");
      chat["top_p"] = p;
    }
    const Json& top_k = get(body, "top_k");
    if (!top_k.is_null()) chat["top_k"] = integer(top_k, "top_k", 0, std::numeric_limits<int32_t>::max());
    const Json& metadata = get(body, "metadata");
    if (!metadata.is_null()) {
      object(metadata, "metadata");
      const Json& user = get(metadata, "user_id");
      if (!user.is_null()) str(user, "metadata.user_id");
    }
    const Json& tier = get(body, "service_tier");
    if (!tier.is_null()) str(tier, "service_tier");
    for (const char* k : {"container", "mcp_servers"})
      if (!get(body, k).is_null()) bad(k, fmt::format("'{}' is not supported by tansy", k));
    ignored_fields =
        unknown_fields(body, {"model", "max_tokens", "messages", "system", "stop_sequences", "stream",
                              "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata",
                              "service_tier", "container", "mcp_servers"});
    return chat;
  }

  std::string error_body(const ApiError& e) const override {
    return anthropic_error_body(e.status, e.what());
  }
  int error_status(const ApiError& e) const override { return anthropic_status(e.status); }

  Json response(const Json& completion) override {
    const Json& choice = completion["choices"][0];
    const Json& msg = choice["message"];
    Json content = Json::array();
    if (msg["reasoning_content"].is_string())
      content.push_back({{"type", "thinking"}, {"thinking", msg["reasoning_content"]}, {"signature", ""}});
    if (msg["content"].is_string() && !msg["content"].get<std::string>().empty())
      content.push_back({{"type", "text"}, {"text", msg["content"]}});
    if (msg.contains("tool_calls"))
      for (const Json& c : msg["tool_calls"])
        content.push_back({{"type", "tool_use"},
                           {"id", c["id"]},
                           {"name", c["function"]["name"]},
                           {"input", Json::parse(c["function"]["arguments"].get<std::string>())}});
    auto [reason, seq] = stop_reason(choice, msg.contains("tool_calls"));
    return Json{{"id", completion["id"]}, {"type", "message"},
                {"role", "assistant"},    {"model", completion["model"]},
                {"content", content},     {"stop_reason", reason},
                {"stop_sequence", seq},   {"usage", usage(completion["usage"])}};
  }

  std::string chunk(const Json& c) override {
    std::string out;
    if (!started_) {
      started_ = true;
      Json u{{"input_tokens", prompt_tokens},
             {"cache_creation_input_tokens", 0},
             {"cache_read_input_tokens", 0},
             {"output_tokens", 0}};
      Json m{{"id", c["id"]},
             {"type", "message"},
             {"role", "assistant"},
             {"model", c["model"]},
             {"content", Json::array()},
             {"stop_reason", nullptr},
             {"stop_sequence", nullptr},
             {"usage", u}};
      out += sse_event("message_start", {{"type", "message_start"}, {"message", m}});
      out += sse_event("ping", {{"type", "ping"}});
    }
    if (c.contains("usage") && c["usage"].is_object()) {
      // The last chunk: the stop reason came with the one before.
      out += close_block();
      Json u = usage(c["usage"]);
      out += sse_event("message_delta", {{"type", "message_delta"},
                                         {"delta", {{"stop_reason", reason_}, {"stop_sequence", sequence_}}},
                                         {"usage", u}});
      out += sse_event("message_stop", {{"type", "message_stop"}});
      finished_ = true;
      return out;
    }
    if (!c.contains("choices") || c["choices"].empty()) return out;
    const Json& choice = c["choices"][0];
    const Json& d = choice["delta"];
    if (d.contains("reasoning_content") && d["reasoning_content"].is_string())
      out += delta_text("thinking", "thinking_delta", "thinking", d["reasoning_content"]);
    if (d.contains("content") && d["content"].is_string() && !d["content"].get<std::string>().empty())
      out += delta_text("text", "text_delta", "text", d["content"]);
    if (d.contains("tool_calls")) {
      for (const Json& t : d["tool_calls"]) {
        if (t.contains("id")) {
          out += close_block();
          open_ = "tool_use";
          saw_tool_ = true;
          out += sse_event("content_block_start", {{"type", "content_block_start"},
                                                   {"index", index_},
                                                   {"content_block",
                                                    {{"type", "tool_use"},
                                                     {"id", t["id"]},
                                                     {"name", t["function"]["name"]},
                                                     {"input", Json::object()}}}});
        }
        const std::string args = t["function"].value("arguments", "");
        if (!args.empty())
          out += sse_event("content_block_delta",
                           {{"type", "content_block_delta"},
                            {"index", index_},
                            {"delta", {{"type", "input_json_delta"}, {"partial_json", args}}}});
      }
    }
    if (!choice["finish_reason"].is_null()) std::tie(reason_, sequence_) = stop_reason(choice, saw_tool_);
    return out;
  }

  std::string done() override { return ""; }

  std::string error(const ApiError& e) override {
    finished_ = true;
    return sse_event("error", error_json(e.status, e.what()));
  }

 private:
  static std::pair<Json, Json> stop_reason(const Json& choice, bool tool_calls) {
    const std::string f = choice["finish_reason"].get<std::string>();
    if (f == "length") return {"max_tokens", nullptr};
    if (tool_calls) return {"tool_use", nullptr};
    if (choice.contains("stop_reason") && choice["stop_reason"].is_string())
      return {"stop_sequence", choice["stop_reason"]};
    return {"end_turn", nullptr};
  }

  static Json usage(const Json& u) {
    const int prompt = u["prompt_tokens"].get<int>();
    const int cached = u["prompt_tokens_details"]["cached_tokens"].get<int>();
    return {{"input_tokens", prompt - cached},
            {"cache_creation_input_tokens", 0},
            {"cache_read_input_tokens", cached},
            {"output_tokens", u["completion_tokens"]}};
  }

  std::string close_block() {
    if (open_.empty()) return "";
    open_.clear();
    return sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_++}});
  }

  std::string delta_text(const char* block, const char* delta_type, const char* field, const Json& text) {
    std::string out;
    if (open_ != block) {
      out += close_block();
      open_ = block;
      Json cb{{"type", block}, {field, ""}};
      if (open_ == "thinking") cb["signature"] = "";
      out += sse_event("content_block_start",
                       {{"type", "content_block_start"}, {"index", index_}, {"content_block", cb}});
    }
    out += sse_event("content_block_delta", {{"type", "content_block_delta"},
                                             {"index", index_},
                                             {"delta", {{"type", delta_type}, {field, text}}}});
    return out;
  }

  bool stream_ = false, started_ = false, finished_ = false, saw_tool_ = false;
  std::string open_;  // the open content block's type
  int index_ = 0;
  Json reason_ = "end_turn", sequence_ = nullptr;
};

}  // namespace

int anthropic_status(int status) { return status == 503 ? 529 : status; }

std::string anthropic_error_body(int status, const std::string& message) {
  return error_json(status, message).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::unique_ptr<ChatFrontend> make_anthropic_frontend() { return std::make_unique<AnthropicFrontend>(); }

Json anthropic_count_tokens_body(const Json& body) {
  bool thinking = false;
  Json chat = translate_common(body, thinking);
  return chat;
}

}  // namespace tansy::server
