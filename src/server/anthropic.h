// Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat path:
// requests are translated into chat-completions bodies, outputs into Anthropic content blocks
// and its streaming events (message_start, content_block_start/delta/stop, message_delta,
// message_stop, ping). Errors use Anthropic's shape {"type": "error", "error": {type, message}}.
#pragma once
#include <memory>
#include <string>

#include "server/frontend.h"

namespace tansy::server {

std::unique_ptr<ChatFrontend> make_anthropic_frontend();

// The body of an Anthropic-shaped error for an HTTP status (and the status Anthropic uses for
// it: 503 "busy" becomes 529 overloaded_error).
int anthropic_status(int status);
std::string anthropic_error_body(int status, const std::string& message);

// /v1/messages/count_tokens: the chat-completions body whose prompt is to be counted.
Json anthropic_count_tokens_body(const Json& body);

}  // namespace tansy::server
