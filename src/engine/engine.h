// The generation loop: prompt ids in, a stream of sampled tokens and their text out. Owns the
// model, the tokenizer, the prefix cache and the pool of sequence states. One thread of its own
// runs every request in flight: each step feeds one token of every decoding sequence and pieces
// of the prompts being prefilled (under a token budget) to the model in one batch, then lets each
// sequence choose its next token. Callers block in generate() and get their steps on their own
// thread, so a slow client never holds up the others.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/constraint.h"
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "model/model.h"
#include "text/tokenizer.h"

namespace tansy {

// EngineOptions::prefix_cache_entries: as many states as the device's memory allows (see Engine's
// pool) when the states live on a GPU (Model::states_on_device) whose free memory the backend
// knows; else kPrefixCacheWithoutMemory.
inline constexpr size_t kPrefixCacheAuto = ~size_t(0);
inline constexpr size_t kPrefixCacheWithoutMemory = 4;

struct EngineOptions {
  int max_seq = 32768;  // tokens per sequence (prompt + generated)
  // States the prefix cache keeps at most (0: off), or kPrefixCacheAuto.
  size_t prefix_cache_entries = kPrefixCacheAuto;
  // Prompt tokens fed per step, over all the sequences being prefilled (decoding sequences feed
  // their token besides): a long prompt is cut into pieces, so that it does not stall the
  // others' tokens, and cancellation is checked between them.
  int prefill_chunk = 256;
  // Sequences in flight at once (decoded together); capped by the backend's batch
  // (Model::max_batch) and by the states that fit in memory.
  int max_running = 16;
  // A prompt that shares at least this many tokens more with a cached conversation than the
  // cache can restore has its state kept at the end of the shared part too (PrefixCache's
  // shared entries: a common system prompt is prefilled once, not once per conversation).
  int shared_prefix_min = 512;
  // Plain greedy requests (is_plain_greedy, no logprobs) decode through Model::greedy_step, which
  // a backend may run without moving the logits to the host. Off: every token goes through
  // forward() and the host sampler (tests compare the two paths).
  bool greedy_fast_path = true;
};

// True when Sampler would pick exactly the argmax of the raw logits: temperature <= 0 and no
// repetition/presence/frequency penalty or logit_bias.
bool is_plain_greedy(const SamplingParams& p);

// A sequence whose caller has not taken this many of its steps yet sits out the engine's steps
// until it does: a client that reads slowly (or has left, unnoticed until its next read) costs
// at most about twice this much work ahead (the caller takes the queue whole, then sends it),
// and holds up nobody else.
constexpr int kMaxStepsAhead = 16;

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
  bool admitted = false;  // false: it ended (timeout, cancel) while waiting for a place
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
  ~Engine();  // requests still in flight end cancelled; waits for their callers to return

  const Tokenizer& tokenizer() const { return tok_; }
  const ModelConfig& config() const { return model_->config(); }
  Model& model() { return *model_; }
  const EngineOptions& options() const { return opt_; }
  const std::vector<int32_t>& eos_ids() const { return eos_; }

  // Runs one request to completion, on the engine's thread among the others in flight; on_step
  // is called on the caller's thread for every step, in order (returning false cancels: steps
  // computed meanwhile are dropped). on_start, when set, is called once the request has a place,
  // before its first step (false cancels). req.cancelled is polled on the caller's thread.
  // Throws Error for a request the engine cannot run (empty prompt, over max_seq).
  GenResult generate(const GenRequest& req, const std::function<bool(const GenStep&)>& on_step,
                     const std::function<bool()>& on_start = {});

  // Sequences in flight at once, and the pool of states they and the prefix cache share.
  int max_running() const { return run_cap_; }
  size_t pool_states() const { return pool_states_; }
  size_t state_bytes() const { return state_bytes_; }
  std::string describe_capacity() const;  // one line for the startup log

  struct Load {
    int running = 0, waiting = 0;  // sequences
    size_t states_used = 0;        // of pool_states(): running, cached and spare
    uint64_t steps = 0;            // engine steps run
    int max_step_sequences = 0;    // the most sequences one step has fed
  };
  Load load() const;

  struct CacheStats {
    uint64_t hits = 0, misses = 0, cached_tokens = 0, evictions = 0;
    size_t entries = 0, capacity = 0;
    size_t bytes = 0;  // at most: entries * state_bytes()
  };
  CacheStats cache_stats() const;

 private:
  struct Seq;
  void loop();
  bool step(std::vector<std::shared_ptr<Seq>>& admit);  // false: nothing could be fed
  void admit(Seq& s);
  void make_room(size_t keep_free);
  size_t states_used() const;
  void snapshot(std::vector<int32_t> tokens, const SequenceState& from, bool shared);
  std::shared_ptr<Seq> take(Seq& s);
  void prepare_choice(Seq& s);
  void choose(Seq& s);
  void finish(Seq& s, Finish f);
  void fail_seq(Seq& s, std::exception_ptr e);
  void keep_spare(std::unique_ptr<SequenceState> s);
  std::unique_ptr<SequenceState> take_spare();  // null when there is none
  void make_spares();
  // Idle: waits up to kIdleSpin for a request, awake (yielding), before the loop sleeps.
  void spin_for_arrival();
  void publish();

  std::unique_ptr<Model> model_;
  Tokenizer tok_;
  EngineOptions opt_;
  std::vector<int32_t> eos_;
  size_t n_real_ = 0;  // ids the tokenizer defines: the rest of the embedding rows are padding
  size_t state_bytes_ = 0, pool_states_ = 0;
  int run_cap_ = 1;

  // The engine thread's own: the running sequences, the prefix cache, the spare states.
  std::vector<std::shared_ptr<Seq>> running_;
  PrefixCache cache_;
  // States made beforehand or let go of, reused (reset, or copied into) so that a request's path
  // makes none: a request that misses the cache takes one and its snapshot at the cut another; a
  // hit copies into one, its snapshot into the other.
  static constexpr size_t kSpares = 2;
  std::vector<std::unique_ptr<SequenceState>> spares_;

  mutable std::mutex mu_;  // guards waiting_ and stop_
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Seq>> waiting_;
  bool stop_ = false;
  bool drained_ = false;               // a caller took a full queue of steps: a sequence set aside may go on
  std::atomic<uint64_t> arrivals_{0};  // requests put in waiting_ so far (spin_for_arrival watches it)
  // A sleeping engine thread took 35-280 µs (150 typical) to wake for a request on the H200
  // machine (a VM; measured through the server's first-token path, docs/PERFORMANCE.md), 0.8% of a
  // 256-token request's time to first token. After its last step the loop stays awake this long.
  static constexpr std::chrono::milliseconds kIdleSpin{10};
  std::mutex callers_mu_;  // guards callers_: the calls inside generate()
  std::condition_variable callers_cv_;
  int callers_ = 0;
  std::thread thread_;

  // Copies of the loop's counters, readable (by /metrics) while it runs.
  std::atomic<uint64_t> hits_{0}, misses_{0}, cached_tokens_total_{0}, steps_{0}, evictions_{0};
  std::atomic<size_t> entries_{0}, states_used_{0};
  std::atomic<int> running_n_{0}, max_step_seqs_{0};
};

}  // namespace tansy
