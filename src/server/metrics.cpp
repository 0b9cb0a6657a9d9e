#include "server/metrics.h"

#include <fmt/format.h>

namespace tansy::server {

std::string route_label(const std::string& path) {
  // Every route tansy serves or is planned to (issue 18's included), so that adding one needs no
  // change here beyond its name.
  static const char* const kRoutes[] = {"/v1/chat/completions",
                                        "/v1/completions",
                                        "/v1/models",
                                        "/v1/messages",
                                        "/v1/responses",
                                        "/tokenize",
                                        "/detokenize",
                                        "/health",
                                        "/metrics",
                                        "/"};
  for (const char* r : kRoutes)
    if (path == r) return r;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models";
  return "other";
}

std::string escape_label(const std::string& value) {
  std::string o;
  for (unsigned char c : value) {
    if (c == '\\')
      o += "\\\\";
    else if (c == '"')
      o += "\\\"";
    else if (c == '\n')
      o += "\\n";
    else if (c < 0x20 || c >= 0x7f)
      o += '?';
    else
      o += char(c);
  }
  return o;
}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  counts_[i]++;
  sum_ += v;
  n_++;
}

void Histogram::render(std::string& out, const std::string& name) const {
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cum);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, n_, name, sum_, name, n_);
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}),
      duration_({0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}) {}

void Metrics::request_done(const std::string& endpoint, int status) {
  std::lock_guard lk(mu_);
  requests_[{route_label(endpoint), status}]++;
}
void Metrics::unauthorized() {
  std::lock_guard lk(mu_);
  unauthorized_++;
}
void Metrics::tokens(int prompt, int generated) {
  std::lock_guard lk(mu_);
  prompt_tokens_ += uint64_t(prompt);
  generated_tokens_ += uint64_t(generated);
}
void Metrics::time_to_first_token(double s) {
  std::lock_guard lk(mu_);
  ttft_.observe(s);
}
void Metrics::inter_token_latency(double s) {
  std::lock_guard lk(mu_);
  itl_.observe(s);
}
void Metrics::request_duration(double s) {
  std::lock_guard lk(mu_);
  duration_.observe(s);
}

std::string Metrics::render(const Snapshot& s) const {
  std::lock_guard lk(mu_);
  std::string o;
  auto head = [&](const char* name, const char* type, const char* help) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  head("tansy_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  for (auto& [k, n] : requests_)
    o += fmt::format("tansy_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", escape_label(k.first),
                     k.second, n);
  head("tansy_unauthorized_requests_total", "counter",
       "Requests refused for a missing or wrong API key (not broken down: their paths are the client's).");
  o += fmt::format("tansy_unauthorized_requests_total {}\n", unauthorized_);
  head("tansy_prompt_tokens_total", "counter",
       "Prompt tokens of completed generations (cached ones included).");
  o += fmt::format("tansy_prompt_tokens_total {}\n", prompt_tokens_);
  head("tansy_generation_tokens_total", "counter", "Tokens sampled.");
  o += fmt::format("tansy_generation_tokens_total {}\n", generated_tokens_);
  head("tansy_queue_depth", "gauge", "Requests waiting for a place in the engine.");
  o += fmt::format("tansy_queue_depth {}\n", s.queue_waiting);
  head("tansy_requests_running", "gauge", "Requests in flight in the engine (prefilling or decoding).");
  o += fmt::format("tansy_requests_running {}\n", s.running);
  head("tansy_requests_running_max", "gauge", "Most requests in flight at once.");
  o += fmt::format("tansy_requests_running_max {}\n", s.max_running);
  head("tansy_state_pool_states", "gauge",
       "Sequence states the pool holds at most (running requests, prefix cache, one spare).");
  o += fmt::format("tansy_state_pool_states {}\n", s.pool_states);
  head("tansy_state_pool_used", "gauge", "Sequence states held now.");
  o += fmt::format("tansy_state_pool_used {}\n", s.pool_used);
  head("tansy_engine_steps_total", "counter", "Engine steps run (each feeds every sequence in flight).");
  o += fmt::format("tansy_engine_steps_total {}\n", s.engine_steps);
  head("tansy_prefix_cache_hits_total", "counter", "Prompts that resumed from a cached prefix state.");
  o += fmt::format("tansy_prefix_cache_hits_total {}\n", s.cache_hits);
  head("tansy_prefix_cache_misses_total", "counter", "Prompts that found no cached prefix.");
  o += fmt::format("tansy_prefix_cache_misses_total {}\n", s.cache_misses);
  head("tansy_prefix_cache_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache.");
  o += fmt::format("tansy_prefix_cache_cached_tokens_total {}\n", s.cache_tokens);
  head("tansy_prefix_cache_entries", "gauge", "Sequence states held by the prefix cache.");
  o += fmt::format("tansy_prefix_cache_entries {}\n", s.cache_entries);
  head("tansy_prefix_cache_capacity", "gauge", "Most sequence states the prefix cache holds.");
  o += fmt::format("tansy_prefix_cache_capacity {}\n", s.cache_capacity);
  head("tansy_prefix_cache_evictions_total", "counter",
       "States the prefix cache let go of for room (over its capacity, or a request needed the pool's "
       "place).");
  o += fmt::format("tansy_prefix_cache_evictions_total {}\n", s.cache_evictions);
  head("tansy_prefix_cache_bytes", "gauge",
       "Memory the prefix cache's states may take: entries times a state of the context limit.");
  o += fmt::format("tansy_prefix_cache_bytes {}\n", s.cache_bytes);
  head("tansy_time_to_first_token_seconds", "histogram",
       "From request arrival to the first generated token.");
  ttft_.render(o, "tansy_time_to_first_token_seconds");
  head("tansy_inter_token_latency_seconds", "histogram", "Between consecutive generated tokens.");
  itl_.render(o, "tansy_inter_token_latency_seconds");
  head("tansy_request_duration_seconds", "histogram", "From arrival to the end of generation.");
  duration_.render(o, "tansy_request_duration_seconds");
  return o;
}

}  // namespace tansy::server
