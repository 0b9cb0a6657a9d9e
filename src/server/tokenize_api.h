// Tokenization over HTTP, shaped like vLLM's: POST /tokenize with a `prompt` (text) or a
// `messages` list (rendered by the chat template first, the rendered text returned as well),
// POST /detokenize with `tokens`.
#pragma once
#include <string>

#include "engine/sampler.h"
#include "server/openai.h"
#include "text/tokenizer.h"

namespace tansy::server {

struct TokenizeContext {
  const Tokenizer& tokenizer;
  const std::string& model_id;
  int max_model_len;
  const SamplingParams& defaults;
};

// Both throw ApiError (400 naming the field, 404 for another model).
Json tokenize_request(const Json& body, const TokenizeContext& ctx);
Json detokenize_request(const Json& body, const TokenizeContext& ctx);

}  // namespace tansy::server
