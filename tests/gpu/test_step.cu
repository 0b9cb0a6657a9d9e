// The persistent decode step (src/cuda/step/) against the per-op decode kernels it replaces, on
// the synthetic full-size checkpoint (its shapes are the ones the step runs; set TANSY_SYNTH_DIR).
// Teacher-forced on the per-op run's greedy tokens: on a 132-multiprocessor card (H100 SXM / H200,
// where the residual products' partial sums fall into the same row blocks) the logits of every
// step bit-identical to the per-op kernels' and the same routed experts, since the step computes
// each value with their device functions in their order; elsewhere within the bf16 plan's
// tolerance with the same decisive top-1. The step is deterministic (two runs bit-identical). The
// per-op kernels are themselves checked against the CPU reference (test_matvec, test_gdn,
// test_moe, and test_model's layer-by-layer runs, whose synthetic decode step runs the step).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/bf16/plan.h"
#include "gpu_test_util.h"

namespace tansy {
namespace {

const char* step_synth_dir() {
  const char* d = std::getenv("TANSY_SYNTH_DIR");
  return d && *d ? d : nullptr;
}

std::vector<int32_t> prompt_ids(int n, int vocab) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i)
    ids[i] = int32_t(uint64_t(uint32_t(uint64_t(i) * 2654435761u)) % uint64_t(vocab));
  return ids;
}

int argmax_of(const std::vector<float>& v) { return int(std::max_element(v.begin(), v.end()) - v.begin()); }

struct DecodeRun {
  std::vector<std::vector<float>> logits;  // after the prompt, then after each fed token
  std::vector<int32_t> tokens;             // greedy from those logits
  std::vector<std::vector<int32_t>> routes;
};

// Greedy from the run's own logits, or the tokens of `force` (teacher forcing).
DecodeRun decode_run(cuda::CudaModel& m, const std::vector<int32_t>& prompt, int steps,
                     const std::vector<int32_t>* force = nullptr) {
  DecodeRun r;
  const int V = m.config().vocab_size;
  auto st = m.new_state(int(prompt.size()) + steps + 2);
  std::vector<float> lg(V);
  m.forward(*st, prompt, lg, false);
  r.logits.push_back(lg);
  for (int i = 0; i < steps; ++i) {
    const int32_t t = force ? (*force)[i] : argmax_of(lg);
    r.tokens.push_back(t);
    m.forward(*st, std::span<const int32_t>(&t, 1), lg, false);  // the decode graph
    r.logits.push_back(lg);
  }
  // one more step eagerly with the routes traced
  m.set_route_trace(
      [&](int, std::span<const int32_t> idx) { r.routes.emplace_back(idx.begin(), idx.end()); });
  const int32_t t = force ? (*force)[steps] : argmax_of(lg);
  m.forward(*st, std::span<const int32_t>(&t, 1), lg, false);
  m.set_route_trace(nullptr);
  r.logits.push_back(lg);
  return r;
}

TEST(Step, SyntheticMatchesPerOpKernels) {
  if (!step_synth_dir()) GTEST_SKIP() << "set TANSY_SYNTH_DIR to a `tansy synth` checkpoint";
  auto model = make_cuda_model(step_synth_dir());
  auto* m = dynamic_cast<cuda::CudaModel*>(model.get());
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(m->decode_persistent())
      << "the synthetic checkpoint has the real shapes: " << m->decode_persistent_why();
  const int V = m->config().vocab_size;
  const auto prompt = prompt_ids(300, V);
  constexpr int kSteps = 24;
  m->use_decode_kernels(cuda::DecodeKernels::kPerOp);
  ASSERT_FALSE(m->decode_persistent());
  const DecodeRun ref = decode_run(*m, prompt, kSteps);
  std::vector<int32_t> forced = ref.tokens;
  forced.push_back(argmax_of(ref.logits[kSteps]));  // the token of ref's traced step
  m->use_decode_kernels(cuda::DecodeKernels::kPersistent);
  ASSERT_TRUE(m->decode_persistent());
  const DecodeRun step = decode_run(*m, prompt, kSteps, &forced);
  const DecodeRun again = decode_run(*m, prompt, kSteps, &forced);

  ASSERT_EQ(step.routes.size(), size_t(m->config().num_layers)) << "every layer's routing reported once";
  EXPECT_EQ(step.routes, again.routes);
  int same_routes = 0;
  for (size_t l = 0; l < step.routes.size(); ++l) same_routes += step.routes[l] == ref.routes[l];
  double worst = 0;
  int decisive = 0, agree = 0, identical = 0;
  for (size_t s = 0; s < step.logits.size(); ++s) {
    const auto& a = step.logits[s];
    const auto& b = ref.logits[s];
    float mx = 0, d = 0;
    for (int i = 0; i < V; ++i) {
      mx = std::max(mx, std::fabs(b[i]));
      d = std::max(d, std::fabs(a[i] - b[i]));
    }
    worst = std::max(worst, double(d) / mx);
    const int top = argmax_of(b);
    float second = -INFINITY;
    for (int i = 0; i < V; ++i)
      if (i != top) second = std::max(second, b[i]);
    if (b[top] - second > 0.05f * mx) {
      ++decisive;
      agree += argmax_of(a) == top;
    }
    EXPECT_EQ(std::memcmp(a.data(), again.logits[s].data(), sizeof(float) * V), 0)
        << "step " << s << " not deterministic";
    identical += std::memcmp(a.data(), b.data(), sizeof(float) * V) == 0;
  }
  std::printf(
      "  persistent vs per-op decode (teacher-forced, %zu logit rows): max |dlogit|/max|logit| %.2e, "
      "decisive top-1 "
      "%d/%d, %d rows bit-identical; traced step: %d/%zu layers routed alike\n",
      step.logits.size(), worst, agree, decisive, identical, same_routes, step.routes.size());
  EXPECT_EQ(agree, decisive);
  if (cuda::sm_count() == 132) {
    EXPECT_EQ(identical, int(step.logits.size()))
        << "132 multiprocessors: the step must equal the per-op kernels";
    EXPECT_EQ(step.routes, ref.routes);
  } else {
    EXPECT_LT(worst, 2e-2);
  }

  // greedy through generate_greedy (the bench's path) from a reset state equals a new state's
  auto st = m->new_state(int(prompt.size()) + 41);
  std::vector<int32_t> toks, toks2;
  m->generate_greedy(*st, prompt, 40, [&](int32_t t) {
    toks.push_back(t);
    return true;
  });
  ASSERT_TRUE(m->reset_state(*st));
  m->generate_greedy(*st, prompt, 40, [&](int32_t t) {
    toks2.push_back(t);
    return true;
  });
  EXPECT_EQ(toks2, toks) << "a reset state decodes as a new one";
  EXPECT_EQ(int(toks.size()), 40);
}

// Not a pass/fail test: decode speed of both plans in one process (TANSY_STEP_TIMING=1).
TEST(Step, Timing) {
  if (!step_synth_dir() || !std::getenv("TANSY_STEP_TIMING"))
    GTEST_SKIP() << "set TANSY_SYNTH_DIR and TANSY_STEP_TIMING";
  auto model = make_cuda_model(step_synth_dir());
  auto* m = dynamic_cast<cuda::CudaModel*>(model.get());
  ASSERT_NE(m, nullptr);
  for (int ctx : {256, 4096, 32768}) {
    const auto prompt = prompt_ids(ctx, m->config().vocab_size);
    for (auto k :
         {cuda::DecodeKernels::kPersistent, cuda::DecodeKernels::kPerOp, cuda::DecodeKernels::kPersistent}) {
      m->use_decode_kernels(k);
      auto st = m->new_state(ctx + 80);
      std::chrono::steady_clock::time_point t1;
      int got = 0;
      m->generate_greedy(*st, prompt, 65, [&](int32_t) {
        if (got++ == 0) t1 = std::chrono::steady_clock::now();
        return true;
      });
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
      std::printf("STEP TIMING ctx %6d %-10s decode %7.1f tok/s (%.3f ms/token)\n", ctx,
                  k == cuda::DecodeKernels::kPersistent ? "persistent" : "per-op", 64 / s, 1e3 * s / 64);
    }
  }
  m->use_decode_kernels(cuda::DecodeKernels::kPersistent);
}

}  // namespace
}  // namespace tansy
