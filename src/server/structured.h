// Structured output for the OpenAI endpoints: the TokenConstraint a request asks for through
// response_format (json_object, json_schema) or its tools (tool_choice required or a named
// function, or functions marked strict), built from the grammar engine (src/grammar).
#pragma once
#include <cstdint>
#include <memory>
#include <span>

#include "engine/constraint.h"
#include "server/openai.h"
#include "text/tokenizer.h"

namespace tansy::server {

// Null when the request is unconstrained. Throws ApiError (400, naming the field) for a schema
// outside the supported subset. starts_in_reasoning: the constraint applies after "</think>".
std::shared_ptr<TokenConstraint> chat_constraint(const ApiRequest& r, const Tokenizer& tok,
                                                 std::span<const int32_t> end_tokens,
                                                 bool starts_in_reasoning, int max_tokens);
std::shared_ptr<TokenConstraint> completion_constraint(const ApiRequest& r, const Tokenizer& tok,
                                                       std::span<const int32_t> end_tokens, int max_tokens);

}  // namespace tansy::server
