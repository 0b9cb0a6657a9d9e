#include "engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/stop.h"
#include "text/detokenizer.h"

namespace tansy {

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::kStop:
      return "stop";
    case Finish::kLength:
      return "length";
    case Finish::kCancelled:
      return "cancelled";
    case Finish::kTimeout:
      return "timeout";
  }
  return "?";
}

GenerationDefaults load_generation_defaults(const std::filesystem::path& model_dir) {
  GenerationDefaults d;
  auto path = model_dir / "generation_config.json";
  std::ifstream in(path);
  if (!in) {
    d.source = "OpenAI defaults (no generation_config.json): temperature 1, top_p 1";
    return d;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    fail("{}: not valid JSON: {}", path.string(), e.what());
  }
  if (!j.is_object()) fail("{}: must be a JSON object", path.string());
  std::vector<std::string> used;
  auto num = [&](const char* key, double& dst, double lo, double hi) {
    if (!j.contains(key) || j[key].is_null()) return;
    if (!j[key].is_number() || j[key].get<double>() < lo || j[key].get<double>() > hi)
      fail("{}: '{}' must be a number in [{}, {}]", path.string(), key, lo, hi);
    dst = j[key].get<double>();
    used.push_back(fmt::format("{} {}", key, dst));
  };
  SamplingParams& s = d.sampling;
  num("temperature", s.temperature, 0, 100);
  num("top_p", s.top_p, 1e-9, 1);
  num("min_p", s.min_p, 0, 1);
  num("repetition_penalty", s.repetition_penalty, 1e-9, 100);
  num("presence_penalty", s.presence_penalty, -2, 2);
  num("frequency_penalty", s.frequency_penalty, -2, 2);
  if (j.contains("top_k") && !j["top_k"].is_null()) {
    if (!j["top_k"].is_number_integer()) fail("{}: 'top_k' must be an integer", path.string());
    s.top_k = std::max(0, j["top_k"].get<int>());
    used.push_back(fmt::format("top_k {}", s.top_k));
  }
  // Hugging Face treats do_sample=false as greedy whatever the temperature says.
  if (j.contains("do_sample") && j["do_sample"].is_boolean() && !j["do_sample"].get<bool>()) {
    s.temperature = 0;
    used.push_back("do_sample false (greedy)");
  }
  d.source = used.empty()
                 ? "OpenAI defaults (generation_config.json sets no sampling fields): temperature 1, top_p 1"
                 : fmt::format("{}: {}", path.string(), fmt::join(used, ", "));
  return d;
}

bool is_plain_greedy(const SamplingParams& p) {
  // Sampler::sample: penalties and logit_bias apply before the temperature test; with none of
  // them and temperature <= 0 it returns the argmax of the raw logits (lowest id on ties).
  return p.temperature <= 0.0 && p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 &&
         p.frequency_penalty == 0.0 && p.logit_bias.empty();
}

// One request in flight. The caller's thread and the engine's share the channel (under mu); the
// rest belongs to the engine's thread.
struct Engine::Seq {
  Seq(const GenRequest& r, const Tokenizer& tok) : req(r), decoder(tok), stops(r.stop) {}
  const GenRequest& req;  // generate() outlives the sequence's time in the engine
  std::atomic<bool> cancel{false};

  std::mutex mu;
  std::condition_variable cv;
  std::deque<GenStep> steps;
  bool admitted = false, done = false;
  std::exception_ptr error;
  GenResult res;

  std::unique_ptr<SequenceState> state;
  std::unique_ptr<TokenSampler> sampler;
  bool greedy = false;       // the sampler is make_greedy_sampler's: a forced step needs no choice
  std::vector<int32_t> fed;  // every token the state holds
  int pos = 0;               // prompt tokens in the state
  size_t cut = 0;            // also cache the state after this many prompt tokens (0: none)
  size_t shared_cut = 0;     // and after the prefix it shares with a cached conversation (0: none)
  int generated = 0;         // tokens chosen
  int32_t to_feed = -1;      // the token chosen last, fed by the next step
  int32_t forced = -1;       // the next choice, when it is forced
  bool choice_fed = false;   // the sampler was fed for the next choice
  StreamDecoder decoder;
  StopMatcher stops;
  std::vector<uint32_t> mask;    // constraint: the allowed-token bitmask, reused every step
  bool document_done = false;    // constraint: ended by a complete document
  std::vector<int32_t> pending;  // forced tokens still to emit, in reverse order
  bool armed = false;            // forcing happens once per request

  bool decoding() const { return pos == int(req.prompt.size()); }
  // The caller may return (and destroy this) as soon as it sees `done`: notified under the lock,
  // and nothing touches the sequence afterwards.
  void mark_done() {
    std::lock_guard lk(mu);
    done = true;
    cv.notify_one();
  }
  void push(GenStep s) {
    {
      std::lock_guard lk(mu);
      steps.push_back(std::move(s));
    }
    cv.notify_one();
  }
};

Engine::Engine(std::unique_ptr<Model> model, Tokenizer tokenizer, const EngineOptions& opt)
    : model_(std::move(model)), tok_(std::move(tokenizer)), opt_(opt), cache_(0) {
  TANSY_CHECK(opt_.max_seq >= 2, "max_seq must be at least 2");
  TANSY_CHECK(opt_.prefill_chunk >= 1, "prefill_chunk must be positive");
  TANSY_CHECK(opt_.max_running >= 1, "max_running must be at least 1");
  eos_ = model_->config().eos_token_ids;
  if (eos_.empty())
    for (const char* t : {"<|im_end|>", "<|endoftext|>"})
      if (auto id = tok_.token_id(t)) eos_.push_back(*id);
  TANSY_CHECK(!eos_.empty(), "the model declares no eos_token_id and the tokenizer has no <|im_end|>");
  n_real_ = size_t(std::min(model_->config().vocab_size, tok_.vocab_size()));
  // The pool: the states that fit in what the backend has free (a tenth of it, at least 1 GiB,
  // kept for everything else it allocates later), less one for the clone a cache hit or a
  // snapshot holds for a moment beside the pool when no spare takes the copy, and less the
  // backend's own scratch states.
  state_bytes_ = std::max<size_t>(1, model_->state_bytes(opt_.max_seq));
  size_t fit = std::numeric_limits<size_t>::max();
  if (auto free = model_->free_state_memory()) {
    const size_t keep = std::max<size_t>(*free / 10, size_t(1) << 30);
    const size_t held = 1 + size_t(std::max(0, model_->scratch_states()));
    fit = *free > keep ? (*free - keep) / state_bytes_ : 0;
    if (fit < 1 + held)
      fail(
          "not enough memory for a sequence of {} tokens: a state takes {:.1f} MiB and {:.1f} MiB are free "
          "(lower --max-seq)",
          opt_.max_seq, double(state_bytes_) / (1 << 20), double(*free) / (1 << 20));
    fit -= held;
  }
  run_cap_ = int(std::min<size_t>({size_t(opt_.max_running), size_t(model_->max_batch()), fit}));
  // The cache's capacity: the number asked for; by default (kPrefixCacheAuto) every state the
  // device's memory holds but one, since the cache gives way (make_room) whenever a request or a
  // snapshot needs a state; kPrefixCacheWithoutMemory when the states live in host memory (shared
  // with everything else) or the backend does not know its memory.
  size_t cache_cap = opt_.prefix_cache_entries;
  if (cache_cap == kPrefixCacheAuto)
    cache_cap = model_->states_on_device() && fit != std::numeric_limits<size_t>::max()
                    ? fit - 1
                    : kPrefixCacheWithoutMemory;
  cache_.set_capacity(cache_cap);
  // At most: every running sequence, a full cache and one spare; a second spare (kSpares) has
  // room while fewer than run_cap sequences run or the cache is not full.
  pool_states_ = std::min(fit, size_t(run_cap_) + cache_cap + 1);
  spares_.reserve(kSpares);
  make_spares();
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // Every request has ended; its caller may still be handing out its last steps.
  std::unique_lock lk(callers_mu_);
  callers_cv_.wait(lk, [&] { return callers_ == 0; });
}

std::string Engine::describe_capacity() const {
  std::string why;
  if (run_cap_ == model_->max_batch() && run_cap_ < opt_.max_running)
    why = fmt::format(" (the {} backend feeds at most {} sequence{} per step)", model_->backend_plan(),
                      run_cap_, run_cap_ == 1 ? "" : "s");
  else if (run_cap_ < opt_.max_running)
    why = " (all that fit in memory)";
  return fmt::format(
      "requests in flight at once: {}{}; a pool of {} sequence states of up to {} tokens ({:.1f} MiB "
      "each) for them and the prefix cache",
      run_cap_, why, pool_states_, opt_.max_seq, double(state_bytes_) / (1 << 20));
}

Engine::CacheStats Engine::cache_stats() const {
  const size_t entries = entries_.load();
  return {hits_.load(), misses_.load(),    cached_tokens_total_.load(), evictions_.load(),
          entries,      cache_.capacity(), entries * state_bytes_};
}

Engine::Load Engine::load() const {
  Load l;
  {
    std::lock_guard lk(mu_);
    l.waiting = int(waiting_.size());
  }
  l.running = running_n_.load();
  l.states_used = states_used_.load();
  l.steps = steps_.load();
  l.max_step_sequences = max_step_seqs_.load();
  return l;
}

void Engine::publish() {
  hits_ = cache_.hits();
  misses_ = cache_.misses();
  evictions_ = cache_.evictions();
  entries_ = cache_.size();
  running_n_ = int(running_.size());
  states_used_ = states_used();
}

void Engine::keep_spare(std::unique_ptr<SequenceState> s) {
  if (s && spares_.size() < kSpares) spares_.push_back(std::move(s));
}

std::unique_ptr<SequenceState> Engine::take_spare() {
  if (spares_.empty()) return nullptr;
  std::unique_ptr<SequenceState> s = std::move(spares_.back());
  spares_.pop_back();
  return s;
}

// Makes spare states, as many as kSpares and the pool allow, while no request waits: a state is
// an allocation (on CUDA also a graph capture), which a request's snapshot or cache hit then does
// not pay. Only a prefix cache copies into spares; without one a finished request's state is the
// next one's. Out of memory only means fewer spares.
void Engine::make_spares() {
  if (cache_.capacity() == 0) return;
  while (spares_.size() < kSpares && states_used() < pool_states_) {
    {
      std::lock_guard lk(mu_);
      if (stop_ || !waiting_.empty()) break;
    }
    try {
      std::unique_ptr<SequenceState> s = model_->new_state(opt_.max_seq);
      // Emptied once here: on CUDA the first reset captures the state's reset graph, which a
      // request's admission would otherwise pay.
      model_->reset_state(*s);
      spares_.push_back(std::move(s));
    } catch (const std::exception&) {
      break;
    }
  }
  publish();
}

void Engine::spin_for_arrival() {
  const uint64_t seen = arrivals_.load(std::memory_order_acquire);
  const auto until = std::chrono::steady_clock::now() + kIdleSpin;
  while (arrivals_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
    std::this_thread::yield();
}

size_t Engine::states_used() const { return running_.size() + cache_.size() + spares_.size(); }

// Lets go of the spare states, then of the least recently used cache entries, until at most
// pool_states - keep_free states are held.
void Engine::make_room(size_t keep_free) {
  while (states_used() + keep_free > pool_states_) {
    if (!spares_.empty())
      spares_.pop_back();
    else if (cache_.size() > 0)
      cache_.pop_lru();
    else
      break;
  }
}

GenResult Engine::generate(const GenRequest& req, const std::function<bool(const GenStep&)>& on_step,
                           const std::function<bool()>& on_start) {
  const int n_prompt = int(req.prompt.size());
  const int vocab = model_->config().vocab_size;
  TANSY_CHECK(n_prompt > 0, "the prompt is empty");
  TANSY_CHECK(req.max_tokens >= 1, "max_tokens must be at least 1");
  TANSY_CHECK(int64_t(n_prompt) + req.max_tokens <= opt_.max_seq,
              "prompt ({} tokens) plus max_tokens ({}) exceeds the context limit of {} tokens", n_prompt,
              req.max_tokens, opt_.max_seq);
  for (int32_t id : req.prompt)
    TANSY_CHECK(id >= 0 && id < vocab, "token id {} is outside the vocabulary [0, {})", id, vocab);

  // Counted until the very end, so that the engine outlives every call (~Engine waits).
  struct Caller {
    Engine& e;
    explicit Caller(Engine& en) : e(en) {
      std::lock_guard lk(e.callers_mu_);
      ++e.callers_;
    }
    ~Caller() {
      std::lock_guard lk(e.callers_mu_);
      --e.callers_;
      e.callers_cv_.notify_all();
    }
  } caller(*this);
  auto seq = std::make_shared<Seq>(req, tok_);
  {
    std::lock_guard lk(mu_);
    TANSY_CHECK(!stop_, "engine: shutting down");
    waiting_.push_back(seq);
  }
  arrivals_.fetch_add(1, std::memory_order_release);
  cv_.notify_all();
  bool started = false, cancelled = false;
  std::deque<GenStep> got;
  // The engine reads `req` until the sequence is done: leaving early (a callback threw) cancels
  // it and waits for that.
  struct Leave {
    Seq& s;
    bool armed = true;
    ~Leave() {
      if (!armed) return;
      s.cancel = true;
      std::unique_lock lk(s.mu);
      s.cv.wait(lk, [&] { return s.done; });
    }
  } leave{*seq};
  for (;;) {
    bool done, admitted;
    {
      std::unique_lock lk(seq->mu);
      seq->cv.wait_for(lk, std::chrono::milliseconds(20),
                       [&] { return !seq->steps.empty() || seq->done || (seq->admitted && !started); });
      got.swap(seq->steps);
      done = seq->done;
      admitted = seq->admitted;
    }
    if (admitted && !started) {
      started = true;
      if (on_start && !cancelled && !on_start()) cancelled = true;
    }
    for (const GenStep& s : got)
      if (!cancelled && !on_step(s)) cancelled = true;
    if (got.size() >= size_t(kMaxStepsAhead)) {  // the engine may have set it aside: wake it
      {
        std::lock_guard lk(mu_);
        drained_ = true;
      }
      cv_.notify_all();
    }
    got.clear();
    if (done) break;
    if (!cancelled && req.cancelled && req.cancelled()) cancelled = true;
    if (cancelled) seq->cancel = true;
  }
  leave.armed = false;
  if (seq->error) std::rethrow_exception(seq->error);
  GenResult res = seq->res;
  if (cancelled) res.finish = Finish::kCancelled;
  return res;
}

void Engine::loop() {
  std::vector<std::shared_ptr<Seq>> admit;
  std::unique_lock lk(mu_);
  for (;;) {
    if (running_.empty() && waiting_.empty() && !stop_ && spares_.size() < kSpares) {
      lk.unlock();
      make_spares();  // idle: nothing is held up
      lk.lock();
    }
    if (running_.empty() && waiting_.empty() && !stop_) {
      lk.unlock();
      spin_for_arrival();
      lk.lock();
    }
    cv_.wait(lk, [&] { return stop_ || !waiting_.empty() || !running_.empty(); });
    if (stop_) break;
    // Requests that left or ran out of time while waiting end here; the first ones in line take
    // the free places.
    const auto now = std::chrono::steady_clock::now();
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      Seq& s = **it;
      if (s.cancel || now >= s.req.deadline) {
        s.res.prompt_tokens = int(s.req.prompt.size());
        s.res.finish = s.cancel ? Finish::kCancelled : Finish::kTimeout;
        s.mark_done();
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    while (int(running_.size() + admit.size()) < run_cap_ && !waiting_.empty()) {
      admit.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
    }
    lk.unlock();
    bool fed = true;
    try {
      fed = step(admit);
    } catch (...) {
      // Nothing in a step should throw past its sequences; if something does, every sequence
      // in flight ends with the error rather than the server.
      auto e = std::current_exception();
      for (auto& sp : admit) {
        std::unique_lock g(sp->mu);
        const bool done = sp->done;
        g.unlock();
        if (!done && std::find(running_.begin(), running_.end(), sp) == running_.end()) fail_seq(*sp, e);
      }
      while (!running_.empty()) fail_seq(*running_.front(), e);
    }
    admit.clear();
    lk.lock();
    // Every sequence waits for its caller: sleep until one of them takes its steps (or a new
    // request can start).
    if (!fed)
      cv_.wait_for(lk, std::chrono::milliseconds(20), [&] {
        return stop_ || drained_ || (!waiting_.empty() && int(running_.size()) < run_cap_);
      });
    drained_ = false;
  }
  // Shutting down: everything still in flight ends cancelled.
  std::vector<std::shared_ptr<Seq>> left(waiting_.begin(), waiting_.end());
  waiting_.clear();
  lk.unlock();
  for (auto& s : running_) left.push_back(s);
  running_.clear();
  for (auto& s : left) {
    s->sampler.reset();
    s->state.reset();  // here, before the model goes: a caller may hold the sequence longer
    s->res.finish = Finish::kCancelled;
    s->mark_done();
  }
}

void Engine::admit(Seq& s) {
  const GenRequest& req = s.req;
  const int n_prompt = int(req.prompt.size());
  s.res.prompt_tokens = n_prompt;
  // A spare state takes a cache hit's copy or, on a miss, is emptied and reused: no allocation
  // (and on CUDA no graph capture) on the request's path. The last prompt token is always fed,
  // so that its logits exist.
  std::unique_ptr<SequenceState> spare = take_spare();
  PrefixCache::Hit hit = cache_.lookup(*model_, req.prompt, size_t(n_prompt - 1), &spare);
  s.state = std::move(hit.state);
  if (!s.state) {
    if (spare && model_->reset_state(*spare)) {
      s.state = std::move(spare);
    } else {
      spare.reset();
      make_room(1);
      s.state = model_->new_state(opt_.max_seq);
    }
  }
  keep_spare(std::move(spare));  // unused (the backend cloned the hit): still a spare
  s.res.cached_tokens = hit.n_tokens;
  cached_tokens_total_ += uint64_t(hit.n_tokens);
  s.pos = hit.n_tokens;
  s.fed.assign(req.prompt.begin(), req.prompt.begin() + hit.n_tokens);
  // Plain greedy: the argmax over [0, n_real), which a backend feeding one sequence at a time
  // fuses with the step (Model::greedy_step: on CUDA the logits stay on the device). Every other
  // request samples on the backend that holds the logits (on CUDA: the device), which follows the
  // reference Sampler's rule; with the fast path off, on the host (tests compare). A constrained
  // request samples through its mask, never through greedy_step.
  s.greedy = opt_.greedy_fast_path && is_plain_greedy(req.sampling) && req.logprobs < 0 && !req.constraint;
  if (s.greedy) {
    s.sampler = model_->make_greedy_sampler(int(n_real_));
  } else {
    SamplerSpec spec{req.sampling, req.prompt, int(n_real_), req.logprobs};
    s.sampler = opt_.greedy_fast_path ? model_->make_sampler(spec) : model_->make_host_sampler(spec);
  }
  // Without a cache there is nothing to snapshot at the cut: prefill straight through (a snapshot
  // is a state copy, and a new state when no spare takes it).
  s.cut = cache_.capacity() > 0 ? req.cache_cut : 0;
  // A long prefix shared with a cached conversation that no entry holds by itself (the system
  // prompt and tools that every conversation of an application begins with): its state is kept
  // as a shared entry, so that the next conversations resume from it.
  if (cache_.capacity() > 0) {
    const size_t common = std::min(cache_.longest_common_prefix(req.prompt), size_t(n_prompt - 1));
    if (common >= size_t(hit.n_tokens) + size_t(opt_.shared_prefix_min) && common != s.cut)
      s.shared_cut = common;
  }
  if (req.constraint) s.mask.resize((size_t(model_->config().vocab_size) + 31) / 32);
  if (!req.force_trigger) {
    s.pending.assign(req.forced.rbegin(), req.forced.rend());
    s.armed = true;
  }
  s.res.finish = Finish::kLength;
  s.res.admitted = true;
  {
    std::lock_guard g(s.mu);
    s.admitted = true;
  }
  s.cv.notify_one();
}

// The next choice's forced token, if any: known before the step that precedes it, so that a
// greedy sequence whose next token is forced is fed without a choice.
void Engine::prepare_choice(Seq& s) {
  const GenRequest& req = s.req;
  if (!s.armed && s.generated == req.trigger_budget) {
    s.pending.assign(req.forced.rbegin(), req.forced.rend());
    s.pending.insert(s.pending.end(), req.budget_forced.rbegin(), req.budget_forced.rend());
    s.armed = true;
  }
  s.forced = -1;
  if (!s.pending.empty()) {
    s.forced = s.pending.back();
    s.pending.pop_back();
  }
}

bool Engine::step(std::vector<std::shared_ptr<Seq>>& admitted) {
  const auto now = std::chrono::steady_clock::now();
  for (auto& sp : admitted) {
    Seq& w = *sp;
    if (w.cancel || now >= w.req.deadline) {  // as in the line: it never got its place
      w.res.prompt_tokens = int(w.req.prompt.size());
      w.res.finish = w.cancel ? Finish::kCancelled : Finish::kTimeout;
      w.mark_done();
      continue;
    }
    try {
      admit(*sp);
      running_.push_back(sp);
      make_room(0);  // a cache hit's copy held a place beside the pool
    } catch (...) {
      fail_seq(*sp, std::current_exception());
    }
  }
  publish();
  // Leaving, out of time: the state keeps what was fed (the prefix cache may keep it).
  for (size_t i = 0; i < running_.size();) {
    Seq& s = *running_[i];
    if (s.cancel || now >= s.req.deadline)
      finish(s, s.cancel ? Finish::kCancelled : Finish::kTimeout);  // removes it from running_
    else
      ++i;
  }
  if (running_.empty()) return true;

  // One token of every decoding sequence; prompt pieces, in arrival order, under the budget.
  struct Part {
    Seq* s;
    int n_prompt;  // prompt tokens in this piece (0: a decode token)
    bool chooses;
  };
  std::vector<FeedEntry> entries;
  std::vector<Part> parts;
  int budget = opt_.prefill_chunk;
  for (auto& sp : running_) {
    Seq& s = *sp;
    {
      std::lock_guard g(s.mu);
      if (int(s.steps.size()) >= kMaxStepsAhead) continue;  // its caller is behind: it sits out
    }
    const int n_prompt = int(s.req.prompt.size());
    std::span<const int32_t> ids;
    int n_piece = 0;
    size_t cut = 0;  // a cache cut inside the piece, from its start (FeedEntry::cut)
    if (s.decoding()) {
      ids = std::span<const int32_t>(&s.to_feed, 1);
    } else {
      // A piece's length depends on its own prompt only (--prefill-chunk, the cache cuts), never
      // on what else is in the step, so that its arithmetic is the same alone or batched (a
      // backend's prefill kernels may round differently for different piece lengths); the
      // budget decides which prompts get a piece this step. The first cut inside the piece is
      // the backend's to show (FeedEntry::cut: no extra pass where the backend computes the
      // piece at once); a second one ends the piece.
      if (budget <= 0) continue;
      int end = std::min(n_prompt, s.pos + opt_.prefill_chunk);
      const size_t lo = std::min(s.cut, s.shared_cut), hi = std::max(s.cut, s.shared_cut);
      for (size_t c : {lo, hi}) {
        if (c <= size_t(s.pos) || c >= size_t(end) || c == size_t(s.pos) + cut) continue;
        if (cut)
          end = int(c);
        else
          cut = c - size_t(s.pos);
      }
      n_piece = end - s.pos;
      budget -= n_piece;
      ids = std::span<const int32_t>(s.req.prompt.data() + s.pos, size_t(n_piece));
    }
    const bool chooses = s.pos + n_piece == n_prompt;
    if (chooses) prepare_choice(s);
    // A greedy sequence's forced token needs no argmax: the step runs without a choice.
    s.choice_fed = chooses && !(s.greedy && s.forced >= 0);
    FeedEntry entry{s.state.get(), ids, s.choice_fed ? s.sampler.get() : nullptr};
    if (cut) {
      entry.cut = cut;
      const size_t at = size_t(s.pos) + cut;
      entry.on_cut = [this, &s, ids, cut, at](const SequenceState& state) {
        std::vector<int32_t> tokens = s.fed;
        tokens.insert(tokens.end(), ids.begin(), ids.begin() + std::ptrdiff_t(cut));
        snapshot(std::move(tokens), state, /*shared=*/at == s.shared_cut && at != s.cut);
      };
    }
    entries.push_back(std::move(entry));
    parts.push_back({&s, n_piece, chooses});
  }
  if (entries.empty()) return false;  // every sequence waits for its caller
  try {
    model_->feed_batch(entries);
  } catch (...) {
    // The states of this step are in an unknown condition: its sequences end with the error.
    auto e = std::current_exception();
    for (const Part& p : parts) fail_seq(*p.s, e);
    publish();
    return true;
  }
  ++steps_;
  if (int(parts.size()) > max_step_seqs_) max_step_seqs_ = int(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    Seq& s = *parts[i].s;
    const std::span<const int32_t> ids = entries[i].ids;
    s.fed.insert(s.fed.end(), ids.begin(), ids.end());
    if (parts[i].n_prompt > 0) {
      s.pos += parts[i].n_prompt;
      const bool own = size_t(s.pos) == s.cut, shared = size_t(s.pos) == s.shared_cut;
      if ((own || shared) && !s.decoding()) snapshot(s.fed, *s.state, shared && !own);
    }
    if (parts[i].chooses) {
      try {
        choose(s);
      } catch (...) {
        fail_seq(s, std::current_exception());
      }
    }
  }
  publish();
  return true;
}

// Keeps a copy of the state at a cut in the prefix cache: in a spare state (already counted in
// the pool; the copy allocates nothing), else in a new one when the pool has room for it. A copy
// that fails (out of memory) only costs the cache an entry.
void Engine::snapshot(std::vector<int32_t> tokens, const SequenceState& from, bool shared) {
  try {
    std::unique_ptr<SequenceState> copy = take_spare();
    if (copy && !model_->copy_state(from, *copy)) keep_spare(std::move(copy));  // the backend clones
    if (!copy) {
      make_room(1);
      if (states_used() + 1 > pool_states_) return;
      copy = model_->clone_state(from);
    }
    keep_spare(cache_.insert(std::move(tokens), std::move(copy), /*cold=*/false, shared));
  } catch (const std::exception&) {
    make_room(0);
  }
}

void Engine::choose(Seq& s) {
  const GenRequest& req = s.req;
  GenStep step;
  const int32_t forced = s.forced;
  step.forced = forced >= 0;
  // constraint: the mask is computed while the backend runs the step just fed (on CUDA the feed
  // only enqueued it), and applied by the sampler on the device.
  const uint32_t* allowed = nullptr;
  if (forced < 0 && req.constraint && req.constraint->active()) {
    req.constraint->fill_mask(s.mask);
    allowed = s.mask.data();
  }
  int32_t tok = forced;
  std::optional<LogprobInfo> lp;
  if (s.choice_fed) {
    SampleChoice c = s.sampler->next(allowed, forced);
    tok = c.token;
    lp = std::move(c.logprobs);
  }
  if (forced < 0 && !s.armed && req.force_trigger && tok == *req.force_trigger) {
    s.pending.assign(req.forced.rbegin(), req.forced.rend());
    s.armed = true;
  }
  if (req.constraint) req.constraint->accept(tok);  // constraint: sampled and forced tokens alike
  ++s.generated;
  ++s.res.completion_tokens;
  step.token = tok;
  bool ended = false;
  const bool eos = !req.ignore_eos && std::find(eos_.begin(), eos_.end(), tok) != eos_.end();
  // The end-of-sequence token is not part of the text, so it gets no logprobs entry.
  if (req.logprobs >= 0 && !eos) step.logprobs = std::move(lp);
  if (eos) {
    s.res.finish = Finish::kStop;
    s.res.stop_token = tok;
    ended = true;
  } else {
    step.text = s.stops.push(s.decoder.push(tok));
    if (s.stops.stopped()) {
      s.res.finish = Finish::kStop;
      s.res.stop_string = s.stops.matched();
      ended = true;
    } else if (req.constraint && req.constraint->complete()) {
      // constraint: a document that nothing may follow ends the generation (no end-of-turn token).
      s.res.finish = Finish::kStop;
      ended = s.document_done = true;
    }
  }
  s.push(std::move(step));
  if (ended || s.generated == req.max_tokens) {
    finish(s, s.res.finish);
    return;
  }
  s.to_feed = tok;
}

void Engine::finish(Seq& s, Finish f) {
  s.res.finish = f;
  if (f == Finish::kLength || (f == Finish::kStop && (s.res.stop_token || s.document_done))) {
    GenStep last;
    last.text = s.stops.push(s.decoder.flush());
    if (s.stops.stopped() && !s.res.stop_token) {
      s.res.finish = Finish::kStop;
      s.res.stop_string = s.stops.matched();
    } else {
      last.text += s.stops.flush();
    }
    if (!last.text.empty()) s.push(std::move(last));
  }
  s.sampler.reset();  // before the next request makes one (the CUDA plan has one device sampler)
  // The end state is stored cold: measured on multi-turn chat (tools/measure_prefix_cache.py,
  // docs/API.md), the next turn resumes from the cut inside the prompt, because the template
  // re-renders the answer; an end state kept hot would evict the cuts of other conversations.
  // A sequence that ends before its prompt is in keeps nothing but the reusable state.
  std::shared_ptr<Seq> keep = take(s);  // the caller may have left: this may be the last owner
  try {
    if (s.decoding())
      keep_spare(cache_.insert(std::move(s.fed), std::move(s.state), /*cold=*/s.req.cache_cut > 0));
    else
      keep_spare(std::move(s.state));
    make_room(0);
  } catch (...) {
    s.state.reset();  // the answer is complete: a state the cache could not take is dropped
  }
  publish();
  s.mark_done();
}

// Removes `s` from the running sequences, returning the engine's reference to it.
std::shared_ptr<Engine::Seq> Engine::take(Seq& s) {
  std::shared_ptr<Seq> keep;
  for (auto it = running_.begin(); it != running_.end(); ++it)
    if (it->get() == &s) {
      keep = std::move(*it);
      running_.erase(it);
      break;
    }
  return keep;
}

void Engine::fail_seq(Seq& s, std::exception_ptr e) {
  std::shared_ptr<Seq> keep = take(s);
  s.sampler.reset();
  s.state.reset();
  publish();
  {
    std::lock_guard g(s.mu);
    s.error = std::move(e);
  }
  s.mark_done();
}

}  // namespace tansy
