// The generation loop's greedy fast path (Model::greedy_step) against the general path
// (forward() + host sampler): same tokens, text, finish reasons and prefix-cache contents.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/synth.h"
#include "core/error.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/model.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace {

using tansy::Engine;
using tansy::EngineOptions;
using tansy::Finish;
using tansy::GenRequest;
using tansy::GenResult;
using tansy::GenStep;
using tansy::Model;
using tansy::SequenceState;

// The host sampler, saying that its feed only enqueues the step (as the CUDA plan's does), so the
// engine feeds each token before handing it out; every feed is logged.
class AsyncFeedSampler : public tansy::TokenSampler {
 public:
  AsyncFeedSampler(std::unique_ptr<tansy::TokenSampler> inner, std::vector<std::string>& log)
      : inner_(std::move(inner)), log_(log) {}
  void feed(SequenceState& state, std::span<const int32_t> ids) override {
    log_.push_back("feed " + std::to_string(ids.size()));
    inner_->feed(state, ids);
  }
  tansy::SampleChoice next(const uint32_t* allowed, int32_t forced) override {
    return inner_->next(allowed, forced);
  }
  bool feed_is_async() const override { return true; }

 private:
  std::unique_ptr<tansy::TokenSampler> inner_;
  std::vector<std::string>& log_;
};

constexpr int kTokIds = 400;          // ids the tokenizer defines (n_real)
constexpr int kVocab = kTokIds + 24;  // embedding rows: the rest is padding

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

struct FakeState : SequenceState {
  std::vector<int32_t> toks;
  int max_tokens = 0;
  std::shared_ptr<std::atomic<int>> live;  // the model's count of its states alive
  FakeState() = default;
  FakeState(const FakeState& o) : toks(o.toks), max_tokens(o.max_tokens), live(o.live) {
    if (live) ++*live;
  }
  ~FakeState() override {
    if (live) --*live;
  }
  int n_tokens() const override { return int(toks.size()); }
};

// Logits are a pure function of every token fed so far, so a skipped, repeated or reordered
// token changes all later choices. The padding rows hold the largest logits (the first padding
// id above all), so a limit past the tokenizer's ids picks a token the host path never would.
class FakeModel : public Model {
 public:
  explicit FakeModel(std::vector<int> eos = {}) {
    cfg_.vocab_size = kVocab;
    cfg_.max_position = 4096;
    cfg_.eos_token_ids = std::move(eos);
    cfg_.name = "fake";
  }
  const tansy::ModelConfig& config() const override { return cfg_; }
  std::string backend_name() const override { return "fake"; }
  size_t state_bytes(int n) const override { return size_t(n) * 4; }
  std::optional<size_t> free_state_memory() const override { return free_bytes; }
  std::optional<size_t> free_bytes;  // what the engine sizes its pool from (nullopt: unknown)
  int scratch_states() const override { return scratch; }
  int scratch = 0;  // states the backend makes for itself, which the pool leaves room for
  bool states_on_device() const override { return on_device; }
  bool on_device = false;  // true: the states in memory of their own (the cache fills it by default)
  int max_batch() const override { return batch; }
  int batch = 1;  // > 1: Model's default forward_batch (each piece alone), host samplers
  std::unique_ptr<SequenceState> new_state(int max_tokens) override {
    record("new");
    auto s = std::make_unique<FakeState>();
    s->max_tokens = max_tokens;
    s->live = live;
    ++*live;
    return s;
  }
  std::unique_ptr<SequenceState> clone_state(const SequenceState& s) override {
    record("clone");
    if (copies_fail) tansy::fail("fake model: out of memory (clone_state)");
    return std::make_unique<FakeState>(dynamic_cast<const FakeState&>(s));
  }
  bool copy_state(const SequenceState& src, SequenceState& dst) override {
    if (!can_copy) return false;
    record("copy");
    if (copies_fail) tansy::fail("fake model: copy_state failed");
    const auto& a = dynamic_cast<const FakeState&>(src);
    auto& b = dynamic_cast<FakeState&>(dst);
    if (a.max_tokens != b.max_tokens) tansy::fail("fake model: copy_state across capacities");
    b.toks = a.toks;
    return true;
  }
  bool reset_state(SequenceState& state) override {
    record("reset");
    dynamic_cast<FakeState&>(state).toks.clear();
    return true;
  }
  // The state calls (new, clone, copy, reset) and forwards, in order.
  std::vector<std::string> calls() const {
    std::lock_guard lk(calls_mu_);
    return calls_;
  }
  ~FakeModel() override {
    if (live_at_destruction) *live_at_destruction = live->load();
  }
  std::shared_ptr<std::atomic<int>> live = std::make_shared<std::atomic<int>>(0);
  int* live_at_destruction = nullptr;  // set: receives the states still alive when the model goes
  bool copies_fail = false;            // clone_state and copy_state throw
  bool can_copy = true;                // false: copy_state returns false (the engine clones)
  void forward(SequenceState& state, std::span<const int32_t> ids, std::span<float> logits,
               bool all) override {
    auto& st = dynamic_cast<FakeState&>(state);
    if (all) tansy::fail("fake model: all_positions is not implemented");
    if (logits.size() != size_t(kVocab)) tansy::fail("fake model: logits has {} entries", logits.size());
    for (int32_t id : ids) {
      if (id < 0 || id >= kVocab) tansy::fail("fake model: id {} fed", id);
      st.toks.push_back(id);
    }
    if (st.n_tokens() > st.max_tokens) tansy::fail("fake model: state overflow");
    ++forward_calls;
    record("forward");
    fill(st.toks, logits);
  }
  std::unique_ptr<tansy::TokenSampler> make_sampler(const tansy::SamplerSpec& spec) override {
    auto s = make_host_sampler(spec);
    if (!async_feed) return s;
    return std::make_unique<AsyncFeedSampler>(std::move(s), log);
  }
  int32_t greedy_step(SequenceState& state, std::span<const int32_t> ids, int limit) override {
    ++greedy_calls;
    limits.push_back(limit);
    return Model::greedy_step(state, ids, limit);
  }

  static void fill(const std::vector<int32_t>& toks, std::span<float> logits) {
    uint64_t h = 0x1234;
    for (int32_t t : toks) h = mix(h ^ uint64_t(uint32_t(t)));
    for (int v = 0; v < kVocab; ++v)
      logits[size_t(v)] = float(mix(h + uint64_t(v)) >> 40) * (4.0f / 16777216.0f);
    for (int v = kTokIds; v < kVocab; ++v) logits[size_t(v)] = 100.0f - float(v - kTokIds);
    if (h % 3 == 0) {  // a tie between two real ids: the lower one must win
      int a = int(h % 97), b = a + 1 + int((h >> 8) % 200);
      logits[size_t(a)] = logits[size_t(b)] = 9.0f;
    }
  }

  int greedy_calls = 0, forward_calls = 0;
  std::vector<int> limits;
  bool async_feed = false;       // make_sampler: an AsyncFeedSampler logging into `log`
  std::vector<std::string> log;  // its feeds (written on the engine's thread)

 private:
  void record(const char* what) {
    std::lock_guard lk(calls_mu_);
    calls_.push_back(what);
  }
  tansy::ModelConfig cfg_;
  mutable std::mutex calls_mu_;  // the engine's thread records while a test reads
  std::vector<std::string> calls_;
};

tansy::Tokenizer synth_tokenizer() {
  tansy::ModelConfig c;
  c.vocab_size = kTokIds;
  return tansy::Tokenizer::from_json(tansy::synthetic_tokenizer_json(tansy::synth_tokenizer_layout(c)));
}

// Greedy continuation computed outside the engine: argmax over the tokenizer's ids.
std::vector<int32_t> oracle(const std::vector<int32_t>& prompt, int n) {
  std::vector<int32_t> toks = prompt, out;
  std::vector<float> logits(kVocab);
  for (int i = 0; i < n; ++i) {
    FakeModel::fill(toks, logits);
    int32_t t = tansy::argmax(std::span<const float>(logits.data(), size_t(kTokIds)));
    out.push_back(t);
    toks.push_back(t);
  }
  return out;
}

struct Outcome {
  GenResult res;
  std::vector<int32_t> tokens;
  std::vector<bool> forced;
  std::string text;
  int greedy_calls = 0;
  std::vector<int> limits;
};

// The most states an engine held while it ran: states_used sampled every 100 µs on a thread of
// its own until stop().
class PeakStates {
 public:
  explicit PeakStates(const Engine& e)
      : watch_([this, &e] {
          while (!done_) {
            most_ = std::max(most_.load(), e.load().states_used);
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          }
        }) {}
  ~PeakStates() { stop(); }
  PeakStates(const PeakStates&) = delete;
  PeakStates& operator=(const PeakStates&) = delete;
  size_t stop() {
    done_ = true;
    if (watch_.joinable()) watch_.join();
    return most_;
  }

 private:
  std::atomic<bool> done_{false};
  std::atomic<size_t> most_{0};
  std::thread watch_;
};

struct Harness {
  FakeModel* model;
  std::unique_ptr<Engine> engine;
  Harness(bool fast, std::vector<int> eos = {}, size_t cache_entries = 4) {
    auto m = std::make_unique<FakeModel>(std::move(eos));
    model = m.get();
    EngineOptions o;
    o.max_seq = 1024;
    o.prefill_chunk = 7;  // several prefill chunks
    o.prefix_cache_entries = cache_entries;
    o.greedy_fast_path = fast;
    engine = std::make_unique<Engine>(std::move(m), synth_tokenizer(), o);
  }
  Outcome run(const GenRequest& req, int stop_after = -1) {
    Outcome r;
    const int before = model->greedy_calls;
    model->limits.clear();
    r.res = engine->generate(req, [&](const GenStep& s) {
      if (s.token >= 0) {
        r.tokens.push_back(s.token);
        r.forced.push_back(s.forced);
      }
      r.text += s.text;
      return stop_after < 0 || int(r.tokens.size()) < stop_after;
    });
    r.greedy_calls = model->greedy_calls - before;
    r.limits = model->limits;
    return r;
  }
};

GenRequest greedy_request(std::vector<int32_t> prompt, int max_tokens) {
  GenRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

std::vector<int32_t> prompt_of(int n, int seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(int32_t(mix(uint64_t(seed * 1000 + i)) % kTokIds));
  return p;
}

void expect_same(const Outcome& a, const Outcome& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.forced, b.forced);
  EXPECT_EQ(a.text, b.text);
  EXPECT_EQ(a.res.finish, b.res.finish);
  // A cancelled request may have run up to kMaxStepsAhead steps beyond what its caller took.
  if (a.res.finish != Finish::kCancelled) {
    EXPECT_EQ(a.res.completion_tokens, b.res.completion_tokens);
  }
  EXPECT_EQ(a.res.stop_string, b.res.stop_string);
  EXPECT_EQ(a.res.stop_token, b.res.stop_token);
  EXPECT_EQ(a.res.cached_tokens, b.res.cached_tokens);
}

}  // namespace

TEST(Engine, PlainGreedyMatchesTheSampler) {
  tansy::SamplingParams p;
  p.temperature = 0;
  EXPECT_TRUE(tansy::is_plain_greedy(p));
  p.temperature = -1;
  EXPECT_TRUE(tansy::is_plain_greedy(p));
  p.top_p = 0.5, p.top_k = 3, p.min_p = 0.2, p.seed = 7;  // irrelevant at temperature 0
  EXPECT_TRUE(tansy::is_plain_greedy(p));
  auto with = [](auto f) {
    tansy::SamplingParams q;
    q.temperature = 0;
    f(q);
    return tansy::is_plain_greedy(q);
  };
  EXPECT_FALSE(with([](auto& q) { q.temperature = 0.1; }));
  EXPECT_FALSE(with([](auto& q) { q.presence_penalty = 0.5; }));
  EXPECT_FALSE(with([](auto& q) { q.frequency_penalty = -0.5; }));
  EXPECT_FALSE(with([](auto& q) { q.repetition_penalty = 1.1; }));
  EXPECT_FALSE(with([](auto& q) { q.logit_bias[3] = 1.0; }));
}

TEST(Engine, GreedyFastPathEqualsTheGeneralPath) {
  for (int seed = 0; seed < 4; ++seed) {
    const auto prompt = prompt_of(5 + 9 * seed, seed);
    const int n = 40;
    GenRequest req = greedy_request(prompt, n);
    req.ignore_eos = true;
    Harness fast(true), slow(false);
    Outcome a = fast.run(req), b = slow.run(req);
    expect_same(a, b);
    EXPECT_EQ(a.tokens, oracle(prompt, n));
    // The fast path ran the prompt's last piece and every decode step, always with the
    // tokenizer's id count as the limit; the general path never.
    EXPECT_EQ(a.greedy_calls, n);
    EXPECT_EQ(b.greedy_calls, 0);
    EXPECT_EQ(a.limits, std::vector<int>(size_t(n), kTokIds));
    EXPECT_EQ(a.res.finish, Finish::kLength);
  }
}

TEST(Engine, GreedyFastPathStopsLikeTheGeneralPath) {
  const auto prompt = prompt_of(11, 9);
  const auto ref = oracle(prompt, 60);
  // End of sequence: the 20th token of the continuation is declared an eos id.
  {
    Harness fast(true, {ref[19]}), slow(false, {ref[19]});
    GenRequest req = greedy_request(prompt, 60);
    Outcome a = fast.run(req), b = slow.run(req);
    expect_same(a, b);
    EXPECT_EQ(a.res.finish, Finish::kStop);
    ASSERT_TRUE(a.res.stop_token.has_value());
    EXPECT_EQ(*a.res.stop_token, ref[19]);
    EXPECT_LE(a.tokens.size(), 20u);
    EXPECT_GT(a.greedy_calls, 0);
  }
  // A stop string taken from the middle of the continuation's text.
  {
    Harness fast(true), slow(false);
    GenRequest req = greedy_request(prompt, 60);
    req.ignore_eos = true;
    Outcome full = slow.run(req);
    std::string stop;
    for (size_t k = full.text.size() / 3; k + 2 < full.text.size() && stop.empty(); ++k) {
      std::string cand = full.text.substr(k, 2);
      if (std::all_of(cand.begin(), cand.end(), [](char c) { return c > ' ' && c <= '~'; })) stop = cand;
    }
    ASSERT_FALSE(stop.empty()) << "no ASCII run in " << full.text;
    req.stop = {stop};
    Harness fast2(true), slow2(false);
    Outcome a = fast2.run(req), b = slow2.run(req);
    expect_same(a, b);
    EXPECT_EQ(a.res.finish, Finish::kStop);
    EXPECT_EQ(a.res.stop_string, stop);
    EXPECT_GT(a.greedy_calls, 0);
  }
  // The client goes away after 7 tokens: the engine runs at most kMaxStepsAhead steps beyond
  // what it took (here, with nothing else to do, it runs them all), then stops feeding.
  {
    Harness fast(true), slow(false);
    GenRequest req = greedy_request(prompt, 60);
    req.ignore_eos = true;
    Outcome a = fast.run(req, 7), b = slow.run(req, 7);
    expect_same(a, b);
    EXPECT_EQ(a.res.finish, Finish::kCancelled);
    EXPECT_GE(a.greedy_calls, 1 + 6);
    EXPECT_LE(a.greedy_calls, 7 + 2 * tansy::kMaxStepsAhead);
    EXPECT_EQ(a.greedy_calls, a.res.completion_tokens) << "each chosen token but the last one fed";
  }
}

TEST(Engine, ForcedTokensTakePrecedenceOverTheFastPath) {
  const auto prompt = prompt_of(9, 3);
  const auto ref = oracle(prompt, 30);
  GenRequest req = greedy_request(prompt, 30);
  req.ignore_eos = true;
  req.force_trigger = ref[4];
  req.forced = {'x', 'y', 'z'};
  Harness fast(true), slow(false);
  Outcome a = fast.run(req), b = slow.run(req);
  expect_same(a, b);
  // The trigger fires on the first occurrence of ref[4] (at index 4 or earlier).
  size_t at = size_t(std::find(ref.begin(), ref.end(), ref[4]) - ref.begin());
  ASSERT_GT(a.tokens.size(), at + 3);
  EXPECT_EQ(std::vector<int32_t>(a.tokens.begin() + long(at) + 1, a.tokens.begin() + long(at) + 4),
            (std::vector<int32_t>{'x', 'y', 'z'}));
  EXPECT_TRUE(a.forced[at + 1] && a.forced[at + 2] && a.forced[at + 3]);
  // Steps whose successor is forced feed through forward(): three fewer greedy steps (the
  // prompt and 29 decode steps otherwise).
  EXPECT_EQ(a.greedy_calls, 30 - 3);
  // Forcing from the first step (no trigger): the prompt's piece is one of those steps.
  req.force_trigger.reset();
  Harness fast2(true), slow2(false);
  Outcome c = fast2.run(req), d = slow2.run(req);
  expect_same(c, d);
  EXPECT_EQ(std::vector<int32_t>(c.tokens.begin(), c.tokens.begin() + 3),
            (std::vector<int32_t>{'x', 'y', 'z'}));
  EXPECT_EQ(c.greedy_calls, 30 - 3);
}

TEST(Engine, TriggerBudgetForcesTheTriggerOnce) {
  const auto prompt = prompt_of(9, 4);
  const auto ref = oracle(prompt, 30);
  int32_t never = 0;  // a token the greedy continuation never produces, as the trigger
  while (std::find(ref.begin(), ref.end(), never) != ref.end()) ++never;
  GenRequest req = greedy_request(prompt, 20);
  req.ignore_eos = true;
  req.force_trigger = never;
  req.trigger_budget = 5;
  req.budget_forced = {'a', 'b', never};
  req.forced = {'x'};
  Harness fast(true), slow(false);
  Outcome a = fast.run(req), b = slow.run(req);
  expect_same(a, b);
  // Five sampled tokens, then the budget's tokens and the trigger's, then greedy from there.
  std::vector<int32_t> want(ref.begin(), ref.begin() + 5);
  for (int32_t t : {int32_t('a'), int32_t('b'), never, int32_t('x')}) want.push_back(t);
  std::vector<int32_t> ctx = prompt;
  ctx.insert(ctx.end(), want.begin(), want.end());
  for (int32_t t : oracle(ctx, 20 - int(want.size()))) want.push_back(t);
  EXPECT_EQ(a.tokens, want);
  EXPECT_EQ(std::count(a.forced.begin(), a.forced.end(), true), 4);
  EXPECT_TRUE(a.forced[5] && a.forced[8] && !a.forced[4] && !a.forced[9]);

  // The trigger generated within the budget: no budget tokens, `forced` after the trigger.
  req.force_trigger = ref[2];
  Harness fast2(true), slow2(false);
  Outcome c = fast2.run(req), d = slow2.run(req);
  expect_same(c, d);
  size_t at = size_t(std::find(ref.begin(), ref.end(), ref[2]) - ref.begin());
  EXPECT_EQ(std::vector<int32_t>(c.tokens.begin(), c.tokens.begin() + long(at) + 1),
            std::vector<int32_t>(ref.begin(), ref.begin() + long(at) + 1));
  EXPECT_EQ(c.tokens[at + 1], 'x');
  EXPECT_EQ(std::count(c.forced.begin(), c.forced.end(), true), 1);
}

TEST(Engine, OtherSamplingKeepsTheGeneralPath) {
  const auto prompt = prompt_of(13, 5);
  std::vector<std::function<void(GenRequest&)>> variants = {
      [](GenRequest& r) { r.sampling.presence_penalty = 0.5; },
      [](GenRequest& r) { r.sampling.frequency_penalty = 0.5; },
      [](GenRequest& r) { r.sampling.repetition_penalty = 1.3; },
      [](GenRequest& r) { r.sampling.logit_bias[7] = 2.5; },
      [](GenRequest& r) { r.logprobs = 2; },
      [](GenRequest& r) { r.sampling.temperature = 0.8, r.sampling.seed = 11; },
  };
  for (size_t i = 0; i < variants.size(); ++i) {
    GenRequest req = greedy_request(prompt, 25);
    req.ignore_eos = true;
    variants[i](req);
    Harness fast(true), slow(false);
    Outcome a = fast.run(req), b = slow.run(req);
    SCOPED_TRACE(i);
    expect_same(a, b);
    EXPECT_EQ(a.greedy_calls, 0);
  }
}

TEST(Engine, GreedyFastPathKeepsThePrefixCacheExact) {
  const auto prompt = prompt_of(20, 7);
  GenRequest first = greedy_request(prompt, 12);
  first.ignore_eos = true;
  Harness fast(true);
  Outcome a = fast.run(first);
  ASSERT_EQ(a.tokens.size(), 12u);
  // The end state holds the prompt and every generated token but the last (never fed). A prompt
  // extending exactly that resumes from it; its continuation must equal a fresh computation.
  std::vector<int32_t> ext = prompt;
  ext.insert(ext.end(), a.tokens.begin(), a.tokens.end() - 1);
  ext.push_back(a.tokens.back());
  ext.push_back(42);
  GenRequest second = greedy_request(ext, 15);
  second.ignore_eos = true;
  Outcome b = fast.run(second);
  EXPECT_EQ(b.res.cached_tokens, int(prompt.size()) + 11);
  EXPECT_EQ(b.tokens, oracle(ext, 15));
  Harness fresh(false, {}, 0);
  Outcome c = fresh.run(second);
  EXPECT_EQ(c.res.cached_tokens, 0);
  EXPECT_EQ(b.tokens, c.tokens);
  EXPECT_EQ(b.text, c.text);
}

// The CPU backend on the bundled demo model: a real forward pass, its own greedy_step.
TEST(Engine, GreedyFastPathOnTheDemoModel) {
  const auto dir = tansy::test::source_dir() / "models" / "tansy-demo";
  if (!std::filesystem::exists(dir / "config.json")) GTEST_SKIP() << "no " << dir;
  struct Counting : Model {
    std::unique_ptr<Model> in;
    int greedy = 0;
    explicit Counting(std::unique_ptr<Model> m) : in(std::move(m)) {}
    const tansy::ModelConfig& config() const override { return in->config(); }
    std::string backend_name() const override { return in->backend_name(); }
    size_t state_bytes(int n) const override { return in->state_bytes(n); }
    std::unique_ptr<SequenceState> new_state(int n) override { return in->new_state(n); }
    std::unique_ptr<SequenceState> clone_state(const SequenceState& s) override { return in->clone_state(s); }
    void forward(SequenceState& s, std::span<const int32_t> ids, std::span<float> l, bool all) override {
      in->forward(s, ids, l, all);
    }
    int32_t greedy_step(SequenceState& s, std::span<const int32_t> ids, int limit) override {
      ++greedy;
      return in->greedy_step(s, ids, limit);
    }
  };
  auto run = [&](bool fast, const std::string& text, int n, int* calls) {
    tansy::ModelOptions mo;
    mo.backend = "cpu";
    auto counting = std::make_unique<Counting>(tansy::open_model(dir, mo));
    Counting* c = counting.get();
    EngineOptions eo;
    eo.max_seq = 512;
    eo.greedy_fast_path = fast;
    Engine e(std::move(counting), tansy::Tokenizer::load(dir), eo);
    GenRequest req = greedy_request(e.tokenizer().encode(text), n);
    req.ignore_eos = true;
    std::pair<std::vector<int32_t>, std::string> out;
    e.generate(req, [&](const GenStep& s) {
      if (s.token >= 0) out.first.push_back(s.token);
      out.second += s.text;
      return true;
    });
    *calls = c->greedy;
    return out;
  };
  const std::string prompt =
      "<|im_start|>user\nWhat does the word apple mean?<|im_end|>\n<|im_start|>assistant\n<think>\n";
  int fast_calls = 0, slow_calls = 0;
  auto a = run(true, prompt, 48, &fast_calls);
  auto b = run(false, prompt, 48, &slow_calls);
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(a.second, b.second);
  EXPECT_EQ(a.first.size(), 48u);
  EXPECT_EQ(fast_calls, 48);  // the prompt's (one) piece and 47 decode steps
  EXPECT_EQ(slow_calls, 0);
}

// Without a prefix cache a request neither snapshots its state at the cut nor splits its prefill
// there, and the second request reuses the first one's state (reset, not new); with a cache the
// snapshot is taken.
TEST(Engine, StatesWithAndWithoutACache) {
  const auto dir = tansy::test::source_dir() / "models" / "tansy-demo";
  if (!std::filesystem::exists(dir / "config.json")) GTEST_SKIP() << "no " << dir;
  struct Calls {
    int news = 0, clones = 0, resets = 0, forwards = 0;
  };
  struct Counting : Model {
    std::unique_ptr<Model> in;
    Calls* c;
    Counting(std::unique_ptr<Model> m, Calls* calls) : in(std::move(m)), c(calls) {}
    const tansy::ModelConfig& config() const override { return in->config(); }
    std::string backend_name() const override { return in->backend_name(); }
    size_t state_bytes(int n) const override { return in->state_bytes(n); }
    std::unique_ptr<SequenceState> new_state(int n) override {
      ++c->news;
      return in->new_state(n);
    }
    std::unique_ptr<SequenceState> clone_state(const SequenceState& s) override {
      ++c->clones;
      return in->clone_state(s);
    }
    bool reset_state(SequenceState& s) override {
      ++c->resets;
      return in->reset_state(s);
    }
    void forward(SequenceState& s, std::span<const int32_t> ids, std::span<float> l, bool all) override {
      ++c->forwards;
      in->forward(s, ids, l, all);
    }
  };
  auto run = [&](size_t cache_entries) {
    Calls calls;
    tansy::ModelOptions mo;
    mo.backend = "cpu";
    EngineOptions eo;
    eo.max_seq = 256;
    eo.prefix_cache_entries = cache_entries;
    Engine e(std::make_unique<Counting>(tansy::open_model(dir, mo), &calls), tansy::Tokenizer::load(dir), eo);
    // Each answer's tokens and their exact logprobs: a reused state that kept anything of the
    // previous request would move them.
    std::vector<std::pair<std::vector<int32_t>, std::vector<float>>> outs;
    for (const char* text : {"What does the word apple mean?", "Define the word river."}) {
      GenRequest req = greedy_request(e.tokenizer().encode(text), 4);
      req.cache_cut = req.prompt.size() - 1;  // as the server sets it for /v1/completions
      req.ignore_eos = true;
      req.logprobs = 0;
      std::pair<std::vector<int32_t>, std::vector<float>> out;
      e.generate(req, [&](const GenStep& s) {
        if (s.token >= 0) out.first.push_back(s.token);
        if (s.logprobs) out.second.push_back(s.logprobs->logprob);
        return true;
      });
      outs.push_back(out);
    }
    return std::pair{calls, outs};
  };
  auto [none, out0] = run(0);
  EXPECT_EQ(none.clones, 0) << "no snapshot without a cache";
  EXPECT_EQ(none.news, 1);
  EXPECT_EQ(none.resets, 1) << "the second request reuses the first one's state";
  EXPECT_EQ(none.forwards, 2 + 2 * 3)
      << "one prefill pass per request (no split at the cut) + 3 decode steps";
  auto [cached, out2] = run(2);
  EXPECT_EQ(cached.clones, 2) << "a snapshot at each request's cut";
  EXPECT_EQ(out0, out2) << "the same answers either way";
}

// ---- structured output: the constraint hook --------------------------------------------------

namespace {

// Allows exactly the next token of a script; complete once the script is done.
class ScriptConstraint : public tansy::TokenConstraint {
 public:
  explicit ScriptConstraint(std::vector<int32_t> script) : script_(std::move(script)) {}
  bool active() const override { return true; }
  void fill_mask(std::span<uint32_t> bits) override {
    ++masks;
    std::fill(bits.begin(), bits.end(), 0u);
    int32_t t = script_[pos_];
    bits[size_t(t) >> 5] |= 1u << (t & 31);
  }
  void accept(int32_t token) override {
    accepted.push_back(token);
    if (pos_ < script_.size() && token == script_[pos_]) ++pos_;
  }
  bool can_end() const override { return pos_ == script_.size(); }
  bool complete() const override { return pos_ == script_.size(); }
  int masks = 0;
  std::vector<int32_t> accepted;

 private:
  std::vector<int32_t> script_;
  size_t pos_ = 0;
};

}  // namespace

TEST(Engine, ConstraintMasksEverySampledStepAndEndsTheDocument) {
  const auto prompt = prompt_of(9, 5);
  const std::vector<int32_t> script = {7, 300, 12, 12, 399, 1};
  for (bool fast : {true, false}) {
    GenRequest req = greedy_request(prompt, 20);
    auto c = std::make_shared<ScriptConstraint>(script);
    req.constraint = c;
    Harness h(fast);
    Outcome o = h.run(req);
    EXPECT_EQ(o.tokens, script);  // greedy would pick others: the mask decides
    EXPECT_EQ(o.res.finish, Finish::kStop);
    EXPECT_EQ(o.res.completion_tokens, int(script.size()));
    EXPECT_EQ(o.greedy_calls, 0);  // a constrained request never takes greedy_step
    EXPECT_EQ(c->masks, int(script.size()));
    EXPECT_EQ(c->accepted, script);
  }
  // Forced tokens are accepted without a mask; a document cut by max_tokens is "length".
  GenRequest req = greedy_request(prompt, 4);
  auto c = std::make_shared<ScriptConstraint>(script);
  req.constraint = c;
  req.forced = {7, 300};
  Harness h(true);
  Outcome o = h.run(req);
  EXPECT_EQ(o.tokens, std::vector<int32_t>(script.begin(), script.begin() + 4));
  EXPECT_EQ(c->masks, 2);
  EXPECT_EQ(o.res.finish, Finish::kLength);
}

// A sampler whose feed only enqueues (CUDA's): the same tokens, text and finish as any other;
// every step of the request feeds through it, in order; on a cancel the state and the prefix
// cache still agree (the caller's thread takes the steps while the engine's runs ahead).
TEST(Engine, AsyncFeedSamplerAndCancelKeepStateAndCacheInAgreement) {
  const auto prompt = prompt_of(17, 3);
  std::vector<std::function<void(GenRequest&)>> variants = {
      [](GenRequest& r) { r.sampling.temperature = 0.8, r.sampling.seed = 11; },
      [](GenRequest& r) {
        r.sampling.temperature = 0.6, r.sampling.top_k = 20, r.sampling.seed = 5, r.logprobs = 3;
      },
      [](GenRequest& r) { r.sampling.presence_penalty = 1.5; },
  };
  for (size_t i = 0; i < variants.size(); ++i) {
    SCOPED_TRACE(i);
    GenRequest req = greedy_request(prompt, 30);
    req.ignore_eos = true;
    variants[i](req);
    Harness async(true), plain(true);
    async.model->async_feed = true;
    Outcome a = async.run(req), b = plain.run(req);
    expect_same(a, b);
    ASSERT_EQ(a.tokens.size(), 30u);
    // The prompt's last piece (prefill_chunk 7: the others need no choice), then each token but
    // the last.
    std::vector<std::string> want = {"feed " + std::to_string((prompt.size() - 1) % 7 + 1)};
    for (int t = 0; t < 29; ++t) want.push_back("feed 1");
    EXPECT_EQ(async.model->log, want);
    // A stop string ends it as it does for the plain sampler.
    std::string stop;
    for (size_t k = b.text.size() / 2; k + 2 < b.text.size() && stop.empty(); ++k) {
      std::string cand = b.text.substr(k, 2);
      if (std::all_of(cand.begin(), cand.end(), [](char c) { return c > ' ' && c <= '~'; })) stop = cand;
    }
    if (!stop.empty()) {
      GenRequest sr = req;
      sr.stop = {stop};
      Harness as(true), pl(true);
      as.model->async_feed = true;
      Outcome x = as.run(sr), y = pl.run(sr);
      expect_same(x, y);
      EXPECT_EQ(x.res.finish, Finish::kStop);
    }
    // The client leaves after 6 tokens. The engine may have chosen more meanwhile (all but the
    // last of them fed); the cached end state holds exactly those, and a prompt extending them
    // resumes from it to the same continuation as a fresh computation.
    Harness ac(true);
    ac.model->async_feed = true;
    Outcome c = ac.run(req, 6);
    EXPECT_EQ(c.res.finish, Finish::kCancelled);
    EXPECT_EQ(c.tokens, std::vector<int32_t>(a.tokens.begin(), a.tokens.begin() + 6));
    const int chosen = c.res.completion_tokens;
    ASSERT_GE(chosen, 6);
    ASSERT_LE(chosen, 30);
    std::vector<int32_t> ext = prompt;
    ext.insert(ext.end(), a.tokens.begin(), a.tokens.begin() + (chosen - 1));
    ext.push_back(42);
    ext.push_back(7);
    GenRequest next = greedy_request(ext, 10);
    next.ignore_eos = true;
    Outcome e = ac.run(next);
    EXPECT_EQ(e.res.cached_tokens, int(prompt.size()) + chosen - 1);
    EXPECT_EQ(e.tokens, oracle(ext, 10));
  }
}

// A pool of 4 states for 2 requests in flight and a cache of 8 entries: the cache lets go of its
// least recently used states whenever a request needs the room, never of a running request's, so
// every answer stays exact; the states held never exceed the pool.
TEST(Engine, ThePoolBoundsTheStatesAndTheCacheGivesWay) {
  auto m = std::make_unique<FakeModel>();
  FakeModel* fake = m.get();
  // 1 GiB is kept for the backend's other uses; 5 states of 1,024 tokens (4 bytes each) fit, one
  // of which stays free for a cache hit's copy.
  fake->free_bytes = (size_t(1) << 30) + 5 * 4096;
  fake->batch = 4;
  EngineOptions o;
  o.max_seq = 1024;
  o.prefill_chunk = 7;
  o.prefix_cache_entries = 8;
  o.max_running = 2;
  Engine e(std::move(m), synth_tokenizer(), o);
  EXPECT_EQ(e.max_running(), 2);
  EXPECT_EQ(e.pool_states(), 4u);
  PeakStates peak(e);
  std::vector<std::thread> th;
  std::vector<std::vector<int32_t>> got(6);
  std::vector<std::vector<int32_t>> prompts;
  for (int c = 0; c < 6; ++c) prompts.push_back(prompt_of(20 + c, 40 + c));
  for (int c = 0; c < 6; ++c)
    th.emplace_back([&, c] {
      GenRequest r = greedy_request(prompts[size_t(c)], 12);
      r.ignore_eos = true;
      r.cache_cut = 10;
      e.generate(r, [&](const GenStep& s) {
        if (s.token >= 0) got[size_t(c)].push_back(s.token);
        return true;
      });
    });
  for (auto& t : th) t.join();
  const size_t most = peak.stop();
  for (int c = 0; c < 6; ++c) EXPECT_EQ(got[size_t(c)], oracle(prompts[size_t(c)], 12)) << c;
  EXPECT_LE(most, 4u);
  EXPECT_LE(e.load().states_used, 4u);
  EXPECT_GT(e.cache_stats().evictions, 0u) << "12 states were offered to a cache with room for 2-3";
  // Too little memory for even one state is a startup error naming the limit.
  auto small = std::make_unique<FakeModel>();
  small->free_bytes = size_t(1) << 30;
  EXPECT_THROW(Engine(std::move(small), synth_tokenizer(), o), tansy::Error);
}

// The default cache capacity (kPrefixCacheAuto) is every state the device memory holds but one; the
// cache gives way to requests, so conversations beyond it stay exact and the states held never
// exceed the pool. States in host memory, or of unknown memory, get kPrefixCacheWithoutMemory.
TEST(Engine, TheCacheByDefaultHoldsWhatMemoryAllows) {
  EngineOptions o;
  o.max_seq = 1024;
  o.prefill_chunk = 7;
  o.max_running = 2;
  ASSERT_EQ(o.prefix_cache_entries, tansy::kPrefixCacheAuto);
  {
    auto m = std::make_unique<FakeModel>();
    m->free_bytes = (size_t(1) << 30) + 10 * 4096;  // 10 states: 9 in the pool, 1 for a copy
    m->on_device = true;
    m->batch = 4;
    Engine e(std::move(m), synth_tokenizer(), o);
    EXPECT_EQ(e.pool_states(), 9u);
    EXPECT_EQ(e.cache_stats().capacity, 8u);
    PeakStates peak(e);
    // 12 conversations of two turns, 3 at a time: their first turns fill the cache past what the
    // pool holds beside the running requests; their second turns, the latest conversations first,
    // hit it or not.
    std::vector<std::vector<int32_t>> prompts;
    for (int c = 0; c < 12; ++c) prompts.push_back(prompt_of(20 + c, 70 + c));
    for (int turn = 0; turn < 2; ++turn)
      for (int c0 = 0; c0 < 12; c0 += 3) {
        std::vector<std::vector<int32_t>> p(3);
        std::vector<int> cut(3);
        for (int j = 0; j < 3; ++j) {
          const int c = turn == 0 ? c0 + j : 11 - (c0 + j);
          p[size_t(j)] = prompts[size_t(c)];
          cut[size_t(j)] = int(p[size_t(j)].size()) - 1;
          if (turn == 1) p[size_t(j)].insert(p[size_t(j)].end(), {5, 6, 7, 8});
        }
        std::vector<std::thread> th;
        std::vector<std::vector<int32_t>> got(3);
        for (int j = 0; j < 3; ++j)
          th.emplace_back([&, j] {
            GenRequest r = greedy_request(p[size_t(j)], 5);
            r.ignore_eos = true;
            r.cache_cut = cut[size_t(j)];
            e.generate(r, [&](const GenStep& s) {
              if (s.token >= 0) got[size_t(j)].push_back(s.token);
              return true;
            });
          });
        for (auto& t : th) t.join();
        for (int j = 0; j < 3; ++j) EXPECT_EQ(got[size_t(j)], oracle(p[size_t(j)], 5)) << "turn " << turn;
      }
    EXPECT_LE(peak.stop(), 9u);
    const auto cs = e.cache_stats();
    EXPECT_GT(cs.hits, 0u);
    EXPECT_GT(cs.evictions, 0u) << "12 conversations' states offered to a cache of 8";
    EXPECT_LE(cs.entries, 8u);
  }
  auto unknown = std::make_unique<FakeModel>();  // free_state_memory: nullopt
  unknown->on_device = true;
  Engine e(std::move(unknown), synth_tokenizer(), o);
  EXPECT_EQ(e.cache_stats().capacity, tansy::kPrefixCacheWithoutMemory);
  auto host = std::make_unique<FakeModel>();  // memory known, but the host's
  host->free_bytes = (size_t(1) << 30) + 100 * 4096;
  Engine eh(std::move(host), synth_tokenizer(), o);
  EXPECT_EQ(eh.cache_stats().capacity, tansy::kPrefixCacheWithoutMemory);
}

// A backend's own scratch states (the bf16 plan's state for a cut computed in one pass) come out of
// the pool: the same memory holds one state fewer for requests and the cache, and memory for the
// copy and the scratch alone is a startup error.
TEST(Engine, ThePoolLeavesRoomForTheBackendsScratchStates) {
  EngineOptions o;
  o.max_seq = 1024;
  o.prefix_cache_entries = 8;
  o.max_running = 2;
  auto m = std::make_unique<FakeModel>();
  m->free_bytes = (size_t(1) << 30) + 5 * 4096;
  m->scratch = 1;
  m->batch = 4;
  Engine e(std::move(m), synth_tokenizer(), o);
  EXPECT_EQ(e.pool_states(), 3u);
  auto two = std::make_unique<FakeModel>();
  two->free_bytes = (size_t(1) << 30) + 2 * 4096;
  two->scratch = 1;
  EXPECT_THROW(Engine(std::move(two), synth_tokenizer(), o), tansy::Error);
}

// With the prefix cache on, once the spares exist a request's path makes no state: a cold request
// takes a spare at admission and copies its cut into the other; the next turn's cache hit copies
// into a spare, and its cut into the other. The spares are made at startup and while the engine
// is idle. The answers are the cache-off engine's, token for token, greedy and seeded; the states
// held never exceed the pool.
TEST(Engine, SparesTakeTheCacheCopiesOffTheRequestPath) {
  for (bool seeded : {false, true}) {
    SCOPED_TRACE(seeded ? "seeded" : "greedy");
    Harness hot(true), cold(true, {}, 0);
    Engine& e = *hot.engine;
    PeakStates peak(e);
    // Idle with both spares made: every state but the cache's is a spare.
    auto wait_for_spares = [&] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (e.load().states_used != e.cache_stats().entries + 2 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ASSERT_EQ(e.load().states_used, e.cache_stats().entries + 2);
    };
    // The calls a request made: from `from` to its last forward (the engine makes spares after it).
    auto request_path = [&](size_t from) {
      auto calls = hot.model->calls();
      auto last = std::find(calls.rbegin(), calls.rend(), "forward").base();
      return std::vector<std::string>(calls.begin() + std::ptrdiff_t(from), last);
    };
    auto count = [](const std::vector<std::string>& v, const char* what) {
      return std::count(v.begin(), v.end(), what);
    };
    auto request = [&](std::vector<int32_t> prompt, size_t cut) {
      GenRequest r = greedy_request(std::move(prompt), 8);
      r.ignore_eos = true;
      r.cache_cut = cut;
      if (seeded) r.sampling.temperature = 0.8, r.sampling.seed = 3;
      return r;
    };

    const GenRequest first = request(prompt_of(30, 21), 20);
    wait_for_spares();
    size_t mark = hot.model->calls().size();
    Outcome a = hot.run(first);
    auto path = request_path(mark);
    EXPECT_EQ(count(path, "new") + count(path, "clone"), 0) << "a state made on the cold request's path";
    EXPECT_EQ(count(path, "reset"), 1) << "admission empties a spare";
    EXPECT_EQ(count(path, "copy"), 1) << "the cut is copied into a spare";
    ASSERT_EQ(a.tokens.size(), 8u);

    // The next turn extends the first one's end state (its prompt and all but the last token).
    std::vector<int32_t> ext = first.prompt;
    ext.insert(ext.end(), a.tokens.begin(), a.tokens.end());
    ext.insert(ext.end(), {42, 7});
    const GenRequest second = request(ext, ext.size() - 2);
    wait_for_spares();
    mark = hot.model->calls().size();
    Outcome b = hot.run(second);
    path = request_path(mark);
    EXPECT_EQ(count(path, "new") + count(path, "clone"), 0) << "a state made on the cache hit's path";
    EXPECT_EQ(count(path, "reset"), 0);
    EXPECT_EQ(count(path, "copy"), 2) << "the hit and the cut are copied into spares";
    EXPECT_EQ(b.res.cached_tokens, int(first.prompt.size()) + 7);

    for (const auto& [req, got] : {std::pair{&first, &a}, std::pair{&second, &b}}) {
      Outcome ref = cold.run(*req);
      EXPECT_EQ(got->tokens, ref.tokens);
      EXPECT_EQ(got->text, ref.text);
      EXPECT_EQ(got->res.finish, ref.res.finish);
    }
    if (!seeded) {
      EXPECT_EQ(b.tokens, oracle(ext, 8));
    }
    wait_for_spares();
    EXPECT_LE(peak.stop(), e.pool_states());
  }
}

// What the engine's thread does when things go wrong around it: a caller whose callback throws
// gets the exception and its request is stopped (the engine goes on serving); a state copy that
// fails costs only the cache entry; with memory for a single state the cut is not copied at all;
// and a caller still in its callback at shutdown holds no state past the model.
TEST(Engine, ThrowingCallersFailingCopiesTightPoolsAndShutdown) {
  const auto prompt = prompt_of(30, 8);
  {
    Harness h(true);
    GenRequest r = greedy_request(prompt, 40);
    r.ignore_eos = true;
    int seen = 0;
    EXPECT_THROW(h.engine->generate(r,
                                    [&](const GenStep&) {
                                      if (++seen == 3) throw std::runtime_error("client code failed");
                                      return true;
                                    }),
                 std::runtime_error);
    EXPECT_EQ(h.engine->load().running, 0) << "the request was stopped before generate() returned";
    Outcome o = h.run(greedy_request(prompt, 5));
    EXPECT_EQ(o.tokens, oracle(prompt, 5));
  }
  for (bool can_copy : {true, false}) {  // into a spare, or a clone
    Harness h(true);
    h.model->copies_fail = true;
    h.model->can_copy = can_copy;
    GenRequest r = greedy_request(prompt, 6);
    r.cache_cut = 12;
    Outcome o = h.run(r);
    EXPECT_EQ(o.tokens, oracle(prompt, 6));
    EXPECT_EQ(o.res.finish, Finish::kLength);
    const auto calls = h.model->calls();
    EXPECT_EQ(std::count(calls.begin(), calls.end(), can_copy ? "copy" : "clone"), 1)
        << "the snapshot was tried";
  }
  {
    auto m = std::make_unique<FakeModel>();
    m->free_bytes = (size_t(1) << 30) + 2 * 4096;  // 2 states fit: 1 in the pool, 1 for a copy
    FakeModel* fake = m.get();
    EngineOptions o;
    o.max_seq = 1024;
    o.prefill_chunk = 7;
    o.prefix_cache_entries = 4;  // more than the pool holds
    Engine e(std::move(m), synth_tokenizer(), o);
    EXPECT_EQ(e.pool_states(), 1u);
    for (int k = 0; k < 3; ++k) {
      GenRequest r = greedy_request(prompt_of(25, 60 + k), 4);
      r.cache_cut = 20;
      std::vector<int32_t> got;
      e.generate(r, [&](const GenStep& st) {
        if (st.token >= 0) got.push_back(st.token);
        // The running state, and at most one copy beside it while the request runs.
        EXPECT_LE(fake->live->load(), 1);
        return true;
      });
      EXPECT_EQ(got, oracle(prompt_of(25, 60 + k), 4));
      EXPECT_LE(e.load().states_used, 1u);
    }
  }
  {
    int live_at_end = -1;
    std::thread caller;
    std::atomic<bool> in_callback{false};
    {
      auto m = std::make_unique<FakeModel>();
      m->live_at_destruction = &live_at_end;
      Engine e(std::move(m), synth_tokenizer(), EngineOptions{});
      caller = std::thread([&] {
        GenRequest r = greedy_request(prompt, 50);
        r.ignore_eos = true;
        e.generate(r, [&](const GenStep&) {
          in_callback = true;
          std::this_thread::sleep_for(std::chrono::milliseconds(40));
          return true;
        });
      });
      while (!in_callback) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }  // the engine goes while its caller sleeps in the callback
    caller.join();
    EXPECT_EQ(live_at_end, 0) << "a state outlived its model";
  }
}
