// The sparse MoE block (src/cuda/moe/, and the grouped GEMM of src/cuda/gemm/) against
// cpu::route_topk, cpu::matmul per expert + cpu::swiglu and the weighted combine: routing (alone and
// fused into the router product), the routed experts of decode, and MoE prefill (routing sort, grouped
// gate|up and down, combine). Tolerances in gpu_test_util.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/ops.h"
#include "cuda/gemm/gemm.cuh"
#include "cuda/matvec/matvec.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/norm/norm.cuh"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

// ---- routing ----

TEST(Moe, RouteTopkTiesAtTheBoundary) {
  // Equal logits across the top-k boundary, in one lane (experts 1 and 33) and across lanes (20):
  // the lower expert indices are chosen, as cpu::route_topk does.
  const int E = 40, k = 2;
  std::vector<float> l(E);
  for (int e = 0; e < E; ++e) l[e] = -0.01f * float(e);
  l[33] = l[20] = l[1] = 5.f;
  DeviceBuffer<float> dl = to_device(l);
  DeviceBuffer<int> idx(k);
  DeviceBuffer<float> w(k);
  cuda::route_topk(dl.get(), E, 1, E, k, idx.get(), w.get(), 0);
  std::vector<int> ri(k);
  std::vector<float> rw(k);
  cpu::route_topk(l.data(), E, k, ri.data(), rw.data());
  EXPECT_EQ(ri, (std::vector<int>{1, 20}));
  EXPECT_EQ(from_device(idx.get(), k), ri);
  const auto gw = from_device(w.get(), k);
  EXPECT_NEAR(gw[0], 0.5f, 1e-6);
  EXPECT_NEAR(gw[1], 0.5f, 1e-6);
}

TEST(Moe, RouteTopk) {
  for (auto [E, k, n] :
       {std::tuple{256, 8, 5}, std::tuple{8, 2, 3}, std::tuple{16, 16, 1}, std::tuple{256, 8, 63},
        std::tuple{256, 8, 64}, std::tuple{256, 8, 65}, std::tuple{256, 8, 4099}}) {
    const int ld = E + 2;
    auto logits = randn(size_t(n) * ld, 2.f);
    // a tie between two of the largest: the lower index must win
    logits[5] = logits[9] = 50.f;
    DeviceBuffer<float> dl = to_device(logits);
    DeviceBuffer<int> idx(size_t(n) * k);
    DeviceBuffer<float> w(size_t(n) * k);
    poison(idx);
    poison(w);
    cuda::route_topk(dl.get(), ld, n, E, k, idx.get(), w.get(), 0);
    const auto gi = from_device(idx.get(), idx.size());
    const auto gw = from_device(w.get(), w.size());
    for (int t = 0; t < n; ++t) {
      std::vector<int> ri(k);
      std::vector<float> rw(k);
      cpu::route_topk(&logits[size_t(t) * ld], E, k, ri.data(), rw.data());
      // compare as sets keyed by expert (order within equal weights may differ)
      std::vector<std::pair<int, float>> a, b;
      for (int j = 0; j < k; ++j) {
        a.push_back({gi[size_t(t) * k + j], gw[size_t(t) * k + j]});
        b.push_back({ri[j], rw[j]});
      }
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(a[j].first, b[j].first) << "E=" << E << " token " << t;
        EXPECT_NEAR(a[j].second, b[j].second, 1e-5) << "E=" << E << " token " << t;
      }
    }
    std::printf("  route_topk E=%d k=%d n=%d checked\n", E, k, n);
  }
}

TEST(Moe, RouterWithRouting) {
  for (auto [E, k, H, shared] : {std::tuple{256, 8, 2048, true}, std::tuple{8, 2, 64, true},
                                 std::tuple{16, 4, 128, false}, std::tuple{512, 10, 256, true}}) {
    const int rows = E + 2;  // experts | shared gate | pad
    TestMatrix W = make_matrix(WFormat::kAffine8, rows, H);
    const NormCase c = make_norm_case(H);
    NormDev d(c);
    DeviceBuffer<float> logits(rows);
    DeviceBuffer<int> idx(k + 1);
    DeviceBuffer<float> w(k + 1);
    DeviceBuffer<unsigned> counter(1);
    CUDA_CHECK(cudaMemset(counter.get(), 0, 4));
    cuda::RouteEpilogue re;
    re.E = E;
    re.k = k;
    re.shared_slot = shared;
    re.idx = idx.get();
    re.w = w.get();
    re.counter = counter.get();
    for (int rep = 0; rep < 3; ++rep) {  // the counter must come back to zero for the next launch
      poison(idx);
      poison(w);
      poison(logits);
      cuda::matvec_norm_route(W.dev, d.in, logits.get(), re, 0);
      const auto gl = from_device(logits.get(), rows);
      std::vector<float> ref(rows);
      cpu::matmul(W.host, c.x.data(), 1, ref.data());
      if (rep == 0) EXPECT_REL(gl, ref, 3e-3, "router logits E=" + std::to_string(E));
      // routing from the kernel's own logits must match the CPU's exactly
      std::vector<int> ri(k);
      std::vector<float> rw(k);
      cpu::route_topk(gl.data(), E, k, ri.data(), rw.data());
      const auto gi = from_device(idx.get(), k + 1);
      const auto gw = from_device(w.get(), k + 1);
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(gi[j], ri[j]) << "E=" << E << " slot " << j << " rep " << rep;
        EXPECT_NEAR(gw[j], rw[j], 1e-5) << "E=" << E << " slot " << j;
      }
      if (shared) {
        EXPECT_EQ(gi[k], E) << "shared slot";
        EXPECT_NEAR(gw[k], 1.f / (1.f + std::exp(-gl[E])), 1e-5) << "shared weight";
      }
      EXPECT_EQ(from_device(counter.get(), 1)[0], 0u) << "counter reset";
    }
    std::printf("  router+routing E=%d k=%d H=%d shared=%d: 3 launches checked\n", E, k, H, int(shared));
  }
}

// ---- decode experts ----

// Routed experts: gate|up per slot, then down + weighted combine + gated shared expert.
void check_experts(WFormat fmt, int E, int H, int I, int k, int n) {
  TestMatrix GU = make_matrix(fmt, E * 2 * I, H);
  TestMatrix D = make_matrix(fmt, E * H, I);
  auto x = randn(size_t(n) * H);
  round_bf16_inplace(x);
  std::vector<int> idx(size_t(n) * k);
  std::vector<float> wts(size_t(n) * k);
  for (int t = 0; t < n; ++t) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    float s = 0;
    for (int j = 0; j < k; ++j) {
      idx[size_t(t) * k + j] = perm[j];
      wts[size_t(t) * k + j] = std::uniform_real_distribution<float>(0.05f, 1.f)(rng());
      s += wts[size_t(t) * k + j];
    }
    for (int j = 0; j < k; ++j) wts[size_t(t) * k + j] /= s;
  }
  auto shared = randn(size_t(n) * H, 0.5f);
  round_bf16_inplace(shared);
  const int ld = 7;  // shared gate logit in column 3 of rows 7 apart
  auto logits = randn(size_t(n) * ld);

  // reference
  std::vector<float> act_ref(size_t(n) * k * I), out_ref(size_t(n) * H);
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < k; ++j) {
      const int e = idx[size_t(t) * k + j];
      std::vector<float> rows(2 * I);
      cpu::matmul(GU.host.rows(e * 2 * I, 2 * I), &x[size_t(t) * H], 1, rows.data());
      const auto a = swiglu_ref(rows, 1, I);
      std::copy(a.begin(), a.end(), &act_ref[(size_t(t) * k + j) * I]);
    }
  }
  // down reads the kernel's own bf16 activations (checked separately above)
  DeviceBuffer<int> didx = to_device(idx);
  DeviceBuffer<float> dw = to_device(wts), dlog = to_device(logits);
  auto dx = to_device_bf16(x);
  DeviceBuffer<bf16> act(size_t(n) * k * I);
  poison(act);
  cuda::matvec_swiglu_experts(GU.dev, E, didx.get(), n, k, dx.get(), H, act.get(), 0);
  const auto act_got = from_device_bf16(act.get(), act.size());
  EXPECT_REL(act_got, act_ref, kTolBf16,
             std::string("experts gate|up ") + fmt_name(fmt) + " E=" + std::to_string(E) +
                 " n=" + std::to_string(n));
  for (int t = 0; t < n; ++t) {
    const float sg = 1.f / (1.f + std::exp(-logits[size_t(t) * ld + 3]));
    for (int r = 0; r < H; ++r) out_ref[size_t(t) * H + r] = sg * shared[size_t(t) * H + r];
    for (int j = 0; j < k; ++j) {
      const int e = idx[size_t(t) * k + j];
      std::vector<float> y(H);
      cpu::matmul(D.host.rows(e * H, H), &act_got[(size_t(t) * k + j) * I], 1, y.data());
      for (int r = 0; r < H; ++r) out_ref[size_t(t) * H + r] += wts[size_t(t) * k + j] * y[r];
    }
  }
  auto dout = to_device_bf16(shared);  // shared output aliases out, as in the backend
  cuda::moe_down_combine(D.dev, E, didx.get(), dw.get(), act.get(), n, k, dout.get(), dlog.get() + 3, ld,
                         dout.get(), 0);
  EXPECT_REL(from_device_bf16(dout.get(), dout.size()), out_ref, kTolBf16, "  experts down + combine");
}

// The routing sort's permutation, offsets and tiles (of `bm` rows) against the ids it was given.
::testing::AssertionResult route_sort_matches(const std::vector<int>& idx, int E, DeviceRouting& R,
                                              int bm = cuda::kGroupedBM) {
  const int rows = int(idx.size());
  const auto off = from_device(R.offsets.get(), E + 1), tiles = from_device(R.tiles.get(), E + 1);
  const auto sorted = from_device(R.sorted.get(), rows), slot_row = from_device(R.slot_row.get(), rows);
  const auto work = from_device(R.work.get(), R.work.size());
  std::vector<int> count(E, 0);
  for (int e : idx) ++count[e];
  if (off[0] != 0 || tiles[0] != 0) return ::testing::AssertionFailure() << "offsets do not start at 0";
  for (int e = 0; e < E; ++e)
    if (off[e + 1] - off[e] != count[e] || tiles[e + 1] - tiles[e] != (count[e] + bm - 1) / bm)
      return ::testing::AssertionFailure()
             << "expert " << e << ": offsets or tiles do not match its count " << count[e];
  std::vector<int> seen(rows, 0);
  for (int e = 0; e < E; ++e)
    for (int r = off[e]; r < off[e + 1]; ++r) {
      const int s = sorted[r];
      if (s < 0 || s >= rows || idx[s] != e || slot_row[s] != r || ++seen[s] != 1)
        return ::testing::AssertionFailure()
               << "sorted row " << r << " (expert " << e << ") holds slot " << s;
    }
  for (int e = 0; e < E; ++e)
    if (work[e] != 0) return ::testing::AssertionFailure() << "count " << e << " not left zero";
  if (work[2 * E] != 0) return ::testing::AssertionFailure() << "the blocks-done counter was not left zero";
  return ::testing::AssertionSuccess();
}

// Sizes around the sort's 4,096 ids a block, uniform and skewed (a few experts take most rows),
// in tiles of both sizes, each sorted twice on the same counters (a sort must leave them zero for
// the next); every output poisoned before each sort, so that none passes on an earlier one's.
TEST(Moe, RouteSortAcrossBlocks) {
  const int E = 256, k = 8;
  DeviceRouting R;
  for (int n : {1, 511, 512, 513, 4096, 20000}) {
    for (bool skewed : {false, true}) {
      std::vector<int> idx(size_t(n) * k);
      for (int t = 0; t < n; ++t)
        for (int j = 0; j < k; ++j)  // distinct per token; skewed: token t mostly picks experts 0..k+3
          idx[size_t(t) * k + j] =
              skewed ? (t % 5 == 0 ? (t / 5 * k + j) % E : (t + j) % (k + 4)) : (t * 37 + j) % E;
      auto didx = to_device(idx);
      for (const int bm : {cuda::kGroupedBM, cuda::kGroupedSmallBM}) {
        const cuda::MoeRouting rv = R.view(E, n * k, bm);
        for (int round = 0; round < 2; ++round) {
          for (DeviceBuffer<int>* b : {&R.sorted, &R.slot_row, &R.offsets, &R.tiles})
            CUDA_CHECK(cudaMemset(b->get(), 0xff, b->bytes()));
          cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
          ASSERT_TRUE(route_sort_matches(idx, E, R, bm))
              << "n=" << n << (skewed ? " skewed" : " uniform") << " " << bm << "-row tiles, round " << round;
        }
      }
    }
  }
}

TEST(Moe, Experts) {
  check_experts(WFormat::kAffine4, 16, 2048, 512, 8, 1);  // real per-expert shapes (16 of 256 experts)
  check_experts(WFormat::kAffine4, 16, 2048, 512, 8, 3);
  check_experts(WFormat::kAffine4, 8, 64, 64, 2, 2);  // tiny golden shapes
  check_experts(WFormat::kBF16, 8, 128, 64, 4, 2);
  check_experts(WFormat::kAffine8, 4, 256, 128, 3, 1);
}

// The batched decode step's gate|up by expert: expert_groups against a CPU grouping (each
// expert's slots in slot order, items of at most 8), and matvec_swiglu_experts_grouped's act
// against matvec_swiglu_experts's (per slot) bit for bit, whose values Moe.Experts checks against
// cpu::matmul. Real columns and top-k + shared slot; uniform and skewed routing (a few experts take
// most slots: items of 8, and a last one partly full).
void check_experts_grouped(int E, int I) {
  const int H = 2048, K = 8, k = K + 1;  // slot K: the shared expert, stacked as expert E
  TestMatrix GU = make_matrix(WFormat::kAffine4, (E + 1) * 2 * I, H);
  ASSERT_TRUE(cuda::experts_grouped_ok(GU.dev, E + 1));
  const int max_slots = cuda::kMaxBatch * k, max_items = cuda::expert_group_items_max(max_slots, E + 1);
  DeviceBuffer<int> sorted(max_slots), count(1);
  DeviceBuffer<int4> items(max_items);
  const cuda::ExpertGroups g{sorted.get(), items.get(), count.get()};
  for (int n : {1, 2, 7, 8, 9, 16, 33, 64}) {
    for (bool skewed : {false, true}) {
      const std::string label =
          "E=" + std::to_string(E) + " n=" + std::to_string(n) + (skewed ? " skewed" : " uniform");
      std::vector<int> idx(size_t(n) * k);
      for (int t = 0; t < n; ++t) {
        std::vector<int> perm(E);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng());
        if (skewed && t % 4 != 0)  // experts 0..11 first, in a random order
          std::stable_partition(perm.begin(), perm.end(), [](int e) { return e < 12; });
        for (int j = 0; j < K; ++j) idx[size_t(t) * k + j] = perm[j];
        idx[size_t(t) * k + K] = E;
      }
      // the grouping on the CPU
      std::vector<int> want_sorted, want_items;
      for (int e = 0; e <= E; ++e) {
        std::vector<int> mine;
        for (int s = 0; s < n * k; ++s)
          if (idx[s] == e) mine.push_back(s);
        for (size_t j = 0; j < mine.size(); j += cuda::kGroupCols)
          want_items.insert(want_items.end(), {e, int(want_sorted.size() + j),
                                               int(std::min<size_t>(cuda::kGroupCols, mine.size() - j)), 0});
        want_sorted.insert(want_sorted.end(), mine.begin(), mine.end());
      }
      const int n_items = int(want_items.size() / 4);
      ASSERT_LE(n_items, cuda::expert_group_items_max(n * k, E + 1)) << label;
      auto didx = to_device(idx);
      auto x = randn(size_t(n) * H);
      round_bf16_inplace(x);
      auto dx = to_device_bf16(x);
      DeviceBuffer<bf16> per_slot(size_t(n) * k * I), grouped(size_t(n) * k * I);
      poison(per_slot);
      poison(grouped);
      CUDA_CHECK(cudaMemset(sorted.get(), 0xff, sorted.bytes()));
      CUDA_CHECK(cudaMemset(items.get(), 0xff, items.bytes()));
      CUDA_CHECK(cudaMemset(count.get(), 0xff, count.bytes()));
      cuda::matvec_swiglu_experts(GU.dev, E + 1, didx.get(), n, k, dx.get(), H, per_slot.get(), 0);
      cuda::matvec_swiglu_experts_grouped(GU.dev, E + 1, didx.get(), n, k, dx.get(), H, grouped.get(), g, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(from_device(count.get(), 1)[0], n_items) << label;
      EXPECT_EQ(from_device(sorted.get(), size_t(n) * k), want_sorted) << label;
      const auto got_items = from_device(reinterpret_cast<const int*>(items.get()), size_t(n_items) * 4);
      EXPECT_EQ(got_items, want_items) << label;
      const auto a = from_device(per_slot.get(), per_slot.size()),
                 b = from_device(grouped.get(), grouped.size());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16))) << label << ": act differs";
    }
  }
}

TEST(Moe, ExpertsGroupedAreThePerSlotBits) {
  check_experts_grouped(32, 128);  // 33 experts of 256 rows
  check_experts_grouped(256, 8);   // the real model's 257 experts (the scan over 9 warps), 16 rows each
}

// ---- prefill ----

// `routing` (n*k expert choices, distinct per token) replaces the random uniform routing.
// expect_tile_rows (0: any): the tile rows grouped_tile_rows must choose for these matrices.
void check_moe(WFormat fmt, int E, int H, int I, int k, int n, const std::vector<int>* routing = nullptr,
               const char* what = "", int expect_tile_rows = 0) {
  std::string label = std::string("moe") + what +
                      (cuda::gemm_kernel() == cuda::GemmKernel::kWgmma          ? " (wgmma)"
                       : cuda::gemm_kernel() == cuda::GemmKernel::kWgmmaGrouped ? " (wgmma-grouped)"
                                                                                : " (mma)") +
                      " E=" + str(E) + " H=" + str(H) + " I=" + str(I) + " k=" + str(k) + " n=" + str(n);
  TestMatrix GU = make_matrix(fmt, E * 2 * I, H);  // per expert: interleaved gate/up rows
  TestMatrix D = make_matrix(fmt, E * H, I);
  auto x = randn(size_t(n) * H);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  std::vector<int> idx;
  std::vector<float> wts;
  random_routing(n, E, k, idx, wts);
  if (routing) idx = *routing;
  auto didx = to_device(idx);
  auto dw = to_device(wts);
  const int rows = n * k;
  if (expect_tile_rows) EXPECT_EQ(cuda::grouped_tile_rows(GU.dev, D.dev, rows, E), expect_tile_rows) << label;

  // Routing sort: a permutation grouping slots by expert, with consistent offsets and tiles, in the
  // tiles the model's plan takes for these matrices under the current kernel choice.
  DeviceRouting R;
  const int bm = cuda::grouped_tile_rows(GU.dev, D.dev, rows, E);
  const cuda::MoeRouting rv = R.view(E, rows, bm);
  CUDA_CHECK(cudaMemset(R.sorted.get(), 0xff, R.sorted.bytes()));
  CUDA_CHECK(cudaMemset(R.slot_row.get(), 0xff, R.slot_row.bytes()));
  cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
  label += " tiles " + str(bm);
  ASSERT_TRUE(route_sort_matches(idx, E, R, bm)) << label;
  const auto off = from_device(R.offsets.get(), E + 1);
  const auto slot_row = from_device(R.slot_row.get(), rows);

  // gate|up with the SwiGLU epilogue, token rows gathered in place.
  DeviceBuffer<bf16> act(size_t(rows) * I);
  poison(act);
  cuda::gemm_grouped(GU.dev, E, dx.get(), H, /*gather=*/true, n, k, rv,
                     {act.get(), cuda::GemmOutType::kBF16, I, cuda::GemmEpilogue::kSwiGlu}, 0);
  const auto hact = from_device_bf16(act.get(), act.size());
  // Reference per expert over the tokens routed to it (one cpu::matmul per expert).
  std::vector<float> ref_act(size_t(rows) * I), got_act(size_t(rows) * I);
  for (int e = 0; e < E; ++e) {
    std::vector<int> slots;
    for (int s = 0; s < rows; ++s)
      if (idx[s] == e) slots.push_back(s);
    if (slots.empty()) continue;
    std::vector<float> xe, ye(slots.size() * 2 * I);
    for (int s : slots) xe.insert(xe.end(), x.begin() + size_t(s / k) * H, x.begin() + size_t(s / k + 1) * H);
    cpu::matmul(GU.host.rows(e * 2 * I, 2 * I), xe.data(), int(slots.size()), ye.data());
    for (size_t j = 0; j < slots.size(); ++j)
      for (int i = 0; i < I; ++i)
        ref_act[size_t(slots[j]) * I + i] = silu(ye[j * 2 * I + 2 * i]) * ye[j * 2 * I + 2 * i + 1];
  }
  for (int s = 0; s < rows; ++s)
    std::copy_n(hact.begin() + size_t(slot_row[s]) * I, I, got_act.begin() + size_t(s) * I);
  EXPECT_REL(got_act, ref_act, kTolBf16, label + " gate|up swiglu");

  // down_proj over the sorted activations (no gather); reference fed the GPU's activations.
  DeviceBuffer<bf16> yd(size_t(rows) * H);
  poison(yd);
  cuda::gemm_grouped(D.dev, E, act.get(), I, /*gather=*/false, n, k, rv,
                     {yd.get(), cuda::GemmOutType::kBF16, H, cuda::GemmEpilogue::kStore}, 0);
  const auto hyd = from_device_bf16(yd.get(), yd.size());
  std::vector<float> ref_yd(size_t(rows) * H), got_yd(size_t(rows) * H);
  for (int e = 0; e < E; ++e) {
    if (off[e + 1] == off[e]) continue;
    const int cnt = off[e + 1] - off[e];
    cpu::matmul(D.host.rows(e * H, H), hact.data() + size_t(off[e]) * I, cnt,
                ref_yd.data() + size_t(off[e]) * H);
  }
  EXPECT_REL(hyd, ref_yd, kTolBf16, label + " down");

  // Combine into the residual in place, with the gated shared expert (logit in column 1 of rows 3 apart).
  auto resid = randn(size_t(n) * H);
  auto shared = randn(size_t(n) * H, 0.5f);
  auto logits = randn(size_t(n) * 3);
  round_bf16_inplace(resid);
  round_bf16_inplace(shared);
  auto dres = to_device_bf16(resid), dsh = to_device_bf16(shared);
  auto dlog = to_device(logits);
  cuda::moe_combine(yd.get(), R.slot_row.get(), dw.get(), n, k, H, dres.get(), dsh.get(), dlog.get() + 1, 3,
                    dres.get(), 0);
  std::vector<float> ref_out(size_t(n) * H);
  for (int t = 0; t < n; ++t) {
    const float sg = sigmoid(logits[size_t(t) * 3 + 1]);
    for (int d = 0; d < H; ++d) {
      float acc = 0;
      for (int j = 0; j < k; ++j) acc += wts[size_t(t) * k + j] * hyd[size_t(slot_row[t * k + j]) * H + d];
      ref_out[size_t(t) * H + d] = resid[size_t(t) * H + d] + acc + sg * shared[size_t(t) * H + d];
    }
  }
  EXPECT_REL(from_device_bf16(dres.get(), dres.size()), ref_out, kTolBf16, label + " combine");
}

// Runs the grouped cases under one prefill GEMM kernel (gemm_set_kernel), restoring the default after.
struct GemmKernelScope {
  cuda::GemmKernel saved = cuda::gemm_kernel();
  explicit GemmKernelScope(cuda::GemmKernel k) { cuda::gemm_set_kernel(k); }
  ~GemmKernelScope() { cuda::gemm_set_kernel(saved); }
};

// short: the tile rows the real shapes take at up to 16 rows an expert under the kernel in force
// (kGroupedSmallBM under mma.sync; the wgmma kernels take kGroupedBM).
void grouped_cases(int short_tiles) {
  check_moe(WFormat::kAffine4, 256, 2048, 512, 8, 1, nullptr, "", short_tiles);      // real shapes, one token
  check_moe(WFormat::kAffine4, 256, 2048, 512, 8, 200, nullptr, "", short_tiles);    // most experts 1 tile
  check_moe(WFormat::kAffine4, 8, 256, 128, 2, 300, nullptr, "", cuda::kGroupedBM);  // ~75 rows an expert
  for (int n : {63, 64, 65}) {  // every row to expert 1 (expert 0 empty): one expert's rows around a tile
    const std::vector<int> all_to_1(n, 1);
    check_moe(WFormat::kAffine4, 2, 256, 128, 1, n, &all_to_1, " one expert");
  }
  // real shapes, 16 rows an expert: the last prompt length of the short tiles
  check_moe(WFormat::kAffine4, 256, 2048, 512, 8, 512, nullptr, "", short_tiles);
  check_moe(WFormat::kAffine4, 256, 2048, 512, 8, 513, nullptr, "", cuda::kGroupedBM);  // one row more
  check_moe(WFormat::kAffine4, 8, 192, 192, 2, 150);  // 3 k-tiles per product: odd step counts, items
                                                      // ending between the two A buffers of a trip
  check_moe(WFormat::kAffine8, 4, 128, 64, 1, 65, nullptr, "", cuda::kGroupedBM);  // 8-bit, top-1
  check_moe(WFormat::kBF16, 16, 192, 64, 4, 33, nullptr, "", cuda::kGroupedBM);    // bf16: 64-row tiles
  check_moe(WFormat::kAffine4, 8, 64, 64, 2, 6, nullptr, " narrow",
            cuda::kGroupedBM);  // in = 64: no run of scales
}

TEST(Moe, Grouped) {
  GemmKernelScope scope(cuda::GemmKernel::kMma);
  grouped_cases(cuda::kGroupedSmallBM);
}
TEST(Moe, GroupedAuto) {  // the model's choice: mma.sync and short tiles below 128 rows an expert
  GemmKernelScope scope(cuda::GemmKernel::kAuto);
  grouped_cases(cuda::kGroupedSmallBM);
}
TEST(Moe, GroupedWgmma) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmma);
  grouped_cases(cuda::kGroupedBM);
}
TEST(Moe, GroupedWgmmaGrouped) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmmaGrouped);
  grouped_cases(cuda::kGroupedBM);
}

// One grouped product into a poisoned f32 [n*k][cols] buffer (NaN where nothing is written), with
// its rows put back in slot order (slot_row: the sort's sorted row of each slot).
std::vector<float> grouped_by_slot(const cuda::DevLinear& W, int E, const bf16* X, int64_t ldx, bool gather,
                                   int n, int k, const cuda::MoeRouting& rv, const std::vector<int>& slot_row,
                                   int cols) {
  const int rows = n * k;
  DeviceBuffer<float> y(size_t(rows) * cols);
  poison(y);
  cuda::gemm_grouped(W, E, X, ldx, gather, n, k, rv,
                     {y.get(), cuda::GemmOutType::kF32, cols, cuda::GemmEpilogue::kStore}, 0);
  const auto sorted = from_device(y.get(), y.size());
  std::vector<float> out(sorted.size());
  for (int s = 0; s < rows; ++s)
    std::copy_n(sorted.begin() + size_t(slot_row[s]) * cols, cols, out.begin() + size_t(s) * cols);
  return out;
}

// A row's sums do not depend on the tile that holds it: the grouped products' f32 outputs in 16-row
// tiles are the bits of 64-row tiles, slot by slot (each sort orders an expert's rows its own way),
// at the real shapes with uniform routing and with one expert taking every token (32 short tiles).
TEST(Moe, GroupedShortTilesAreTheLongTilesBits) {
  GemmKernelScope scope(cuda::GemmKernel::kMma);
  constexpr int E = 256, k = 8, H = 2048, I = 512;
  TestMatrix GU = make_matrix(WFormat::kAffine4, E * 2 * I, H);
  TestMatrix D = make_matrix(WFormat::kAffine4, E * H, I);
  for (const int n : {1, 37, 256, 512}) {
    for (const bool skewed : {false, true}) {
      std::vector<int> idx;
      std::vector<float> wts;
      random_routing(n, E, k, idx, wts);
      if (skewed)
        for (int t = 0; t < n; ++t) {  // expert 0 first for every token, the others kept distinct
          for (int j = 0; j < k; ++j)
            if (idx[size_t(t) * k + j] == 0) idx[size_t(t) * k + j] = idx[size_t(t) * k];
          idx[size_t(t) * k] = 0;
        }
      const int rows = n * k;
      ASSERT_EQ(cuda::grouped_tile_rows(GU.dev, D.dev, rows, E), cuda::kGroupedSmallBM);
      auto x = randn(size_t(n) * H);
      round_bf16_inplace(x);
      auto dx = to_device_bf16(x);
      auto didx = to_device(idx);
      // by slot: gate|up f32 [slot][2I], down f32 [slot][H] (down fed the same activations by slot)
      auto run = [&](int bm) {
        DeviceRouting R;
        const cuda::MoeRouting rv = R.view(E, rows, bm);
        cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
        const auto slot_row = from_device(R.slot_row.get(), rows);
        const auto hgu = grouped_by_slot(GU.dev, E, dx.get(), H, true, n, k, rv, slot_row, 2 * I);
        std::vector<float> act_by_slot(size_t(rows) * I);  // an activation per slot, from a fixed seed
        for (int s = 0; s < rows; ++s)
          for (int i = 0; i < I; ++i) act_by_slot[size_t(s) * I + i] = std::sin(0.01f * float(s * I + i));
        round_bf16_inplace(act_by_slot);
        std::vector<float> act_sorted(act_by_slot.size());
        for (int s = 0; s < rows; ++s)
          std::copy_n(act_by_slot.begin() + size_t(s) * I, I, act_sorted.begin() + size_t(slot_row[s]) * I);
        auto dact = to_device_bf16(act_sorted);
        const auto hdn = grouped_by_slot(D.dev, E, dact.get(), I, false, n, k, rv, slot_row, H);
        std::vector<float> by_slot(size_t(rows) * (2 * I + H));
        for (int s = 0; s < rows; ++s) {
          std::copy_n(hgu.begin() + size_t(s) * 2 * I, 2 * I, by_slot.begin() + size_t(s) * (2 * I + H));
          std::copy_n(hdn.begin() + size_t(s) * H, H, by_slot.begin() + size_t(s) * (2 * I + H) + 2 * I);
        }
        return by_slot;
      };
      const auto long_tiles = run(cuda::kGroupedBM), short_tiles = run(cuda::kGroupedSmallBM);
      const std::string label = "n=" + str(n) + (skewed ? " skewed" : " uniform");
      ASSERT_TRUE(all_finite(long_tiles)) << label << ": 64-row tiles left rows unwritten";
      EXPECT_EQ(0, std::memcmp(long_tiles.data(), short_tiles.data(), long_tiles.size() * sizeof(float)))
          << label << ": 16-row tiles give other bits than 64-row tiles";
    }
  }
}

// The 16-row tiles read their weights as boxes of 128 rows of the stacked matrices (2-D tensor
// copies): a column tile past an expert's last row takes the next expert's rows, or zeros past the
// last expert, which must reach no stored output. Experts of 200 rows (a partial column tile each,
// 20 tokens top-2 over 3 experts: at most 16 rows an expert on average): the f32 outputs, slot by
// slot, are the bits of the 64-row tiles (per-thread copies of clamped rows), and every one is
// written.
TEST(Moe, GroupedShortTilesPartialColumnTiles) {
  GemmKernelScope scope(cuda::GemmKernel::kMma);
  constexpr int E = 3, k = 2, in = 512, out = 200, n = 20, rows = n * k;
  TestMatrix W = make_matrix(WFormat::kAffine4, E * out, in);
  std::vector<int> idx;
  std::vector<float> wts;
  random_routing(n, E, k, idx, wts);
  auto x = randn(size_t(n) * in);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  auto didx = to_device(idx);
  auto run = [&](int bm) {
    DeviceRouting R;
    const cuda::MoeRouting rv = R.view(E, rows, bm);
    cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
    return grouped_by_slot(W.dev, E, dx.get(), in, true, n, k, rv, from_device(R.slot_row.get(), rows), out);
  };
  const auto long_tiles = run(cuda::kGroupedBM), short_tiles = run(cuda::kGroupedSmallBM);
  ASSERT_TRUE(all_finite(long_tiles)) << "64-row tiles left outputs unwritten";
  ASSERT_TRUE(all_finite(short_tiles)) << "16-row tiles left outputs unwritten";
  EXPECT_EQ(0, std::memcmp(long_tiles.data(), short_tiles.data(), long_tiles.size() * sizeof(float)))
      << "16-row tiles give other bits than 64-row tiles on partial column tiles";
}

// Uneven loads: one expert takes every token (thousands of rows: tens of 64-row tiles), one takes a
// single token, a third of the experts take none, the rest share the remaining choices at random.
void uneven_cases() {
  auto skewed = [](int n, int E, int k) {
    std::vector<int> idx(size_t(n) * k);
    std::vector<int> perm(E - 2 - E / 3);  // experts 2 .. E - E/3 - 1; the last E/3 get nothing
    for (int t = 0; t < n; ++t) {
      std::iota(perm.begin(), perm.end(), 2);
      std::shuffle(perm.begin(), perm.end(), rng());
      idx[size_t(t) * k] = 0;
      for (int j = 1; j < k; ++j) idx[size_t(t) * k + j] = t == 0 && j == 1 ? 1 : perm[j - 1];
    }
    return idx;
  };
  {
    const auto r = skewed(1500, 32, 4);
    check_moe(WFormat::kAffine4, 32, 2048, 512, 4, 1500, &r, " uneven");  // real per-expert shapes
  }
  {  // the real model at 400 tokens: expert 0 takes every token, in 16-row tiles under mma.sync
    const auto r = skewed(400, 256, 8);
    check_moe(WFormat::kAffine4, 256, 2048, 512, 8, 400, &r, " uneven");
  }
  {
    const auto r = skewed(65, 12, 3);
    check_moe(WFormat::kAffine4, 12, 256, 128, 3, 65, &r, " uneven");
  }
  {
    const auto r = skewed(130, 9, 2);
    check_moe(WFormat::kBF16, 9, 192, 64, 2, 130, &r, " uneven");
  }
}

TEST(Moe, GroupedUnevenExperts) {
  GemmKernelScope scope(cuda::GemmKernel::kMma);
  uneven_cases();
}
TEST(Moe, GroupedUnevenExpertsWgmma) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmma);
  uneven_cases();
}
TEST(Moe, GroupedUnevenExpertsWgmmaGrouped) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmmaGrouped);
  uneven_cases();
}

// The fused combine + RMSNorm against the two launches it replaces (moe_combine into r, then
// add_rmsnorm): the same bits in h and xn, at the model's shape and at small ones, with and
// without the shared expert. Also against the host: h + Σ_j w_j·Yd[slot_row] + sigmoid(logit)·shared
// in f32, then cpu::rmsnorm.
TEST(Moe, CombineAddRmsnormIsTheTwoLaunches) {
  for (auto [n, d, k, with_shared] : {std::tuple{4096, 2048, 8, true}, std::tuple{1, 2048, 8, true},
                                      std::tuple{7, 64, 2, false}, std::tuple{3, 1024, 4, true}}) {
    const std::string label =
        "n=" + str(n) + " d=" + str(d) + " k=" + str(k) + (with_shared ? " shared" : "");
    const int rows = n * k;
    auto yd = randn(size_t(rows) * d), sh = randn(size_t(n) * d, 0.5f), h = randn(size_t(n) * d, 3.f);
    auto logits = randn(size_t(n) * 3), w = randn(d, 0.2f, 1.f);
    std::vector<int> perm(rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    std::vector<float> wts(rows);
    for (float& x : wts) x = std::uniform_real_distribution<float>(0.f, 0.3f)(rng());
    yd[0] = -0.f;            // a signed zero through the mixture
    round_bf16_inplace(yd);  // the values the device holds (bf16), for the host reference
    round_bf16_inplace(sh);
    auto dyd = to_device_bf16(yd), dsh = to_device_bf16(sh);
    auto dlog = to_device(logits), dw = to_device(w), dwts = to_device(wts);
    auto dperm = to_device(perm);
    DeviceBuffer<float> h_two = to_device(h), h_one = to_device(h);
    DeviceBuffer<bf16> r(size_t(n) * d), xn_two(size_t(n) * d), xn_one(size_t(n) * d);
    poison(xn_two);
    poison(xn_one);
    const bf16* shp = with_shared ? dsh.get() : nullptr;
    const float* slp = with_shared ? dlog.get() + 1 : nullptr;
    cuda::moe_combine(dyd.get(), dperm.get(), dwts.get(), n, k, d, nullptr, shp, slp, 3, r.get(), 0);
    cuda::add_rmsnorm(h_two.get(), r.get(), dw.get(), n, d, 1e-6f, xn_two.get(), 0);
    cuda::moe_combine_add_rmsnorm(dyd.get(), dperm.get(), dwts.get(), n, k, d, shp, slp, 3, h_one.get(),
                                  dw.get(), 1e-6f, xn_one.get(), 0);
    const auto a = from_device(h_two.get(), h_two.size()), b = from_device(h_one.get(), h_one.size());
    const auto xa = from_device_bf16(xn_two.get(), xn_two.size()),
               xb = from_device_bf16(xn_one.get(), xn_one.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << label << ": h differs";
    EXPECT_EQ(0, std::memcmp(xa.data(), xb.data(), xa.size() * sizeof(float))) << label << ": xn differs";
    EXPECT_GT(max_abs_diff(a, h), 0.f) << label << ": h was not updated";
    // Host reference, independent of the device: the combine in f32 (as check_moe's), then the norm.
    std::vector<float> ref_r(size_t(n) * d), ref_h(size_t(n) * d), ref_xn(size_t(n) * d),
        got_r(size_t(n) * d);
    for (int t = 0; t < n; ++t) {
      const float sg = with_shared ? sigmoid(logits[size_t(t) * 3 + 1]) : 0.f;
      for (int c = 0; c < d; ++c) {
        const size_t i = size_t(t) * d + c;
        float acc = 0;
        for (int j = 0; j < k; ++j)
          acc += wts[size_t(t) * k + j] * yd[size_t(perm[size_t(t) * k + j]) * d + c];
        if (with_shared) acc += sg * sh[i];
        ref_r[i] = acc;
        ref_h[i] = h[i] + acc;
        got_r[i] = b[i] - h[i];
      }
      cpu::rmsnorm(&ref_h[size_t(t) * d], w.data(), d, 1e-6f, &ref_xn[size_t(t) * d]);
    }
    EXPECT_REL(b, ref_h, kTolBf16, "combine_add_rmsnorm h " + label);
    EXPECT_REL(got_r, ref_r, kTolBf16, "  its increment h - h0 (the mixture)");
    EXPECT_REL(xb, ref_xn, kTolBf16, "  its xn");
  }
  DeviceBuffer<bf16> y(8 * 4096);
  DeviceBuffer<float> hh(4096);
  DeviceBuffer<int> sr(8);
  EXPECT_THROW(cuda::moe_combine_add_rmsnorm(y.get(), sr.get(), hh.get(), 1, 8, 4096, nullptr, nullptr, 0,
                                             hh.get(), hh.get(), 1e-6f, y.get(), 0),
               Error);  // wider than one block's row
}

TEST(Moe, RejectsBadShapes) {
  DeviceRouting R;
  DeviceBuffer<int> idx(8);
  EXPECT_THROW(cuda::moe_route_sort(idx.get(), 4, 2, cuda::kRouteMaxExperts + 1, R.view(4, 8), 0), Error);
  EXPECT_THROW(cuda::moe_route_sort(idx.get(), 4, 0, 4, R.view(4, 8), 0), Error);
  TestMatrix W = make_matrix(WFormat::kAffine4, 3 * 64, 128);
  DeviceBuffer<bf16> x(8 * 128), y(8 * 64);
  // 192 stacked rows do not split into 5 experts
  EXPECT_THROW(cuda::gemm_grouped(W.dev, 5, x.get(), 128, true, 4, 2, R.view(5, 8),
                                  {y.get(), cuda::GemmOutType::kBF16, 64, cuda::GemmEpilogue::kStore}, 0),
               Error);
  EXPECT_THROW(cuda::moe_combine(y.get(), R.slot_row.get(), nullptr, 4, 2, 60, nullptr, nullptr, nullptr, 0,
                                 y.get(), 0),
               Error);
  // Tiles of 16 rows: only sizes that are built, only 4-bit weights whose rows hold whole runs of 8
  // quant groups (in = 128 holds 2), only on the mma.sync kernel (the per-tile wgmma kernel reads 64)
  EXPECT_THROW(cuda::moe_route_sort(idx.get(), 4, 2, 4, R.view(4, 8, 32), 0), Error);
  {
    GemmKernelScope scope(cuda::GemmKernel::kMma);
    const cuda::GemmOutput o{y.get(), cuda::GemmOutType::kBF16, 64, cuda::GemmEpilogue::kStore};
    EXPECT_THROW(cuda::gemm_grouped(W.dev, 3, x.get(), 128, true, 4, 2, R.view(3, 8, 32), o, 0), Error);
    EXPECT_THROW(
        cuda::gemm_grouped(W.dev, 3, x.get(), 128, true, 4, 2, R.view(3, 8, cuda::kGroupedSmallBM), o, 0),
        Error);
    TestMatrix B = make_matrix(WFormat::kBF16, 3 * 64, 512);
    DeviceBuffer<bf16> xb(8 * 512);
    EXPECT_THROW(
        cuda::gemm_grouped(B.dev, 3, xb.get(), 512, true, 4, 2, R.view(3, 8, cuda::kGroupedSmallBM), o, 0),
        Error);
    // the plan's choice keeps 64-row tiles for both
    EXPECT_EQ(cuda::grouped_tile_rows(W.dev, W.dev, 8, 3), cuda::kGroupedBM);
    EXPECT_EQ(cuda::grouped_tile_rows(B.dev, B.dev, 8, 3), cuda::kGroupedBM);
  }
  {
    TestMatrix W4 = make_matrix(WFormat::kAffine4, 3 * 64, 512);  // 8 quant groups a row
    DeviceBuffer<bf16> x4(8 * 512);
    const cuda::GemmOutput o{y.get(), cuda::GemmOutType::kBF16, 64, cuda::GemmEpilogue::kStore};
    for (const auto kernel : {cuda::GemmKernel::kAuto, cuda::GemmKernel::kMma, cuda::GemmKernel::kWgmma,
                              cuda::GemmKernel::kWgmmaGrouped}) {
      GemmKernelScope scope(kernel);
      const bool mma = kernel == cuda::GemmKernel::kAuto || kernel == cuda::GemmKernel::kMma;
      // up to 16 rows an expert on average, on the mma.sync kernel alone
      EXPECT_EQ(cuda::grouped_tile_rows(W4.dev, W4.dev, 48, 3),
                mma ? cuda::kGroupedSmallBM : cuda::kGroupedBM);
      EXPECT_EQ(cuda::grouped_tile_rows(W4.dev, W4.dev, 49, 3), cuda::kGroupedBM);
      EXPECT_EQ(cuda::grouped_tile_rows(W4.dev, W.dev, 8, 3), cuda::kGroupedBM);  // one of the two narrow
      if (kernel == cuda::GemmKernel::kWgmma)
        EXPECT_THROW(cuda::gemm_grouped(W4.dev, 3, x4.get(), 512, true, 4, 2,
                                        R.view(3, 8, cuda::kGroupedSmallBM), o, 0),
                     Error);
    }
  }
  // gate|up by expert: only experts with tensor-core tiles (2048 columns), and at most the batch's slots
  DeviceBuffer<int> sorted(8), count(1);
  DeviceBuffer<int4> items(8);
  const cuda::ExpertGroups g{sorted.get(), items.get(), count.get()};
  DeviceBuffer<bf16> act(8 * 64);
  EXPECT_FALSE(cuda::experts_grouped_ok(W.dev, 3));
  EXPECT_THROW(cuda::matvec_swiglu_experts_grouped(W.dev, 3, idx.get(), 4, 2, x.get(), 128, act.get(), g, 0),
               Error);
  EXPECT_THROW(cuda::expert_groups(idx.get(), cuda::kMaxBatch + 1, cuda::kRouteMaxTopK, 4, g, 0), Error);
}

}  // namespace
}  // namespace tansy
