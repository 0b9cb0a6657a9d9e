// Gated full attention (src/cuda/attention/) against cpu::rmsnorm + cpu::rope and cpu::attention with
// the sigmoid output gate: decode (qk_norm_rope, the split attention, the fused one-token kernel) and
// prefill (up to a 32K-token context). Inputs are rounded to bf16 first; outputs are poisoned with
// NaN bytes first; tolerances in gpu_test_util.h.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/threadpool.h"
#include "cpu/ops.h"
#include "cuda/attention/attention.cuh"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

// ---- decode ----

TEST(Attention, QkNormRope) {
  const int NH = 16, NKV = 2, hd = 256, rot = 64, n = 3;
  for (int pos0 : {0, 100000}) {
    cuda::QkvLayout L;
    L.n_heads = NH;
    L.n_kv = NKV;
    L.ld = L.v_off() + NKV * hd + 8;
    auto rows = randn(size_t(n) * L.ld, 2.f);
    round_bf16_inplace(rows);
    auto drows = to_device_bf16(rows);
    L.base = drows.get();
    auto qn = randn(hd, 0.1f, 1.f), kn = randn(hd, 0.1f, 1.f);
    DeviceBuffer<float> dqn = to_device(qn), dkn = to_device(kn);
    const int cap = pos0 + n;
    DeviceBuffer<bf16> K(size_t(cap) * NKV * hd), V(size_t(cap) * NKV * hd);
    poison(K);
    poison(V);
    DeviceBuffer<int> dpos = to_device(std::vector<int>{pos0});
    cuda::qk_norm_rope(L, n, dpos.get(), dqn.get(), dkn.get(), 1e-6f, rot, 1e7, K.get(), V.get(), 0);
    const auto got_rows = from_device_bf16(drows.get(), rows.size());
    const auto gk = from_device_bf16(K.get() + size_t(pos0) * NKV * hd, size_t(n) * NKV * hd);
    const auto gv = from_device_bf16(V.get() + size_t(pos0) * NKV * hd, size_t(n) * NKV * hd);
    std::vector<float> q_ref, q_got, k_ref, v_ref;
    for (int t = 0; t < n; ++t) {
      const float* row = &rows[size_t(t) * L.ld];
      for (int h = 0; h < NH; ++h) {
        std::vector<float> q(hd);
        cpu::rmsnorm(row + size_t(h) * 2 * hd, qn.data(), hd, 1e-6f, q.data());
        cpu::rope(q.data(), rot, pos0 + t, 1e7);
        q_ref.insert(q_ref.end(), q.begin(), q.end());
        q_got.insert(q_got.end(), &got_rows[size_t(t) * L.ld + size_t(h) * 2 * hd],
                     &got_rows[size_t(t) * L.ld + size_t(h) * 2 * hd + hd]);
        // the gate half is untouched
        for (int d = 0; d < hd; ++d)
          ASSERT_EQ(got_rows[size_t(t) * L.ld + size_t(h) * 2 * hd + hd + d],
                    row[size_t(h) * 2 * hd + hd + d]);
      }
      for (int j = 0; j < NKV; ++j) {
        std::vector<float> k(hd);
        cpu::rmsnorm(row + L.k_off() + size_t(j) * hd, kn.data(), hd, 1e-6f, k.data());
        cpu::rope(k.data(), rot, pos0 + t, 1e7);
        k_ref.insert(k_ref.end(), k.begin(), k.end());
        v_ref.insert(v_ref.end(), row + L.v_off() + size_t(j) * hd, row + L.v_off() + size_t(j + 1) * hd);
      }
    }
    EXPECT_REL(q_got, q_ref, kTolBf16, "qk_norm_rope q, pos " + std::to_string(pos0));
    EXPECT_REL(gk, k_ref, kTolBf16, "  k -> cache");
    EXPECT_EQ(max_abs_diff(gv, v_ref), 0.0) << "v copied exactly";
  }
}

// Decode attention of n new tokens after ctx cached ones (the prefill check below takes an AttnCase).
void check_attention(int NH, int NKV, int ctx, int n, int splits) {
  const int hd = 256;
  cuda::QkvLayout L;
  L.n_heads = NH;
  L.n_kv = NKV;
  L.ld = L.v_off() + NKV * hd;
  auto rows = randn(size_t(n) * L.ld);
  round_bf16_inplace(rows);
  auto drows = to_device_bf16(rows);
  L.base = drows.get();
  const int total = ctx + n;  // ctx cached before the n new tokens
  auto K = randn(size_t(total) * NKV * hd), V = randn(size_t(total) * NKV * hd);
  round_bf16_inplace(K);
  round_bf16_inplace(V);
  auto dK = to_device_bf16(K), dV = to_device_bf16(V);
  DeviceBuffer<int> dpos = to_device(std::vector<int>{ctx});
  DeviceBuffer<float> scratch(cuda::attn_scratch_floats(n, NH, splits));
  DeviceBuffer<bf16> out(size_t(n) * NH * hd);
  poison(out);
  poison(scratch);
  cuda::attention_decode(L, n, dpos.get(), dK.get(), dV.get(), splits, scratch.get(), out.get(), NH * hd, 0);
  std::vector<float> ref(size_t(n) * NH * hd);
  for (int t = 0; t < n; ++t) {
    std::vector<float> q(size_t(NH) * hd);
    for (int h = 0; h < NH; ++h)
      std::copy(&rows[size_t(t) * L.ld + size_t(h) * 2 * hd],
                &rows[size_t(t) * L.ld + size_t(h) * 2 * hd + hd], &q[size_t(h) * hd]);
    float* o = &ref[size_t(t) * NH * hd];
    cpu::attention(q.data(), K.data(), V.data(), ctx + t + 1, NH, NKV, hd, o);
    for (int h = 0; h < NH; ++h)
      for (int d = 0; d < hd; ++d) {
        const float g = rows[size_t(t) * L.ld + size_t(h) * 2 * hd + hd + d];
        o[size_t(h) * hd + d] *= 1.f / (1.f + std::exp(-g));
      }
  }
  EXPECT_REL(from_device_bf16(out.get(), out.size()), ref, kTolBf16,
             "attention_decode heads " + std::to_string(NH) + "/" + std::to_string(NKV) + " ctx " +
                 std::to_string(ctx) + " n " + std::to_string(n) + " splits " + std::to_string(splits));
}

TEST(Attention, Decode) {
  for (int ctx : {0, 62, 63, 64, 1000, 5000}) check_attention(16, 2, ctx, 1, 64);
  check_attention(16, 2, 40000, 1, 64);
  check_attention(16, 2, 100, 5, 2);  // several new tokens, causal among themselves
  check_attention(16, 2, 0, 70, 1);
  check_attention(2, 1, 10, 3, 4);  // tiny golden heads
}

// One token through attention_decode_fused: q/k norm + RoPE of the pre-norm projection rows, the
// new k/v written into the cache at the position, attention over ctx cached keys plus the new one,
// output gate. Reference: cpu::rmsnorm + cpu::rope (q and k rounded to bf16, as cached/stored),
// cpu::attention, sigmoid gate.
void check_attention_fused(int NH, int NKV, int ctx, int splits) {
  const int hd = 256, rot = 64;
  const float eps = 1e-6f;
  const double theta = 1e7;
  cuda::QkvLayout L;
  L.n_heads = NH;
  L.n_kv = NKV;
  L.ld = L.v_off() + NKV * hd;
  auto row = randn(size_t(L.ld), 2.f);
  round_bf16_inplace(row);
  auto drow = to_device_bf16(row);
  L.base = drow.get();
  auto qn = randn(hd, 0.1f, 1.f), kn = randn(hd, 0.1f, 1.f);
  DeviceBuffer<float> dqn = to_device(qn), dkn = to_device(kn);
  const int cap = ctx + 2;  // the row after the position must stay untouched
  auto K = randn(size_t(cap) * NKV * hd), V = randn(size_t(cap) * NKV * hd);
  round_bf16_inplace(K);
  round_bf16_inplace(V);
  auto dK = to_device_bf16(K), dV = to_device_bf16(V);
  DeviceBuffer<int> dpos = to_device(std::vector<int>{ctx});
  DeviceBuffer<float> scratch(cuda::attn_scratch_floats(1, NH, splits));
  DeviceBuffer<bf16> out(size_t(NH) * hd);
  poison(out);
  poison(scratch);
  cuda::attention_decode_fused(L, dpos.get(), dqn.get(), dkn.get(), eps, rot, theta, dK.get(), dV.get(),
                               splits, scratch.get(), out.get(), NH * hd, 0);
  // The same token again with the splits merged in the kernel (merge_counters): the combine
  // kernel's bits. The cache row it writes holds the same values as the first call's.
  const std::vector<float> combined = from_device_bf16(out.get(), out.size());
  DeviceBuffer<unsigned> counters{size_t(NKV)};
  CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
  poison(out);
  poison(scratch);
  cuda::attention_decode_fused(L, dpos.get(), dqn.get(), dkn.get(), eps, rot, theta, dK.get(), dV.get(),
                               splits, scratch.get(), out.get(), NH * hd, 0, nullptr, counters.get());
  const std::vector<float> merged = from_device_bf16(out.get(), out.size());
  for (size_t i = 0; i < merged.size(); ++i)
    ASSERT_EQ(merged[i], combined[i]) << "attention_decode_fused heads " << NH << "/" << NKV << " ctx " << ctx
                                      << " splits " << splits << ": merged in the kernel, element " << i;
  // reference: the new k/v at row ctx, then attention over ctx + 1 keys
  std::vector<float> q(size_t(NH) * hd);
  for (int h = 0; h < NH; ++h) {
    cpu::rmsnorm(&row[size_t(h) * 2 * hd], qn.data(), hd, eps, &q[size_t(h) * hd]);
    cpu::rope(&q[size_t(h) * hd], rot, ctx, theta);
  }
  round_bf16_inplace(q);
  for (int j = 0; j < NKV; ++j) {
    float* k = &K[(size_t(ctx) * NKV + j) * hd];
    cpu::rmsnorm(&row[L.k_off() + size_t(j) * hd], kn.data(), hd, eps, k);
    cpu::rope(k, rot, ctx, theta);
    for (int d = 0; d < hd; ++d) k[d] = round_bf16(k[d]);
    std::copy(&row[L.v_off() + size_t(j) * hd], &row[L.v_off() + size_t(j + 1) * hd],
              &V[(size_t(ctx) * NKV + j) * hd]);
  }
  std::vector<float> ref(size_t(NH) * hd);
  cpu::attention(q.data(), K.data(), V.data(), ctx + 1, NH, NKV, hd, ref.data());
  for (int h = 0; h < NH; ++h)
    for (int d = 0; d < hd; ++d)
      ref[size_t(h) * hd + d] *= 1.f / (1.f + std::exp(-row[size_t(h) * 2 * hd + hd + d]));
  const std::string what = "attention_decode_fused heads " + std::to_string(NH) + "/" + std::to_string(NKV) +
                           " ctx " + std::to_string(ctx) + " splits " + std::to_string(splits);
  EXPECT_REL(from_device_bf16(out.get(), out.size()), ref, kTolBf16, what);
  // the cache: row ctx holds the new k (bf16-rounded, as the reference) and v exactly; the rest is untouched
  const auto gK = from_device_bf16(dK.get(), K.size()), gV = from_device_bf16(dV.get(), V.size());
  const size_t r0 = size_t(ctx) * NKV * hd, r1 = r0 + size_t(NKV) * hd;
  EXPECT_REL(std::vector<float>(gK.begin() + r0, gK.begin() + r1),
             std::vector<float>(K.begin() + r0, K.begin() + r1), kTolBf16, "  new k in the cache");
  for (size_t i = 0; i < K.size(); ++i) {
    if (i >= r0 && i < r1) {
      ASSERT_EQ(gV[i], V[i]) << what << ": new v at " << i - r0;
      continue;
    }
    ASSERT_EQ(gK[i], K[i]) << what << ": cached k changed at " << i;
    ASSERT_EQ(gV[i], V[i]) << what << ": cached v changed at " << i;
  }
}

TEST(Attention, DecodeFused) {
  // tile (32 keys), stage ring (3 tiles) and split (>= 16 keys) boundaries
  for (int ctx : {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 1000, 4095, 5000})
    check_attention_fused(16, 2, ctx, 64);
  check_attention_fused(16, 2, 40000, 64);
  for (int splits : {1, 2, 7, 128, 256}) check_attention_fused(16, 2, 1000, splits);  // many tiles per split
  check_attention_fused(8, 2, 300, 64);                                               // 4 heads per kv head
  check_attention_fused(4, 2, 300, 64);                                               // 2: the demo model
  check_attention_fused(2, 1, 10, 4);                                                 // 2: tiny goldens
  check_attention_fused(4, 4, 300, 64);                                               // 1
}

// A batched step's attention (AttnDecodeRows: each row its own position and cache) gives every
// row the output and cache row it gets alone, bit for bit: the batched launch runs its blocks with
// fewer tiles in flight (two blocks a multiprocessor), which must not change the arithmetic.
// Contexts across the tile, stage and split boundaries, and a long one (many tiles a split).
TEST(Attention, DecodeFusedBatchedRowsMatchOneRow) {
  const int NH = 16, NKV = 2, hd = 256, rot = 64, splits = 64;
  const float eps = 1e-6f;
  const double theta = 1e7;
  const std::vector<int> ctxs = {0, 1, 31, 32, 95, 97, 1000, 4095, 20000};
  const int n = int(ctxs.size());
  cuda::QkvLayout L;
  L.n_heads = NH;
  L.n_kv = NKV;
  L.ld = L.v_off() + NKV * hd;
  auto rows = randn(size_t(n) * L.ld, 2.f);
  round_bf16_inplace(rows);
  auto qn = randn(hd, 0.1f, 1.f), kn = randn(hd, 0.1f, 1.f);
  DeviceBuffer<float> dqn = to_device(qn), dkn = to_device(kn);
  std::vector<std::vector<float>> K(n), V(n);
  for (int t = 0; t < n; ++t) {
    K[t] = randn(size_t(ctxs[t] + 1) * NKV * hd);
    V[t] = randn(size_t(ctxs[t] + 1) * NKV * hd);
    round_bf16_inplace(K[t]);
    round_bf16_inplace(V[t]);
  }
  // batched: every row in one launch
  auto drows = to_device_bf16(rows);
  L.base = drows.get();
  std::vector<DeviceBuffer<bf16>> dK, dV;
  std::vector<DeviceBuffer<int>> dpos;
  cuda::AttnDecodeRows R;
  R.n = n;
  for (int t = 0; t < n; ++t) {
    dK.push_back(to_device_bf16(K[t]));
    dV.push_back(to_device_bf16(V[t]));
    dpos.push_back(to_device(std::vector<int>{ctxs[t]}));
  }
  for (int t = 0; t < n; ++t) {
    R.pos[t] = dpos[t].get();
    R.k_cache[t] = dK[t].get();
    R.v_cache[t] = dV[t].get();
  }
  DeviceBuffer<float> scratch(cuda::attn_scratch_floats(n, NH, splits));
  DeviceBuffer<bf16> out(size_t(n) * NH * hd);
  poison(out);
  poison(scratch);
  cuda::attention_decode_fused(L, R.pos[0], dqn.get(), dkn.get(), eps, rot, theta, R.k_cache[0], R.v_cache[0],
                               splits, scratch.get(), out.get(), NH * hd, 0, &R);
  const auto got = from_device_bf16(out.get(), out.size());
  for (int t = 0; t < n; ++t) {
    std::vector<float> row1(rows.begin() + size_t(t) * L.ld, rows.begin() + size_t(t + 1) * L.ld);
    auto drow1 = to_device_bf16(row1);
    cuda::QkvLayout L1 = L;
    L1.base = drow1.get();
    auto dK1 = to_device_bf16(K[t]), dV1 = to_device_bf16(V[t]);
    DeviceBuffer<float> scratch1(cuda::attn_scratch_floats(1, NH, splits));
    DeviceBuffer<bf16> out1(size_t(NH) * hd);
    poison(out1);
    poison(scratch1);
    cuda::attention_decode_fused(L1, dpos[t].get(), dqn.get(), dkn.get(), eps, rot, theta, dK1.get(),
                                 dV1.get(), splits, scratch1.get(), out1.get(), NH * hd, 0);
    const auto want = from_device_bf16(out1.get(), out1.size());
    const std::string what =
        "batched attention, row " + std::to_string(t) + " ctx " + std::to_string(ctxs[t]);
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(got[size_t(t) * NH * hd + i], want[i]) << what << ", element " << i;
    EXPECT_EQ(from_device_bf16(dK[t].get(), K[t].size()), from_device_bf16(dK1.get(), K[t].size()))
        << what << ": k cache";
    EXPECT_EQ(from_device_bf16(dV[t].get(), V[t].size()), from_device_bf16(dV1.get(), V[t].size()))
        << what << ": v cache";
  }
}

TEST(Attention, DecodeFusedRejectsBadShapes) {
  cuda::QkvLayout L;
  L.n_heads = 16;
  L.n_kv = 1;  // 16 query heads per kv head: not supported
  L.ld = L.v_off() + 256;
  DeviceBuffer<bf16> rows(L.ld), K(256), V(256), out(16 * 256);
  DeviceBuffer<float> w(256), scratch(cuda::attn_scratch_floats(1, 16, 4));
  DeviceBuffer<int> pos = to_device(std::vector<int>{0});
  L.base = rows.get();
  EXPECT_THROW(cuda::attention_decode_fused(L, pos.get(), w.get(), w.get(), 1e-6f, 64, 1e7, K.get(), V.get(),
                                            4, scratch.get(), out.get(), 16 * 256, 0),
               Error);
  L.n_kv = 2;
  L.ld = L.v_off() + 512;
  DeviceBuffer<bf16> rows2(L.ld);
  L.base = rows2.get();
  EXPECT_THROW(cuda::attention_decode_fused(L, pos.get(), w.get(), w.get(), 1e-6f, 40, 1e7, K.get(), V.get(),
                                            4, scratch.get(), out.get(), 16 * 256, 0),
               Error);  // rotary_dim not a multiple of 16
  EXPECT_THROW(cuda::attention_decode_fused(L, pos.get(), w.get(), w.get(), 1e-6f, 64, 1e7, K.get(), V.get(),
                                            0, scratch.get(), out.get(), 16 * 256, 0),
               Error);  // no split
}

// ---- prefill ----

struct AttnCase {
  int n_heads, n_kv, p0, n;
  bool gate;
  int n_random;  // sampled query rows when n > 256
};

// The prefill kernel under test: attention_prefill as selected (kDefault: the warpgroup kernel
// where it supports the group), the mma.sync kernel (selected for the call), or the warpgroup
// kernel called directly (so that an unsupported shape fails instead of taking mma.sync).
enum class Prefill { kDefault, kMmaSync, kWgmma };

void run_prefill(const cuda::AttnPrefillArgs& a, Prefill k) {
  if (k == Prefill::kWgmma) {
    cuda::attention_prefill_wgmma(a, 0);
  } else if (k == Prefill::kMmaSync) {
    const cuda::AttnPrefillKernel saved = cuda::attention_prefill_current_kernel();
    cuda::attention_prefill_set_kernel(cuda::AttnPrefillKernel::kMmaSync);
    cuda::attention_prefill(a, 0);
    cuda::attention_prefill_set_kernel(saved);
  } else {
    cuda::attention_prefill(a, 0);
  }
}

void check_attention(const AttnCase& c, Prefill kernel = Prefill::kMmaSync) {
  constexpr int hd = cuda::kHeadDim;
  const int ctx = c.p0 + c.n, pad_rows = 40;
  const std::string label = std::string(kernel == Prefill::kWgmma ? "wgmma " : "") + "attention heads " +
                            str(c.n_heads) + "/" + str(c.n_kv) + " p0=" + str(c.p0) + " n=" + str(c.n) +
                            (c.gate ? " gated" : "");
  // Cache [ctx + pad, n_kv, 256]: rows past ctx hold NaN, which must never leak into the output.
  const size_t kv_row = size_t(c.n_kv) * hd;
  auto K = randn(size_t(ctx) * kv_row), V = randn(size_t(ctx) * kv_row);
  round_bf16_inplace(K);
  round_bf16_inplace(V);
  DeviceBuffer<bf16> dK((ctx + pad_rows) * kv_row), dV((ctx + pad_rows) * kv_row);
  poison(dK);
  poison(dV);
  const auto hK = to_bf16(K), hV = to_bf16(V);
  CUDA_CHECK(cudaMemcpy(dK.get(), hK.data(), hK.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dV.get(), hV.data(), hV.size() * 2, cudaMemcpyHostToDevice));
  // Queries in the q_proj layout: per token n_heads x [q (256) | gate (256)], plus 16 spare columns.
  const int64_t ldq = int64_t(c.n_heads) * 2 * hd + 16;
  auto qg = randn(size_t(c.n) * ldq, 1.5f);  // scores of std ~1.5: softmax neither flat nor one-hot
  round_bf16_inplace(qg);
  auto dq = to_device_bf16(qg);
  const int64_t ldo = int64_t(c.n_heads) * hd;
  constexpr int kGuardRows = 2;  // past the last row: must stay untouched
  DeviceBuffer<bf16> out(size_t(c.n + kGuardRows) * ldo);
  poison(out);

  cuda::AttnPrefillArgs a;
  a.q = dq.get();
  a.q_stride_t = ldq;
  a.q_stride_h = 2 * hd;
  a.k_cache = dK.get();
  a.v_cache = dV.get();
  a.p0 = c.p0;
  a.n = c.n;
  a.n_heads = c.n_heads;
  a.n_kv = c.n_kv;
  if (c.gate) {
    a.gate = dq.get() + hd;
    a.gate_stride_t = ldq;
    a.gate_stride_h = 2 * hd;
  }
  a.out = out.get();
  a.out_stride_t = ldo;
  a.out_stride_h = hd;
  run_prefill(a, kernel);
  const auto got_all = from_device_bf16(out.get(), size_t(c.n) * ldo);
  EXPECT_TRUE(all_finite(got_all)) << label << ": unwritten or non-finite output";
  const auto guard = from_device_bf16(out.get() + size_t(c.n) * ldo, size_t(kGuardRows) * ldo);
  EXPECT_TRUE(std::all_of(guard.begin(), guard.end(), [](float x) { return std::isnan(x); }))
      << label << ": wrote past the last row";

  const auto rows = rows_to_check(c.n, c.n_random);
  std::vector<float> ref(rows.size() * ldo);
  ThreadPool::global().parallel_for(int64_t(rows.size()), [&](int64_t r0, int64_t r1) {
    std::vector<float> q(ldo);
    for (int64_t ri = r0; ri < r1; ++ri) {
      const int i = rows[ri];
      for (int h = 0; h < c.n_heads; ++h)
        std::copy_n(qg.begin() + i * ldq + h * 2 * hd, hd, q.begin() + h * hd);
      float* o = ref.data() + ri * ldo;
      cpu::attention(q.data(), K.data(), V.data(), c.p0 + i + 1, c.n_heads, c.n_kv, hd, o);
      if (c.gate)
        for (int h = 0; h < c.n_heads; ++h)
          for (int d = 0; d < hd; ++d) o[h * hd + d] *= sigmoid(qg[i * ldq + h * 2 * hd + hd + d]);
    }
  });
  EXPECT_REL(take_rows(got_all, ldo, int(ldo), rows), ref, kTolBf16, label);
}

TEST(Attention, Prefill) {
  const AttnCase cases[] = {
      {16, 2, 0, 1, false, 0},    {16, 2, 0, 63, true, 0},
      {16, 2, 0, 64, false, 0},   {16, 2, 0, 65, true, 0},
      {16, 2, 0, 200, true, 0},   {16, 2, 37, 200, true, 0},   // continuing a cache
      {16, 2, 0, 4096, true, 24}, {16, 2, 1000, 3, false, 0},  // few queries, long cache
      {4, 2, 0, 65, false, 0},    {6, 1, 10, 70, true, 0},
      {2, 2, 5, 33, false, 0},  // tiny-model groups 2, 6, 1
      {16, 1, 0, 40, true, 0},  // group 16 (the limit)
  };
  for (const auto& c : cases) check_attention(c);
}

TEST(Attention, PrefillLongContext) {
  // ~32K cached positions; a few query rows checked (each reference row costs 32K x 16 heads).
  check_attention({16, 2, 32768 - 64, 64, true, 0});
  check_attention({16, 2, 32768 - 600, 600, false, 3});
}

// Runs the warpgroup kernel with `keys` per K/V tile (and ping-pong on or off), restoring the
// defaults after.
struct WgmmaTileScope {
  int saved = cuda::attention_prefill_wgmma_tile();
  bool saved_pp = cuda::attention_prefill_wgmma_pingpong();
  explicit WgmmaTileScope(int keys, bool pingpong = false) {
    cuda::attention_prefill_wgmma_set_tile(keys);
    cuda::attention_prefill_wgmma_set_pingpong(pingpong);
  }
  ~WgmmaTileScope() {
    cuda::attention_prefill_wgmma_set_tile(saved);
    cuda::attention_prefill_wgmma_set_pingpong(saved_pp);
  }
};
constexpr int kWgmmaTiles[] = {80, 64};

// The warpgroup kernel (prefill_wgmma.cu) against the CPU, both tile sizes with and without
// ping-pong: the real heads at
// lengths across the key-tile and 128-row block (16 positions) edges, continuing caches (first
// positions at and just before a tile end), and the tiny models' groups it supports (1, 2, 4, 16).
TEST(Attention, PrefillWgmma) {
  EXPECT_EQ(cuda::attention_prefill_wgmma_tile(), 80) << "default tile";
  EXPECT_FALSE(cuda::attention_prefill_wgmma_pingpong()) << "default schedule";
  for (const int variant : {0, 1, 2, 3}) {
    const int keys = kWgmmaTiles[variant / 2];
    const bool pingpong = variant % 2 == 0;
    WgmmaTileScope scope(keys, pingpong);
    std::printf("  -- %d keys per tile, ping-pong %s\n", keys, pingpong ? "on" : "off");
    for (int n : {1, 7, 63, 64, 65, 127, 128, 129, 1000, 4096})
      check_attention({16, 2, 0, n, n % 2 == 1, 24}, Prefill::kWgmma);
    const AttnCase cases[] = {
        {16, 2, 37, 200, true, 0},  {16, 2, 1000, 3, false, 0},       {16, 2, 62, 20, true, 0},
        {16, 2, 63, 5, false, 0},   {16, 2, 78, 20, true, 0},         {16, 2, 79, 3, false, 0},
        {16, 2, 126, 140, true, 0}, {16, 2, 158, 30, false, 0},       {16, 2, 1, 16, false, 0},
        {4, 2, 0, 65, false, 0},    {2, 2, 5, 33, true, 0},           {16, 1, 0, 40, true, 0},
        {8, 2, 3, 300, false, 0},   {16, 2, 32768 - 64, 64, true, 0},
    };
    for (const auto& c : cases) check_attention(c, Prefill::kWgmma);
  }
  EXPECT_THROW(cuda::attention_prefill_wgmma_set_tile(96), Error);
}

// Random bf16 values in [-scale, scale) from a hash of the index: fills gigabytes on the device.
__global__ void fill_random_bf16(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ uint32_t(i >> 32) * 0x85EBCA77u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    p[i] = __float2bfloat16((float(h >> 8) * (1.f / 8388608.f) - 1.f) * scale);
  }
}

// One causal prefill of n tokens from position 0 at the real heads (16/2, q in the q_proj
// layout, gated), on device-filled random data.
struct LongPrefill {
  int n;
  DeviceBuffer<bf16> q, k, v, out_a, out_b;
  cuda::AttnPrefillArgs a;
  explicit LongPrefill(int n_)
      : n(n_),
        q(size_t(n_) * 16 * 512),
        k(size_t(n_) * 2 * 256),
        v(size_t(n_) * 2 * 256),
        out_a(size_t(n_) * 16 * 256),
        out_b(size_t(n_) * 16 * 256) {
    // uniform q in [-4, 4) (std 2.3), k in [-1, 1) (std 0.58): scaled scores of std ~1.3, a
    // softmax neither flat nor one-hot
    fill_random_bf16<<<1024, 256>>>(q.get(), q.size(), 1u, 4.f);
    fill_random_bf16<<<1024, 256>>>(k.get(), k.size(), 2u, 1.f);
    fill_random_bf16<<<1024, 256>>>(v.get(), v.size(), 3u, 1.f);
    CUDA_CHECK(cudaGetLastError());
    poison(out_a);
    poison(out_b);
    a.q = q.get();
    a.q_stride_t = 16 * 512;
    a.q_stride_h = 512;
    a.k_cache = k.get();
    a.v_cache = v.get();
    a.p0 = 0;
    a.n = n;
    a.n_heads = 16;
    a.n_kv = 2;
    a.gate = q.get() + 256;
    a.gate_stride_t = 16 * 512;
    a.gate_stride_h = 512;
    a.out_stride_t = 16 * 256;
    a.out_stride_h = 256;
  }
  void run(Prefill kernel, bf16* out) {
    a.out = out;
    run_prefill(a, kernel);
  }
  // causal: sum over queries of (i+1) keys, 2 products (QK, PV) of 2*256 flop each, 16 heads
  double flop() const { return 4.0 * 256 * 16 * (double(n) * (n + 1) / 2); }
};

// Where a wrong element of a probe output came from: the reference index holding its value (a
// layout bug shows as a permutation), printed for the first few mismatches.
void explain_mismatches(const std::vector<float>& got, const std::vector<float>& ref, int cols,
                        const char* what) {
  int shown = 0;
  for (size_t i = 0; i < got.size() && shown < 6; ++i) {
    if (std::fabs(got[i] - ref[i]) <= 1e-3f * (1.f + std::fabs(ref[i]))) continue;
    long match = -1;
    for (size_t j = 0; j < ref.size(); ++j)
      if (std::fabs(got[i] - ref[j]) <= 1e-4f * (1.f + std::fabs(ref[j]))) {
        match = long(j);
        break;
      }
    std::printf("    %s [%zu][%zu] = %g, want %g; the value of [%ld][%ld]\n", what, i / cols, i % cols,
                got[i], ref[i], match < 0 ? -1 : match / cols, match < 0 ? -1 : match % cols);
    ++shown;
  }
}

// The warpgroup kernel's parts alone (attention_prefill_wgmma_probe): the tensor copies of Q
// (16 positions x 8 heads of kv head 0 in the q_proj layout), K and V, their swizzled shared
// layout, the Q·Kᵀ descriptors (K-major) and the P·V ones (V N-major) with P as register
// fragments, both tiles. f32 products of bf16 values: only the summation order differs.
TEST(Attention, PrefillWgmmaProbe) {
  constexpr int hd = 256, NH = 16, NKV = 2, G = 8, n = 16, p0 = 100, kv_len = p0 + n;
  const int64_t ldq = int64_t(NH) * 2 * hd + 16;
  auto qg = randn(size_t(n) * ldq);
  round_bf16_inplace(qg);
  auto K = randn(size_t(kv_len) * NKV * hd), V = randn(size_t(kv_len) * NKV * hd);
  round_bf16_inplace(K);
  round_bf16_inplace(V);
  auto dq = to_device_bf16(qg), dK = to_device_bf16(K), dV = to_device_bf16(V);
  DeviceBuffer<bf16> out(size_t(n) * NH * hd);
  cuda::AttnPrefillArgs a;
  a.q = dq.get();
  a.q_stride_t = ldq;
  a.q_stride_h = 2 * hd;
  a.k_cache = dK.get();
  a.v_cache = dV.get();
  a.p0 = p0;
  a.n = n;
  a.n_heads = NH;
  a.n_kv = NKV;
  a.out = out.get();
  a.out_stride_t = NH * hd;
  a.out_stride_h = hd;
  for (const int keys : kWgmmaTiles) {
    WgmmaTileScope scope(keys);
    std::vector<float> P(size_t(128) * keys);
    for (auto& x : P) x = round_bf16(std::uniform_real_distribution<float>(0.f, 1.f)(rng()));
    auto dP = to_device_bf16(P);
    DeviceBuffer<float> S(size_t(128) * keys), O(size_t(128) * hd);
    poison(S);
    poison(O);
    cuda::attention_prefill_wgmma_probe(a, dP.get(), S.get(), O.get(), 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> s_got(S.size()), o_got(O.size());
    CUDA_CHECK(cudaMemcpy(s_got.data(), S.get(), S.bytes(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(o_got.data(), O.get(), O.bytes(), cudaMemcpyDeviceToHost));
    std::vector<float> s_ref(S.size()), o_ref(O.size(), 0.f);
    for (int r = 0; r < 128; ++r) {
      const float* q = &qg[size_t(r / G) * ldq + size_t(r % G) * 2 * hd];  // kv head 0: heads 0 .. G-1
      for (int k = 0; k < keys; ++k) {
        double acc = 0;
        for (int d = 0; d < hd; ++d) acc += double(q[d]) * K[size_t(k) * NKV * hd + d];
        s_ref[size_t(r) * keys + k] = float(acc);
      }
      for (int d = 0; d < hd; ++d) {
        double acc = 0;
        for (int k = 0; k < keys; ++k) acc += double(P[size_t(r) * keys + k]) * V[size_t(k) * NKV * hd + d];
        o_ref[size_t(r) * hd + d] = float(acc);
      }
    }
    const std::string tag = " (" + str(keys) + " keys per tile)";
    EXPECT_REL(s_got, s_ref, 1e-4, "probe S = Q·Kᵀ" + tag);
    EXPECT_REL(o_got, o_ref, 1e-4, "probe O = P·V" + tag);
    if (rel_err(s_got, s_ref) > 1e-4) explain_mismatches(s_got, s_ref, keys, "S");
    if (rel_err(o_got, o_ref) > 1e-4) explain_mismatches(o_got, o_ref, hd, "O");
  }
}

// The selection hook: with kWgmma, attention_prefill runs the warpgroup kernel (its output
// bit-identical to calling it, and not to the mma.sync kernel's), and falls back to mma.sync for
// a group the warpgroup kernel does not support (6: a tiny model).
TEST(Attention, PrefillKernelHook) {
  EXPECT_EQ(cuda::attention_prefill_current_kernel(), cuda::AttnPrefillKernel::kWgmma) << "default";
  LongPrefill L(500);
  DeviceBuffer<bf16> out_c(L.out_a.size());
  L.run(Prefill::kMmaSync, L.out_a.get());
  L.run(Prefill::kWgmma, L.out_b.get());
  L.run(Prefill::kDefault, out_c.get());
  check_attention({6, 1, 10, 70, true, 0}, Prefill::kDefault);  // a group it does not support: mma.sync
  const auto mma = from_device_bf16(L.out_a.get(), L.out_a.size());
  const auto wg = from_device_bf16(L.out_b.get(), L.out_b.size());
  const auto hooked = from_device_bf16(out_c.get(), out_c.size());
  EXPECT_TRUE(all_finite(hooked));
  size_t same_as_wg = 0, same_as_mma = 0;
  for (size_t i = 0; i < hooked.size(); ++i) {
    same_as_wg += hooked[i] == wg[i];
    same_as_mma += hooked[i] == mma[i];
  }
  EXPECT_EQ(same_as_wg, hooked.size()) << "hooked attention_prefill is the wgmma kernel";
  EXPECT_LT(same_as_mma, hooked.size()) << "... and not the mma.sync one";
  cuda::AttnPrefillArgs a;
  a.n_heads = 6;
  a.n_kv = 1;
  EXPECT_FALSE(cuda::attention_prefill_wgmma_supports(a));
  a.n_heads = 16;
  a.n_kv = 2;
  EXPECT_TRUE(cuda::attention_prefill_wgmma_supports(a));
}

// 16,384 tokens: the warpgroup kernel (both tiles, ping-pong on and off) against the mma.sync kernel on every
// output, and sampled rows against the CPU (each reference row costs up to 16K keys x 16 heads).
TEST(Attention, PrefillWgmmaLong) {
  const int n = 16384;
  LongPrefill L(n);
  L.run(Prefill::kMmaSync, L.out_a.get());
  const auto ref_gpu = from_device_bf16(L.out_a.get(), L.out_a.size());

  const auto rows = rows_to_check(n, 4);
  const auto hq = from_device_bf16(L.q.get(), L.q.size());
  const auto hk = from_device_bf16(L.k.get(), L.k.size());
  const auto hv = from_device_bf16(L.v.get(), L.v.size());
  const int64_t ldo = 16 * 256;
  std::vector<float> ref(rows.size() * ldo);
  ThreadPool::global().parallel_for(int64_t(rows.size()), [&](int64_t r0, int64_t r1) {
    std::vector<float> q(ldo);
    for (int64_t ri = r0; ri < r1; ++ri) {
      const int i = rows[ri];
      for (int h = 0; h < 16; ++h)
        std::copy_n(hq.begin() + int64_t(i) * 8192 + h * 512, 256, q.begin() + h * 256);
      float* o = ref.data() + ri * ldo;
      cpu::attention(q.data(), hk.data(), hv.data(), i + 1, 16, 2, 256, o);
      for (int h = 0; h < 16; ++h)
        for (int d = 0; d < 256; ++d) o[h * 256 + d] *= sigmoid(hq[int64_t(i) * 8192 + h * 512 + 256 + d]);
    }
  });
  EXPECT_REL(take_rows(ref_gpu, ldo, int(ldo), rows), ref, kTolBf16, "mma.sync attention n=16384 vs the CPU");
  for (const int variant : {0, 1, 2, 3}) {
    const int keys = kWgmmaTiles[variant / 2];
    const bool pingpong = variant % 2 == 0;
    WgmmaTileScope scope(keys, pingpong);
    poison(L.out_b);
    L.run(Prefill::kWgmma, L.out_b.get());
    const auto got = from_device_bf16(L.out_b.get(), L.out_b.size());
    const std::string what = "wgmma (" + str(keys) + " keys per tile, ping-pong " +
                             (pingpong ? "on" : "off") + ") attention n=16384";
    EXPECT_TRUE(all_finite(got)) << what << ": unwritten or non-finite output";
    EXPECT_REL(got, ref_gpu, kTolBf16, what + " vs mma.sync, 16/2 heads, gated");
    EXPECT_REL(take_rows(got, ldo, int(ldo), rows), ref, kTolBf16, what + " vs the CPU");
  }
}

// Both kernels (the warpgroup one at 80 and 64 keys per tile, "pp" = ping-pong) at 4,096, 32,768
// and 131,072 tokens (one layer's causal attention, 16/2 heads, gated, from position 0): median ms
// and TFLOP/s, and the outputs compared with the mma.sync kernel's. Runs only with
// TANSY_ATTN_TIMING=1.
TEST(Attention, PrefillTiming) {
  if (!std::getenv("TANSY_ATTN_TIMING")) GTEST_SKIP() << "set TANSY_ATTN_TIMING=1";
  std::printf("attention prefill, 16/2 heads, causal from position 0, gated (median)\n");
  for (const int n : {4096, 32768, 131072}) {
    LongPrefill L(n);
    const int reps = n <= 4096 ? 21 : n <= 32768 ? 7 : 3;
    double ms[5];
    const char* names[5] = {"mma.sync", "wgmma/80/pp", "wgmma/80", "wgmma/64/pp", "wgmma/64"};
    for (int k = 0; k < 5; ++k) {
      const Prefill kernel = k == 0 ? Prefill::kMmaSync : Prefill::kWgmma;
      WgmmaTileScope scope(k >= 3 ? 64 : 80, k % 2 == 1);
      bf16* out = k == 0 ? L.out_a.get() : L.out_b.get();
      cudaEvent_t e0, e1;
      CUDA_CHECK(cudaEventCreate(&e0));
      CUDA_CHECK(cudaEventCreate(&e1));
      if (k > 0) poison(L.out_b);
      L.run(kernel, out);  // warm-up
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> t(reps);
      for (auto& x : t) {
        CUDA_CHECK(cudaEventRecord(e0, 0));
        L.run(kernel, out);
        CUDA_CHECK(cudaEventRecord(e1, 0));
        CUDA_CHECK(cudaEventSynchronize(e1));
        CUDA_CHECK(cudaEventElapsedTime(&x, e0, e1));
      }
      CUDA_CHECK(cudaEventDestroy(e0));
      CUDA_CHECK(cudaEventDestroy(e1));
      std::sort(t.begin(), t.end());
      ms[k] = t[reps / 2];
      std::printf("  n=%-7d %-12s %9.3f ms  %6.1f TFLOP/s  (x%.2f)\n", n, names[k], ms[k],
                  L.flop() / (ms[k] * 1e9), ms[0] / ms[k]);
      if (k > 0) {
        const auto a = from_device_bf16(L.out_a.get(), L.out_a.size());
        const auto b = from_device_bf16(L.out_b.get(), L.out_b.size());
        EXPECT_TRUE(all_finite(b)) << names[k] << " n=" << n;
        EXPECT_REL(b, a, kTolBf16, std::string("  ") + names[k] + " vs mma.sync, n=" + str(n));
      }
    }
  }
}

TEST(Attention, PrefillRejectsBadShapes) {
  DeviceBuffer<bf16> buf(4 * 4096);
  cuda::AttnPrefillArgs a;
  a.q = a.k_cache = a.v_cache = buf.get();
  a.out = buf.get();
  a.q_stride_t = 2048;
  a.q_stride_h = 512;
  a.out_stride_t = 1024;
  a.out_stride_h = 256;
  a.n = 1;
  a.n_heads = 3;  // not a multiple of n_kv
  a.n_kv = 2;
  EXPECT_THROW(cuda::attention_prefill(a, 0), Error);
  a.n_heads = 34;  // group 17 > limit
  EXPECT_THROW(cuda::attention_prefill(a, 0), Error);
  a.n_heads = 4;
  a.q_stride_h = 500;  // misaligned heads
  EXPECT_THROW(cuda::attention_prefill(a, 0), Error);
  a.q_stride_h = 512;
  a.n = 0;
  EXPECT_THROW(cuda::attention_prefill(a, 0), Error);
  EXPECT_THROW(cuda::attention_prefill_wgmma(a, 0), Error);  // the shared checks
  a.n = 1;
  a.n_heads = 12;  // group 6: not a divisor of the wgmma kernel's 128 rows
  EXPECT_THROW(cuda::attention_prefill_wgmma(a, 0), Error);
}

}  // namespace
}  // namespace tansy
