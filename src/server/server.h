// tansy's OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models,
// /health, /metrics. The engine runs up to its max_running requests at once; the rest wait in
// arrival order, and the Scheduler refuses more than max_queue of them (503).
#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/http_listener.h"
#include "text/chat_template.h"

namespace tansy::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                           // 0: any free port (the chosen one is printed)
  std::string api_key;                       // empty: no authentication
  std::string model_id;                      // the name /v1/models lists and requests must use
  int max_queue = 16;                        // waiting requests beyond the running ones; more get 503
  double request_timeout_s = 600;            // from arrival, queueing included
  size_t max_body_bytes = 8u << 20;          // larger bodies get 413
  SamplingParams defaults;                   // for fields a request leaves out
  std::string defaults_source;               // where they came from (logged, /v1/models)
  ConnectionLimits limits;                   // connection bounds and deadlines (http_listener.h)
  std::vector<std::string> allowed_origins;  // browser origins allowed cross-origin (CORS); "*": any
  std::vector<std::string> allowed_hosts;    // Host names accepted beyond loopback and the bound address
  // The checkpoint's chat template (null: the built-in Qwen3.6 one), and whether special tokens
  // written in message content are matched as control tokens (Hugging Face) or kept as text.
  std::shared_ptr<const text::ChatTemplate> chat_template;
  bool special_tokens_in_content_parse = false;
};

class Server {
 public:
  Server(Engine& engine, ServerOptions opt);
  ~Server();
  // Binds and serves until stop(). Throws Error when the address cannot be bound.
  void run();
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tansy::server
