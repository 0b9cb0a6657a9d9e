#include "server/openai.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <set>

#include "core/error.h"

namespace tansy::server {

ApiError::ApiError(int status_, std::string message, std::string param_, std::string code_)
    : std::runtime_error(std::move(message)),
      status(status_),
      param(std::move(param_)),
      code(std::move(code_)) {}

std::string ApiError::type() const {
  switch (status) {
    case 401:
      return "authentication_error";
    case 413:
      return "invalid_request_error";
    case 429:
    case 503:
      return "server_overloaded";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

std::string ApiError::body() const {
  Json e = {{"message", what()}, {"type", type()}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return Json{{"error", e}}.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void api_fail(int status, const std::string& param, const std::string& message, const std::string& code) {
  throw ApiError(status, message, param, code);
}

namespace {

const char* type_name(const Json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

// Typed access to the top-level fields of a body. A null value counts as absent, as in OpenAI's API.
class Fields {
 public:
  explicit Fields(const Json& body) : b_(body) {
    if (!body.is_object())
      api_fail(400, "", fmt::format("the request body must be a JSON object, got {}", type_name(body)));
  }
  bool has(const char* k) const { return b_.contains(k) && !b_.at(k).is_null(); }
  const Json& at(const char* k) const { return b_.at(k); }

  bool boolean(const char* k, bool fallback) const {
    if (!has(k)) return fallback;
    if (!at(k).is_boolean()) bad_type(k, "a boolean");
    return at(k).get<bool>();
  }
  int64_t integer(const char* k, int64_t fallback, int64_t lo, int64_t hi) const {
    if (!has(k)) return fallback;
    const Json& v = at(k);
    if (!v.is_number_integer()) bad_type(k, "an integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      out_of_range(k, lo, hi);
    int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) out_of_range(k, lo, hi);
    return x;
  }
  double number(const char* k, double fallback, double lo, double hi) const {
    if (!has(k)) return fallback;
    if (!at(k).is_number()) bad_type(k, "a number");
    double x = at(k).get<double>();
    if (!(x >= lo && x <= hi)) out_of_range(k, lo, hi);
    return x;
  }
  std::string string(const char* k) const {
    if (!at(k).is_string()) bad_type(k, "a string");
    return at(k).get<std::string>();
  }
  // Type checks of fields that are accepted but change nothing (absent or null passes).
  void want_string(const char* k) const {
    if (has(k) && !at(k).is_string()) bad_type(k, "a string");
  }
  void want_boolean(const char* k) const {
    if (has(k) && !at(k).is_boolean()) bad_type(k, "a boolean");
  }

  [[noreturn]] void bad_type(const char* k, const char* want) const {
    api_fail(400, k, fmt::format("'{}' must be {}, got {}", k, want, type_name(at(k))));
  }
  template <typename T>
  [[noreturn]] void out_of_range(const char* k, T lo, T hi) const {
    api_fail(400, k, fmt::format("'{}' must be in [{}, {}], got {}", k, lo, hi, at(k).dump()));
  }

 private:
  const Json& b_;
};

// Fields of OpenAI's schema that tansy accepts and ignores: they change nothing about what a
// single local model generates.
const std::set<std::string> kIgnoredOpenAI = {"user",
                                              "metadata",
                                              "store",
                                              "service_tier",
                                              "prompt_cache_key",
                                              "safety_identifier",
                                              "parallel_tool_calls"};

// The types of the accepted-and-ignored fields, as OpenAI's schema gives them.
void check_ignored_types(const Fields& f) {
  for (const char* k : {"user", "service_tier", "prompt_cache_key", "safety_identifier"}) f.want_string(k);
  for (const char* k : {"store", "parallel_tool_calls"}) f.want_boolean(k);
  if (f.has("metadata")) {
    if (!f.at("metadata").is_object()) f.bad_type("metadata", "an object of strings");
    for (auto& [k, v] : f.at("metadata").items())
      if (!v.is_string())
        api_fail(400, "metadata", fmt::format("'metadata' values must be strings ('{}')", k));
  }
}

// An object's member that must be a string when present (null counts as absent).
void want_member_string(const Json& obj, const char* k, const std::string& where) {
  if (obj.contains(k) && !obj[k].is_null() && !obj[k].is_string())
    api_fail(400, where + "." + k,
             fmt::format("'{}.{}' must be a string, got {}", where, k, type_name(obj[k])));
}

void want_member_boolean(const Json& obj, const char* k, const std::string& where) {
  if (obj.contains(k) && !obj[k].is_null() && !obj[k].is_boolean())
    api_fail(400, where + "." + k,
             fmt::format("'{}.{}' must be a boolean, got {}", where, k, type_name(obj[k])));
}

void check_unsupported(const Fields& f, bool chat) {
  // Present and not the value that means "off": tansy would otherwise silently ignore a request it cannot
  // honour.
  if (f.has("n") && !f.at("n").is_number_integer()) f.bad_type("n", "an integer");
  if (f.has("n") && f.at("n").get<int64_t>() != 1)
    api_fail(400, "n", "'n' must be 1: tansy generates one choice per request");
  if (chat) {
    if (f.has("modalities")) {
      const Json& m = f.at("modalities");
      if (!m.is_array()) f.bad_type("modalities", "an array of strings");
      for (auto& x : m)
        if (!x.is_string()) api_fail(400, "modalities", "'modalities' must be an array of strings");
      if (m != Json::array({"text"}))
        api_fail(400, "modalities", "'modalities' other than [\"text\"] is not supported");
    }
    for (const char* k : {"audio", "prediction", "web_search_options", "functions", "function_call",
                          "reasoning_effort", "verbosity"})
      if (f.has(k)) api_fail(400, k, fmt::format("'{}' is not supported by tansy", k));
  } else {
    if (f.has("best_of") && !f.at("best_of").is_number_integer()) f.bad_type("best_of", "an integer");
    if (f.has("best_of") && f.at("best_of").get<int64_t>() != 1)
      api_fail(400, "best_of", "'best_of' must be 1");
    if (f.boolean("echo", false)) api_fail(400, "echo", "'echo' is not supported");
    if (f.has("suffix")) api_fail(400, "suffix", "'suffix' is not supported");
  }
}

// response_format: text, json_object or json_schema (OpenAI's shapes). The schema's own keywords
// are checked when it is compiled (server/structured.h).
void parse_response_format(const Fields& f, ApiRequest& r) {
  if (!f.has("response_format")) return;
  const Json& rf = f.at("response_format");
  if (!rf.is_object()) f.bad_type("response_format", "an object");
  if (!rf.contains("type") || !rf["type"].is_string())
    api_fail(400, "response_format.type", "'response_format.type' must be a string");
  const std::string type = rf["type"].get<std::string>();
  if (type == "text") return;
  if (type == "json_object") {
    r.response_format = ResponseFormat::kJsonObject;
  } else if (type == "json_schema") {
    if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
      api_fail(400, "response_format.json_schema", "'response_format.json_schema' must be an object");
    const Json& js = rf["json_schema"];
    want_member_string(js, "name", "response_format.json_schema");
    want_member_string(js, "description", "response_format.json_schema");
    want_member_boolean(js, "strict", "response_format.json_schema");
    if (!js.contains("schema") || !(js["schema"].is_object() || js["schema"].is_boolean()))
      api_fail(400, "response_format.json_schema.schema",
               "'response_format.json_schema.schema' must be a JSON Schema (an object)");
    r.response_format = ResponseFormat::kJsonSchema;
    r.schema = js["schema"];
  } else {
    api_fail(400, "response_format.type",
             fmt::format("'response_format.type' must be text, json_object or json_schema, got '{}'", type));
  }
  if (r.ignore_eos)
    api_fail(400, "ignore_eos", "'ignore_eos' cannot be combined with a JSON 'response_format'");
}

void parse_common(const Fields& f, ApiRequest& r, const SamplingParams& defaults, int vocab_size) {
  if (!f.has("model")) api_fail(400, "model", "you must provide a model parameter");
  r.model = f.string("model");
  r.stream = f.boolean("stream", false);
  if (f.has("stream_options")) {
    const Json& so = f.at("stream_options");
    if (!so.is_object()) f.bad_type("stream_options", "an object");
    if (so.contains("include_usage") && !so["include_usage"].is_null()) {
      if (!so["include_usage"].is_boolean())
        api_fail(400, "stream_options.include_usage", "'stream_options.include_usage' must be a boolean");
      r.include_usage = so["include_usage"].get<bool>();
    }
  }
  SamplingParams& s = r.sampling;
  s = defaults;
  s.temperature = f.number("temperature", s.temperature, 0, 2);
  s.top_p = f.number("top_p", s.top_p, 0, 1);
  if (s.top_p <= 0) api_fail(400, "top_p", "'top_p' must be greater than 0");
  s.top_k = int(f.integer("top_k", s.top_k, -1, std::numeric_limits<int32_t>::max()));
  if (s.top_k < 0) s.top_k = 0;
  s.min_p = f.number("min_p", s.min_p, 0, 1);
  s.presence_penalty = f.number("presence_penalty", s.presence_penalty, -2, 2);
  s.frequency_penalty = f.number("frequency_penalty", s.frequency_penalty, -2, 2);
  s.repetition_penalty = f.number("repetition_penalty", s.repetition_penalty, 0, 100);
  if (s.repetition_penalty <= 0)
    api_fail(400, "repetition_penalty", "'repetition_penalty' must be greater than 0");
  if (f.has("seed"))
    s.seed = uint64_t(
        f.integer("seed", 0, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
  if (f.has("logit_bias")) {
    const Json& lb = f.at("logit_bias");
    if (!lb.is_object()) f.bad_type("logit_bias", "an object mapping token ids to biases");
    for (auto& [k, v] : lb.items()) {
      char* end = nullptr;
      errno = 0;
      long id = std::strtol(k.c_str(), &end, 10);
      if (k.empty() || *end != '\0' || errno != 0 || id < 0 || id >= vocab_size)
        api_fail(400, "logit_bias",
                 fmt::format("logit_bias key '{}' is not a token id in [0, {})", k, vocab_size));
      if (!v.is_number() || !(v.get<double>() >= -100 && v.get<double>() <= 100))
        api_fail(400, "logit_bias",
                 fmt::format("logit_bias value for '{}' must be a number in [-100, 100]", k));
      s.logit_bias[int32_t(id)] = v.get<double>();
    }
  }
  if (f.has("stop")) {
    const Json& st = f.at("stop");
    if (st.is_string()) {
      r.stop.push_back(st.get<std::string>());
    } else if (st.is_array()) {
      if (st.size() > 16) api_fail(400, "stop", "'stop' may hold at most 16 strings");
      for (auto& x : st) {
        if (!x.is_string()) api_fail(400, "stop", "'stop' must be a string or an array of strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      f.bad_type("stop", "a string or an array of strings");
    }
    for (auto& x : r.stop)
      if (x.empty()) api_fail(400, "stop", "stop strings must not be empty");
  }
  r.ignore_eos = f.boolean("ignore_eos", false);
  parse_response_format(f, r);
}

void validate_content(const Json& content, const std::string& where) {
  if (content.is_null() || content.is_string()) return;
  if (!content.is_array())
    api_fail(400, where, fmt::format("'{}' must be a string, an array of parts or null", where));
  for (size_t i = 0; i < content.size(); ++i) {
    const Json& p = content[i];
    std::string w = fmt::format("{}[{}]", where, i);
    if (!p.is_object()) api_fail(400, w, fmt::format("'{}' must be an object", w));
    std::string type = p.contains("type") && p["type"].is_string() ? p["type"].get<std::string>() : "";
    if (type != "text")
      api_fail(400, w + ".type",
               type.empty()
                   ? fmt::format("'{}.type' must be a string", w)
                   : fmt::format("content part type '{}' is not supported (tansy serves a text-only model)",
                                 type));
    if (!p.contains("text") || !p["text"].is_string())
      api_fail(400, w + ".text", fmt::format("'{}.text' must be a string", w));
  }
}

void validate_messages(const Fields& f) {
  if (!f.has("messages")) api_fail(400, "messages", "'messages' is required");
  const Json& m = f.at("messages");
  if (!m.is_array()) f.bad_type("messages", "an array");
  if (m.empty()) api_fail(400, "messages", "'messages' must not be empty");
  static const std::set<std::string> roles = {"system", "developer", "user", "assistant", "tool"};
  for (size_t i = 0; i < m.size(); ++i) {
    const Json& msg = m[i];
    std::string w = fmt::format("messages[{}]", i);
    if (!msg.is_object()) api_fail(400, w, fmt::format("'{}' must be an object", w));
    if (!msg.contains("role") || !msg["role"].is_string())
      api_fail(400, w + ".role", fmt::format("'{}.role' must be a string", w));
    std::string role = msg["role"].get<std::string>();
    if (!roles.count(role))
      api_fail(400, w + ".role",
               fmt::format("role '{}' is not supported (system, developer, user, assistant, tool)", role));
    want_member_string(msg, "name", w);
    want_member_string(msg, "tool_call_id", w);
    if (msg.contains("content"))
      validate_content(msg["content"], w + ".content");
    else if (role != "assistant")
      api_fail(400, w + ".content", fmt::format("'{}.content' is required", w));
    if (msg.contains("reasoning_content") && !msg["reasoning_content"].is_null() &&
        !msg["reasoning_content"].is_string())
      api_fail(400, w + ".reasoning_content", fmt::format("'{}.reasoning_content' must be a string", w));
    if (msg.contains("tool_calls") && !msg["tool_calls"].is_null()) {
      const Json& tc = msg["tool_calls"];
      if (role != "assistant" || !tc.is_array())
        api_fail(400, w + ".tool_calls",
                 fmt::format("'{}.tool_calls' must be an array on an assistant message", w));
      for (size_t j = 0; j < tc.size(); ++j) {
        std::string wj = fmt::format("{}.tool_calls[{}]", w, j);
        const Json& c = tc[j];
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
          api_fail(400, wj, fmt::format("'{}' must be an object with a 'function' object", wj));
        want_member_string(c, "id", wj);
        want_member_string(c, "type", wj);
        if (c.contains("type") && c["type"].is_string() && c["type"] != "function")
          api_fail(400, wj + ".type", fmt::format("'{}.type' must be \"function\"", wj));
        const Json& fn = c["function"];
        if (!fn.contains("name") || !fn["name"].is_string())
          api_fail(400, wj + ".function.name", fmt::format("'{}.function.name' must be a string", wj));
        if (fn.contains("arguments") && !fn["arguments"].is_string() && !fn["arguments"].is_object())
          api_fail(400, wj + ".function.arguments",
                   fmt::format("'{}.function.arguments' must be a JSON string", wj));
      }
    }
  }
}

std::set<std::string> validate_tools(const Fields& f) {
  std::set<std::string> names;
  if (!f.has("tools")) return names;
  const Json& t = f.at("tools");
  if (!t.is_array()) f.bad_type("tools", "an array");
  for (size_t i = 0; i < t.size(); ++i) {
    std::string w = fmt::format("tools[{}]", i);
    const Json& x = t[i];
    if (!x.is_object() || !x.contains("type") || !x["type"].is_string() || x["type"] != "function" ||
        !x.contains("function") || !x["function"].is_object())
      api_fail(400, w, fmt::format("'{}' must be {{\"type\": \"function\", \"function\": {{...}}}}", w));
    const Json& fn = x["function"];
    want_member_string(fn, "description", w + ".function");
    want_member_boolean(fn, "strict", w + ".function");
    if (!fn.contains("name") || !fn["name"].is_string() || fn["name"].get<std::string>().empty())
      api_fail(400, w + ".function.name", fmt::format("'{}.function.name' must be a non-empty string", w));
    if (fn.contains("parameters") && !fn["parameters"].is_null() && !fn["parameters"].is_object())
      api_fail(400, w + ".function.parameters", fmt::format("'{}.function.parameters' must be an object", w));
    names.insert(fn["name"].get<std::string>());
  }
  return names;
}

void collect_ignored(const Json& body, const std::set<std::string>& known, ApiRequest& r) {
  for (auto& [k, v] : body.items())
    if (!known.count(k) && !kIgnoredOpenAI.count(k)) r.ignored_fields.push_back(k);
}

}  // namespace

ApiRequest parse_chat_request(const Json& body, const SamplingParams& defaults, int vocab_size) {
  Fields f(body);
  ApiRequest r;
  r.chat = true;
  check_unsupported(f, true);
  check_ignored_types(f);
  parse_common(f, r, defaults, vocab_size);
  // Both are checked; max_completion_tokens (the newer name) wins when both are given.
  if (f.has("max_tokens"))
    r.max_tokens = int(f.integer("max_tokens", 0, 1, std::numeric_limits<int32_t>::max()));
  if (f.has("max_completion_tokens"))
    r.max_tokens = int(f.integer("max_completion_tokens", 0, 1, std::numeric_limits<int32_t>::max()));
  if (f.boolean("logprobs", false))
    r.logprobs = int(f.integer("top_logprobs", 0, 0, 20));
  else if (f.has("top_logprobs"))
    api_fail(400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");

  validate_messages(f);
  std::set<std::string> tool_names = validate_tools(f);
  r.parallel_tool_calls = f.boolean("parallel_tool_calls", true);
  if (f.has("chat_template_kwargs")) {
    const Json& kw = f.at("chat_template_kwargs");
    if (!kw.is_object()) f.bad_type("chat_template_kwargs", "an object");
    for (const char* k : {"enable_thinking", "preserve_thinking", "add_generation_prompt"})
      want_member_boolean(kw, k, "chat_template_kwargs");
  }
  for (const char* k : {"enable_thinking", "preserve_thinking", "add_generation_prompt"}) f.want_boolean(k);

  if (f.has("tool_choice")) {
    const Json& tc = f.at("tool_choice");
    if (tc.is_string()) {
      std::string s = tc.get<std::string>();
      if (s == "none")
        r.tool_choice = ToolChoice::kNone;
      else if (s == "auto")
        r.tool_choice = ToolChoice::kAuto;
      else if (s == "required")
        r.tool_choice = ToolChoice::kRequired;
      else
        api_fail(400, "tool_choice",
                 fmt::format("'tool_choice' must be none, auto, required or a named function, got '{}'", s));
    } else if (tc.is_object() && tc.contains("type") && tc["type"] == "function" && tc.contains("function") &&
               tc["function"].is_object() && tc["function"].contains("name") &&
               tc["function"]["name"].is_string()) {
      r.tool_choice = ToolChoice::kNamed;
      r.tool_name = tc["function"]["name"].get<std::string>();
      if (!tool_names.count(r.tool_name))
        api_fail(400, "tool_choice",
                 fmt::format("tool_choice names function '{}', which is not in 'tools'", r.tool_name));
    } else {
      f.bad_type(
          "tool_choice",
          "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    if ((r.tool_choice == ToolChoice::kRequired) && tool_names.empty())
      api_fail(400, "tool_choice", "tool_choice 'required' needs at least one tool in 'tools'");
  }
  if (tool_names.empty() && r.tool_choice == ToolChoice::kAuto) r.tool_choice = ToolChoice::kNone;

  try {
    r.render = text::parse_render_request(body);
  } catch (const Error& e) {
    api_fail(400, "messages", e.what());
  }
  // Newer OpenAI tooling sends instructions as "developer"; the template knows them as system.
  for (Json& m : r.render.messages)
    if (m["role"] == "developer") m["role"] = "system";
  if (r.tool_choice == ToolChoice::kNone) r.render.tools = nullptr;
  collect_ignored(body,
                  {"model",
                   "messages",
                   "stream",
                   "stream_options",
                   "max_tokens",
                   "max_completion_tokens",
                   "temperature",
                   "top_p",
                   "top_k",
                   "min_p",
                   "seed",
                   "presence_penalty",
                   "frequency_penalty",
                   "repetition_penalty",
                   "logit_bias",
                   "stop",
                   "logprobs",
                   "top_logprobs",
                   "tools",
                   "tool_choice",
                   "n",
                   "response_format",
                   "modalities",
                   "chat_template_kwargs",
                   "enable_thinking",
                   "preserve_thinking",
                   "add_generation_prompt",
                   "ignore_eos"},
                  r);
  return r;
}

ApiRequest parse_completion_request(const Json& body, const SamplingParams& defaults, int vocab_size) {
  Fields f(body);
  ApiRequest r;
  r.chat = false;
  check_unsupported(f, false);
  check_ignored_types(f);
  parse_common(f, r, defaults, vocab_size);
  r.max_tokens = int(f.integer("max_tokens", 16, 1, std::numeric_limits<int32_t>::max()));
  if (f.has("logprobs")) r.logprobs = int(f.integer("logprobs", 0, 0, 20));
  if (!f.has("prompt")) api_fail(400, "prompt", "'prompt' is required");
  const Json* p = &f.at("prompt");
  // A batch of one prompt is accepted; larger batches would need n > 1 choices.
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();  // may be empty, as in OpenAI's API
  } else if (p->is_array() && !p->empty()) {
    for (auto& x : *p) {
      if (!x.is_number_integer())
        api_fail(400, "prompt",
                 "'prompt' must be a string, an array of token ids, or a batch of one of those");
      int64_t id = x.get<int64_t>();
      if (id < 0 || id >= vocab_size)
        api_fail(400, "prompt", fmt::format("token id {} is outside [0, {})", id, vocab_size));
      r.prompt_ids.push_back(int32_t(id));
    }
  } else {
    api_fail(400, "prompt",
             "'prompt' must be a string, a non-empty array of token ids, or a batch of one of those");
  }
  collect_ignored(body,
                  {"model",
                   "prompt",
                   "stream",
                   "stream_options",
                   "max_tokens",
                   "temperature",
                   "top_p",
                   "top_k",
                   "min_p",
                   "seed",
                   "presence_penalty",
                   "frequency_penalty",
                   "repetition_penalty",
                   "logit_bias",
                   "stop",
                   "logprobs",
                   "n",
                   "best_of",
                   "echo",
                   "suffix",
                   "response_format",
                   "ignore_eos"},
                  r);
  return r;
}

}  // namespace tansy::server
