// The decode-side products (src/cuda/matvec/) against cpu::matmul: the plain matvec, its SwiGLU,
// norm-in and residual variants, at the real model's shapes and at edge sizes. Inputs are rounded to
// bf16 first, so both sides see the same values; tolerances in gpu_test_util.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "cpu/ops.h"
#include "cuda/matvec/matvec.cuh"
#include "cuda/moe/moe.cuh"
#include "gpu_test_util.h"
#include "model/model.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

// sqrt(Σ_t Σ_r Σ_i (W[r, i]·X[t, i])²): the size of the products' terms.
double terms_rss(const Linear& W, const std::vector<float>& X, int n) {
  std::vector<float> row(W.in);
  double s = 0;
  for (int r = 0; r < W.out; ++r) {
    cpu::embed_row(W, r, row.data());
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < W.in; ++i) {
        const double v = double(row[i]) * X[size_t(t) * W.in + i];
        s += v * v;
      }
  }
  return std::sqrt(s);
}

struct MatvecCase {
  WFormat fmt;
  int out, in, n;
};

TEST(Matvec, Plain) {
  const MatvecCase cases[] = {
      {WFormat::kAffine4, 12352, 2048, 1},   // GDN in_proj (qkv|z|a|b)
      {WFormat::kAffine4, 2048, 4096, 1},    // out_proj / o_proj
      {WFormat::kAffine4, 9216, 2048, 1},    // attention q|k|v
      {WFormat::kAffine8, 258, 2048, 1},     // router + shared gate + pad
      {WFormat::kAffine4, 248320, 2048, 1},  // lm_head
      {WFormat::kAffine4, 2048, 512, 1},     // shared expert down
      {WFormat::kAffine4, 1, 64, 1},         // smallest
      {WFormat::kAffine4, 37, 192, 3},       // odd rows, 3 tokens (one partial 4-token pass)
      {WFormat::kAffine4, 300, 2048, 9},     // 3 passes, the last partial
      {WFormat::kAffine8, 70, 128, 5},      {WFormat::kBF16, 513, 2048, 1}, {WFormat::kBF16, 65, 64, 6},
  };
  for (const auto& c : cases) {
    TestMatrix W = make_matrix(c.fmt, c.out, c.in);
    auto x = randn(size_t(c.n) * c.in);
    round_bf16_inplace(x);
    auto dx = to_device_bf16(x);
    std::vector<float> ref(size_t(c.n) * c.out);
    cpu::matmul(W.host, x.data(), c.n, ref.data());
    // f32 output, rows padded to ld = out + 3
    const int64_t ld = c.out + 3;
    DeviceBuffer<float> y32(size_t(c.n) * ld);
    poison(y32);
    cuda::matvec(W.dev, dx.get(), c.in, c.n, cuda::MatvecOut{y32.get(), true, ld}, 0);
    auto h32 = from_device(y32.get(), y32.size());
    std::vector<float> got(ref.size());
    for (int t = 0; t < c.n; ++t)
      for (int r = 0; r < c.out; ++r) got[size_t(t) * c.out + r] = h32[size_t(t) * ld + r];
    const std::string label = std::string("matvec f32 ") + fmt_name(c.fmt) + " [" + std::to_string(c.out) +
                              "x" + std::to_string(c.in) + "] n=" + std::to_string(c.n);
    // Summation-order error scales with the terms, not with their sum: against ||ref|| where the
    // outputs are of the terms' size, against the terms' root-sum-square where they cancel (one
    // output of 64 terms can come out near zero and make any relative error large).
    const double rss = terms_rss(W.host, x, c.n);
    const double den = std::max(l2norm(ref), rss);
    std::printf("  %-48s err %.3e of max(||ref|| %.3g, terms' rss %.3g) (tol %.0e)\n", label.c_str(),
                diff_norm(got, ref) / den, l2norm(ref), rss, kTolF32);
    EXPECT_LE(diff_norm(got, ref) / den, kTolF32) << label;
    DeviceBuffer<bf16> y16(size_t(c.n) * c.out);
    poison(y16);
    cuda::matvec(W.dev, dx.get(), c.in, c.n, cuda::MatvecOut{y16.get(), false, c.out}, 0);
    EXPECT_REL(from_device_bf16(y16.get(), y16.size()), ref, kTolBf16, "  (bf16 out)");
  }
}

TEST(Matvec, RejectsBadShapes) {
  TestMatrix W = make_matrix(WFormat::kAffine4, 8, 64);
  W.dev.in = 96;  // not a multiple of the quant group
  DeviceBuffer<bf16> x(96);
  DeviceBuffer<float> y(8);
  EXPECT_THROW(cuda::matvec(W.dev, x.get(), 96, 1, cuda::MatvecOut{y.get(), true, 8}, 0), Error);
  W.dev.in = 64;
  W.dev.fmt = WFormat::kF32;
  EXPECT_THROW(cuda::matvec(W.dev, x.get(), 64, 1, cuda::MatvecOut{y.get(), true, 8}, 0), Error);
}

TEST(Matvec, Swiglu) {
  const MatvecCase cases[] = {{WFormat::kAffine4, 1024, 2048, 1},
                              {WFormat::kAffine4, 128, 64, 5},
                              {WFormat::kAffine8, 64, 256, 2},
                              {WFormat::kBF16, 256, 2048, 1}};
  for (const auto& c : cases) {
    TestMatrix W = make_matrix(c.fmt, c.out, c.in);  // rows interleaved gate/up
    auto x = randn(size_t(c.n) * c.in);
    round_bf16_inplace(x);
    auto dx = to_device_bf16(x);
    std::vector<float> rows(size_t(c.n) * c.out);
    cpu::matmul(W.host, x.data(), c.n, rows.data());
    const auto ref = swiglu_ref(rows, c.n, c.out / 2);
    DeviceBuffer<bf16> y(size_t(c.n) * c.out / 2);
    poison(y);
    cuda::matvec_swiglu(W.dev, dx.get(), c.in, c.n, y.get(), c.out / 2, 0);
    EXPECT_REL(from_device_bf16(y.get(), y.size()), ref, kTolBf16,
               std::string("matvec_swiglu ") + fmt_name(c.fmt) + " n=" + std::to_string(c.n));
  }
}

TEST(Matvec, Norm) {
  const MatvecCase cases[] = {
      {WFormat::kAffine4, 9216, 2048, 1},  // attention q|k|v (tensor-core tiles)
      {WFormat::kAffine4, 300, 2048, 1},   // tensor-core tiles, the last one partial
      {WFormat::kAffine4, 300, 256, 1},   {WFormat::kAffine8, 70, 128, 1}, {WFormat::kBF16, 65, 64, 1},
  };
  for (const auto& mc : cases) {
    TestMatrix W = make_matrix(mc.fmt, mc.out, mc.in);
    const NormCase c = make_norm_case(mc.in);
    NormDev d(c);
    std::vector<float> ref(mc.out);
    cpu::matmul(W.host, c.x.data(), 1, ref.data());
    DeviceBuffer<float> y(mc.out + 5);
    poison(y);
    cuda::matvec_norm(W.dev, d.in, cuda::MatvecOut{y.get(), true, mc.out}, 0);
    auto got = from_device(y.get(), mc.out);
    const std::string label = std::string("matvec_norm ") + fmt_name(mc.fmt) + " [" + std::to_string(mc.out) +
                              "x" + std::to_string(mc.in) + "]";
    // x is bf16-rounded on both sides; a rounding that falls the other way moves y by ~1e-3
    EXPECT_REL(got, ref, 3e-3, label);
    EXPECT_REL(from_device_bf16(d.xn.get(), mc.in), c.x, 5e-3, "  xn_out");
  }
  // wider than the fused norm holds: refused
  TestMatrix W = make_matrix(WFormat::kAffine4, 64, cuda::kFusedNormMaxDim + 64);
  const NormCase c = make_norm_case(64);
  NormDev d(c);
  DeviceBuffer<float> y(64);
  EXPECT_THROW(cuda::matvec_norm(W.dev, d.in, cuda::MatvecOut{y.get(), true, 64}, 0), Error);
}

// A batched decode step's products (DecodeRows): each of n token rows in one launch gives its
// outputs, residual rows and partial sums of h² bit for bit as the one-row launch on that row
// alone, at the real model's shapes (attention q|k|v with the input norm; o_proj / GDN out_proj
// with the residual) and at batch sizes around the kernel's rows per block.
TEST(Matvec, BatchedRowsMatchOneRow) {
  {  // the input norm
    TestMatrix W = make_matrix(WFormat::kAffine4, 9216, 2048);
    for (int n : {1, 2, 8, 9, 17}) {
      std::vector<NormCase> cases;
      std::vector<float> h, ss;
      for (int t = 0; t < n; ++t) {
        cases.push_back(make_norm_case(2048));
        h.insert(h.end(), cases.back().h.begin(), cases.back().h.end());
        ss.insert(ss.end(), cases.back().ss.begin(), cases.back().ss.end());
      }
      DeviceBuffer<float> dh = to_device(h), dss = to_device(ss), dw = to_device(cases[0].w);
      DeviceBuffer<float> y(size_t(n) * 9216);
      poison(y);
      cuda::NormIn in;
      in.h = dh.get();
      in.ss = dss.get();
      in.w = dw.get();
      in.eps = 1e-6f;
      cuda::DecodeRows rows;
      rows.n = n;
      rows.h = 2048;
      rows.ss = cuda::kNormParts;
      cuda::matvec_norm(W.dev, in, cuda::MatvecOut{y.get(), true, 9216}, 0, &rows);
      const auto got = from_device(y.get(), size_t(n) * 9216);
      for (int t = 0; t < n; ++t) {
        NormCase c = cases[size_t(t)];
        c.w = cases[0].w;
        NormDev d(c);
        DeviceBuffer<float> y1(9216);
        cuda::matvec_norm(W.dev, d.in, cuda::MatvecOut{y1.get(), true, 9216}, 0);
        const auto want = from_device(y1.get(), 9216);
        EXPECT_EQ(std::memcmp(got.data() + size_t(t) * 9216, want.data(), sizeof(float) * 9216), 0)
            << "matvec_norm batch of " << n << ", row " << t;
      }
    }
  }
  // the residual: o_proj [2048 x 4096]
  TestMatrix W = make_matrix(WFormat::kAffine4, 2048, 4096);
  for (int n : {1, 3, 8, 16}) {
    auto x = randn(size_t(n) * 4096);
    round_bf16_inplace(x);
    auto h = randn(size_t(n) * 2048, 2.f);
    auto dx = to_device_bf16(x);
    DeviceBuffer<float> dh = to_device(h), ss(size_t(n) * cuda::kNormParts);
    CUDA_CHECK(cudaMemset(ss.get(), 0, ss.bytes()));
    cuda::DecodeRows rows;
    rows.n = n;
    rows.h = 2048;
    rows.ss = cuda::kNormParts;
    rows.y = 4096;
    cuda::matvec_residual(W.dev, dx.get(), cuda::ResidualOut{dh.get(), ss.get()}, 0, &rows);
    const auto got_h = from_device(dh.get(), size_t(n) * 2048);
    const auto got_ss = from_device(ss.get(), size_t(n) * cuda::kNormParts);
    for (int t = 0; t < n; ++t) {
      std::vector<float> x1(x.begin() + size_t(t) * 4096, x.begin() + size_t(t + 1) * 4096);
      std::vector<float> h1(h.begin() + size_t(t) * 2048, h.begin() + size_t(t + 1) * 2048);
      auto dx1 = to_device_bf16(x1);
      DeviceBuffer<float> dh1 = to_device(h1), ss1(cuda::kNormParts);
      CUDA_CHECK(cudaMemset(ss1.get(), 0, ss1.bytes()));
      cuda::matvec_residual(W.dev, dx1.get(), cuda::ResidualOut{dh1.get(), ss1.get()}, 0);
      const auto want_h = from_device(dh1.get(), 2048);
      const auto want_ss = from_device(ss1.get(), cuda::kNormParts);
      EXPECT_EQ(std::memcmp(got_h.data() + size_t(t) * 2048, want_h.data(), sizeof(float) * 2048), 0)
          << "matvec_residual batch of " << n << ", row " << t << ": h";
      EXPECT_EQ(std::memcmp(got_ss.data() + size_t(t) * cuda::kNormParts, want_ss.data(),
                            sizeof(float) * cuda::kNormParts),
                0)
          << "matvec_residual batch of " << n << ", row " << t << ": partial sums";
    }
    if (n > 1) {  // rows whose h or partial sums overlap are refused before any launch
      cuda::DecodeRows bad = rows;
      bad.h = 2047;
      EXPECT_THROW(cuda::matvec_residual(W.dev, dx.get(), cuda::ResidualOut{dh.get(), ss.get()}, 0, &bad),
                   Error);
      bad = rows;
      bad.ss = cuda::kNormParts - 1;
      EXPECT_THROW(cuda::matvec_residual(W.dev, dx.get(), cuda::ResidualOut{dh.get(), ss.get()}, 0, &bad),
                   Error);
    }
  }
}

// h += W·x in place, with the partial sums of the new h² for the next norm.
TEST(Matvec, ResidualEpilogues) {
  for (auto [fmt, out, in] : {std::tuple{WFormat::kAffine4, 2048, 4096},
                              std::tuple{WFormat::kAffine4, 64, 128}, std::tuple{WFormat::kBF16, 256, 512}}) {
    TestMatrix W = make_matrix(fmt, out, in);
    auto x = randn(in);
    round_bf16_inplace(x);
    auto h = randn(out, 2.f);
    auto dx = to_device_bf16(x);
    DeviceBuffer<float> dh = to_device(h), ss(cuda::kNormParts);
    CUDA_CHECK(cudaMemset(ss.get(), 0, ss.bytes()));
    cuda::matvec_residual(W.dev, dx.get(), cuda::ResidualOut{dh.get(), ss.get()}, 0);
    std::vector<float> y(out), want(out);
    cpu::matmul(W.host, x.data(), 1, y.data());
    double sq = 0;
    for (int i = 0; i < out; ++i) {
      want[i] = h[i] + y[i];
      sq += double(want[i]) * want[i];
    }
    const std::string label = std::string("matvec_residual ") + fmt_name(fmt) + " [" + std::to_string(out) +
                              "x" + std::to_string(in) + "]";
    EXPECT_REL(from_device(dh.get(), out), want, kTolF32 * 10, label);
    const auto parts = from_device(ss.get(), cuda::kNormParts);
    double got_sq = 0;
    for (float p : parts) got_sq += p;
    EXPECT_NEAR(got_sq, sq, 1e-5 * sq) << label << ": partial sums of h^2";
  }
  // experts down + combine into the residual (9 slots, shared expert folded in as expert E)
  const int E = 16, H = 2048, I = 512, k = 9;
  TestMatrix D = make_matrix(WFormat::kAffine4, (E + 1) * H, I);
  std::vector<int> idx = {3, 7, 0, 15, 9, 12, 1, 5, E};
  std::vector<float> wts = {0.2f, 0.15f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.15f, 0.7f};
  auto act = randn(size_t(k) * I);
  round_bf16_inplace(act);
  auto h = randn(H, 2.f);
  DeviceBuffer<int> didx = to_device(idx);
  DeviceBuffer<float> dw = to_device(wts), dh = to_device(h), ss(cuda::kNormParts);
  auto dact = to_device_bf16(act);
  CUDA_CHECK(cudaMemset(ss.get(), 0, ss.bytes()));
  cuda::moe_down_residual(D.dev, E + 1, didx.get(), dw.get(), dact.get(), k, nullptr, nullptr,
                          cuda::ResidualOut{dh.get(), ss.get()}, 0);
  std::vector<float> want = h;
  for (int j = 0; j < k; ++j) {
    std::vector<float> y(H);
    cpu::matmul(D.host.rows(idx[j] * H, H), &act[size_t(j) * I], 1, y.data());
    for (int r = 0; r < H; ++r) want[r] += wts[j] * y[r];
  }
  double sq = 0;
  for (float v : want) sq += double(v) * v;
  EXPECT_REL(from_device(dh.get(), H), want, kTolF32 * 10, "moe_down_residual 9 slots");
  const auto parts = from_device(ss.get(), cuda::kNormParts);
  double got_sq = 0;
  for (float p : parts) got_sq += p;
  EXPECT_NEAR(got_sq, sq, 1e-5 * sq) << "moe_down_residual partial sums";
}

}  // namespace
}  // namespace tansy
