// Server metrics in the Prometheus text exposition format (version 0.0.4).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace tansy::server {

// The label a request path is counted under: one of the server's routes, else "other".
std::string route_label(const std::string& path);
// A label value escaped per the Prometheus text format (backslash, double quote, newline), with
// bytes that are not printable ASCII replaced, so the exposition stays valid UTF-8.
std::string escape_label(const std::string& value);

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double v);
  // Appends the _bucket, _sum and _count lines (caller holds the metrics lock).
  void render(std::string& out, const std::string& name) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // counts_[i]: observations <= bounds_[i]; last: +Inf
  double sum_ = 0;
  uint64_t n_ = 0;
};

class Metrics {
 public:
  Metrics();
  // Counted under route_label(endpoint): a client cannot create series of its own.
  void request_done(const std::string& endpoint, int status);
  // Refused for a missing or wrong API key: one unlabelled counter, whatever the path.
  void unauthorized();
  void tokens(int prompt, int generated);
  void time_to_first_token(double seconds);
  void inter_token_latency(double seconds);
  void request_duration(double seconds);

  // Gauges and engine counters are sampled when /metrics is read.
  struct Snapshot {
    int queue_waiting = 0;
    int running = 0, max_running = 0;
    size_t pool_states = 0, pool_used = 0;
    uint64_t engine_steps = 0;
    uint64_t cache_hits = 0, cache_misses = 0, cache_tokens = 0, cache_evictions = 0;
    size_t cache_entries = 0, cache_capacity = 0, cache_bytes = 0;
  };
  std::string render(const Snapshot& s) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  uint64_t unauthorized_ = 0;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0;
  Histogram ttft_, itl_, duration_;
};

}  // namespace tansy::server
