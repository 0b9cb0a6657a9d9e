// Each CPU op against a direct formula written independently here (in double where it helps).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <numeric>
#include <random>

#include "core/bf16.h"
#include "cpu/ops.h"

namespace tansy {
namespace {

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double rel_err(const std::vector<float>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// A random affine-quantized matrix plus its dequantized values computed from the definition.
struct QMat {
  std::vector<uint32_t> q;
  std::vector<uint16_t> s, b;
  std::vector<double> deq;
  Linear lin;
};

QMat make_qmat(int out, int in, int bits, std::mt19937& rng) {
  QMat m;
  const int per = 32 / bits, groups = in / 64;
  m.q.resize(size_t(out) * in / per);
  m.s.resize(size_t(out) * groups);
  m.b.resize(size_t(out) * groups);
  m.deq.resize(size_t(out) * in);
  std::vector<uint32_t> codes(size_t(out) * in);
  for (auto& c : codes) c = rng() & ((1u << bits) - 1);
  std::normal_distribution<float> d(0, 0.05f);
  for (auto& x : m.s) x = f32_to_bf16(std::fabs(d(rng)) + 1e-3f);
  for (auto& x : m.b) x = f32_to_bf16(d(rng));
  for (int r = 0; r < out; ++r)
    for (int c = 0; c < in; ++c) {
      // Element c lives in word c/per at bit offset bits*(c%per), lowest bits first (docs/MODEL.md §8.3).
      m.q[(size_t(r) * in + c) / per] |= codes[size_t(r) * in + c] << (bits * (c % per));
      m.deq[size_t(r) * in + c] =
          double(bf16_to_f32(m.s[size_t(r) * groups + c / 64])) * codes[size_t(r) * in + c] +
          bf16_to_f32(m.b[size_t(r) * groups + c / 64]);
    }
  m.lin.fmt = bits == 4 ? WFormat::kAffine4 : WFormat::kAffine8;
  m.lin.out = out;
  m.lin.in = in;
  m.lin.q = m.q.data();
  m.lin.scales = m.s.data();
  m.lin.biases = m.b.data();
  return m;
}

TEST(Ops, AffineMatmulMatchesDefinition) {
  std::mt19937 rng(1);
  for (int bits : {4, 8}) {
    for (int n : {1, 3, 17}) {
      const int out = 300, in = 256;
      QMat m = make_qmat(out, in, bits, rng);
      auto X = randn(size_t(n) * in, rng);
      std::vector<float> Y(size_t(n) * out);
      cpu::matmul(m.lin, X.data(), n, Y.data());
      std::vector<double> ref(Y.size());
      for (int t = 0; t < n; ++t)
        for (int r = 0; r < out; ++r) {
          double s = 0;
          for (int c = 0; c < in; ++c) s += m.deq[size_t(r) * in + c] * X[size_t(t) * in + c];
          ref[size_t(t) * out + r] = s;
        }
      EXPECT_LT(rel_err(Y, ref), 1e-5) << bits << " bits, n=" << n;
    }
  }
}

TEST(Ops, Bf16MatmulAndRowViews) {
  std::mt19937 rng(2);
  const int out = 70, in = 64;
  auto Wf = randn(size_t(out) * in, rng);
  std::vector<uint16_t> Wb(Wf.size());
  for (size_t i = 0; i < Wf.size(); ++i) Wb[i] = f32_to_bf16(Wf[i]);
  Linear L;
  L.fmt = WFormat::kBF16;
  L.out = out;
  L.in = in;
  L.bf16 = Wb.data();
  Linear sub = L.rows(10, 20);
  auto X = randn(in, rng);
  std::vector<float> Y(20);
  cpu::matmul(sub, X.data(), 1, Y.data());
  std::vector<double> ref(20);
  for (int r = 0; r < 20; ++r)
    for (int c = 0; c < in; ++c) ref[r] += double(bf16_to_f32(Wb[size_t(r + 10) * in + c])) * X[c];
  EXPECT_LT(rel_err(Y, ref), 1e-5);
}

TEST(Ops, RmsNormVariants) {
  std::mt19937 rng(3);
  const int dim = 256;
  auto x = randn(dim, rng, 3.0f), w = randn(dim, rng), z = randn(dim, rng);
  std::vector<float> y(dim);
  cpu::rmsnorm(x.data(), w.data(), dim, 1e-6f, y.data());
  double ms = 0;
  for (float v : x) ms += double(v) * v;
  ms /= dim;
  std::vector<double> ref(dim), ref2(dim);
  for (int i = 0; i < dim; ++i) ref[i] = x[i] / std::sqrt(ms + 1e-6) * w[i];
  EXPECT_LT(rel_err(y, ref), 1e-6);
  cpu::rmsnorm_gated(x.data(), z.data(), w.data(), dim, 1e-6f, y.data());
  for (int i = 0; i < dim; ++i) ref2[i] = ref[i] * z[i] / (1 + std::exp(-double(z[i])));
  EXPECT_LT(rel_err(y, ref2), 1e-6);
}

TEST(Ops, RopeIsARotationOfPairs) {
  std::mt19937 rng(4);
  const int hd = 256, rd = 64;
  auto x = randn(hd, rng);
  for (int pos : {0, 1, 17, 100000}) {
    auto y = x;
    cpu::rope(y.data(), rd, pos, 1e7);
    std::vector<double> ref(x.begin(), x.end());
    for (int j = 0; j < rd / 2; ++j) {
      // Pair (j, j + rd/2) as a complex number rotated by pos * theta^(-2j/rd).
      double ang = pos * std::pow(1e7, -2.0 * j / rd);
      std::complex<double> c(x[j], x[j + rd / 2]);
      c *= std::polar(1.0, ang);
      ref[j] = c.real();
      ref[j + rd / 2] = c.imag();
    }
    EXPECT_LT(rel_err(y, ref), 1e-6) << pos;
    for (int i = rd; i < hd; ++i) EXPECT_EQ(y[i], x[i]);
  }
}

TEST(Ops, AttentionMatchesSoftmaxFormula) {
  std::mt19937 rng(5);
  const int nh = 8, nkv = 2, hd = 32, n = 37;
  auto q = randn(size_t(nh) * hd, rng), K = randn(size_t(n) * nkv * hd, rng),
       V = randn(size_t(n) * nkv * hd, rng);
  std::vector<float> out(size_t(nh) * hd);
  cpu::attention(q.data(), K.data(), V.data(), n, nh, nkv, hd, out.data());
  std::vector<double> ref(out.size());
  for (int h = 0; h < nh; ++h) {
    int g = h / (nh / nkv);
    std::vector<double> s(n);
    double z = 0;
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < hd; ++i) s[t] += double(q[h * hd + i]) * K[(t * nkv + g) * hd + i];
      s[t] = std::exp(s[t] / std::sqrt(double(hd)));
      z += s[t];
    }
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < hd; ++i) ref[h * hd + i] += s[t] / z * V[(t * nkv + g) * hd + i];
  }
  EXPECT_LT(rel_err(out, ref), 1e-5);
}

TEST(Ops, ConvStepMatchesSequenceConvolution) {
  std::mt19937 rng(6);
  const int C = 24, K = 4, T = 9;
  auto x = randn(size_t(T) * C, rng), w = randn(size_t(C) * K, rng);
  std::vector<float> window(size_t(K - 1) * C, 0.0f), y(C);
  for (int t = 0; t < T; ++t) {
    cpu::conv1d_step(&x[size_t(t) * C], window.data(), w.data(), C, K, y.data());
    std::vector<double> ref(C);
    for (int c = 0; c < C; ++c) {
      double acc = 0;
      for (int j = 0; j < K; ++j) {
        int src = t - (K - 1) + j;  // zeros before the start
        if (src >= 0) acc += double(w[c * K + j]) * x[size_t(src) * C + c];
      }
      ref[c] = acc / (1 + std::exp(-acc));
    }
    EXPECT_LT(rel_err(y, ref), 1e-6) << t;
  }
}

TEST(Ops, GatesAndL2Norm) {
  float a[3] = {-3.0f, 0.5f, 30.0f}, b[3] = {-1.0f, 0.0f, 2.0f}, A_log[3] = {0.1f, 1.0f, 2.0f},
        dt[3] = {0.5f, 1.0f, -2.0f};
  float beta[3], g[3];
  cpu::gdn_gates(a, b, A_log, dt, 3, beta, g);
  for (int h = 0; h < 3; ++h) {
    EXPECT_NEAR(beta[h], 1.0 / (1 + std::exp(-double(b[h]))), 1e-6);
    EXPECT_NEAR(g[h], -std::exp(double(A_log[h])) * std::log1p(std::exp(double(a[h]) + dt[h])), 1e-4);
  }
  std::vector<float> x = {3.0f, 4.0f, 0.0f, 0.0f, 1.0f, 1.0f};
  cpu::l2norm_heads(x.data(), 2, 3, 2.0f);
  EXPECT_NEAR(x[0], 2.0 * 3 / std::sqrt(25 + 1e-6), 1e-6);
  EXPECT_NEAR(x[4], 2.0 / std::sqrt(2 + 1e-6), 1e-6);
}

// The chunked gated delta rule (MODEL.md §5.6, chunk 64) in double, written from the formulas:
// it must equal the token-by-token recurrence, including across chunk boundaries.
TEST(Ops, RecurrenceMatchesChunkedAlgorithm) {
  std::mt19937 rng(7);
  const int nk = 2, nv = 4, dk = 16, dv = 8, T = 130, C = 64;
  std::vector<float> q(size_t(T) * nk * dk), k(size_t(T) * nk * dk), v(size_t(T) * nv * dv),
      beta(size_t(T) * nv), g(size_t(T) * nv);
  q = randn(q.size(), rng);
  k = randn(k.size(), rng);
  v = randn(v.size(), rng);
  for (int t = 0; t < T; ++t) {
    cpu::l2norm_heads(&q[size_t(t) * nk * dk], nk, dk, 1.0f / std::sqrt(float(dk)));
    cpu::l2norm_heads(&k[size_t(t) * nk * dk], nk, dk, 1.0f);
  }
  std::uniform_real_distribution<float> u01(0.05f, 0.95f);
  for (auto& x : beta) x = u01(rng);
  for (auto& x : g) x = -u01(rng);
  // Recurrent (the implementation under test).
  std::vector<float> S(size_t(nv) * dk * dv, 0.0f), o(size_t(T) * nv * dv);
  for (int t = 0; t < T; ++t)
    cpu::gdn_recurrent_step(&q[size_t(t) * nk * dk], &k[size_t(t) * nk * dk], &v[size_t(t) * nv * dv],
                            &beta[size_t(t) * nv], &g[size_t(t) * nv], nk, nv, dk, dv, S.data(),
                            &o[size_t(t) * nv * dv]);
  // Chunked reference per value head.
  std::vector<double> ref(o.size());
  for (int h = 0; h < nv; ++h) {
    const int kh = h / (nv / nk);
    std::vector<double> St(size_t(dk) * dv, 0.0);
    for (int c0 = 0; c0 < T; c0 += C) {
      const int L = std::min(C, T - c0);
      auto Q = [&](int i, int r) { return double(q[(size_t(c0 + i) * nk + kh) * dk + r]); };
      auto Kf = [&](int i, int r) { return double(k[(size_t(c0 + i) * nk + kh) * dk + r]); };
      auto Vf = [&](int i, int cc) { return double(v[(size_t(c0 + i) * nv + h) * dv + cc]); };
      auto B = [&](int i) { return double(beta[size_t(c0 + i) * nv + h]); };
      std::vector<double> G(L);
      for (int i = 0; i < L; ++i) G[i] = (i ? G[i - 1] : 0.0) + g[size_t(c0 + i) * nv + h];
      // T = (I + strict_tril(beta_i k_i.k_j exp(G_i - G_j)))^-1 by forward substitution.
      std::vector<double> A(size_t(L) * L, 0.0), Tm(size_t(L) * L, 0.0);
      for (int i = 0; i < L; ++i)
        for (int j = 0; j < i; ++j) {
          double kk = 0;
          for (int r = 0; r < dk; ++r) kk += Kf(i, r) * Kf(j, r);
          A[i * L + j] = B(i) * kk * std::exp(G[i] - G[j]);
        }
      for (int i = 0; i < L; ++i) {
        Tm[i * L + i] = 1.0;
        for (int j = 0; j < i; ++j) {
          double s = 0;
          for (int m = j; m < i; ++m) s += A[i * L + m] * Tm[m * L + j];
          Tm[i * L + j] = -s;
        }
      }
      std::vector<double> U(size_t(L) * dv, 0.0), W(size_t(L) * dk, 0.0);
      for (int i = 0; i < L; ++i)
        for (int j = 0; j <= i; ++j) {
          for (int cc = 0; cc < dv; ++cc) U[i * dv + cc] += Tm[i * L + j] * B(j) * Vf(j, cc);
          for (int r = 0; r < dk; ++r) W[i * dk + r] += Tm[i * L + j] * B(j) * std::exp(G[j]) * Kf(j, r);
        }
      std::vector<double> Vp(size_t(L) * dv);
      for (int i = 0; i < L; ++i)
        for (int cc = 0; cc < dv; ++cc) {
          double s = U[i * dv + cc];
          for (int r = 0; r < dk; ++r) s -= W[i * dk + r] * St[r * dv + cc];
          Vp[i * dv + cc] = s;
        }
      for (int i = 0; i < L; ++i)
        for (int cc = 0; cc < dv; ++cc) {
          double s = 0;
          for (int r = 0; r < dk; ++r) s += Q(i, r) * std::exp(G[i]) * St[r * dv + cc];
          for (int j = 0; j <= i; ++j) {
            double qk = 0;
            for (int r = 0; r < dk; ++r) qk += Q(i, r) * Kf(j, r);
            s += qk * std::exp(G[i] - G[j]) * Vp[j * dv + cc];
          }
          ref[(size_t(c0 + i) * nv + h) * dv + cc] = s;
        }
      std::vector<double> Sn(St.size());
      for (int r = 0; r < dk; ++r)
        for (int cc = 0; cc < dv; ++cc) {
          double s = std::exp(G[L - 1]) * St[r * dv + cc];
          for (int j = 0; j < L; ++j) s += Kf(j, r) * std::exp(G[L - 1] - G[j]) * Vp[j * dv + cc];
          Sn[r * dv + cc] = s;
        }
      St = Sn;
    }
  }
  EXPECT_LT(rel_err(o, ref), 1e-5);
}

TEST(Ops, RouteTopkRenormalises) {
  std::mt19937 rng(8);
  const int E = 64, K = 8;
  auto logits = randn(E, rng, 2.0f);
  int idx[K];
  float w[K];
  cpu::route_topk(logits.data(), E, K, idx, w);
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  double z = 0;
  for (int i = 0; i < K; ++i) z += std::exp(double(logits[order[i]]));
  for (int i = 0; i < K; ++i) {
    EXPECT_EQ(idx[i], order[i]);
    EXPECT_NEAR(w[i], std::exp(double(logits[order[i]])) / z, 1e-6);
  }
  float s[3] = {1, -2, 0.5f}, u[3] = {2, 3, -1}, y[3];
  cpu::swiglu(s, u, 3, y);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(y[i], s[i] / (1 + std::exp(-s[i])) * u[i], 1e-6);
}

}  // namespace
}  // namespace tansy
