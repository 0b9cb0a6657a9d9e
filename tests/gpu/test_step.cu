// The persistent decode step (src/cuda/step/) against the per-op decode kernels it replaces, on
// the synthetic full-size checkpoint (its shapes are the ones the step runs; set TANSY_SYNTH_DIR):
// the same logits bit for bit at every step on a 132-multiprocessor card (H100 SXM / H200, where
// the residual products' partial sums fall into the same row blocks), the same greedy tokens
// through the decode graph, and the same routed experts. The per-op kernels are themselves checked
// against the CPU reference (test_matvec, test_gdn, test_moe, and test_model's layer-by-layer runs,
// whose synthetic decode step now runs the persistent step).
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

DecodeRun decode_run(cuda::CudaModel& m, const std::vector<int32_t>& prompt, int steps) {
  DecodeRun r;
  const int V = m.config().vocab_size;
  auto st = m.new_state(int(prompt.size()) + steps + 2);
  std::vector<float> lg(V);
  m.forward(*st, prompt, lg, false);
  r.logits.push_back(lg);
  for (int i = 0; i < steps; ++i) {
    const int32_t t = argmax_of(lg);
    r.tokens.push_back(t);
    m.forward(*st, std::span<const int32_t>(&t, 1), lg, false);  // the decode graph
    r.logits.push_back(lg);
  }
  // one more step eagerly with the routes traced
  m.set_route_trace(
      [&](int, std::span<const int32_t> idx) { r.routes.emplace_back(idx.begin(), idx.end()); });
  const int32_t t = argmax_of(lg);
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
  const DecodeRun step = decode_run(*m, prompt, kSteps);
  m->use_decode_kernels(cuda::DecodeKernels::kPerOp);
  ASSERT_FALSE(m->decode_persistent());
  const DecodeRun per_op = decode_run(*m, prompt, kSteps);
  m->use_decode_kernels(cuda::DecodeKernels::kPersistent);
  ASSERT_TRUE(m->decode_persistent());

  EXPECT_EQ(step.tokens, per_op.tokens);
  ASSERT_EQ(step.routes.size(), size_t(m->config().num_layers)) << "every layer's routing reported once";
  EXPECT_EQ(step.routes, per_op.routes);
  const bool same_blocks = cuda::sm_count() == 132;
  double worst = 0;
  int identical = 0;
  for (size_t s = 0; s < step.logits.size(); ++s) {
    const auto& a = step.logits[s];
    const auto& b = per_op.logits[s];
    float mx = 0, d = 0;
    for (int i = 0; i < V; ++i) {
      mx = std::max(mx, std::fabs(b[i]));
      d = std::max(d, std::fabs(a[i] - b[i]));
    }
    worst = std::max(worst, double(d) / mx);
    identical += std::memcmp(a.data(), b.data(), sizeof(float) * V) == 0;
  }
  std::printf(
      "  persistent vs per-op decode: %d of %zu logit rows bit-identical, max |dlogit|/max|logit| %.2e\n",
      identical, step.logits.size(), worst);
  if (same_blocks)
    EXPECT_EQ(identical, int(step.logits.size()))
        << "132 multiprocessors: the step must equal the per-op kernels";
  else
    EXPECT_LT(worst, 2e-2);

  // greedy through generate_greedy (the bench's path), both plans, and a reset state
  auto greedy = [&](int n) {
    std::vector<int32_t> toks;
    auto st = m->new_state(int(prompt.size()) + n + 1);
    m->generate_greedy(*st, prompt, n, [&](int32_t t) {
      toks.push_back(t);
      return true;
    });
    EXPECT_TRUE(m->reset_state(*st));
    std::vector<int32_t> again;
    m->generate_greedy(*st, prompt, n, [&](int32_t t) {
      again.push_back(t);
      return true;
    });
    EXPECT_EQ(again, toks) << "a reset state decodes as a new one";
    return toks;
  };
  const auto g_step = greedy(40);
  m->use_decode_kernels(cuda::DecodeKernels::kPerOp);
  const auto g_op = greedy(40);
  m->use_decode_kernels(cuda::DecodeKernels::kPersistent);
  EXPECT_EQ(g_step, g_op);
  std::vector<int32_t> from_logits(step.tokens.begin(), step.tokens.end());
  EXPECT_EQ(std::vector<int32_t>(g_step.begin(), g_step.begin() + kSteps), from_logits);
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
