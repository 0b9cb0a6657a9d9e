// tansy serve: the OpenAI-compatible HTTP server (docs/API.md).
#include <pthread.h>
#include <signal.h>

#include <thread>

#include "cli/command.h"
#include "cli/engine_setup.h"
#include "core/error.h"
#include "server/http_policy.h"
#include "server/server.h"

namespace {

int run(const std::vector<std::string>& args) {
  std::vector<std::string> values = tansy::cli::engine_flags();
  values.insert(values.end(),
                {"host", "port", "api-key", "served-model-name", "max-queue", "timeout", "max-body-mb",
                 "max-connections", "max-connections-per-client", "header-timeout", "body-timeout",
                 "idle-timeout", "allowed-origins", "allowed-hosts"});
  values.push_back("special-tokens-in-content");
  tansy::cli::Flags flags(args, values);
  tansy::server::ServerOptions so;
  so.host = flags.get("host", "127.0.0.1");
  so.port = int(flags.get_int("port", 8000, 0, 65535));
  so.api_key = flags.get("api-key", "");
  so.max_queue = int(flags.get_int("max-queue", 16, 0, 4096));
  so.request_timeout_s = flags.get_double("timeout", 600);
  if (!(so.request_timeout_s > 0)) tansy::fail("--timeout must be a positive number of seconds");
  so.max_body_bytes = size_t(flags.get_int("max-body-mb", 8, 1, 1024)) << 20;
  const std::string special = flags.get("special-tokens-in-content", "plain");
  if (special != "plain" && special != "parse")
    tansy::fail("--special-tokens-in-content must be plain or parse, got '{}'", special);
  so.special_tokens_in_content_parse = special == "parse";
  so.limits.max_connections = int(flags.get_int("max-connections", 256, 1, 65536));
  so.limits.max_per_client =
      int(flags.get_int("max-connections-per-client", 64, 1, so.limits.max_connections));
  auto seconds = [&](const char* name, double fallback) {
    double v = flags.get_double(name, fallback);
    if (!(v > 0 && v <= 86400)) tansy::fail("--{} must be a number of seconds in (0, 86400]", name);
    return v;
  };
  so.limits.header_timeout_s = seconds("header-timeout", 10);
  so.limits.body_timeout_s = seconds("body-timeout", 60);
  so.limits.idle_timeout_s = seconds("idle-timeout", 5);
  so.allowed_origins = tansy::server::HttpPolicy::split_list(flags.get("allowed-origins", ""));
  so.allowed_hosts = tansy::server::HttpPolicy::split_list(flags.get("allowed-hosts", ""));

  // Signals go to a dedicated thread, which stops the server cleanly.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto loaded = tansy::cli::load_engine(flags);
  so.model_id = flags.get("served-model-name", loaded.dir.filename().string());
  if (so.model_id.empty()) so.model_id = "tansy";
  so.defaults = loaded.defaults.sampling;
  so.defaults_source = loaded.defaults.source;
  so.chat_template = loaded.chat_template;
  tansy::server::Server server(*loaded.engine, so);
  std::thread sig([&server, set] {
    int s = 0;
    sigwait(&set, &s);
    server.stop();
  });
  sig.detach();
  server.run();
  return 0;
}

tansy::cli::Register reg("serve", "OpenAI-compatible HTTP server (chat completions, completions, metrics)",
                         run);

}  // namespace
