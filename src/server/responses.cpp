#include "server/responses.h"

#include <fmt/format.h>

#include <chrono>
#include <limits>
#include <set>

namespace tansy::server {

using namespace fe;

namespace {

// Content of a message item: a string or input_text / output_text parts.
Json message_content(const Json& c, const std::string& path) {
  if (c.is_string()) return c;
  if (!c.is_array()) bad_type(path, c, "a string or an array of content parts");
  std::string text;
  for (size_t i = 0; i < c.size(); ++i) {
    std::string p = join(path, i);
    const Json& part = object(c[i], p);
    std::string type = str(require(part, "type", join(p, "type")), join(p, "type"));
    if (type != "input_text" && type != "output_text")
      bad(join(p, "type"),
          fmt::format("content part type '{}' is not supported (tansy serves a text-only model)", type));
    text += str(require(part, "text", join(p, "text")), join(p, "text"));
  }
  return text;
}

// input (a string or items) + instructions -> chat messages. Consecutive assistant-side items
// (reasoning, assistant message, function_call) form one assistant turn.
Json translate_input(const Json& body) {
  Json out = Json::array();
  const Json& instructions = get(body, "instructions");
  if (!instructions.is_null())
    out.push_back({{"role", "system"}, {"content", str(instructions, "instructions")}});
  const Json& input = require(body, "input", "input");
  if (input.is_string()) {
    out.push_back({{"role", "user"}, {"content", input}});
    return out;
  }
  if (!input.is_array()) bad_type("input", input, "a string or an array of input items");
  if (input.empty()) bad("input", "'input' must not be empty");
  Json* turn = nullptr;  // the assistant message being built
  auto assistant = [&]() -> Json& {
    if (!turn) {
      out.push_back({{"role", "assistant"}, {"content", ""}});
      turn = &out.back();
    }
    return *turn;
  };
  for (size_t i = 0; i < input.size(); ++i) {
    std::string w = join("input", i);
    const Json& item = object(input[i], w);
    const Json& t = get(item, "type");
    std::string type = t.is_null() ? "message" : str(t, join(w, "type"));
    if (type == "message") {
      std::string role = str(require(item, "role", join(w, "role")), join(w, "role"));
      Json content = message_content(require(item, "content", join(w, "content")), join(w, "content"));
      if (role == "assistant") {
        Json& a = assistant();
        a["content"] = a["content"].get<std::string>() + content.get<std::string>();
        continue;
      }
      if (role == "developer") role = "system";
      if (role != "user" && role != "system")
        bad(join(w, "role"),
            fmt::format("role '{}' is not supported (user, assistant, system, developer)", role));
      turn = nullptr;
      out.push_back({{"role", role}, {"content", content}});
    } else if (type == "function_call") {
      std::string call_id = str(require(item, "call_id", join(w, "call_id")), join(w, "call_id"));
      std::string name = str(require(item, "name", join(w, "name")), join(w, "name"));
      std::string args = str(require(item, "arguments", join(w, "arguments")), join(w, "arguments"));
      Json parsed = Json::parse(args, nullptr, false);
      if (parsed.is_discarded() || !parsed.is_object())
        bad(join(w, "arguments"),
            fmt::format("'{}' must be a JSON object in a string", join(w, "arguments")));
      Json& a = assistant();
      if (!a.contains("tool_calls")) a["tool_calls"] = Json::array();
      a["tool_calls"].push_back(
          {{"id", call_id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", args}}}});
    } else if (type == "function_call_output") {
      std::string call_id = str(require(item, "call_id", join(w, "call_id")), join(w, "call_id"));
      Json output = message_content(require(item, "output", join(w, "output")), join(w, "output"));
      turn = nullptr;
      out.push_back({{"role", "tool"}, {"tool_call_id", call_id}, {"content", output}});
    } else if (type == "reasoning") {
      std::string text;
      const Json& content = get(item, "content");
      if (!content.is_null()) {
        array(content, join(w, "content"));
        for (size_t k = 0; k < content.size(); ++k) {
          std::string p = join(join(w, "content"), k);
          const Json& part = object(content[k], p);
          text += str(require(part, "text", join(p, "text")), join(p, "text"));
        }
      }
      const Json& summary = get(item, "summary");
      if (!summary.is_null()) {
        array(summary, join(w, "summary"));
        for (size_t k = 0; k < summary.size(); ++k) {
          std::string p = join(join(w, "summary"), k);
          str(require(object(summary[k], p), "text", join(p, "text")), join(p, "text"));
        }
      }
      Json& a = assistant();
      a["reasoning_content"] = a.value("reasoning_content", "") + text;
    } else if (type == "item_reference") {
      bad(join(w, "type"), "'item_reference' needs stored responses; tansy stores nothing (send the items)");
    } else {
      bad(join(w, "type"), fmt::format("input item type '{}' is not supported", type));
    }
  }
  return out;
}

class ResponsesFrontend : public ChatFrontend {
 public:
  const char* endpoint() const override { return "/v1/responses"; }
  std::string make_id(const std::string& hex) const override { return "resp_" + hex; }
  bool stream() const override { return stream_; }

  Json chat_body(const Json& body) override {
    object(body, "");
    Json chat{{"model", str(require(body, "model", "model"), "model")}};
    const Json& store = get(body, "store");
    if (!store.is_null() && boolean(store, "store"))
      bad("store",
          "'store': true is not supported: tansy's Responses API is stateless (send \"store\": false)");
    if (!get(body, "previous_response_id").is_null())
      bad("previous_response_id",
          "'previous_response_id' is not supported: tansy stores no responses (send the whole conversation "
          "as "
          "'input')");
    for (const char* k : {"conversation", "prompt", "background"}) {
      const Json& v = get(body, k);
      if (!v.is_null() && !(v.is_boolean() && !v.get<bool>()))
        bad(k, fmt::format("'{}' is not supported by tansy", k));
    }
    chat["messages"] = translate_input(body);

    std::set<std::string> names;
    const Json& tools = get(body, "tools");
    if (!tools.is_null()) {
      array(tools, "tools");
      Json t = Json::array();
      for (size_t i = 0; i < tools.size(); ++i) {
        std::string w = join("tools", i);
        const Json& x = object(tools[i], w);
        std::string type = str(require(x, "type", join(w, "type")), join(w, "type"));
        if (type != "function")
          bad(join(w, "type"), fmt::format("tool type '{}' is not supported (function only)", type));
        std::string name = str(require(x, "name", join(w, "name")), join(w, "name"));
        if (name.empty()) bad(join(w, "name"), "tool names must not be empty");
        names.insert(name);
        Json fn{{"name", name}};
        const Json& desc = get(x, "description");
        if (!desc.is_null()) fn["description"] = str(desc, join(w, "description"));
        const Json& params = get(x, "parameters");
        if (!params.is_null()) fn["parameters"] = object(params, join(w, "parameters"));
        const Json& strict = get(x, "strict");
        if (!strict.is_null()) fn["strict"] = boolean(strict, join(w, "strict"));
        t.push_back({{"type", "function"}, {"function", fn}});
        tools_.push_back(x);
      }
      if (!t.empty()) chat["tools"] = t;
    }
    const Json& tc = get(body, "tool_choice");
    if (!tc.is_null()) {
      if (tc.is_string()) {
        std::string s = tc.get<std::string>();
        if (s != "none" && s != "auto" && s != "required")
          bad("tool_choice",
              fmt::format("'tool_choice' must be none, auto, required or a function, got '{}'", s));
        chat["tool_choice"] = s;
      } else if (tc.is_object()) {
        std::string type = str(require(tc, "type", "tool_choice.type"), "tool_choice.type");
        if (type != "function")
          bad("tool_choice.type", fmt::format("tool_choice type '{}' is not supported", type));
        std::string name = str(require(tc, "name", "tool_choice.name"), "tool_choice.name");
        if (!names.count(name))
          bad("tool_choice.name",
              fmt::format("tool_choice names function '{}', which is not in 'tools'", name));
        chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", name}}}};
      } else {
        bad_type("tool_choice", tc, "a string or an object");
      }
      tool_choice_ = tc;
    }
    const Json& mot = get(body, "max_output_tokens");
    if (!mot.is_null()) {
      chat["max_tokens"] = integer(mot, "max_output_tokens", 1, std::numeric_limits<int32_t>::max());
      max_output_tokens_ = chat["max_tokens"];
    }
    const Json& temperature = get(body, "temperature");
    if (!temperature.is_null()) chat["temperature"] = number(temperature, "temperature", 0, 2);
    const Json& top_p = get(body, "top_p");
    if (!top_p.is_null()) {
      double p = number(top_p, "top_p", 0, 1);
      if (p <= 0) bad("top_p", "'top_p' must be greater than 0");
      chat["top_p"] = p;
    }
    const Json& text = get(body, "text");
    if (!text.is_null()) {
      object(text, "text");
      const Json& format = get(text, "format");
      if (!format.is_null()) {
        object(format, "text.format");
        std::string type = str(require(format, "type", "text.format.type"), "text.format.type");
        // Structured output: the chat request's response_format (its schema checked there).
        if (type == "json_object") {
          chat["response_format"] = {{"type", "json_object"}};
        } else if (type == "json_schema") {
          Json js{{"name", str(require(format, "name", "text.format.name"), "text.format.name")},
                  {"schema", object(require(format, "schema", "text.format.schema"), "text.format.schema")}};
          const Json& strict = get(format, "strict");
          if (!strict.is_null()) js["strict"] = boolean(strict, "text.format.strict");
          chat["response_format"] = {{"type", "json_schema"}, {"json_schema", js}};
        } else if (type != "text") {
          bad("text.format.type",
              fmt::format("'text.format.type' must be text, json_object or json_schema, got '{}'", type));
        }
        text_format_ = format;
      }
      const Json& verbosity = get(text, "verbosity");
      if (!verbosity.is_null()) str(verbosity, "text.verbosity");
    }
    const Json& reasoning = get(body, "reasoning");
    if (!reasoning.is_null()) {
      object(reasoning, "reasoning");
      const Json& effort = get(reasoning, "effort");
      if (!effort.is_null()) {
        std::string e = str(effort, "reasoning.effort");
        static const std::set<std::string> efforts = {"none", "minimal", "low", "medium", "high"};
        if (!efforts.count(e))
          bad("reasoning.effort",
              fmt::format("'reasoning.effort' must be none, minimal, low, medium or high, got '{}'", e));
        // Qwen3.6 has one switch: thinking on or off.
        chat["chat_template_kwargs"] = {{"enable_thinking", e != "none"}};
        reasoning_["effort"] = e;
      }
      const Json& summary = get(reasoning, "summary");
      if (!summary.is_null()) str(summary, "reasoning.summary");
    }
    const Json& parallel = get(body, "parallel_tool_calls");
    if (!parallel.is_null()) chat["parallel_tool_calls"] = boolean(parallel, "parallel_tool_calls");
    const Json& metadata = get(body, "metadata");
    if (!metadata.is_null()) metadata_ = object(metadata, "metadata");
    for (const char* k : {"user", "safety_identifier", "prompt_cache_key", "service_tier", "truncation"}) {
      const Json& v = get(body, k);
      if (!v.is_null()) str(v, k);
    }
    const Json& include = get(body, "include");
    if (!include.is_null()) {
      array(include, "include");
      for (size_t i = 0; i < include.size(); ++i) str(include[i], join("include", i));
    }
    if (!get(body, "top_logprobs").is_null())
      bad("top_logprobs", "'top_logprobs' is not supported on /v1/responses");
    const Json& stream = get(body, "stream");
    stream_ = !stream.is_null() && boolean(stream, "stream");
    chat["stream"] = stream_;
    if (stream_) chat["stream_options"] = {{"include_usage", true}};
    instructions_ = get(body, "instructions");
    ignored_fields = unknown_fields(body, {"model",
                                           "input",
                                           "instructions",
                                           "tools",
                                           "tool_choice",
                                           "max_output_tokens",
                                           "temperature",
                                           "top_p",
                                           "stream",
                                           "text",
                                           "reasoning",
                                           "store",
                                           "previous_response_id",
                                           "conversation",
                                           "prompt",
                                           "background",
                                           "parallel_tool_calls",
                                           "metadata",
                                           "user",
                                           "safety_identifier",
                                           "prompt_cache_key",
                                           "service_tier",
                                           "truncation",
                                           "include",
                                           "top_logprobs",
                                           "stream_options"});
    if (!temperature.is_null()) temperature_ = temperature;
    if (!top_p.is_null()) top_p_ = top_p;
    return chat;
  }

  std::string error_body(const ApiError& e) const override { return e.body(); }

  Json response(const Json& completion) override {
    const Json& choice = completion["choices"][0];
    const Json& msg = choice["message"];
    start(completion);
    Json output = Json::array();
    if (msg["reasoning_content"].is_string())
      output.push_back(reasoning_item(msg["reasoning_content"], "completed"));
    if (msg["content"].is_string() && !msg["content"].get<std::string>().empty())
      output.push_back(message_item(msg["content"], "completed"));
    if (msg.contains("tool_calls"))
      for (const Json& c : msg["tool_calls"])
        output.push_back(call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed"));
    return final_response(choice, output, completion["usage"]);
  }

  std::string chunk(const Json& c) override {
    std::string out;
    if (!started_) {
      started_ = true;
      start(c);
      Json r = base("in_progress");
      out += event("response.created", {{"response", r}});
      out += event("response.in_progress", {{"response", r}});
    }
    if (c.contains("usage") && c["usage"].is_object()) {
      out += close_item();
      Json r = final_response(last_choice_, output_, c["usage"]);
      out +=
          event(r["status"] == "completed" ? "response.completed" : "response.incomplete", {{"response", r}});
      return out;
    }
    if (!c.contains("choices") || c["choices"].empty()) return out;
    const Json& choice = c["choices"][0];
    const Json& d = choice["delta"];
    if (d.contains("reasoning_content") && d["reasoning_content"].is_string()) {
      if (open_ != "reasoning") {
        out += close_item();
        open_ = "reasoning";
        item_id_ = "rs_" + hex_ + "_" + std::to_string(output_.size());
        text_.clear();
        out += event("response.output_item.added",
                     {{"output_index", output_.size()}, {"item", reasoning_item_empty("in_progress")}});
        out += event("response.content_part.added", {{"item_id", item_id_},
                                                     {"output_index", output_.size()},
                                                     {"content_index", 0},
                                                     {"part", {{"type", "reasoning_text"}, {"text", ""}}}});
      }
      text_ += d["reasoning_content"].get<std::string>();
      out += event("response.reasoning_text.delta", {{"item_id", item_id_},
                                                     {"output_index", output_.size()},
                                                     {"content_index", 0},
                                                     {"delta", d["reasoning_content"]}});
    }
    if (d.contains("content") && d["content"].is_string() && !d["content"].get<std::string>().empty()) {
      if (open_ != "message") {
        out += close_item();
        open_ = "message";
        item_id_ = "msg_" + hex_ + "_" + std::to_string(output_.size());
        text_.clear();
        Json item = message_item("", "in_progress");
        item["content"] = Json::array();
        out += event("response.output_item.added", {{"output_index", output_.size()}, {"item", item}});
        out += event("response.content_part.added", {{"item_id", item_id_},
                                                     {"output_index", output_.size()},
                                                     {"content_index", 0},
                                                     {"part", text_part("")}});
      }
      text_ += d["content"].get<std::string>();
      out += event("response.output_text.delta", {{"item_id", item_id_},
                                                  {"output_index", output_.size()},
                                                  {"content_index", 0},
                                                  {"delta", d["content"]},
                                                  {"logprobs", Json::array()}});
    }
    if (d.contains("tool_calls")) {
      for (const Json& t : d["tool_calls"]) {
        if (t.contains("id")) {
          out += close_item();
          open_ = "function_call";
          item_id_ = "fc_" + hex_ + "_" + std::to_string(output_.size());
          text_.clear();
          call_id_ = t["id"];
          call_name_ = t["function"]["name"];
          out += event("response.output_item.added",
                       {{"output_index", output_.size()},
                        {"item", call_item(call_id_, call_name_, "", "in_progress")}});
        }
        const std::string args = t["function"].value("arguments", "");
        if (!args.empty()) {
          text_ += args;
          out += event("response.function_call_arguments.delta",
                       {{"item_id", item_id_}, {"output_index", output_.size()}, {"delta", args}});
        }
      }
    }
    if (!choice["finish_reason"].is_null()) last_choice_ = choice;
    return out;
  }

  std::string done() override { return ""; }

  std::string error(const ApiError& e) override {
    Json err{
        {"code", e.code.empty() ? Json(e.type()) : Json(e.code)}, {"message", e.what()}, {"param", nullptr}};
    if (!e.param.empty()) err["param"] = e.param;
    return event("error", err);
  }

 private:
  void start(const Json& c) {
    id_ = c["id"];
    model_ = c["model"];
    created_ = c["created"];
    hex_ = id_.get<std::string>().substr(5);
  }

  std::string event(const char* type, Json data) {
    Json e{{"type", type}, {"sequence_number", seq_++}};
    for (auto& [k, v] : data.items()) e[k] = v;
    return sse_event(type, e);
  }

  Json text_part(const std::string& text) const {
    return {
        {"type", "output_text"}, {"text", text}, {"annotations", Json::array()}, {"logprobs", Json::array()}};
  }
  Json reasoning_item_empty(const char* status) const {
    return {{"id", item_id_},
            {"type", "reasoning"},
            {"summary", Json::array()},
            {"content", Json::array()},
            {"status", status}};
  }
  Json reasoning_item(const Json& text, const char* status) {
    if (item_id_.empty() || open_ != "reasoning")
      item_id_ = "rs_" + hex_ + "_" + std::to_string(output_count());
    Json item = reasoning_item_empty(status);
    item["content"] = Json::array({{{"type", "reasoning_text"}, {"text", text}}});
    return item;
  }
  Json message_item(const Json& text, const char* status) {
    if (open_ != "message") item_id_ = "msg_" + hex_ + "_" + std::to_string(output_count());
    return {{"id", item_id_},
            {"type", "message"},
            {"status", status},
            {"role", "assistant"},
            {"content", Json::array({text_part(text.get<std::string>())})}};
  }
  Json call_item(const Json& call_id, const Json& name, const Json& args, const char* status) {
    if (open_ != "function_call") item_id_ = "fc_" + hex_ + "_" + std::to_string(output_count());
    return {{"id", item_id_},    {"type", "function_call"}, {"status", status},
            {"arguments", args}, {"call_id", call_id},      {"name", name}};
  }
  // Non-streaming builds its items in a local array; streaming appends to output_.
  size_t output_count() { return open_.empty() ? counter_++ : output_.size(); }

  std::string close_item() {
    if (open_.empty()) return "";
    std::string out;
    const size_t index = output_.size();
    Json item;
    if (open_ == "reasoning") {
      Json part{{"type", "reasoning_text"}, {"text", text_}};
      out += event("response.reasoning_text.done",
                   {{"item_id", item_id_}, {"output_index", index}, {"content_index", 0}, {"text", text_}});
      out += event("response.content_part.done",
                   {{"item_id", item_id_}, {"output_index", index}, {"content_index", 0}, {"part", part}});
      item = reasoning_item(text_, "completed");
    } else if (open_ == "message") {
      out += event("response.output_text.done", {{"item_id", item_id_},
                                                 {"output_index", index},
                                                 {"content_index", 0},
                                                 {"text", text_},
                                                 {"logprobs", Json::array()}});
      out += event(
          "response.content_part.done",
          {{"item_id", item_id_}, {"output_index", index}, {"content_index", 0}, {"part", text_part(text_)}});
      item = message_item(text_, "completed");
    } else {
      out +=
          event("response.function_call_arguments.done",
                {{"item_id", item_id_}, {"output_index", index}, {"arguments", text_}, {"name", call_name_}});
      item = call_item(call_id_, call_name_, text_, "completed");
    }
    out += event("response.output_item.done", {{"output_index", index}, {"item", item}});
    output_.push_back(item);
    open_.clear();
    return out;
  }

  Json base(const char* status) const {
    return Json{{"id", id_},
                {"object", "response"},
                {"created_at", created_},
                {"status", status},
                {"background", false},
                {"error", nullptr},
                {"incomplete_details", nullptr},
                {"instructions", instructions_},
                {"max_output_tokens", max_output_tokens_},
                {"model", model_},
                {"output", Json::array()},
                {"parallel_tool_calls", true},
                {"previous_response_id", nullptr},
                {"reasoning", reasoning_},
                {"store", false},
                {"temperature", temperature_},
                {"text", {{"format", text_format_}}},
                {"tool_choice", tool_choice_},
                {"tools", tools_},
                {"top_p", top_p_},
                {"truncation", "disabled"},
                {"usage", nullptr},
                {"metadata", metadata_}};
  }

  Json final_response(const Json& choice, const Json& output, const Json& u) const {
    const bool length = choice.is_object() && choice["finish_reason"] == "length";
    Json r = base(length ? "incomplete" : "completed");
    if (length) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
    r["output"] = output;
    const int prompt = u["prompt_tokens"].get<int>(), completion = u["completion_tokens"].get<int>();
    r["usage"] = {{"input_tokens", prompt},
                  {"input_tokens_details", {{"cached_tokens", u["prompt_tokens_details"]["cached_tokens"]}}},
                  {"output_tokens", completion},
                  {"total_tokens", prompt + completion}};
    return r;
  }

  bool stream_ = false, started_ = false;
  int seq_ = 0;
  size_t counter_ = 0;
  Json id_, model_, created_;
  std::string hex_;
  Json instructions_, max_output_tokens_, temperature_, top_p_;  // null: the server's defaults
  Json tool_choice_ = "auto", tools_ = Json::array(),
       reasoning_ = {{"effort", nullptr}, {"summary", nullptr}};
  Json metadata_ = Json::object();
  Json text_format_ = {{"type", "text"}};
  Json output_ = Json::array(), last_choice_;
  std::string open_, item_id_, text_;
  Json call_id_, call_name_;
};

}  // namespace

std::unique_ptr<ChatFrontend> make_responses_frontend() { return std::make_unique<ResponsesFrontend>(); }

}  // namespace tansy::server
