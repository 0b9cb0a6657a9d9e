// Prefill GEMM timings, old kernel (gemm_v1.cu, ldmatrix on a dequantized shared tile) against the
// current ones (src/cuda/gemm/gemm.cu, mma.sync with codes dequantized into mma fragments, and
// src/cuda/gemm/gemm_wgmma.cu, wgmma with codes dequantized into register A fragments, and for the grouped
// products src/cuda/gemm/gemm_grouped_wgmma.cu, the persistent wgmma kernel), at the real model's
// prefill shapes for 4,096 tokens: the grouped expert gate|up (SwiGLU) and down [256 x 1024x2048],
// [256 x 2048x512] with uniform routing (~128 rows per expert) and with a skewed one, and the dense
// GDN in_proj / out_proj and attention q|k|v. Not pass/fail beyond the
// kernels agreeing; runs only with TANSY_GEMM_TIMING=1 and prints median ms and TFLOP/s.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/gemm/gemm.cuh"
#include "cuda/gemm/gemm_impl.cuh"
#include "cuda/moe/moe.cuh"
#include "gemm_v1.h"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

namespace gemm_timing {

template <typename F>
double median_ms(F&& fn, int reps = 21) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  fn();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> t(reps);
  for (auto& ms : t) {
    CUDA_CHECK(cudaEventRecord(e0, 0));
    fn();
    CUDA_CHECK(cudaEventRecord(e1, 0));
    CUDA_CHECK(cudaEventSynchronize(e1));
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

// Times `run(variant)` for the old kernel (0), the mma.sync kernel (1) and the wgmma kernel (2), and
// for grouped products the persistent grouped wgmma kernel (3), prints them, and checks the outputs
// agree (relative L2 distance, bf16 outputs: the f32 sums differ only in order).
template <typename Run>
void compare(const char* what, double flop, DeviceBuffer<bf16>& y, bool grouped, Run&& run) {
  const int variants = grouped ? 4 : 3;
  double ms[4] = {};
  std::vector<float> out[4];
  for (int v = 0; v < variants; ++v) {
    run(v);
    CUDA_CHECK(cudaDeviceSynchronize());
    out[v] = from_device_bf16(y.get(), y.size());
    ms[v] = median_ms([&] { run(v); });
  }
  auto tf = [&](int v) { return flop / (ms[v] * 1e-3) / 1e12; };
  std::printf(
      "  TIMING %-40s old %7.3f ms %5.1f TF/s | mma %7.3f ms %5.1f TF/s | wgmma %7.3f ms %5.1f TF/s | "
      "wgmma/old x%.2f\n",
      what, ms[0], tf(0), ms[1], tf(1), ms[2], tf(2), ms[0] / ms[2]);
  if (grouped)
    std::printf("  TIMING %-40s wgmma-grouped %7.3f ms %5.1f TF/s | wgmma-grouped/mma x%.2f\n", what, ms[3],
                tf(3), ms[1] / ms[3]);
  EXPECT_REL(out[1], out[0], kTolBf16, std::string(what) + ": mma kernel vs old");
  EXPECT_REL(out[2], out[0], kTolBf16, std::string(what) + ": wgmma kernel vs old");
  if (grouped) EXPECT_REL(out[3], out[0], kTolBf16, std::string(what) + ": wgmma-grouped kernel vs old");
  // Each wgmma tile shape forced (grouped products always take 64-row tiles), for choosing the
  // automatic rule in gemm_wgmma.cu's launch_wgmma.
  std::printf("         %-40s wgmma tiles rows x cols:", "");
  for (const auto& [rows, wg] :
       {std::pair{64, 2}, std::pair{64, 4}, std::pair{128, 2}, std::pair{128, 4}, std::pair{256, 2}}) {
    if (grouped && rows != 64) continue;
    cuda::gemm_impl::set_wgmma_tiles(rows, wg);
    run(2);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto o = from_device_bf16(y.get(), y.size());
    const double t = median_ms([&] { run(2); });
    cuda::gemm_impl::set_wgmma_tiles(0, 0);
    std::printf(" %dx%d %.3f ms %.1f TF/s |", rows, 64 * wg, t, flop / (t * 1e-3) / 1e12);
    EXPECT_REL(
        o, out[0], kTolBf16,
        std::string(what) + ": wgmma " + std::to_string(rows) + "x" + std::to_string(64 * wg) + " vs old");
  }
  std::printf("\n");
  if (!grouped) return;
  // Each tile row count of the grouped wgmma kernel forced, for choosing gemm_grouped_wgmma.cu's
  // choose_rows.
  std::printf("         %-40s wgmma-grouped tile rows:", "");
  for (const int rows : cuda::gemm_impl::kGroupedWgmmaRows) {
    cuda::gemm_impl::set_grouped_wgmma_rows(rows);
    run(3);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto o = from_device_bf16(y.get(), y.size());
    const double t = median_ms([&] { run(3); });
    cuda::gemm_impl::set_grouped_wgmma_rows(0);
    std::printf(" %d %.3f ms %.1f TF/s |", rows, t, flop / (t * 1e-3) / 1e12);
    EXPECT_REL(o, out[0], kTolBf16,
               std::string(what) + ": wgmma-grouped " + std::to_string(rows) + " rows vs old");
  }
  std::printf("\n");
}

// Runs the current gemm entry points under the mma.sync (variant 1), wgmma (2) or grouped wgmma (3)
// kernel.
struct KernelScope {
  cuda::GemmKernel saved = cuda::gemm_kernel();
  explicit KernelScope(int variant) {
    cuda::gemm_set_kernel(variant == 3   ? cuda::GemmKernel::kWgmmaGrouped
                          : variant == 2 ? cuda::GemmKernel::kWgmma
                                         : cuda::GemmKernel::kMma);
  }
  ~KernelScope() { cuda::gemm_set_kernel(saved); }
};

}  // namespace gemm_timing

TEST(Timing, Gemm) {
  if (!std::getenv("TANSY_GEMM_TIMING")) GTEST_SKIP() << "set TANSY_GEMM_TIMING=1";
  using namespace gemm_timing;
  constexpr int n = 4096;
  std::printf(
      "prefill GEMM timings at n=%d (median of 21; 4-bit weights; random data; old = gemm_v1, mma = gemm.cu, "
      "wgmma = gemm_wgmma.cu, wgmma-grouped = gemm_grouped_wgmma.cu)\n",
      n);
  auto x = randn(size_t(n) * 4096);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  auto dense = [&](const char* what, int out, int in, WFormat fmt = WFormat::kAffine4) {
    TestMatrix W = make_matrix(fmt, out, in);
    DeviceBuffer<bf16> y(size_t(n) * out);
    compare(what, 2.0 * n * out * in, y, false, [&](int v) {
      const cuda::GemmOutput o{y.get(), cuda::GemmOutType::kBF16, out, cuda::GemmEpilogue::kStore};
      KernelScope scope(v);
      if (v > 0)
        cuda::gemm(W.dev, dx.get(), in, n, o, 0);
      else
        cuda::gemm_v1::gemm(W.dev, dx.get(), in, n, o, 0);
    });
  };
  dense("gemm gdn in_proj [12352x2048]", 12352, 2048);
  dense("gemm gdn out_proj [2048x4096]", 2048, 4096);
  dense("gemm attn in_qkv [8192x2048]", 8192, 2048);
  dense("gemm shared gate|up [1024x2048]", 1024, 2048);
  dense("gemm shared down [2048x512]", 2048, 512);
  // (8-bit: the wgmma kernels are 4-bit only, so their columns repeat the mma.sync kernel)
  dense("gemm router|shared gate [258x2048] 8-bit", 258, 2048, WFormat::kAffine8);

  constexpr int E = 256, k = 8, H = 2048, I = 512;
  TestMatrix GU = make_matrix(WFormat::kAffine4, E * 2 * I, H);
  TestMatrix Dn = make_matrix(WFormat::kAffine4, E * H, I);
  // Uniform routing, then a skewed one: each token's 8 experts drawn without replacement with
  // probability ~ rank^-0.5 (Gumbel top-k), the kind of load tansy synth --router-skew 0.5 gives.
  for (const bool skewed : {false, true}) {
    std::vector<int> idx;
    std::vector<float> wts;
    random_routing(n, E, k, idx, wts);
    if (skewed) {
      std::vector<float> logw(E);
      for (int e = 0; e < E; ++e) logw[size_t(e)] = -0.5f * std::log(float(e + 1));
      std::uniform_real_distribution<double> u(1e-12, 1.0);
      std::vector<std::pair<double, int>> key(E);
      for (int t = 0; t < n; ++t) {
        for (int e = 0; e < E; ++e) key[size_t(e)] = {logw[size_t(e)] - std::log(-std::log(u(rng()))), e};
        std::partial_sort(key.begin(), key.begin() + k, key.end(), std::greater<>());
        for (int j = 0; j < k; ++j) idx[size_t(t) * k + j] = key[size_t(j)].second;
      }
    }
    std::vector<int> count(E, 0);
    for (int e : idx) ++count[size_t(e)];
    std::printf("  routing %s: rows per expert max %d, min %d (mean %d)\n", skewed ? "skewed" : "uniform",
                *std::max_element(count.begin(), count.end()), *std::min_element(count.begin(), count.end()),
                n * k / E);
    auto didx = to_device(idx);
    DeviceRouting R;
    const auto rv = R.view(E, n * k);
    cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
    DeviceBuffer<bf16> act(size_t(n) * k * I), yd(size_t(n) * k * H);
    const std::string tag = skewed ? " (skewed)" : " (uniform)";
    compare(("gemm_grouped gate|up swiglu" + tag).c_str(), 2.0 * n * k * 2 * I * H, act, true, [&](int v) {
      const cuda::GemmOutput o{act.get(), cuda::GemmOutType::kBF16, I, cuda::GemmEpilogue::kSwiGlu};
      KernelScope scope(v);
      if (v > 0)
        cuda::gemm_grouped(GU.dev, E, dx.get(), H, true, n, k, rv, o, 0);
      else
        cuda::gemm_v1::gemm_grouped(GU.dev, E, dx.get(), H, true, n, k, rv, o, 0);
    });
    // down reads the SwiGLU activations of the last gate|up run above
    compare(("gemm_grouped down" + tag).c_str(), 2.0 * n * k * H * I, yd, true, [&](int v) {
      const cuda::GemmOutput o{yd.get(), cuda::GemmOutType::kBF16, H, cuda::GemmEpilogue::kStore};
      KernelScope scope(v);
      if (v > 0)
        cuda::gemm_grouped(Dn.dev, E, act.get(), I, false, n, k, rv, o, 0);
      else
        cuda::gemm_v1::gemm_grouped(Dn.dev, E, act.get(), I, false, n, k, rv, o, 0);
    });
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace tansy
