// The generation loop: prompt ids in, a stream of sampled tokens and their text out. Owns the
// model, the tokenizer and the prefix cache; serves one request at a time (the Scheduler decides
// whose turn it is).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/constraint.h"
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "model/model.h"
#include "text/tokenizer.h"

namespace tansy {

struct EngineOptions {
  int max_seq = 32768;  // tokens per sequence (prompt + generated)
  size_t prefix_cache_entries = 4;
  int prefill_chunk = 256;  // cancellation is checked between chunks of this many prompt tokens
  // Plain greedy requests (is_plain_greedy, no logprobs) decode through Model::greedy_step, which
  // a backend may run without moving the logits to the host. Off: every token goes through
  // forward() and the host sampler (tests compare the two paths).
  bool greedy_fast_path = true;
};

// True when Sampler would pick exactly the argmax of the raw logits: temperature <= 0 and no
// repetition/presence/frequency penalty or logit_bias.
bool is_plain_greedy(const SamplingParams& p);

enum class Finish { kStop, kLength, kCancelled, kTimeout };
const char* finish_name(Finish f);

struct GenRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 16;
  std::vector<std::string> stop;  // stop strings
  bool ignore_eos = false;
  int logprobs = -1;  // -1: none; k >= 0: chosen token's logprob and k alternatives
  // Also keep the state after this many prompt tokens in the prefix cache (0: only the final
  // state). The server passes the start of the assistant turn, which the next turn's prompt
  // shares even when the template rewrites the answer it generated.
  size_t cache_cut = 0;
  // Tokens emitted without sampling, as if the model had chosen them: right after the token
  // `force_trigger` is generated, or from the first step when there is no trigger. tool_choice
  // "required" and a named function use this to open a tool call once the reasoning ends.
  std::optional<int32_t> force_trigger;
  std::vector<int32_t> forced;
  // A budget for the text before `force_trigger`: when the trigger has not been generated
  // after this many tokens, `budget_forced` (which should end with the trigger) is emitted and
  // then `forced`. Anthropic's thinking budget ends the reasoning block this way. -1: none.
  int trigger_budget = -1;
  std::vector<int32_t> budget_forced;
  // Structured output: masks the sampled tokens and sees every emitted one. Null: none.
  std::shared_ptr<TokenConstraint> constraint;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::function<bool()> cancelled;  // polled once per step; true stops the computation
};

struct GenStep {
  int32_t token = -1;   // -1: end-of-generation flush (text only)
  bool forced = false;  // emitted by GenRequest::forced, not sampled
  std::string text;     // text that became safe to emit (complete UTF-8, not part of a stop string)
  std::optional<LogprobInfo> logprobs;
};

struct GenResult {
  int prompt_tokens = 0;
  int cached_tokens = 0;      // prompt tokens restored from the prefix cache
  int completion_tokens = 0;  // sampled tokens, including a final end-of-sequence token
  Finish finish = Finish::kLength;
  std::string stop_string;            // the stop string that matched, when one did
  std::optional<int32_t> stop_token;  // the end-of-sequence token that ended it, when one did
};

// Sampling defaults read from DIR/generation_config.json, else OpenAI's (temperature 1, top_p 1).
struct GenerationDefaults {
  SamplingParams sampling;
  std::string source;  // one line for the startup log
};
GenerationDefaults load_generation_defaults(const std::filesystem::path& model_dir);

class Engine {
 public:
  Engine(std::unique_ptr<Model> model, Tokenizer tokenizer, const EngineOptions& opt);

  const Tokenizer& tokenizer() const { return tok_; }
  const ModelConfig& config() const { return model_->config(); }
  Model& model() { return *model_; }
  const EngineOptions& options() const { return opt_; }
  const std::vector<int32_t>& eos_ids() const { return eos_; }

  // Runs one request to completion. on_step returns false to stop (as a cancellation).
  // Throws Error for a request the engine cannot run (empty prompt, over max_seq).
  GenResult generate(const GenRequest& req, const std::function<bool(const GenStep&)>& on_step);

  struct CacheStats {
    uint64_t hits = 0, misses = 0, cached_tokens = 0;
    size_t entries = 0, capacity = 0;
  };
  CacheStats cache_stats() const;

 private:
  std::unique_ptr<Model> model_;
  Tokenizer tok_;
  EngineOptions opt_;
  std::vector<int32_t> eos_;
  PrefixCache cache_;
  std::unique_ptr<SequenceState> spare_;  // reused for the next request that misses the cache
  std::vector<float> logits_;             // [vocab], reused by every request
  void keep_spare(std::unique_ptr<SequenceState> s) {
    if (s && !spare_) spare_ = std::move(s);
  }
  void publish_cache_stats();
  std::mutex mu_;  // generate() is not reentrant
  // Copies of the cache's counters, readable (by /metrics) while a request runs.
  std::atomic<uint64_t> hits_{0}, misses_{0}, cached_tokens_total_{0};
  std::atomic<size_t> entries_{0};
};

}  // namespace tansy
