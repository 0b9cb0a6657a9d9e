#include "server/structured.h"

#include <fmt/format.h>

#include <mutex>

#include "grammar/constraint.h"
#include "grammar/json_schema.h"

namespace tansy::server {

namespace {

// The vocabulary trie of a tokenizer, built on first use (the server has one tokenizer).
std::shared_ptr<const grammar::Vocabulary> vocabulary(const Tokenizer& tok) {
  static std::mutex mu;
  static const Tokenizer* owner = nullptr;
  static std::shared_ptr<const grammar::Vocabulary> vocab;
  std::lock_guard lk(mu);
  if (owner != &tok || !vocab || vocab->bytes.size() != size_t(tok.vocab_size())) {
    vocab = grammar::Vocabulary::of(tok);
    owner = &tok;
  }
  return vocab;
}

std::shared_ptr<TokenConstraint> make(const std::string& key, const Tokenizer& tok,
                                      std::span<const int32_t> end_tokens, std::optional<int32_t> start_after,
                                      int max_tokens, const std::string& param,
                                      const std::function<std::shared_ptr<grammar::Grammar>()>& build) {
  auto vocab = vocabulary(tok);
  grammar::ConstraintOptions o;
  o.end_tokens.assign(end_tokens.begin(), end_tokens.end());
  o.start_after = start_after;
  o.max_tokens = max_tokens;
  try {
    return std::make_shared<grammar::GrammarConstraint>(grammar::cached_runtime(key, vocab, build), vocab,
                                                        std::move(o));
  } catch (const Error& e) {  // SchemaError, or a grammar whose start the matcher refuses
    api_fail(400, param, e.what());
  }
}

std::string content_key(const ApiRequest& r) {
  switch (r.response_format) {
    case ResponseFormat::kJsonObject:
      return "object";
    case ResponseFormat::kJsonSchema:
      return "schema:" + r.schema.dump();
    default:
      return "text";
  }
}

}  // namespace

std::shared_ptr<TokenConstraint> chat_constraint(const ApiRequest& r, const Tokenizer& tok,
                                                 std::span<const int32_t> end_tokens,
                                                 bool starts_in_reasoning, int max_tokens) {
  std::optional<int32_t> start_after;
  if (starts_in_reasoning) {
    start_after = tok.token_id("</think>");
    if (!start_after) api_fail(500, "", "the tokenizer has no </think> token");
  }
  const grammar::Framing framing{starts_in_reasoning};
  // Tools: a call is forced (required, named), or strict functions are called by their schema.
  std::vector<grammar::ToolSpec> specs;
  bool any_strict = false;
  if (r.tool_choice != ToolChoice::kNone && r.render.tools.is_array()) {
    for (const Json& t : r.render.tools) {
      const Json& fn = t["function"];
      const std::string name = fn["name"].get<std::string>();
      if (r.tool_choice == ToolChoice::kNamed && name != r.tool_name) continue;
      const bool strict = fn.contains("strict") && fn["strict"].is_boolean() && fn["strict"].get<bool>();
      any_strict = any_strict || strict;
      const Json params = fn.contains("parameters") ? fn["parameters"] : Json();
      specs.push_back({name, params, r.tool_choice != ToolChoice::kAuto || strict});
    }
  }
  const bool forced = r.tool_choice == ToolChoice::kRequired || r.tool_choice == ToolChoice::kNamed;
  // A JSON answer with tools on offer: the answer is the document or calls (with free arguments
  // unless strict).
  const bool json_or_calls = r.response_format != ResponseFormat::kText && !specs.empty();
  if (forced || any_strict || json_or_calls) {
    const auto mode = forced ? grammar::ToolMode::kRequired : grammar::ToolMode::kAuto;
    grammar::ToolContent content;
    if (!forced && r.response_format == ResponseFormat::kJsonObject)
      content.kind = grammar::ToolContent::Kind::kJsonObject;
    if (!forced && r.response_format == ResponseFormat::kJsonSchema) {
      content.kind = grammar::ToolContent::Kind::kJsonSchema;
      content.schema = r.schema;
    }
    Json key_tools = Json::array();
    for (auto& s : specs) key_tools.push_back({s.name, s.parameters, s.constrained});
    const bool single = !r.parallel_tool_calls;
    std::string key = fmt::format("tools:{}:{}:{}:{}:{}", int(mode), int(starts_in_reasoning), int(single),
                                  forced ? "text" : content_key(r), key_tools.dump());
    return make(key, tok, end_tokens, start_after, max_tokens, "tools",
                [&] { return grammar::tool_call_grammar(specs, mode, framing, content, single); });
  }
  if (r.response_format == ResponseFormat::kJsonObject)
    return make(fmt::format("object:{}", int(starts_in_reasoning)), tok, end_tokens, start_after, max_tokens,
                "response_format", [&] { return grammar::json_object_grammar(framing); });
  if (r.response_format == ResponseFormat::kJsonSchema)
    return make(fmt::format("schema:{}:{}", int(starts_in_reasoning), r.schema.dump()), tok, end_tokens,
                start_after, max_tokens, "response_format.json_schema.schema",
                [&] { return grammar::json_schema_grammar(r.schema, framing); });
  return nullptr;
}

std::shared_ptr<TokenConstraint> completion_constraint(const ApiRequest& r, const Tokenizer& tok,
                                                       std::span<const int32_t> end_tokens, int max_tokens) {
  if (r.response_format == ResponseFormat::kJsonObject)
    return make("object:0", tok, end_tokens, std::nullopt, max_tokens, "response_format",
                [&] { return grammar::json_object_grammar(); });
  if (r.response_format == ResponseFormat::kJsonSchema)
    return make("schema:0:" + r.schema.dump(), tok, end_tokens, std::nullopt, max_tokens,
                "response_format.json_schema.schema", [&] { return grammar::json_schema_grammar(r.schema); });
  return nullptr;
}

}  // namespace tansy::server
