// The OpenAI request schema as tansy implements it: parsing and validation of
// /v1/chat/completions and /v1/completions bodies into a request the engine can run, and
// OpenAI-shaped errors. Fields of OpenAI's schema that tansy does not implement are refused
// (400 naming the field); fields outside the schema are ignored and reported to the caller
// for logging, since clients add their own.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "text/chat_template.h"

namespace tansy::server {

using Json = nlohmann::ordered_json;

// An error answered to the client: {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  ApiError(int status, std::string message, std::string param = {}, std::string code = {});
  int status;
  std::string param, code;
  std::string type() const;  // invalid_request_error, authentication_error, ...
  std::string body() const;
};
[[noreturn]] void api_fail(int status, const std::string& param, const std::string& message,
                           const std::string& code = {});

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };
enum class ResponseFormat { kText, kJsonObject, kJsonSchema };

struct ApiRequest {
  bool chat = true;
  std::string model;
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
  std::optional<int> max_tokens;  // absent: up to the context limit (chat), 16 (completions)
  SamplingParams sampling;
  std::vector<std::string> stop;
  int logprobs = -1;  // -1 none; else the number of alternatives per token
  bool ignore_eos = false;
  // response_format (structured output): the schema is compiled when the request is prepared.
  ResponseFormat response_format = ResponseFormat::kText;
  Json schema;  // kJsonSchema: response_format.json_schema.schema

  // chat
  text::RenderRequest render;  // messages, tools, template switches
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_name;            // kNamed
  bool parallel_tool_calls = true;  // false: at most one call where calls are constrained

  // completions
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;  // when the prompt was given as token ids

  std::vector<std::string> ignored_fields;  // outside OpenAI's schema (logged)
};

// Both throw ApiError. `defaults` are the sampling settings of fields the body leaves out.
ApiRequest parse_chat_request(const Json& body, const SamplingParams& defaults, int vocab_size);
ApiRequest parse_completion_request(const Json& body, const SamplingParams& defaults, int vocab_size);

}  // namespace tansy::server
