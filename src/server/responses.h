// OpenAI's Responses API (POST /v1/responses), stateless, on the chat path: `input` items and
// `instructions` become chat messages; the output becomes reasoning / message / function_call
// items, and while streaming the Responses events (response.created, response.output_item.added,
// response.output_text.delta, response.function_call_arguments.delta,
// response.reasoning_text.delta, response.completed, ...). Nothing is stored: `store: true` and
// `previous_response_id` are refused with a 400.
#pragma once
#include <memory>

#include "server/frontend.h"

namespace tansy::server {

std::unique_ptr<ChatFrontend> make_responses_frontend();

}  // namespace tansy::server
