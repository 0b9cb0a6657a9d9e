// Sampler, stop-string matcher, prefix cache and scheduler: the engine pieces that need no model.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <thread>

#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/stop.h"

namespace tansy {
namespace {

std::vector<float> make_logits(std::initializer_list<float> v) { return std::vector<float>(v); }

// One draw, then the sampler moves to the next position (each position has its own draw).
int32_t draw(Sampler& s, const std::vector<float>& logits) {
  std::vector<float> l = logits;
  const int32_t t = s.sample(l);
  s.accept(t);
  return t;
}

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p, {});
  EXPECT_EQ(draw(s, make_logits({0.1f, 3.0f, 3.0f, -1.0f})), 1);
}

TEST(Sampler, SeedMakesSamplingReproducible) {
  SamplingParams p;
  p.seed = 42;
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(std::sin(double(i)));
  Sampler a(p, {}), b(p, {});
  std::vector<int32_t> xa, xb;
  for (int i = 0; i < 50; ++i) xa.push_back(draw(a, logits)), xb.push_back(draw(b, logits));
  EXPECT_EQ(xa, xb);
  p.seed = 43;
  Sampler c(p, {});
  std::vector<int32_t> xc;
  for (int i = 0; i < 50; ++i) xc.push_back(draw(c, logits));
  EXPECT_NE(xa, xc);
}

// The draw depends on (seed, position) only: a sampler that reached a position through a longer
// prompt or through accepted tokens draws the same there; other positions draw differently.
TEST(Sampler, DrawIsKeyedBySeedAndPosition) {
  SamplingParams p;
  p.seed = 5;
  std::vector<float> logits(5000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(std::cos(double(i) * 0.37));
  std::vector<int32_t> long_prompt(10, 1), short_prompt(7, 1);
  Sampler a(p, long_prompt), b(p, short_prompt);
  for (int i = 0; i < 3; ++i) b.accept(2);
  EXPECT_EQ(a.position(), b.position());
  std::vector<int32_t> xa, xb;
  for (int i = 0; i < 40; ++i) xa.push_back(draw(a, logits)), xb.push_back(draw(b, logits));
  EXPECT_EQ(xa, xb);
  std::set<int32_t> distinct(xa.begin(), xa.end());
  EXPECT_GT(distinct.size(), 20u) << "successive positions should draw independently";
}

TEST(Sampler, FrequenciesFollowSoftmaxAtTemperature) {
  SamplingParams p;
  p.seed = 7;
  p.temperature = 0.5;
  const auto logits = make_logits({0.0f, std::log(2.0f) * 0.5f, -100.0f});  // at T=0.5: weights 1 : 2 : 0
  Sampler s(p, {});
  std::map<int32_t, int> n;
  const int N = 30000;
  for (int i = 0; i < N; ++i) n[draw(s, logits)]++;
  EXPECT_NEAR(n[0] / double(N), 1.0 / 3, 0.015);
  EXPECT_NEAR(n[1] / double(N), 2.0 / 3, 0.015);
  EXPECT_EQ(n[2], 0);
}

TEST(Sampler, TopKTopPMinPRestrictTheCandidates) {
  const auto logits = make_logits({3.0f, 2.9f, 2.8f, 0.0f, -1.0f});
  auto seen = [&](SamplingParams p) {
    p.seed = 1;
    Sampler s(p, {});
    std::set<int32_t> ids;
    for (int i = 0; i < 3000; ++i) ids.insert(draw(s, logits));
    return ids;
  };
  SamplingParams k;
  k.top_k = 2;
  EXPECT_EQ(seen(k), (std::set<int32_t>{0, 1}));
  SamplingParams tp;
  tp.top_p = 0.5;  // p = [.38 .34 .31 .02 .01]: the nucleus needs tokens 0 and 1
  EXPECT_EQ(seen(tp), (std::set<int32_t>{0, 1}));
  SamplingParams mp;
  mp.min_p = 0.5;  // keeps tokens with p >= 0.5 * p(0): 0, 1, 2
  EXPECT_EQ(seen(mp), (std::set<int32_t>{0, 1, 2}));
  SamplingParams all;
  EXPECT_EQ(seen(all).size(), 5u);
}

TEST(Sampler, PenaltiesAndLogitBias) {
  SamplingParams p;
  p.temperature = 0;
  p.frequency_penalty = 1.0;
  Sampler s(p, {});
  const auto logits = make_logits({2.0f, 1.5f, 0.0f});
  EXPECT_EQ(draw(s, logits), 0);
  EXPECT_EQ(draw(s, logits), 1);  // 2.0 - 1.0 < 1.5
  SamplingParams r;
  r.temperature = 0;
  r.repetition_penalty = 2.0;  // prompt tokens count: 2.0 / 2 = 1.0 < 1.5
  std::vector<int32_t> prompt = {0};
  Sampler rs(r, prompt);
  EXPECT_EQ(draw(rs, logits), 1);
  SamplingParams b;
  b.temperature = 0;
  b.logit_bias[2] = 100;
  Sampler bs(b, {});
  EXPECT_EQ(draw(bs, logits), 2);
}

TEST(Sampler, LogprobsAreOfTheRawDistribution) {
  const auto logits = make_logits({1.0f, 2.0f, 3.0f});
  LogprobInfo lp = logprobs_of(logits, 0, 2);
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(lp.logprob, 1.0 - lse, 1e-6);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].id, 2);
  EXPECT_EQ(lp.top[1].id, 1);
  EXPECT_NEAR(lp.top[0].logprob, 3.0 - lse, 1e-6);
}

// Feeds `text` to a matcher in pieces of `step` bytes.
std::pair<std::string, bool> run_stop(std::vector<std::string> stops, const std::string& text, size_t step) {
  StopMatcher m(std::move(stops));
  std::string out;
  for (size_t i = 0; i < text.size() && !m.stopped(); i += step) out += m.push(text.substr(i, step));
  if (!m.stopped()) out += m.flush();
  return {out, m.stopped()};
}

TEST(StopMatcher, MatchesAcrossPiecesAndNeverEmitsTheStop) {
  for (size_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE(step);
    EXPECT_EQ(run_stop({"END"}, "abcENDdef", step), std::pair(std::string("abc"), true));
    EXPECT_EQ(run_stop({"END"}, "abcENdef", step), std::pair(std::string("abcENdef"), false));
    EXPECT_EQ(run_stop({"xyz", "cE"}, "abcENDdef", step), std::pair(std::string("ab"), true));
    EXPECT_EQ(run_stop({"aab"}, "aaab", step), std::pair(std::string("a"), true));
  }
}

TEST(StopMatcher, HoldsBackOnlyPossibleStarts) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.push("hello S"), "hello ");
  EXPECT_EQ(m.push("T"), "");
  EXPECT_EQ(m.push("x"), "STx");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.push("ST"), "");
  EXPECT_EQ(m.push("OP and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "STOP");
}

// A model whose state is the list of tokens it has seen: enough to check what the cache restores.
struct ListState : SequenceState {
  std::vector<int32_t> toks;
  int n_tokens() const override { return int(toks.size()); }
};
struct ListModel : Model {
  ModelConfig cfg;
  int clones = 0, copies = 0;
  bool can_copy = false;
  const ModelConfig& config() const override { return cfg; }
  std::string backend_name() const override { return "list"; }
  size_t state_bytes(int) const override { return 1; }
  std::unique_ptr<SequenceState> new_state(int) override { return std::make_unique<ListState>(); }
  std::unique_ptr<SequenceState> clone_state(const SequenceState& s) override {
    ++clones;
    return std::make_unique<ListState>(static_cast<const ListState&>(s));
  }
  bool copy_state(const SequenceState& src, SequenceState& dst) override {
    if (!can_copy) return false;
    ++copies;
    static_cast<ListState&>(dst).toks = static_cast<const ListState&>(src).toks;
    return true;
  }
  void forward(SequenceState& s, std::span<const int32_t> ids, std::span<float>, bool) override {
    auto& l = static_cast<ListState&>(s).toks;
    l.insert(l.end(), ids.begin(), ids.end());
  }
};

std::unique_ptr<SequenceState> state_of(std::vector<int32_t> t) {
  auto s = std::make_unique<ListState>();
  s->toks = std::move(t);
  return s;
}

TEST(PrefixCache, LongestPrefixWithinLimitAndLru) {
  ListModel m;
  PrefixCache c(2);
  c.insert({1, 2, 3, 4}, state_of({1, 2, 3, 4}));
  c.insert({1, 2}, state_of({1, 2}));  // shorter, so it does not replace the longer one
  std::vector<int32_t> q = {1, 2, 3, 4, 5};
  auto h = c.lookup(m, q, q.size() - 1);
  ASSERT_TRUE(h.state);
  EXPECT_EQ(h.n_tokens, 4);
  EXPECT_EQ(static_cast<ListState&>(*h.state).toks, (std::vector<int32_t>{1, 2, 3, 4}));
  // The full prompt may not be restored (its last token must be fed for logits).
  std::vector<int32_t> exact = {1, 2, 3, 4};
  EXPECT_EQ(c.lookup(m, exact, exact.size() - 1).n_tokens, 2);
  // A diverging prompt only matches the shorter entry; a foreign one misses.
  std::vector<int32_t> other = {1, 2, 9, 9};
  EXPECT_EQ(c.lookup(m, other, 3).n_tokens, 2);
  std::vector<int32_t> none = {7, 8};
  EXPECT_FALSE(c.lookup(m, none, 1).state);
  EXPECT_EQ(c.hits(), 3u);
  EXPECT_EQ(c.misses(), 1u);
  // {1,2} was used last, so inserting a third entry evicts {1,2,3,4}.
  EXPECT_EQ(c.evictions(), 0u);
  c.insert({5, 6}, state_of({5, 6}));
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(c.evictions(), 1u);
  EXPECT_EQ(c.lookup(m, q, q.size() - 1).n_tokens, 2);
  // A restored copy is private: changing it leaves the entry intact.
  auto h2 = c.lookup(m, q, 4);
  static_cast<ListState&>(*h2.state).toks.push_back(99);
  EXPECT_EQ(static_cast<ListState&>(*c.lookup(m, q, 4).state).toks, (std::vector<int32_t>{1, 2}));
}

// A hit copies into the state the caller gives when the backend can (the hit then owns that
// state); a miss, or a backend that cannot copy (a clone then), leaves the caller's state alone.
TEST(PrefixCache, AHitCopiesIntoTheStateItIsGiven) {
  ListModel m;
  m.can_copy = true;
  PrefixCache c(2);
  c.insert({1, 2, 3}, state_of({1, 2, 3}));
  std::vector<int32_t> q = {1, 2, 3, 4};
  std::unique_ptr<SequenceState> spare = state_of({9, 9, 9, 9, 9});
  const SequenceState* given = spare.get();
  auto h = c.lookup(m, q, 3, &spare);
  EXPECT_EQ(h.state.get(), given);
  EXPECT_FALSE(spare);
  EXPECT_EQ(h.n_tokens, 3);
  EXPECT_EQ(static_cast<ListState&>(*h.state).toks, (std::vector<int32_t>{1, 2, 3}));
  spare = state_of({9});
  given = spare.get();
  std::vector<int32_t> none = {7, 8};
  EXPECT_FALSE(c.lookup(m, none, 1, &spare).state);
  EXPECT_EQ(spare.get(), given);
  m.can_copy = false;
  auto h2 = c.lookup(m, q, 3, &spare);
  EXPECT_EQ(spare.get(), given);
  ASSERT_TRUE(h2.state);
  EXPECT_EQ(static_cast<ListState&>(*h2.state).toks, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(m.copies, 1);
  EXPECT_EQ(m.clones, 1);
  EXPECT_EQ(c.hits(), 2u);
  EXPECT_EQ(c.misses(), 1u);
}

TEST(PrefixCache, ColdEntriesAreEvictedFirst) {
  ListModel m;
  PrefixCache c(2);
  c.insert({1}, state_of({1}));
  c.insert({1, 2, 3}, state_of({1, 2, 3}), /*cold=*/true);  // room left: kept
  std::vector<int32_t> q = {1, 2, 3, 4};
  EXPECT_EQ(c.lookup(m, q, 3).n_tokens, 3);                 // a hit makes it hot
  c.insert({5}, state_of({5}));                             // evicts {1}, the least recently used
  c.insert({5, 6, 7}, state_of({5, 6, 7}), /*cold=*/true);  // full: the cold entry itself goes
  EXPECT_EQ(c.size(), 2u);
  std::vector<int32_t> q2 = {5, 6, 7, 8};
  EXPECT_EQ(c.lookup(m, q2, 3).n_tokens, 1);
  EXPECT_EQ(c.lookup(m, q, 3).n_tokens, 3);
}

TEST(PrefixCache, AHotEntryReplacesThePrefixesItExtends) {
  ListModel m;
  PrefixCache c(4);
  c.insert({1, 2}, state_of({1, 2}));
  c.insert({1, 2, 3, 4}, state_of({1, 2, 3, 4}), /*cold=*/true);  // cold: the hot prefix stays
  EXPECT_EQ(c.size(), 2u);
  c.insert({1, 2, 3}, state_of({1, 2, 3}));  // hot: {1,2} goes, {1,2,3,4} is not its prefix
  EXPECT_EQ(c.size(), 2u);
  std::vector<int32_t> q = {1, 2, 9};
  EXPECT_FALSE(c.lookup(m, q, 2).state);
}

TEST(PrefixCache, SharedEntriesOutliveTheConversationsThatExtendThem) {
  ListModel m;
  PrefixCache c(4);
  c.insert({1, 2, 3, 9}, state_of({1, 2, 3, 9}));
  c.insert({1, 2, 3, 7, 7, 7}, state_of({1, 2, 3, 7, 7, 7}), /*cold=*/true);
  // The longest common prefix counts hot entries only, prefixes of the query or not.
  std::vector<int32_t> q = {1, 2, 3, 7, 7, 8};
  EXPECT_EQ(c.longest_common_prefix(q), 3u);
  std::vector<int32_t> q2 = {1, 2, 3, 9, 5};
  EXPECT_EQ(c.longest_common_prefix(q2), 4u);
  std::vector<int32_t> q3 = {4};
  EXPECT_EQ(c.longest_common_prefix(q3), 0u);
  c.insert({1, 2, 3}, state_of({1, 2, 3}), /*cold=*/false, /*shared=*/true);
  // A conversation's hot entry extending the shared prefix leaves it in place (a plain one goes).
  c.insert({1, 2, 3, 9, 5, 5}, state_of({1, 2, 3, 9, 5, 5}));
  std::vector<int32_t> other = {1, 2, 3, 4, 4};
  EXPECT_EQ(c.lookup(m, other, 4).n_tokens, 3);
  std::vector<int32_t> q4 = {1, 2, 3, 9, 6};
  EXPECT_EQ(c.lookup(m, q4, 4).n_tokens, 3) << "{1,2,3,9} was superseded by its extension";
  // Its own key replaces it.
  c.insert({1, 2, 3}, state_of({1, 2, 3}));
  EXPECT_EQ(c.lookup(m, other, 4).n_tokens, 3);
}

TEST(PrefixCache, ZeroCapacityStoresNothing) {
  ListModel m;
  PrefixCache c(0);
  c.insert({1, 2}, state_of({1, 2}));
  std::vector<int32_t> q = {1, 2, 3};
  EXPECT_FALSE(c.lookup(m, q, 2).state);
}

TEST(Scheduler, BoundsTheRequestsInside) {
  Scheduler s(2);
  auto a = s.enqueue(), b = s.enqueue();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(s.inside(), 2);
  EXPECT_FALSE(s.enqueue());  // full
  a.reset();                  // a finished or left: its place is free
  auto c = s.enqueue();
  ASSERT_TRUE(c);
  EXPECT_FALSE(s.enqueue());
  b.reset();
  c.reset();
  EXPECT_EQ(s.inside(), 0);
}

}  // namespace
}  // namespace tansy
