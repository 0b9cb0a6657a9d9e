// Other APIs served on the chat-completions path: a frontend translates its request body into
// a /v1/chat/completions body (validated there by parse_chat_request, rendered by the same
// template, parsed by the same ChatOutput) and the chat-completions output back into its own
// response and stream events. One frontend object serves one request.
#pragma once
#include <initializer_list>
#include <string>
#include <vector>

#include "server/openai.h"

namespace tansy::server {

class ChatFrontend {
 public:
  virtual ~ChatFrontend() = default;

  // The metrics/log label, e.g. "/v1/messages".
  virtual const char* endpoint() const = 0;
  // The response id, e.g. "msg_..." (the server passes a fresh random hex string).
  virtual std::string make_id(const std::string& hex) const = 0;
  // The request body translated into a chat-completions body. Throws ApiError.
  virtual Json chat_body(const Json& body) = 0;
  virtual bool stream() const = 0;

  // Errors in this API's shape.
  virtual int error_status(const ApiError& e) const { return e.status; }
  virtual std::string error_body(const ApiError& e) const = 0;

  // Non-streaming: the chat.completion object (usage included) turned into this API's response.
  virtual Json response(const Json& completion) = 0;

  // Streaming: each chat.completion.chunk (the usage chunk last), then done() or, on failure,
  // error(); each returns the server-sent-event text to write (maybe empty).
  virtual std::string chunk(const Json& chunk) = 0;
  virtual std::string done() = 0;
  virtual std::string error(const ApiError& e) = 0;

  // Set by the server once the prompt is tokenized (Anthropic's message_start reports it).
  int prompt_tokens = 0;
  // Set by chat_body: end the reasoning after this many generated tokens (-1: no budget).
  int thinking_budget = -1;
  // Set by chat_body: top-level fields outside the API's schema, ignored (the server logs them).
  std::vector<std::string> ignored_fields;
};

// Formats one server-sent event with an event name, as Anthropic and OpenAI Responses send them.
std::string sse_event(const std::string& name, const Json& data);

}  // namespace tansy::server

namespace tansy::server::fe {

// Field checks for the frontends' request bodies: each failure is a 400 naming the field by its
// path (e.g. "messages[2].content[0].text").
const char* type_name(const Json& v);
[[noreturn]] void bad(const std::string& path, const std::string& message);
[[noreturn]] void bad_type(const std::string& path, const Json& v, const char* want);
// The object's member `key`, or null when absent (a JSON null counts as absent).
const Json& get(const Json& obj, const char* key);
const Json& require(const Json& obj, const char* key, const std::string& path);
std::string str(const Json& v, const std::string& path);
const Json& object(const Json& v, const std::string& path);
const Json& array(const Json& v, const std::string& path);
bool boolean(const Json& v, const std::string& path);
int64_t integer(const Json& v, const std::string& path, int64_t lo, int64_t hi);
double number(const Json& v, const std::string& path, double lo, double hi);
std::string join(const std::string& path, const char* key);
std::string join(const std::string& path, size_t index);
// The body's top-level keys that are not in `known`.
std::vector<std::string> unknown_fields(const Json& body, std::initializer_list<const char*> known);

}  // namespace tansy::server::fe
