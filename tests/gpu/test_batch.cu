// Continuous batching on the bf16 plan (src/cuda/bf16/batch.cu): batch invariance on the
// synthetic full-size checkpoint (set TANSY_SYNTH_DIR; its shapes are the ones the batched step
// runs). Every sequence is decoded alone (one entry per feed_batch: the persistent step and the
// fused head) and then among others that arrive and leave at different steps (several entries:
// prompt pieces alone, the one-token entries in one batched decode step); its tokens must be the
// same and, in the steps where every entry decodes (entry t is row t of the batch's logits), its
// logits bit for bit. Greedy and seeded sampling on the device (with a presence penalty, whose
// state is the request's own), mixed in one batch.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/bf16/plan.h"
#include "gpu_test_util.h"

namespace tansy {
namespace {

const char* batch_synth_dir() {
  const char* d = std::getenv("TANSY_SYNTH_DIR");
  return d && *d ? d : nullptr;
}

struct Seq {
  std::vector<int32_t> prompt;
  SamplingParams params;  // temperature 0: greedy
  int start = 0;          // the step at which it arrives (batched run)
  int n_new = 0;          // tokens it generates, then it leaves
};

struct Out {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // after each decode token (alone: all; batched: where comparable)
};

std::unique_ptr<TokenSampler> sampler_for(cuda::CudaModel& m, const Seq& s) {
  const int V = m.config().vocab_size;
  if (s.params.temperature == 0) return m.make_greedy_sampler(V);
  return m.make_sampler(SamplerSpec{s.params, s.prompt, V, -1});
}

std::vector<float> row_logits(cuda::CudaModel& m, const float* dev) {
  std::vector<float> v(size_t(m.config().vocab_size));
  CUDA_CHECK(cudaStreamSynchronize(m.stream()));
  CUDA_CHECK(cudaMemcpy(v.data(), dev, sizeof(float) * v.size(), cudaMemcpyDeviceToHost));
  return v;
}

Out run_alone(cuda::CudaModel& m, const Seq& s) {
  Out o;
  auto st = m.new_state(int(s.prompt.size()) + s.n_new + 1);
  auto smp = sampler_for(m, s);
  FeedEntry e{st.get(), s.prompt, smp.get()};
  m.feed_batch(std::span<const FeedEntry>(&e, 1));
  int32_t tok = smp->next(nullptr, -1).token;
  o.tokens.push_back(tok);
  for (int i = 1; i < s.n_new; ++i) {
    e.ids = std::span<const int32_t>(&tok, 1);
    m.feed_batch(std::span<const FeedEntry>(&e, 1));
    o.logits.push_back(row_logits(m, m.device_logits()));
    tok = smp->next(nullptr, -1).token;
    o.tokens.push_back(tok);
  }
  return o;
}

// All sequences in one engine-like loop: each arrives at its start step with its whole prompt as
// one piece, then decodes one token per step until it has n_new tokens.
std::vector<Out> run_batched(cuda::CudaModel& m, const std::vector<Seq>& seqs, int* max_rows) {
  struct Live {
    std::unique_ptr<SequenceState> st;
    std::unique_ptr<TokenSampler> smp;
    int32_t last = -1;
    bool done = false;
  };
  std::vector<Out> out(seqs.size());
  std::vector<Live> live(seqs.size());
  *max_rows = 0;
  for (int step = 0;; ++step) {
    std::vector<FeedEntry> entries;
    std::vector<size_t> who;
    std::vector<bool> is_prompt;
    bool any_left = false;
    for (size_t j = 0; j < seqs.size(); ++j) {
      const Seq& s = seqs[j];
      Live& l = live[j];
      if (l.done) continue;
      any_left = true;
      if (step < s.start) continue;
      if (!l.st) {
        l.st = m.new_state(int(s.prompt.size()) + s.n_new + 1);
        l.smp = sampler_for(m, s);
        entries.push_back({l.st.get(), s.prompt, l.smp.get()});
        is_prompt.push_back(true);
      } else {
        entries.push_back({l.st.get(), std::span<const int32_t>(&l.last, 1), l.smp.get()});
        is_prompt.push_back(false);
      }
      who.push_back(j);
    }
    if (!any_left) break;
    if (entries.empty()) continue;
    *max_rows = std::max(*max_rows, int(entries.size()));
    m.feed_batch(entries);
    // Every entry one token: entry i is row i of the batch's logits (feed_batch's order).
    const bool rows_known =
        entries.size() > 1 &&
        std::all_of(entries.begin(), entries.end(), [](const FeedEntry& e) { return e.ids.size() == 1; });
    for (size_t i = 0; i < entries.size(); ++i) {
      const size_t j = who[i];
      Live& l = live[j];
      if (!is_prompt[i]) {
        if (rows_known)
          out[j].logits.push_back(row_logits(m, m.batch_logits(int(i))));
        else if (entries.size() == 1)
          out[j].logits.push_back(row_logits(m, m.device_logits()));  // fed alone
        else
          out[j].logits.emplace_back();  // a step with prompt pieces: rows not compared
      }
      l.last = l.smp->next(nullptr, -1).token;
      out[j].tokens.push_back(l.last);
      if (int(out[j].tokens.size()) == seqs[j].n_new) {
        l.done = true;
        l.smp.reset();
        l.st.reset();
      }
    }
  }
  return out;
}

TEST(Batch, CudaDecodeIsBatchInvariant) {
  if (!batch_synth_dir()) GTEST_SKIP() << "set TANSY_SYNTH_DIR to a `tansy synth` checkpoint";
  auto model = make_cuda_model(batch_synth_dir());
  auto* m = dynamic_cast<cuda::CudaModel*>(model.get());
  ASSERT_NE(m, nullptr);
  ASSERT_GT(m->max_batch(), 1) << "the synthetic checkpoint has the real shapes: "
                               << m->decode_persistent_why();
  const int V = m->config().vocab_size;
  // Prompts of different lengths (GDN chunk edges, attention splits), arrivals at different steps,
  // departures at different steps; half greedy, half seeded sampling.
  const int lens[] = {5, 64, 65, 300, 17, 130, 1, 700, 33, 128};
  std::vector<Seq> seqs;
  for (int j = 0; j < 10; ++j) {
    Seq s;
    s.prompt.resize(size_t(lens[j]));
    for (int i = 0; i < lens[j]; ++i)
      s.prompt[size_t(i)] = int32_t((uint64_t(i + 1) * 2654435761u + uint64_t(j) * 40503u) % uint64_t(V));
    s.start = (j * 3) % 7;
    s.n_new = 6 + (j * 5) % 9;
    if (j % 2) {
      s.params.temperature = j % 4 == 1 ? 0.6 : 1.0;
      s.params.top_p = 0.95;
      s.params.top_k = j % 4 == 1 ? 20 : 0;
      s.params.presence_penalty = j == 3 ? 1.5 : 0.0;
      s.params.seed = 1234 + uint64_t(j);
    } else {
      s.params.temperature = 0;
    }
    seqs.push_back(std::move(s));
  }
  std::vector<Out> alone;
  for (const Seq& s : seqs) alone.push_back(run_alone(*m, s));
  int max_rows = 0;
  const std::vector<Out> together = run_batched(*m, seqs, &max_rows);
  EXPECT_GE(max_rows, 6) << "the schedule never batched many sequences: the test proves little";
  int compared = 0;
  for (size_t j = 0; j < seqs.size(); ++j) {
    SCOPED_TRACE("sequence " + std::to_string(j));
    EXPECT_EQ(together[j].tokens, alone[j].tokens);
    ASSERT_EQ(together[j].logits.size(), alone[j].logits.size());
    for (size_t i = 0; i < alone[j].logits.size(); ++i) {
      if (together[j].logits[i].empty()) continue;
      ++compared;
      EXPECT_EQ(
          std::memcmp(together[j].logits[i].data(), alone[j].logits[i].data(), sizeof(float) * size_t(V)), 0)
          << "decode token " << i + 1 << ": logits differ from the sequence's own alone";
    }
  }
  EXPECT_GE(compared, 30) << "too few all-decode steps compared";
  // Sampling moved the sampled sequences off the argmax (else the sampled half proves nothing).
  const Out greedy1 = [&] {
    Seq g = seqs[1];
    g.params = SamplingParams{};
    g.params.temperature = 0;
    return run_alone(*m, g);
  }();
  EXPECT_NE(greedy1.tokens, alone[1].tokens);
}

// A step of prompt pieces only (requests arriving together, no sequence decoding yet): every
// piece's logits stay its own until its sampler draws from them, whatever is fed after it (the
// pieces' lm_head all write row 0: a sampled piece fed first used to draw from the last one's).
TEST(Batch, CudaPromptsTogetherKeepTheirOwnLogits) {
  if (!batch_synth_dir()) GTEST_SKIP() << "set TANSY_SYNTH_DIR to a `tansy synth` checkpoint";
  auto model = make_cuda_model(batch_synth_dir());
  auto* m = dynamic_cast<cuda::CudaModel*>(model.get());
  ASSERT_NE(m, nullptr);
  ASSERT_GT(m->max_batch(), 1) << m->decode_persistent_why();
  const int V = m->config().vocab_size;
  std::vector<Seq> seqs;
  for (int j = 0; j < 4; ++j) {
    Seq s;
    s.prompt.resize(size_t(20 + 7 * j));
    for (size_t i = 0; i < s.prompt.size(); ++i)
      s.prompt[i] = int32_t((uint64_t(i + 1) * 2654435761u + uint64_t(j + 50) * 40503u) % uint64_t(V));
    s.n_new = 3;
    s.params.temperature = j == 3 ? 0 : 1.0;  // the last one greedy: the sampled ones are fed first
    s.params.seed = 77 + uint64_t(j);
    seqs.push_back(std::move(s));
  }
  std::vector<Out> alone;
  for (const Seq& s : seqs) alone.push_back(run_alone(*m, s));
  int max_rows = 0;
  const std::vector<Out> together = run_batched(*m, seqs, &max_rows);
  EXPECT_EQ(max_rows, 4);
  for (size_t j = 0; j < seqs.size(); ++j) EXPECT_EQ(together[j].tokens, alone[j].tokens) << "sequence " << j;
}

// The batched step at every batch size up to the limit: the same sequence as row 0 of a batch of
// n (the others distinct) gives its alone logits bit for bit.
TEST(Batch, CudaRowMatchesAloneAtEverySize) {
  if (!batch_synth_dir()) GTEST_SKIP() << "set TANSY_SYNTH_DIR to a `tansy synth` checkpoint";
  auto model = make_cuda_model(batch_synth_dir());
  auto* m = dynamic_cast<cuda::CudaModel*>(model.get());
  ASSERT_NE(m, nullptr);
  ASSERT_GT(m->max_batch(), 1);
  const int V = m->config().vocab_size;
  std::vector<int32_t> prompt(200);
  for (int i = 0; i < 200; ++i) prompt[size_t(i)] = int32_t((uint64_t(i) * 7919u + 11u) % uint64_t(V));
  // alone: the prompt, then one token
  const int32_t tok = 42;
  std::vector<float> ref;
  {
    auto st = m->new_state(256);
    auto smp = m->make_greedy_sampler(V);
    FeedEntry e{st.get(), prompt, smp.get()};
    m->feed_batch(std::span<const FeedEntry>(&e, 1));
    smp->next(nullptr, -1);
    e.ids = std::span<const int32_t>(&tok, 1);
    m->feed_batch(std::span<const FeedEntry>(&e, 1));
    ref = row_logits(*m, m->device_logits());
  }
  for (int n : {2, 3, 8, 16, 33, m->max_batch()}) {
    SCOPED_TRACE("batch of " + std::to_string(n));
    std::vector<std::unique_ptr<SequenceState>> sts;
    std::vector<std::unique_ptr<TokenSampler>> smps;
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(n));
    std::vector<int32_t> toks(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      prompts[size_t(j)] = prompt;
      if (j > 0)  // the others: other prompts of other lengths
        prompts[size_t(j)].resize(size_t(20 + 13 * j), int32_t(j));
      sts.push_back(m->new_state(int(prompts[size_t(j)].size()) + 4));
      smps.push_back(m->make_greedy_sampler(V));
      FeedEntry e{sts.back().get(), prompts[size_t(j)], smps.back().get()};
      m->feed_batch(std::span<const FeedEntry>(&e, 1));
      const int32_t chosen = smps.back()->next(nullptr, -1).token;
      toks[size_t(j)] = j == 0 ? tok : chosen;
    }
    std::vector<FeedEntry> entries;
    for (int j = 0; j < n; ++j)
      entries.push_back(
          {sts[size_t(j)].get(), std::span<const int32_t>(&toks[size_t(j)], 1), smps[size_t(j)].get()});
    m->feed_batch(entries);
    const std::vector<float> got = row_logits(*m, m->batch_logits(0));
    EXPECT_EQ(std::memcmp(got.data(), ref.data(), sizeof(float) * size_t(V)), 0);
    for (int j = 0; j < n; ++j) smps[size_t(j)]->next(nullptr, -1);
  }
}

}  // namespace
}  // namespace tansy

namespace tansy {
namespace {

// Timing printout (set TANSY_BATCH_TIMING): the batched decode step at 1, 4, 16 and 64 rows of
// 4,096-token sequences: the step through feed_batch (its rows' greedy choices included), and its
// stages with an event between them (which breaks the launches' overlap: the stages sum to more).
TEST(Batch, Timing) {
  if (!batch_synth_dir() || !std::getenv("TANSY_BATCH_TIMING"))
    GTEST_SKIP() << "set TANSY_SYNTH_DIR and TANSY_BATCH_TIMING";
  auto model = make_cuda_model(batch_synth_dir());
  auto* m = dynamic_cast<cuda::CudaModel*>(model.get());
  ASSERT_NE(m, nullptr);
  ASSERT_GT(m->max_batch(), 1);
  const int V = m->config().vocab_size, ctx = 4096;
  std::vector<std::unique_ptr<SequenceState>> sts;
  std::vector<std::unique_ptr<TokenSampler>> smps;
  std::vector<int32_t> toks;
  for (int j = 0; j < 64; ++j) {
    std::vector<int32_t> prompt(ctx);
    for (int i = 0; i < ctx; ++i)
      prompt[size_t(i)] = int32_t((uint64_t(i + 1) * 2654435761u + uint64_t(j) * 977u) % uint64_t(V));
    sts.push_back(m->new_state(ctx + 64));
    smps.push_back(m->make_greedy_sampler(V));
    FeedEntry e{sts.back().get(), prompt, smps.back().get()};
    m->feed_batch(std::span<const FeedEntry>(&e, 1));
    toks.push_back(smps.back()->next(nullptr, -1).token);
  }
  for (int n : {1, 4, 16, 64}) {
    std::vector<FeedEntry> entries;
    for (int j = 0; j < n; ++j)
      entries.push_back(
          {sts[size_t(j)].get(), std::span<const int32_t>(&toks[size_t(j)], 1), smps[size_t(j)].get()});
    auto step = [&] {
      m->feed_batch(entries);
      for (int j = 0; j < n; ++j) toks[size_t(j)] = smps[size_t(j)]->next(nullptr, -1).token;
    };
    step();  // warm
    constexpr int kSteps = 5;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kSteps; ++i) step();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / kSteps;
    std::printf("batched decode step, %d rows at %d tokens: %.3f ms (%.3f ms per row, %.0f tok/s)\n", n, ctx,
                ms, ms / n, n * 1000.0 / ms);
    if (n == 1) continue;  // one row runs alone (the persistent step): no batched stages
    std::vector<SequenceState*> ss;
    for (int j = 0; j < n; ++j) ss.push_back(sts[size_t(j)].get());
    const auto stages = m->profile_decode_batch(ss, std::span<const int32_t>(toks.data(), size_t(n)));
    double total = 0;
    for (const auto& s : stages) total += s.ms;
    std::printf("  stages (events between them; sum %.3f ms)\n", total);
    for (const auto& s : stages)
      std::printf("  %-45s %8.3f ms %6.1f%%  %9.1f MB  %5.2f of 4.5 TB/s\n", s.name.c_str(), s.ms,
                  100 * s.ms / total, s.bytes / 1e6, s.ms > 0 ? s.bytes / (s.ms * 1e-3) / 4.5e12 : 0.0);
  }
}

}  // namespace
}  // namespace tansy
