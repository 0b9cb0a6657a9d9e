// Many requests at once (issue 16) on the CPU backend and the bundled demo model: a batched step
// gives every sequence exactly what feeding it alone gives (batch invariance, bit for bit), and
// the engine keeps each request's tokens, text and logprobs whatever runs beside it; the bounded
// number in flight, waiting, cancelling and timing out while waiting.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "engine/engine.h"
#include "model/model.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace {

using tansy::Engine;
using tansy::EngineOptions;
using tansy::FeedEntry;
using tansy::Finish;
using tansy::GenRequest;
using tansy::GenResult;
using tansy::GenStep;
using tansy::Model;
using tansy::SamplerSpec;
using tansy::SequenceState;

std::filesystem::path demo_dir() { return tansy::test::source_dir() / "models" / "tansy-demo"; }

std::unique_ptr<Model> open_demo() {
  tansy::ModelOptions mo;
  mo.backend = "cpu";
  mo.threads = 2;
  return tansy::open_model(demo_dir(), mo);
}

std::vector<int32_t> ids_of(int n, int salt, int vocab) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i)
    v.push_back(int32_t((uint64_t(i + 1) * 2654435761u + uint64_t(salt) * 40503u) % uint64_t(vocab)));
  return v;
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One step feeding four sequences at once, two of them decoding a token and two feeding prompt
// pieces (one ending its prompt, one not), against each fed alone: the batch's choices and
// logprobs, and every state afterwards (its next logits, computed alone), are identical.
TEST(Batch, CpuFeedBatchEqualsFeedingAlone) {
  if (!std::filesystem::exists(demo_dir() / "config.json")) GTEST_SKIP() << "no demo model";
  auto m = open_demo();
  ASSERT_GT(m->max_batch(), 1);
  const int V = m->config().vocab_size;
  const std::vector<std::vector<int32_t>> history = {ids_of(9, 1, V), ids_of(30, 2, V), ids_of(5, 3, V), {}};
  const std::vector<std::vector<int32_t>> piece = {{17}, {4000}, ids_of(12, 4, V), ids_of(7, 5, V)};
  const std::vector<bool> chooses = {true, true, true, false};
  const size_t n = history.size();
  auto prepare = [&](std::vector<std::unique_ptr<SequenceState>>& st) {
    std::vector<float> scratch(static_cast<size_t>(V));
    for (size_t i = 0; i < n; ++i) {
      st.push_back(m->new_state(128));
      if (!history[i].empty()) m->forward(*st[i], history[i], scratch, false);
    }
  };
  auto spec = [&](size_t i) {
    tansy::SamplingParams p;
    p.temperature = 0.9;
    p.seed = 100 + i;
    return SamplerSpec{p, history[i], V, 5};
  };
  // Alone: each sequence in a step of its own.
  std::vector<std::unique_ptr<SequenceState>> alone, batched;
  prepare(alone);
  prepare(batched);
  std::vector<tansy::SampleChoice> want(n), got(n);
  for (size_t i = 0; i < n; ++i) {
    auto s = m->make_host_sampler(spec(i));
    FeedEntry e{alone[i].get(), piece[i], chooses[i] ? s.get() : nullptr};
    m->feed_batch(std::span<const FeedEntry>(&e, 1));
    if (chooses[i]) want[i] = s->next(nullptr, -1);
  }
  // Together.
  std::vector<std::unique_ptr<tansy::TokenSampler>> samplers;
  std::vector<FeedEntry> entries;
  for (size_t i = 0; i < n; ++i) {
    samplers.push_back(m->make_host_sampler(spec(i)));
    entries.push_back({batched[i].get(), piece[i], chooses[i] ? samplers[i].get() : nullptr});
  }
  m->feed_batch(entries);
  for (size_t i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    if (chooses[i]) {
      got[i] = samplers[i]->next(nullptr, -1);
      EXPECT_EQ(got[i].token, want[i].token);
      ASSERT_TRUE(got[i].logprobs && want[i].logprobs);
      EXPECT_EQ(std::memcmp(&got[i].logprobs->logprob, &want[i].logprobs->logprob, sizeof(float)), 0);
      ASSERT_EQ(got[i].logprobs->top.size(), want[i].logprobs->top.size());
      for (size_t k = 0; k < got[i].logprobs->top.size(); ++k) {
        EXPECT_EQ(got[i].logprobs->top[k].id, want[i].logprobs->top[k].id);
        EXPECT_EQ(
            std::memcmp(&got[i].logprobs->top[k].logprob, &want[i].logprobs->top[k].logprob, sizeof(float)),
            0);
      }
    }
    EXPECT_EQ(batched[i]->n_tokens(), alone[i]->n_tokens());
    // The states: the same logits for the next two tokens, fed alone.
    std::vector<float> la(static_cast<size_t>(V)), lb(static_cast<size_t>(V));
    const std::vector<int32_t> more = {int32_t(7 + i), int32_t(900 + i)};
    m->forward(*alone[i], more, la, false);
    m->forward(*batched[i], more, lb, false);
    EXPECT_TRUE(same_bits(la, lb)) << "sequence " << i << "'s state differs after the batched step";
  }
  // A state fed twice in one step is refused.
  FeedEntry twice[2] = {{batched[0].get(), piece[0], nullptr}, {batched[0].get(), piece[0], nullptr}};
  EXPECT_THROW(m->feed_batch(twice), tansy::Error);
}

// A cut inside a piece (FeedEntry::cut): on_cut sees, once, a state holding exactly the ids
// before the cut, and the piece ends where feeding it whole ends, alone and in a batch; a cut
// outside the piece, or one nobody takes, is refused.
TEST(Batch, ACutInsideAPieceShowsTheStateThereOnce) {
  if (!std::filesystem::exists(demo_dir() / "config.json")) GTEST_SKIP() << "no demo model";
  auto m = open_demo();
  const int V = m->config().vocab_size;
  const std::vector<int32_t> history = ids_of(9, 11, V), piece = ids_of(12, 12, V), other = ids_of(6, 13, V);
  const size_t cut = 5;
  std::vector<float> scratch(static_cast<size_t>(V));
  auto fed = [&](std::span<const int32_t> a, std::span<const int32_t> b) {
    auto st = m->new_state(128);
    m->forward(*st, a, scratch, false);
    if (!b.empty()) m->forward(*st, b, scratch, false);
    return st;
  };
  auto next_logits = [&](SequenceState& st) {
    std::vector<float> l(static_cast<size_t>(V));
    const std::vector<int32_t> more = {31, 4001};
    m->forward(st, more, l, false);
    return l;
  };
  const auto at_cut = fed(history, std::span(piece).first(cut));
  const auto whole = fed(history, piece);
  const std::vector<float> want_cut = next_logits(*at_cut), want_end = next_logits(*whole);
  for (bool together : {false, true}) {
    SCOPED_TRACE(together ? "in a batch" : "alone");
    auto st = fed(history, {});
    auto beside = fed(other, {});
    std::unique_ptr<SequenceState> shown;
    int calls = 0;
    FeedEntry e{st.get(), piece, nullptr};
    e.cut = cut;
    e.on_cut = [&](const SequenceState& at) {
      ++calls;
      EXPECT_EQ(at.n_tokens(), int(history.size() + cut));
      shown = m->clone_state(at);
    };
    std::vector<FeedEntry> entries = {e};
    if (together) entries.push_back({beside.get(), other, nullptr});
    m->feed_batch(entries);
    EXPECT_EQ(calls, 1);
    ASSERT_TRUE(shown);
    EXPECT_EQ(st->n_tokens(), int(history.size() + piece.size()));
    EXPECT_TRUE(same_bits(next_logits(*shown), want_cut)) << "the state shown is not the one at the cut";
    EXPECT_TRUE(same_bits(next_logits(*st), want_end)) << "the piece did not end where feeding it whole ends";
  }
  auto st = fed(history, {});
  FeedEntry bad{st.get(), piece, nullptr};
  bad.cut = piece.size();
  bad.on_cut = [](const SequenceState&) {};
  EXPECT_THROW(m->feed_batch(std::span<const FeedEntry>(&bad, 1)), tansy::Error);
  bad.cut = cut;
  bad.on_cut = nullptr;
  EXPECT_THROW(m->feed_batch(std::span<const FeedEntry>(&bad, 1)), tansy::Error);
  EXPECT_EQ(st->n_tokens(), int(history.size())) << "a refused entry was fed";
}

struct Out {
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<float> logprobs;
  GenResult res;
};

Out run_one(Engine& e, const GenRequest& req) {
  Out o;
  o.res = e.generate(req, [&](const GenStep& s) {
    if (s.token >= 0) o.tokens.push_back(s.token);
    if (s.logprobs) o.logprobs.push_back(s.logprobs->logprob);
    o.text += s.text;
    return true;
  });
  return o;
}

// Requests of every kind: greedy, Qwen's sampled settings, temperature 1 with logprobs,
// penalties, a stop string, different prompt and answer lengths.
std::vector<GenRequest> mixed_requests(const Engine& e, int count) {
  std::vector<GenRequest> reqs;
  const int V = e.config().vocab_size;
  for (int i = 0; i < count; ++i) {
    GenRequest r;
    r.prompt = ids_of(6 + 5 * (i % 7), 10 + i, std::min(V, e.tokenizer().vocab_size()));
    r.max_tokens = 12 + 3 * (i % 5);
    r.ignore_eos = i % 3 != 0;
    r.sampling.seed = 1000 + uint64_t(i);
    switch (i % 5) {
      case 0:
        r.sampling.temperature = 0;
        break;
      case 1:
        r.sampling.temperature = 0.6, r.sampling.top_p = 0.95, r.sampling.top_k = 20;
        break;
      case 2:
        r.sampling.temperature = 1.0, r.logprobs = 3;
        break;
      case 3:
        r.sampling.temperature = 0.7, r.sampling.presence_penalty = 1.5, r.sampling.repetition_penalty = 1.1;
        break;
      case 4:
        r.sampling.temperature = 0;
        r.stop = {"e"};
        break;
    }
    reqs.push_back(std::move(r));
  }
  return reqs;
}

void expect_same(const Out& a, const Out& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.text, b.text);
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
  if (!a.logprobs.empty()) {
    EXPECT_EQ(std::memcmp(a.logprobs.data(), b.logprobs.data(), a.logprobs.size() * sizeof(float)), 0);
  }
  EXPECT_EQ(a.res.finish, b.res.finish);
  EXPECT_EQ(a.res.completion_tokens, b.res.completion_tokens);
  EXPECT_EQ(a.res.stop_string, b.res.stop_string);
}

// The same requests alone (one after another) and all at once, with prompt pieces small enough
// that prefills share steps with other sequences' decoding: identical outputs, and the steps did
// carry several sequences.
TEST(Batch, EngineOutputsDoNotDependOnWhatElseRuns) {
  if (!std::filesystem::exists(demo_dir() / "config.json")) GTEST_SKIP() << "no demo model";
  EngineOptions eo;
  eo.max_seq = 256;
  eo.prefill_chunk = 8;
  eo.max_running = 6;
  eo.prefix_cache_entries = 0;
  Engine e(open_demo(), tansy::Tokenizer::load(demo_dir()), eo);
  ASSERT_EQ(e.max_running(), 6);
  const auto reqs = mixed_requests(e, 10);
  std::vector<Out> alone;
  for (auto& r : reqs) alone.push_back(run_one(e, r));
  EXPECT_EQ(e.load().max_step_sequences, 1);
  std::vector<Out> together(reqs.size());
  std::vector<std::thread> th;
  for (size_t i = 0; i < reqs.size(); ++i) th.emplace_back([&, i] { together[i] = run_one(e, reqs[i]); });
  for (auto& t : th) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_FALSE(alone[i].tokens.empty());
    expect_same(together[i], alone[i]);
  }
  const Engine::Load l = e.load();
  EXPECT_GT(l.max_step_sequences, 1) << "the requests never shared a step";
  EXPECT_LE(l.max_step_sequences, 6);
  EXPECT_EQ(l.running, 0);
  EXPECT_EQ(l.waiting, 0);
}

// The demo model, recording the length of every piece of prompt the engine feeds that does not
// end its prompt (no choice follows it).
class PieceRecorder final : public Model {
 public:
  explicit PieceRecorder(std::unique_ptr<Model> m) : m_(std::move(m)) {}
  const tansy::ModelConfig& config() const override { return m_->config(); }
  std::string backend_name() const override { return m_->backend_name(); }
  std::unique_ptr<SequenceState> new_state(int max_tokens) override { return m_->new_state(max_tokens); }
  std::unique_ptr<SequenceState> clone_state(const SequenceState& s) override { return m_->clone_state(s); }
  void forward(SequenceState& st, std::span<const int32_t> ids, std::span<float> logits, bool all) override {
    m_->forward(st, ids, logits, all);
  }
  size_t state_bytes(int max_tokens) const override { return m_->state_bytes(max_tokens); }
  int max_batch() const override { return m_->max_batch(); }
  std::unique_ptr<tansy::TokenSampler> make_sampler(const SamplerSpec& spec) override {
    return m_->make_sampler(spec);
  }
  std::unique_ptr<tansy::TokenSampler> make_greedy_sampler(int limit) override {
    return m_->make_greedy_sampler(limit);
  }
  void feed_batch(std::span<const FeedEntry> entries) override {
    int prompts = 0;
    for (const FeedEntry& e : entries) {
      if (e.ids.size() > 1) ++prompts;
      if (e.ids.size() > 1 && !e.sampler) inner_pieces.push_back(int(e.ids.size()));
      if (e.ids.size() > 1) pieces.push_back({int(e.ids.size()), int(e.cut)});
    }
    if (prompts > 1) ++shared_prompt_steps;
    m_->feed_batch(entries);
  }
  std::vector<int> inner_pieces;            // engine thread only; read after the requests are done
  std::vector<std::pair<int, int>> pieces;  // every piece of prompt: (length, FeedEntry::cut)
  int shared_prompt_steps = 0;              // steps that carried pieces of several prompts

 private:
  std::unique_ptr<Model> m_;
};

// A piece's length depends on its own prompt only (--prefill-chunk), never on the budget other
// prompts of the same step left (CUDA's prefill rounds differently for other piece lengths):
// every piece that does not end its prompt is a whole chunk, while prompts share steps.
TEST(Batch, PromptPiecesAreWholeChunksWhateverElseIsInTheStep) {
  if (!std::filesystem::exists(demo_dir() / "config.json")) GTEST_SKIP() << "no demo model";
  EngineOptions eo;
  eo.max_seq = 256;
  eo.prefill_chunk = 8;
  eo.max_running = 6;
  eo.prefix_cache_entries = 0;
  auto rec = std::make_unique<PieceRecorder>(open_demo());
  PieceRecorder* r = rec.get();
  Engine e(std::move(rec), tansy::Tokenizer::load(demo_dir()), eo);
  const int V = std::min(e.config().vocab_size, e.tokenizer().vocab_size());
  std::vector<GenRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    GenRequest q;
    q.prompt = ids_of(5 + 7 * i, 300 + i, V);  // 5, 12, ... 40: remainders of every size
    q.max_tokens = 4;
    q.ignore_eos = true;
    q.sampling.temperature = 0;
    reqs.push_back(std::move(q));
  }
  std::vector<std::thread> th;
  for (auto& q : reqs) th.emplace_back([&e, &q] { run_one(e, q); });
  for (auto& t : th) t.join();
  ASSERT_FALSE(r->inner_pieces.empty());
  EXPECT_GT(r->shared_prompt_steps, 0) << "no step carried two prompts: the test proves nothing";
  for (int n : r->inner_pieces) EXPECT_EQ(n, eo.prefill_chunk) << "a piece cut short by the step's budget";
}

// A prompt whose cache cut lies inside a piece is fed as one piece with the cut marked (the
// backend shows the state there), not as two pieces in two steps: a cold request with the cache
// on feeds what it feeds with the cache off. The next turn resumes from the cut with the answer
// computed cold.
TEST(Batch, ACutInsideAPieceIsFedWithItNotSplit) {
  if (!std::filesystem::exists(demo_dir() / "config.json")) GTEST_SKIP() << "no demo model";
  EngineOptions eo;
  eo.max_seq = 256;
  eo.prefill_chunk = 32;
  eo.prefix_cache_entries = 4;
  auto rec = std::make_unique<PieceRecorder>(open_demo());
  PieceRecorder* r = rec.get();
  Engine e(std::move(rec), tansy::Tokenizer::load(demo_dir()), eo);
  EngineOptions cold_opt = eo;
  cold_opt.prefix_cache_entries = 0;
  Engine cold(open_demo(), tansy::Tokenizer::load(demo_dir()), cold_opt);
  const int V = std::min(e.config().vocab_size, e.tokenizer().vocab_size());
  GenRequest q;
  q.prompt = ids_of(40, 21, V);
  q.cache_cut = 37;  // inside the second piece, [32, 40)
  q.max_tokens = 4;
  q.ignore_eos = true;
  q.sampling.temperature = 0;
  Out first = run_one(e, q);
  expect_same(first, run_one(cold, q));
  EXPECT_EQ(r->pieces, (std::vector<std::pair<int, int>>{{32, 0}, {8, 5}}));
  GenRequest next = q;
  next.prompt.resize(37);
  const auto turn = ids_of(9, 22, V);
  next.prompt.insert(next.prompt.end(), turn.begin(), turn.end());
  next.cache_cut = 0;
  Out hot = run_one(e, next);
  EXPECT_EQ(hot.res.cached_tokens, 37);
  expect_same(hot, run_one(cold, next));
}

// At most max_running in flight; the others wait their turn and all finish; one that leaves or
// runs out of time while waiting ends without a place (admitted false).
TEST(Batch, BoundedInFlightWaitingCancelAndTimeout) {
  if (!std::filesystem::exists(demo_dir() / "config.json")) GTEST_SKIP() << "no demo model";
  EngineOptions eo;
  eo.max_seq = 256;
  eo.max_running = 2;
  eo.prefix_cache_entries = 2;
  Engine e(open_demo(), tansy::Tokenizer::load(demo_dir()), eo);
  EXPECT_LE(e.pool_states(), size_t(2 + 2 + 1));
  auto reqs = mixed_requests(e, 5);
  for (auto& r : reqs) r.ignore_eos = true, r.stop.clear(), r.max_tokens = 40;
  std::atomic<bool> done{false};
  std::atomic<int> most_running{0}, most_used{0};
  std::thread watcher([&] {
    while (!done) {
      const Engine::Load l = e.load();
      most_running = std::max(most_running.load(), l.running);
      most_used = std::max(most_used.load(), int(l.states_used));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::vector<Out> outs(reqs.size());
  std::vector<std::thread> th;
  for (size_t i = 0; i < reqs.size(); ++i) th.emplace_back([&, i] { outs[i] = run_one(e, reqs[i]); });
  // Two more arrive while the line is long: one leaves, one's time runs out.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  GenRequest leaving = reqs[0], late = reqs[1];
  std::atomic<bool> gone{false};
  leaving.cancelled = [&] { return gone.load(); };
  late.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
  GenResult rl, rt;
  std::thread tl([&] { rl = run_one(e, leaving).res; });
  std::thread tt([&] { rt = run_one(e, late).res; });
  gone = true;
  tl.join();
  tt.join();
  for (auto& t : th) t.join();
  done = true;
  watcher.join();
  for (size_t i = 0; i < outs.size(); ++i) {
    EXPECT_TRUE(outs[i].res.admitted);
    EXPECT_EQ(outs[i].res.completion_tokens, 40) << i;
  }
  EXPECT_EQ(most_running.load(), 2);
  EXPECT_LE(size_t(most_used.load()), e.pool_states());
  EXPECT_EQ(rl.finish, Finish::kCancelled);
  EXPECT_EQ(rt.finish, Finish::kTimeout);
  EXPECT_FALSE(rt.admitted) << "the deadline passed while it waited";
  EXPECT_EQ(rt.completion_tokens, 0);
}

// Conversations that begin with the same long prefix (a system prompt): the second keeps a
// shared state at the end of the common part, from which the later ones resume, with the same
// answers as computed cold; the conversations' own cut states do not supersede it.
TEST(Batch, ASharedPrefixIsPrefilledOnceForLaterConversations) {
  if (!std::filesystem::exists(demo_dir() / "config.json")) GTEST_SKIP() << "no demo model";
  EngineOptions eo;
  eo.max_seq = 256;
  eo.prefix_cache_entries = 8;
  eo.shared_prefix_min = 16;
  Engine e(open_demo(), tansy::Tokenizer::load(demo_dir()), eo);
  EngineOptions cold_opt = eo;
  cold_opt.prefix_cache_entries = 0;
  Engine cold(open_demo(), tansy::Tokenizer::load(demo_dir()), cold_opt);
  const int V = std::min(e.config().vocab_size, e.tokenizer().vocab_size());
  const std::vector<int32_t> system = ids_of(40, 77, V);
  std::vector<int> cached;
  for (int c = 0; c < 4; ++c) {
    SCOPED_TRACE(c);
    GenRequest r;
    r.prompt = system;
    const auto turn = ids_of(6 + c, 500 + c, V);
    r.prompt.insert(r.prompt.end(), turn.begin(), turn.end());
    r.cache_cut = r.prompt.size() - 1;  // as the server does for completions
    r.max_tokens = 6;
    r.ignore_eos = true;
    r.sampling.temperature = 0.7;
    r.sampling.seed = 9 + uint64_t(c);
    r.logprobs = 1;
    Out hot = run_one(e, r), ref = run_one(cold, r);
    expect_same(hot, ref);
    cached.push_back(hot.res.cached_tokens);
  }
  // The first has nothing to share with; the second shares the system prompt with the first's
  // cut (and stores it); the later ones resume from it.
  EXPECT_EQ(cached, (std::vector<int>{0, 0, 40, 40}));
}

}  // namespace
