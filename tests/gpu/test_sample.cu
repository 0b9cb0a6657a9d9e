// The device sampler (src/cuda/sample/) against the reference Sampler (engine/sampler.cpp): for
// random logits at the real vocabulary size, every setting (temperature, top_k, top_p, min_p,
// penalties, logit_bias, masks, logprobs), tied logits and extreme temperatures, both must pick
// the same token from the same draw, step after step as their penalty states evolve; logprobs
// must name the same ids with values to float rounding. Sample.Timing prints µs per choice.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/sample/sample.cuh"
#include "engine/sample_math.h"
#include "engine/sampler.h"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::DeviceBuffer;

struct Case {
  std::string name;
  SamplingParams p;
  float scale = 3.f;    // logits ~ N(0, scale)
  float quantum = 0.f;  // > 0: logits rounded to multiples of it (many ties)
  double allow = 1.0;   // fraction of ids the mask allows (1: no mask)
  int logprobs = -1;
  int vocab = 248320, limit = 248320;
};

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](std::string name, auto&& set) {
    Case c;
    c.name = std::move(name);
    set(c);
    v.push_back(c);
  };
  add("qwen thinking: T 0.6 top_p 0.95 top_k 20",
      [](Case& c) { c.p.temperature = 0.6, c.p.top_p = 0.95, c.p.top_k = 20; });
  add("qwen instruct: T 0.7 top_p 0.8 top_k 20, presence 1.5",
      [](Case& c) { c.p.temperature = 0.7, c.p.top_p = 0.8, c.p.top_k = 20, c.p.presence_penalty = 1.5; });
  add("T 1.0, full vocabulary", [](Case& c) { c.p.temperature = 1.0; });
  add("T 1.0, full vocabulary, flat", [](Case& c) { c.p.temperature = 1.0, c.scale = 0.05f; });
  add("T 1.0 top_p 0.9 (nucleus over the whole vocabulary)",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_p = 0.9; });
  add("T 0.8 top_p 0.5, sharp", [](Case& c) { c.p.temperature = 0.8, c.p.top_p = 0.5, c.scale = 8.f; });
  add("min_p 0.05 (few candidates)", [](Case& c) { c.p.temperature = 1.0, c.p.min_p = 0.05, c.scale = 4.f; });
  add("min_p 0.2 (thousands of candidates), top_p 0.7",
      [](Case& c) { c.p.temperature = 1.0, c.p.min_p = 0.2, c.p.top_p = 0.7, c.scale = 1.f; });
  add("top_k 1000 top_p 0.99", [](Case& c) { c.p.temperature = 0.9, c.p.top_k = 1000, c.p.top_p = 0.99; });
  add("top_k 5000 (past the gather limit)", [](Case& c) { c.p.temperature = 1.2, c.p.top_k = 5000; });
  add("ties: logits in steps of 0.5, top_k 7 top_p 0.6",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 7, c.p.top_p = 0.6, c.quantum = 0.5f; });
  add("ties: logits in steps of 1, top_p 0.3 over the vocabulary",
      [](Case& c) { c.p.temperature = 0.5, c.p.top_p = 0.3, c.quantum = 1.f; });
  add("penalties: repetition 1.3, frequency 0.5, presence 0.5, logit_bias", [](Case& c) {
    c.p.temperature = 0.8, c.p.top_k = 40, c.p.repetition_penalty = 1.3, c.p.frequency_penalty = 0.5,
    c.p.presence_penalty = 0.5;
    c.p.logit_bias = {{5, 3.0}, {77, -100.0}, {248000, 2.5}};
  });
  add("greedy with penalties and bias", [](Case& c) {
    c.p.temperature = 0, c.p.repetition_penalty = 1.2, c.p.frequency_penalty = 1.0;
    c.p.logit_bias = {{9, 1.0}};
  });
  add("T 1e-3", [](Case& c) { c.p.temperature = 1e-3; });
  add("T 100", [](Case& c) { c.p.temperature = 100, c.p.top_p = 0.95; });
  add("T 1e-40 (greedy by underflow)", [](Case& c) { c.p.temperature = 1e-40; });
  add("mask 10%, top_p 0.9", [](Case& c) { c.p.temperature = 1.0, c.p.top_p = 0.9, c.allow = 0.1; });
  add("mask of 3 ids", [](Case& c) { c.p.temperature = 1.0, c.allow = 3.0 / 248320; });
  add("logprobs 5, qwen settings",
      [](Case& c) { c.p.temperature = 0.6, c.p.top_p = 0.95, c.p.top_k = 20, c.logprobs = 5; });
  add("logprobs 20, T 1", [](Case& c) { c.p.temperature = 1.0, c.logprobs = 20; });
  add("logprobs 0, greedy", [](Case& c) { c.p.temperature = 0, c.logprobs = 0; });
  add("small vocabulary 1000, limit 990",
      [](Case& c) { c.p.temperature = 0.7, c.p.top_p = 0.9, c.vocab = 1000, c.limit = 990, c.logprobs = 3; });
  add("Qwen3 tokenizer size 151936, limit 151669",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 50, c.vocab = 151936, c.limit = 151669; });
  // Small top_k, top_logprobs, fewer ids than either, ties at the cut, penalties that reorder.
  add("top_k 1", [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 1; });
  add("top_k 32 top_p 0.9", [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 32, c.p.top_p = 0.9; });
  add("top_k 33 top_p 0.9", [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 33, c.p.top_p = 0.9; });
  add("ties: steps of 1, top_k 20 top_p 0.95",
      [](Case& c) { c.p.temperature = 0.6, c.p.top_k = 20, c.p.top_p = 0.95, c.quantum = 1.f; });
  add("ties: steps of 4 (a few levels), top_k 32",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 32, c.quantum = 4.f; });
  add("top_k 20 min_p 0.1 top_p 0.95", [](Case& c) {
    c.p.temperature = 1.0, c.p.top_k = 20, c.p.min_p = 0.1, c.p.top_p = 0.95, c.scale = 2.f;
  });
  add("top_k 20 min_p 0.5, sharp",
      [](Case& c) { c.p.temperature = 0.7, c.p.top_k = 20, c.p.min_p = 0.5, c.scale = 6.f; });
  add("top_k 20, mask of 3 ids (fewer candidates than top_k)",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 20, c.allow = 3.0 / 248320; });
  add("top_k 20, mask 10%, logprobs 5", [](Case& c) {
    c.p.temperature = 0.6, c.p.top_k = 20, c.p.top_p = 0.95, c.allow = 0.1, c.logprobs = 5;
  });
  add("top_k 20 T 1e-3, logprobs 5",
      [](Case& c) { c.p.temperature = 1e-3, c.p.top_k = 20, c.p.top_p = 0.95, c.logprobs = 5; });
  add("top_k 20 T 100 top_p 0.95", [](Case& c) { c.p.temperature = 100, c.p.top_k = 20, c.p.top_p = 0.95; });
  add("top_k 20 T 1e-40 (greedy by underflow), logprobs 1",
      [](Case& c) { c.p.temperature = 1e-40, c.p.top_k = 20, c.logprobs = 1; });
  add("penalties and bias, top_k 20, logprobs 5 (raw and penalised orders differ)", [](Case& c) {
    c.p.temperature = 0.7, c.p.top_k = 20, c.p.top_p = 0.8, c.p.presence_penalty = 1.5;
    c.p.repetition_penalty = 1.1, c.p.logit_bias = {{3, 20.0}, {100, 15.0}}, c.logprobs = 5;
  });
  add("logprobs 20, ties: steps of 1",
      [](Case& c) { c.p.temperature = 1.0, c.quantum = 1.f, c.logprobs = 20; });
  add("logprobs 5, greedy with penalties",
      [](Case& c) { c.p.temperature = 0, c.p.frequency_penalty = 1.0, c.logprobs = 5; });
  add("logprobs 5, T 1.0 top_p 0.9 (nucleus over the vocabulary)",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_p = 0.9, c.logprobs = 5; });
  add("small vocabulary 1000, limit 990, top_k 20, logprobs 20 (empty blocks)", [](Case& c) {
    c.p.temperature = 0.8, c.p.top_k = 20, c.p.top_p = 0.9, c.vocab = 1000, c.limit = 990, c.logprobs = 20;
  });
  add("vocabulary 40, top_k 32, logprobs 20",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 32, c.vocab = 40, c.limit = 40, c.logprobs = 20; });
  add("vocabulary 12, top_k 20, logprobs 20 (fewer ids than both)",
      [](Case& c) { c.p.temperature = 1.0, c.p.top_k = 20, c.vocab = 12, c.limit = 12, c.logprobs = 20; });
  return v;
}

TEST(Sample, MatchesTheReference) {
  std::mt19937 rng(1234);
  int mismatches = 0, steps_total = 0;
  for (const Case& c : cases()) {
    cuda::DeviceSampler ds(c.vocab);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 50; ++i) prompt.push_back(int32_t(rng() % uint32_t(c.limit)));
    SamplingParams p = c.p;
    p.seed = 99;
    Sampler ref(p, prompt);
    ds.begin(p, prompt, 0);
    DeviceBuffer<float> dl(size_t(c.vocab));
    const int steps = 12;
    int agree = 0;  // steps whose token is the reference's
    for (int step = 0; step < steps; ++step) {
      std::vector<float> logits = randn(size_t(c.vocab), c.scale);
      if (c.quantum > 0)
        for (float& x : logits) x = std::round(x / c.quantum) * c.quantum;
      // Make generated ids likely again so the penalties matter.
      for (auto [id, n] : ref.counts()) logits[size_t(id)] += 2.f;
      std::vector<uint32_t> mask;
      if (c.allow < 1.0) {
        mask.assign(size_t(c.vocab + 31) / 32, 0u);
        std::uniform_real_distribution<double> u(0, 1);
        int allowed = 0;
        for (int i = 0; i < c.limit; ++i)
          if (u(rng) < c.allow) mask[size_t(i) / 32] |= 1u << (i % 32), ++allowed;
        if (allowed == 0) mask[0] |= 1u;
      }
      dl.upload(logits.data(), logits.size());
      const uint64_t R = sample_math::draw_bits(ref.seed(), ref.position());
      ds.enqueue(dl.get(), c.limit, R, mask.empty() ? nullptr : mask.data(), -1, c.logprobs, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
      const cuda::SampleOutput got = ds.output();

      std::vector<float> l(logits.begin(), logits.begin() + c.limit);
      const int32_t want = ref.sample(l, mask.empty() ? nullptr : mask.data());
      ++steps_total;
      if (got.token != want) {
        ++mismatches;
        ADD_FAILURE() << c.name << " step " << step << ": device chose " << got.token << ", reference "
                      << want;
      } else {
        ++agree;
      }
      if (c.logprobs >= 0) {
        std::vector<float> raw(logits.begin(), logits.begin() + c.limit);
        const LogprobInfo lp = logprobs_of(raw, want, c.logprobs);
        EXPECT_NEAR(got.logprob, lp.logprob, 1e-4 * std::max(1.f, std::fabs(lp.logprob))) << c.name;
        ASSERT_EQ(got.n_top, int(lp.top.size())) << c.name;
        for (size_t i = 0; i < lp.top.size(); ++i) {
          EXPECT_EQ(got.top_id[i], lp.top[i].id) << c.name << " alternative " << i;
          EXPECT_NEAR(got.top_logprob[i], lp.top[i].logprob,
                      1e-4 * std::max(1.f, std::fabs(lp.top[i].logprob)))
              << c.name;
        }
      }
      ref.accept(want);  // the device counted its own choice
    }
    std::printf("  %-72s %2d of %d steps agree\n", c.name.c_str(), agree, steps);
  }
  EXPECT_EQ(mismatches, 0) << "of " << steps_total << " steps";
}

// Forced tokens are counted for the penalties and reported with their logprobs; a seeded draw
// is the same on every run.
TEST(Sample, ForcedTokensAndReproducibility) {
  const int V = 248320;
  std::mt19937 rng(7);
  SamplingParams p;
  p.temperature = 0;
  p.frequency_penalty = 100.0;  // a generated id never wins again
  cuda::DeviceSampler ds(V);
  ds.begin(p, {}, 0);
  std::vector<float> logits = randn(V, 1.f);
  logits[4242] = 50.f;
  DeviceBuffer<float> dl = to_device(logits);
  ds.enqueue(dl.get(), V, 0, nullptr, 4242, 2, 0);  // forced: 4242 counted, logprobs reported
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(ds.output().token, 4242);
  EXPECT_EQ(ds.output().top_id[0], 4242);
  ds.enqueue(dl.get(), V, 0, nullptr, -1, -1, 0);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_NE(ds.output().token, 4242) << "the forced token was not counted for the penalty";

  SamplingParams q;
  q.temperature = 1.0;
  q.top_p = 0.9;
  std::vector<int32_t> first;
  for (int run = 0; run < 2; ++run) {
    cuda::DeviceSampler d(V);
    d.begin(q, {}, 0);
    std::vector<int32_t> got;
    for (int pos = 0; pos < 20; ++pos) {
      d.enqueue(dl.get(), V, sample_math::draw_bits(17, pos), nullptr, -1, -1, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
      got.push_back(d.output().token);
    }
    if (run == 0) first = got;
    EXPECT_EQ(got, first);
  }
}

// µs per choice, back to back (kernel only: the output is written into mapped host memory), for
// every setting the HTTP check runs and the sampler's other paths.
TEST(Sample, Timing) {
  const int V = 248320;
  std::vector<float> logits = randn(V, 3.f);
  DeviceBuffer<float> dl = to_device(logits);
  struct T {
    std::string name;
    SamplingParams p;
    int logprobs = -1;
  };
  SamplingParams greedy, qwen, t1;
  greedy.temperature = 0;
  qwen.temperature = 0.6, qwen.top_p = 0.95, qwen.top_k = 20;
  t1.temperature = 1.0;
  std::vector<T> ts;
  auto add = [&](std::string name, SamplingParams p, int logprobs = -1) {
    ts.push_back({name, p, logprobs});
  };
  add("greedy", greedy);
  SamplingParams gp = greedy;
  gp.repetition_penalty = 1.2, gp.frequency_penalty = 1.0;
  add("greedy, repetition 1.2 frequency 1.0", gp);
  add("greedy + logprobs 0", greedy, 0);
  add("greedy + top_logprobs 5", greedy, 5);
  add("qwen: T 0.6 top_p 0.95 top_k 20", qwen);
  add("qwen + logprobs 0", qwen, 0);
  add("qwen + top_logprobs 5", qwen, 5);
  add("qwen + top_logprobs 20", qwen, 20);
  SamplingParams qp = qwen;
  qp.presence_penalty = 1.5;
  add("qwen + presence 1.5", qp);
  SamplingParams k1 = t1;
  k1.top_k = 1;
  add("T 1.0 top_k 1", k1);
  SamplingParams k32 = t1;
  k32.top_k = 32, k32.top_p = 0.9;
  add("T 1.0 top_k 32 top_p 0.9", k32);
  SamplingParams k50 = t1;
  k50.top_k = 50;
  add("T 1.0 top_k 50", k50);
  add("T 1.0 full vocabulary", t1);
  add("T 1.0 full vocabulary + top_logprobs 5", t1, 5);
  SamplingParams tp = t1;
  tp.top_p = 0.9;
  add("T 1.0 top_p 0.9", tp);
  SamplingParams mp = t1;
  mp.min_p = 0.05;
  add("T 1.0 min_p 0.05", mp);
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  for (const T& t : ts) {
    cuda::DeviceSampler ds(V);
    ds.begin(t.p, {}, 0);
    for (int i = 0; i < 5; ++i) ds.enqueue(dl.get(), V, uint64_t(i), nullptr, -1, t.logprobs, 0);
    const int reps = 50;
    CUDA_CHECK(cudaEventRecord(a, 0));
    for (int i = 0; i < reps; ++i) ds.enqueue(dl.get(), V, uint64_t(i), nullptr, -1, t.logprobs, 0);
    CUDA_CHECK(cudaEventRecord(b, 0));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    std::printf("  sampler %-48s %7.1f us per choice\n", t.name.c_str(), 1000.0 * ms / reps);
  }
}

}  // namespace
}  // namespace tansy
