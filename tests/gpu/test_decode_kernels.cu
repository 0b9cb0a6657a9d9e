// Every decode-side kernel against the CPU reference (src/cpu/ops.h), on fresh random inputs at the
// real model's shapes and at edge sizes. Inputs are rounded to bf16 first, so both sides see the
// same values; tolerances: f32 outputs ~1e-5 (accumulation order only), bf16 outputs 1e-2 (one
// rounding of the result), as METHOD.md gives for bf16 operands.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>

#include "cpu/ops.h"
#include "cuda/attention/attention.cuh"
#include "cuda/gdn/gdn.cuh"
#include "cuda/head/head.cuh"
#include "cuda/matvec/matvec.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/norm/norm.cuh"
#include "gpu_test_util.h"
#include "model/model.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

constexpr double kTolF32 = 2e-5;
constexpr double kTolBf16 = 1e-2;

// A random weight matrix on the host (Linear view) and on the device (DevLinear view).
struct TestMatrix {
  std::vector<uint32_t> q;
  std::vector<uint16_t> s, b, w;
  Linear host;
  DeviceBuffer<uint32_t> dq;
  DeviceBuffer<bf16> ds, db, dw;
  cuda::DevLinear dev;
};

TestMatrix make_matrix(WFormat fmt, int out, int in) {
  TestMatrix m;
  m.host.fmt = fmt;
  m.host.out = out;
  m.host.in = in;
  m.host.group = 64;
  m.dev.fmt = fmt;
  m.dev.out = out;
  m.dev.in = in;
  if (fmt == WFormat::kBF16) {
    m.w = to_bf16(randn(size_t(out) * in, 0.05f));
    m.host.bf16 = m.w.data();
    m.dw.resize(m.w.size());
    CUDA_CHECK(cudaMemcpy(m.dw.get(), m.w.data(), m.w.size() * 2, cudaMemcpyHostToDevice));
    m.dev.w = m.dw.get();
    return m;
  }
  const int bits = fmt == WFormat::kAffine4 ? 4 : 8, groups = in / 64;
  m.q.resize(size_t(out) * in * bits / 32);
  for (auto& x : m.q) x = uint32_t(rng()());
  std::uniform_real_distribution<float> us(0.002f, 0.02f);
  std::normal_distribution<float> nb(0.f, 1.f);
  m.s.resize(size_t(out) * groups);
  m.b.resize(size_t(out) * groups);
  const float mid = bits == 4 ? 7.5f : 127.5f;
  for (size_t i = 0; i < m.s.size(); ++i) {
    const float s = us(rng()) * (bits == 4 ? 1.f : 1.f / 16);
    m.s[i] = f32_to_bf16(s);
    m.b[i] = f32_to_bf16(-mid * s + s * nb(rng()));
  }
  m.host.q = m.q.data();
  m.host.scales = m.s.data();
  m.host.biases = m.b.data();
  m.dq = to_device(m.q);
  m.ds.resize(m.s.size());
  m.db.resize(m.b.size());
  CUDA_CHECK(cudaMemcpy(m.ds.get(), m.s.data(), m.s.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(m.db.get(), m.b.data(), m.b.size() * 2, cudaMemcpyHostToDevice));
  m.dev.q = m.dq.get();
  m.dev.scales = m.ds.get();
  m.dev.biases = m.db.get();
  return m;
}

const char* fmt_name(WFormat f) { return wformat_name(f); }

// ---- matvec ----

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

TEST(DecodeKernels, Matvec) {
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

TEST(DecodeKernels, MatvecRejectsBadShapes) {
  TestMatrix W = make_matrix(WFormat::kAffine4, 8, 64);
  W.dev.in = 96;  // not a multiple of the quant group
  DeviceBuffer<bf16> x(96);
  DeviceBuffer<float> y(8);
  EXPECT_THROW(cuda::matvec(W.dev, x.get(), 96, 1, cuda::MatvecOut{y.get(), true, 8}, 0), Error);
  W.dev.in = 64;
  W.dev.fmt = WFormat::kF32;
  EXPECT_THROW(cuda::matvec(W.dev, x.get(), 64, 1, cuda::MatvecOut{y.get(), true, 8}, 0), Error);
}

// silu(bf16(g)) * bf16(u), the kernels' SwiGLU.
std::vector<float> swiglu_ref(const std::vector<float>& gu_rows, int n, int pairs) {
  std::vector<float> g(size_t(n) * pairs), u(size_t(n) * pairs), y(size_t(n) * pairs);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < pairs; ++i) {
      g[size_t(t) * pairs + i] = round_bf16(gu_rows[size_t(t) * 2 * pairs + 2 * i]);
      u[size_t(t) * pairs + i] = round_bf16(gu_rows[size_t(t) * 2 * pairs + 2 * i + 1]);
    }
  cpu::swiglu(g.data(), u.data(), n * pairs, y.data());
  return y;
}

TEST(DecodeKernels, MatvecSwiglu) {
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

TEST(DecodeKernels, Experts) {
  check_experts(WFormat::kAffine4, 16, 2048, 512, 8, 1);  // real per-expert shapes (16 of 256 experts)
  check_experts(WFormat::kAffine4, 16, 2048, 512, 8, 3);
  check_experts(WFormat::kAffine4, 8, 64, 64, 2, 2);  // tiny golden shapes
  check_experts(WFormat::kBF16, 8, 128, 64, 4, 2);
  check_experts(WFormat::kAffine8, 4, 256, 128, 3, 1);
}

// ---- routing ----

TEST(DecodeKernels, RouteTopkTiesAtTheBoundary) {
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

TEST(DecodeKernels, RouteTopk) {
  for (auto [E, k, n] : {std::tuple{256, 8, 5}, std::tuple{8, 2, 3}, std::tuple{16, 16, 1}}) {
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

// ---- norms, embedding, argmax ----

TEST(DecodeKernels, AddRmsnorm) {
  for (auto [n, dim] : {std::pair{1, 2048}, std::pair{5, 2048}, std::pair{3, 64}, std::pair{2, 5000}}) {
    auto h = randn(size_t(n) * dim, 3.f), r = randn(size_t(n) * dim), w = randn(dim, 0.2f, 1.f);
    round_bf16_inplace(r);
    auto dr = to_device_bf16(r);
    DeviceBuffer<float> dh = to_device(h), dw = to_device(w);
    DeviceBuffer<bf16> xn(size_t(n) * dim);
    poison(xn);
    cuda::add_rmsnorm(dh.get(), dr.get(), dw.get(), n, dim, 1e-6f, xn.get(), 0);
    std::vector<float> hs(h.size()), ref(h.size());
    for (size_t i = 0; i < h.size(); ++i) hs[i] = h[i] + r[i];
    for (int t = 0; t < n; ++t)
      cpu::rmsnorm(&hs[size_t(t) * dim], w.data(), dim, 1e-6f, &ref[size_t(t) * dim]);
    EXPECT_LE(max_abs_diff(from_device(dh.get(), h.size()), hs), 1e-5) << "residual sum is f32 h + r";
    EXPECT_REL(from_device_bf16(xn.get(), xn.size()), ref, kTolBf16, "add_rmsnorm n=" + std::to_string(n));
    // no residual: plain norm of h
    cuda::add_rmsnorm(dh.get(), nullptr, dw.get(), n, dim, 1e-6f, xn.get(), 0);
    EXPECT_REL(from_device_bf16(xn.get(), xn.size()), ref, kTolBf16, "  rmsnorm (no residual)");
  }
}

TEST(DecodeKernels, GatedRmsnorm) {
  const int n = 3, heads = 32, dim = 128;
  const int64_t ldz = heads * dim + 64;
  auto o = randn(size_t(n) * heads * dim), z = randn(size_t(n) * ldz), w = randn(dim, 0.2f, 1.f);
  round_bf16_inplace(z);
  DeviceBuffer<float> dout = to_device(o), dw = to_device(w);
  auto dz = to_device_bf16(z);
  DeviceBuffer<bf16> y(size_t(n) * heads * dim);
  poison(y);
  cuda::gated_rmsnorm(dout.get(), heads * dim, dz.get(), ldz, dw.get(), n, heads, dim, 1e-6f, y.get(),
                      heads * dim, 0);
  std::vector<float> ref(y.size());
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < heads; ++j)
      cpu::rmsnorm_gated(&o[(size_t(t) * heads + j) * dim], &z[size_t(t) * ldz + size_t(j) * dim], w.data(),
                         dim, 1e-6f, &ref[(size_t(t) * heads + j) * dim]);
  EXPECT_REL(from_device_bf16(y.get(), y.size()), ref, kTolBf16, "gated_rmsnorm");
}

TEST(DecodeKernels, Embed) {
  for (WFormat fmt : {WFormat::kAffine4, WFormat::kAffine8, WFormat::kBF16}) {
    const int V = 1000, H = 2048;
    TestMatrix E = make_matrix(fmt, V, H);
    std::vector<int> ids = {0, 999, 17, 17, 523};
    DeviceBuffer<int> dids = to_device(ids);
    DeviceBuffer<float> h(ids.size() * H);
    poison(h);
    cuda::embed(E.dev, dids.get(), int(ids.size()), h.get(), 0);
    std::vector<float> ref(ids.size() * H);
    for (size_t t = 0; t < ids.size(); ++t) cpu::embed_row(E.host, ids[t], &ref[t * H]);
    EXPECT_REL(from_device(h.get(), h.size()), ref, 1e-5, std::string("embed ") + fmt_name(fmt));
  }
}

TEST(DecodeKernels, Argmax) {
  for (int V : {248320, 256, 1}) {
    auto logits = randn(V, 4.f);
    if (V > 300) logits[123] = logits[200000] = 100.f;  // tie: lower index wins
    DeviceBuffer<float> dl = to_device(logits);
    DeviceBuffer<unsigned long long> scratch(cuda::kArgmaxBlocks);
    DeviceBuffer<int> dst(1), ring(4), counter(1);
    CUDA_CHECK(cudaMemset(counter.get(), 0, sizeof(int)));
    cuda::argmax(dl.get(), V, scratch.get(), dst.get(), ring.get(), counter.get(), 0);
    const int got = from_device(dst.get(), 1)[0];
    EXPECT_EQ(got, tansy::argmax(logits)) << "V=" << V;
    EXPECT_EQ(from_device(ring.get(), 1)[0], got);
    EXPECT_EQ(from_device(counter.get(), 1)[0], 1);
    std::printf("  argmax V=%d -> %d\n", V, got);
  }
}

// ---- attention ----

TEST(DecodeKernels, QkNormRope) {
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

TEST(DecodeKernels, AttentionDecode) {
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

TEST(DecodeKernels, AttentionDecodeFused) {
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

TEST(DecodeKernels, AttentionDecodeFusedRejectsBadShapes) {
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

// ---- Gated DeltaNet ----

struct GdnSetup {
  int NK, NV, n;
};

TEST(DecodeKernels, GdnConvAndRecurrence) {
  for (auto [NK, NV, n] :
       {GdnSetup{16, 32, 1}, GdnSetup{16, 32, 40}, GdnSetup{2, 4, 3}, GdnSetup{2, 4, 65}}) {
    const int D = 128, KD = NK * D, VD = NV * D, C = 2 * KD + VD, Kc = 4;
    const int64_t ld = C + VD + 2 * NV + 8;  // proj rows: qkv | z | a | b
    auto proj = randn(size_t(n) * ld);
    round_bf16_inplace(proj);
    auto window = randn(size_t(Kc - 1) * C);
    round_bf16_inplace(window);
    auto convw = randn(size_t(C) * Kc, 0.5f), A_log = randn(NV, 0.5f), dt_bias = randn(NV, 0.5f);
    auto dproj = to_device_bf16(proj), dwin = to_device_bf16(window);
    DeviceBuffer<float> dconv = to_device(convw), dA = to_device(A_log), ddt = to_device(dt_bias);
    DeviceBuffer<bf16> y(size_t(n) * C);
    DeviceBuffer<float> beta(size_t(n) * NV), g(size_t(n) * NV);
    poison(y);
    poison(beta);
    poison(g);
    cuda::GdnConvArgs a;
    a.x = dproj.get();
    a.ldx = ld;
    a.a = dproj.get() + C + VD;
    a.b = dproj.get() + C + VD + NV;
    a.ld_ab = ld;
    a.n = n;
    a.n_k_heads = NK;
    a.n_v_heads = NV;
    a.kernel = Kc;
    a.conv_w = dconv.get();
    a.window = dwin.get();
    a.A_log = dA.get();
    a.dt_bias = ddt.get();
    a.y = y.get();
    a.beta = beta.get();
    a.g = g.get();
    cuda::gdn_conv(a, 0);

    // reference conv + norms + gates, token by token
    std::vector<float> win = window, y_ref(size_t(n) * C), beta_ref(size_t(n) * NV), g_ref(size_t(n) * NV);
    for (int t = 0; t < n; ++t) {
      float* yt = &y_ref[size_t(t) * C];
      cpu::conv1d_step(&proj[size_t(t) * ld], win.data(), convw.data(), C, Kc, yt);
      cpu::l2norm_heads(yt, NK, D, 1.f / std::sqrt(float(D)));
      cpu::l2norm_heads(yt + KD, NK, D, 1.f);
      cpu::gdn_gates(&proj[size_t(t) * ld + C + VD], &proj[size_t(t) * ld + C + VD + NV], A_log.data(),
                     dt_bias.data(), NV, &beta_ref[size_t(t) * NV], &g_ref[size_t(t) * NV]);
    }
    const std::string tag =
        " heads " + std::to_string(NK) + "/" + std::to_string(NV) + " n " + std::to_string(n);
    const auto y_got = from_device_bf16(y.get(), y.size());
    EXPECT_REL(y_got, y_ref, kTolBf16, "gdn_conv (conv+silu+l2norm)" + tag);
    EXPECT_REL(from_device(beta.get(), beta.size()), beta_ref, kTolF32 * 10, "  beta");
    EXPECT_REL(from_device(g.get(), g.size()), g_ref, kTolF32 * 10, "  g");
    EXPECT_EQ(max_abs_diff(from_device_bf16(dwin.get(), win.size()), win), 0.0)
        << "conv window advanced" << tag;

    // recurrence from a random state, fed the kernel's own conv output
    auto S0 = randn(size_t(NV) * D * D, 0.1f);
    DeviceBuffer<float> dS = to_device(S0), o(size_t(n) * VD);
    poison(o);
    cuda::GdnPrefillArgs ra;
    ra.q = y.get();
    ra.k = y.get() + KD;
    ra.v = y.get() + 2 * KD;
    ra.q_stride = ra.k_stride = ra.v_stride = C;
    ra.beta = beta.get();
    ra.g = g.get();
    ra.n = n;
    ra.n_k_heads = NK;
    ra.n_v_heads = NV;
    ra.state = dS.get();
    ra.o_f32 = o.get();
    ra.o_stride = VD;
    cuda::gdn_recurrent(ra, 0);
    const auto beta_got = from_device(beta.get(), beta.size()), g_got = from_device(g.get(), g.size());
    std::vector<float> S = S0, o_ref(size_t(n) * VD);
    for (int t = 0; t < n; ++t) {
      const float* yt = &y_got[size_t(t) * C];
      cpu::gdn_recurrent_step(yt, yt + KD, yt + 2 * KD, &beta_got[size_t(t) * NV], &g_got[size_t(t) * NV], NK,
                              NV, D, D, S.data(), &o_ref[size_t(t) * VD]);
    }
    EXPECT_REL(from_device(o.get(), o.size()), o_ref, 1e-4, "gdn_recurrent output" + tag);
    EXPECT_REL(from_device(dS.get(), S.size()), S, 1e-4, "  state");
  }
}

}  // namespace
}  // namespace tansy

// ---- fused decode kernels (one token): norm-in products and their epilogues ----

namespace tansy {
namespace {

// The normed residual as the fused kernels compute it: x = bf16(rmsnorm(h)·w), the scale from
// partial sums of h² spread over a few of the kNormParts slots (as several producer blocks leave them).
struct NormCase {
  std::vector<float> h, w, x, ss;
};

NormCase make_norm_case(int H) {
  NormCase c;
  c.h = randn(H, 2.f);
  c.w = randn(H, 0.2f, 1.f);
  c.x.resize(H);
  cpu::rmsnorm(c.h.data(), c.w.data(), H, 1e-6f, c.x.data());
  round_bf16_inplace(c.x);
  c.ss.assign(cuda::kNormParts, 0.f);
  for (int i = 0; i < H; ++i) c.ss[(i * 7) % 61] += c.h[i] * c.h[i];
  return c;
}

struct NormDev {
  DeviceBuffer<float> h, w, ss;
  DeviceBuffer<bf16> xn;
  cuda::NormIn in;
  explicit NormDev(const NormCase& c)
      : h(to_device(c.h)), w(to_device(c.w)), ss(to_device(c.ss)), xn(c.h.size()) {
    poison(xn);
    in.h = h.get();
    in.ss = ss.get();
    in.w = w.get();
    in.eps = 1e-6f;
    in.xn_out = xn.get();
  }
};

TEST(FusedDecode, MatvecNorm) {
  const MatvecCase cases[] = {
      {WFormat::kAffine4, 9216, 2048, 1},  // attention q|k|v
      {WFormat::kAffine4, 300, 256, 1},
      {WFormat::kAffine8, 70, 128, 1},
      {WFormat::kBF16, 65, 64, 1},
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

// h += W·x in place, with the partial sums of the new h² for the next norm.
TEST(FusedDecode, ResidualEpilogues) {
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

TEST(FusedDecode, RouterWithRouting) {
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

TEST(FusedDecode, GdnInProjAndStep) {
  for (auto [NK, NV, H] : {std::tuple{16, 32, 2048}, std::tuple{2, 4, 256}}) {
    const int D = 128, KD = NK * D, VD = NV * D, C = 2 * KD + VD, Kc = 4;
    const int rows = C + VD + 2 * NV;
    TestMatrix W = make_matrix(WFormat::kAffine4, rows, H);
    const NormCase c = make_norm_case(H);
    NormDev d(c);
    auto window = randn(size_t(Kc - 1) * C);
    round_bf16_inplace(window);
    auto convw = randn(size_t(C) * Kc, 0.5f), A_log = randn(NV, 0.5f), dt_bias = randn(NV, 0.5f);
    auto gnorm = randn(D, 0.2f, 1.f);
    auto S0 = randn(size_t(NV) * D * D, 0.1f);
    auto dwin = to_device_bf16(window);
    DeviceBuffer<float> dconvw = to_device(convw), dA = to_device(A_log), ddt = to_device(dt_bias),
                        dgn = to_device(gnorm);
    DeviceBuffer<float> dS = to_device(S0), conv_out(C), beta(NV), g(NV), o(VD);
    DeviceBuffer<bf16> P(rows), y(VD);
    DeviceBuffer<unsigned> counters(NV);
    CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
    for (auto* b : {&conv_out, &beta, &g, &o}) poison(*b);
    poison(P);
    poison(y);
    cuda::GdnInEpilogue ge;
    ge.conv_dim = C;
    ge.value_dim = VD;
    ge.n_v_heads = NV;
    ge.kernel = Kc;
    ge.conv_w = dconvw.get();
    ge.window = dwin.get();
    ge.A_log = dA.get();
    ge.dt_bias = ddt.get();
    ge.conv_out = conv_out.get();
    ge.beta = beta.get();
    ge.g = g.get();
    cuda::matvec_norm_gdn(W.dev, d.in, P.get(), ge, 0);
    cuda::GdnDecodeArgs ga;
    ga.conv = conv_out.get();
    ga.beta = beta.get();
    ga.g = g.get();
    ga.n_k_heads = NK;
    ga.n_v_heads = NV;
    ga.state = dS.get();
    ga.z = P.get() + C;
    ga.norm_w = dgn.get();
    ga.eps = 1e-6f;
    ga.o = o.get();
    ga.counters = counters.get();
    ga.y = y.get();
    cuda::gdn_decode_step(ga, 0);

    // CPU: projection (bf16, as the prefill path stores it) -> conv -> l2norm -> gates -> step -> gated norm
    std::vector<float> proj(rows);
    cpu::matmul(W.host, c.x.data(), 1, proj.data());
    round_bf16_inplace(proj);
    const auto proj_got = from_device_bf16(P.get(), rows);
    EXPECT_REL(proj_got, proj, 5e-3,
               "gdn in_proj (bf16 rows) heads " + std::to_string(NK) + "/" + std::to_string(NV));
    // the rest from the kernel's own projection, so that the checks below see the fused ops alone
    std::vector<float> win = window, conv(C), beta_ref(NV), g_ref(NV), S = S0, o_ref(VD), y_ref(VD);
    cpu::conv1d_step(proj_got.data(), win.data(), convw.data(), C, Kc, conv.data());
    EXPECT_REL(from_device(conv_out.get(), C), conv, 1e-5, "  conv + silu");
    EXPECT_EQ(max_abs_diff(from_device_bf16(dwin.get(), win.size()), win), 0.0) << "conv window advanced";
    cpu::gdn_gates(&proj_got[C + VD], &proj_got[C + VD + NV], A_log.data(), dt_bias.data(), NV,
                   beta_ref.data(), g_ref.data());
    EXPECT_REL(from_device(beta.get(), NV), beta_ref, 1e-5, "  beta");
    EXPECT_REL(from_device(g.get(), NV), g_ref, 1e-5, "  g");
    const auto conv_got = from_device(conv_out.get(), C);
    std::vector<float> q(conv_got.begin(), conv_got.begin() + KD),
        kk(conv_got.begin() + KD, conv_got.begin() + 2 * KD);
    cpu::l2norm_heads(q.data(), NK, D, 1.f / std::sqrt(float(D)));
    cpu::l2norm_heads(kk.data(), NK, D, 1.f);
    cpu::gdn_recurrent_step(q.data(), kk.data(), conv_got.data() + 2 * KD, beta_ref.data(), g_ref.data(), NK,
                            NV, D, D, S.data(), o_ref.data());
    EXPECT_REL(from_device(dS.get(), S.size()), S, 1e-4, "  state");
    EXPECT_REL(from_device(o.get(), VD), o_ref, 1e-4, "  o (before the gated norm)");
    for (int j = 0; j < NV; ++j)
      cpu::rmsnorm_gated(&o_ref[size_t(j) * D], &proj_got[C + size_t(j) * D], gnorm.data(), D, 1e-6f,
                         &y_ref[size_t(j) * D]);
    EXPECT_REL(from_device_bf16(y.get(), VD), y_ref, kTolBf16, "  gated norm output");
    EXPECT_EQ(from_device(counters.get(), NV), std::vector<unsigned>(NV, 0u)) << "counters reset";
  }
}

// Buffers of one lm_head_argmax call and the arguments pointing at them (pos is left null).
struct HeadCall {
  DeviceBuffer<float> logits;
  DeviceBuffer<unsigned long long> scratch{size_t(cuda::lm_head_scratch())};
  DeviceBuffer<unsigned> counter{1};
  DeviceBuffer<int> tok{1};
  cuda::LmHeadArgs a;
  HeadCall(const cuda::DevLinear& W, const cuda::NormIn& x) : logits(W.out) {
    CUDA_CHECK(cudaMemset(counter.get(), 0, 4));
    a.W = W;
    a.x = x;
    a.logits = logits.get();
    a.limit = W.out;
    a.token = tok.get();
    a.scratch = scratch.get();
    a.counter = counter.get();
  }
  int run(int limit) {
    a.limit = limit;
    cuda::lm_head_argmax(a, 0);
    return from_device(tok.get(), 1)[0];
  }
};

// The fused decode head: final norm + lm_head + argmax + position in one launch, at the real
// shape, at partial tiles (rows not a multiple of 32, a single partial tile) and at the demo
// model's hidden size 256 (one tensor-copy slab per row, fewer groups than warps).
TEST(FusedDecode, LmHeadArgmax) {
  for (auto [out, in] : {std::pair{248320, 2048}, std::pair{4100, 2048}, std::pair{8184, 256},
                         std::pair{33, 256}, std::pair{7, 1024}}) {
    TestMatrix W = make_matrix(WFormat::kAffine4, out, in);
    const NormCase c = make_norm_case(in);
    NormDev d(c);
    HeadCall h(W.dev, d.in);
    DeviceBuffer<int> pos = to_device(std::vector<int>{7});
    h.a.pos = pos.get();
    int calls = 0;
    for (int limit : {out, std::max(1, out / 3)}) {
      poison(h.logits);
      const int id = h.run(limit);
      ++calls;
      const std::string label = "lm_head_argmax [" + std::to_string(out) + "x" + std::to_string(in) +
                                "] limit " + std::to_string(limit);
      const auto got = from_device(h.logits.get(), out);
      const auto xn = from_device_bf16(d.xn.get(), in);
      EXPECT_REL(xn, c.x, 5e-3, "  xn_out");
      std::vector<float> ref(out), ref_own(out);
      cpu::matmul(W.host, c.x.data(), 1, ref.data());
      cpu::matmul(W.host, xn.data(), 1, ref_own.data());
      // against the CPU norm: a bf16 rounding of x that falls the other way moves y by ~1e-3
      EXPECT_REL(got, ref, 3e-3, label);
      // on the kernel's own x: f32 accumulation order only (tensor-core adds, per quant group)
      EXPECT_REL(got, ref_own, 1e-4, "  same on the kernel's x");
      const std::vector<float> head(got.begin(), got.begin() + limit),
          head_ref(ref_own.begin(), ref_own.begin() + limit);
      EXPECT_EQ(id, tansy::argmax(head)) << label << ": the argmax of the kernel's own logits";
      ASSERT_TRUE(id >= 0 && id < limit) << label;
      const float best = *std::max_element(head_ref.begin(), head_ref.end());
      EXPECT_GE(ref_own[id], best - 1e-4f * (std::fabs(best) + 1.f))
          << label << ": the CPU's best logit is " << best;
      EXPECT_EQ(from_device(pos.get(), 1)[0], 7 + calls) << label << ": position advanced once per call";
      EXPECT_EQ(from_device(h.counter.get(), 1)[0], 0u) << label << ": counter left zero";
      std::printf("  %s -> id %d\n", label.c_str(), id);
    }
  }
  {  // ties go to the lower id, and ids from `limit` on never win: rows 5 and 9 are the largest
    TestMatrix W = make_matrix(WFormat::kAffine4, 40, 256);
    const NormCase c = make_norm_case(256);
    double sx = 0;
    for (float v : c.x) sx += v;
    std::fill(W.s.begin(), W.s.end(), uint16_t(0));
    std::fill(W.b.begin(), W.b.end(), uint16_t(0));
    for (int r : {5, 9})
      for (int gi = 0; gi < 4; ++gi) W.b[size_t(r) * 4 + gi] = f32_to_bf16(sx > 0 ? 1.f : -1.f);
    CUDA_CHECK(cudaMemcpy(W.ds.get(), W.s.data(), W.s.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(W.db.get(), W.b.data(), W.b.size() * 2, cudaMemcpyHostToDevice));
    NormDev d(c);
    HeadCall h(W.dev, d.in);
    for (auto [limit, want] : {std::pair{40, 5}, std::pair{6, 5}, std::pair{5, 0}})
      EXPECT_EQ(h.run(limit), want) << "limit " << limit;
    // refused: other formats, in beyond the register-held x or not a multiple of the 128-byte slab, a
    // limit outside 1..out
    cuda::LmHeadArgs& a = h.a;
    for (int bad : {0, 41}) {
      a.limit = bad;
      EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error) << "limit " << bad;
    }
    a.limit = 40;
    TestMatrix W8 = make_matrix(WFormat::kAffine8, 40, 128);
    a.W = W8.dev;
    EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error);
    TestMatrix Wwide = make_matrix(WFormat::kAffine4, 40, cuda::kFusedNormMaxDim + 256);
    a.W = Wwide.dev;
    EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error);
    TestMatrix Wnarrow = make_matrix(WFormat::kAffine4, 40, 192);
    a.W = Wnarrow.dev;
    EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error);
  }
}

}  // namespace
}  // namespace tansy

// ---- decode kernel timing at the real shapes (not pass/fail: prints µs per launch) ----

namespace tansy {
namespace {

// Launches `fn` `reps` times back to back on one stream (PDL as in the decode graph) and
// returns µs per launch.
template <typename Fn>
double time_launches(Fn&& fn, int reps = 100) {
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreate(&s));
  for (int i = 0; i < 5; ++i) fn(s);
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < reps; ++i) fn(s);
  CUDA_CHECK(cudaEventRecord(b, s));
  CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  return 1e3 * ms / reps;
}

double mat_bytes(const cuda::DevLinear& W) {
  return double(W.out) * W.in * W.bits() / 8 +
         (W.fmt == WFormat::kBF16 ? 0.0 : double(W.out) * (W.in / 64) * 4);
}

void report(const char* what, double us, double bytes) {
  std::printf("  TIMING %-44s %8.2f us  %7.1f GB/s\n", what, us, bytes / (us * 1e-6) / 1e9);
}

TEST(DecodeTiming, RealShapes) {
  if (!std::getenv("TANSY_DECODE_TIMING")) GTEST_SKIP() << "set TANSY_DECODE_TIMING=1";
  const int H = 2048, E = 256, K = 8, I = 512, NK = 16, NV = 32, D = 128;
  const int C = 2 * NK * D + NV * D, VD = NV * D;
  const NormCase nc = make_norm_case(H);
  NormDev nd(nc);
  // GDN in_proj with norm + conv/gates epilogue
  TestMatrix gin = make_matrix(WFormat::kAffine4, C + VD + 2 * NV, H);
  DeviceBuffer<bf16> P(C + VD + 2 * NV), win(3 * C), mix(VD), act((K + 1) * I), r(H);
  DeviceBuffer<float> convw = to_device(randn(size_t(C) * 4, 0.5f)), A = to_device(randn(NV)),
                      dt = to_device(randn(NV));
  DeviceBuffer<float> conv_out(C), beta(NV), g(NV), S = to_device(randn(size_t(NV) * D * D, 0.1f)), o(VD);
  DeviceBuffer<float> gnw = to_device(randn(D, 0.2f, 1.f)), logits(E + 2), y32(248320);
  DeviceBuffer<unsigned> counters(NV), rc(1);
  CUDA_CHECK(cudaMemset(counters.get(), 0, counters.bytes()));
  CUDA_CHECK(cudaMemset(rc.get(), 0, 4));
  CUDA_CHECK(cudaMemset(win.get(), 0, win.bytes()));
  CUDA_CHECK(cudaMemset(mix.get(), 0, mix.bytes()));
  CUDA_CHECK(cudaMemset(act.get(), 0, act.bytes()));
  cuda::GdnInEpilogue ge;
  ge.conv_dim = C;
  ge.value_dim = VD;
  ge.n_v_heads = NV;
  ge.kernel = 4;
  ge.conv_w = convw.get();
  ge.window = win.get();
  ge.A_log = A.get();
  ge.dt_bias = dt.get();
  ge.conv_out = conv_out.get();
  ge.beta = beta.get();
  ge.g = g.get();
  report("gdn in_proj + norm + conv/gates [12352x2048]",
         time_launches([&](cudaStream_t s) { cuda::matvec_norm_gdn(gin.dev, nd.in, P.get(), ge, s); }),
         mat_bytes(gin.dev));
  auto dxn = to_device_bf16(nc.x);
  report("  same, plain matvec", time_launches([&](cudaStream_t s) {
           cuda::matvec(gin.dev, dxn.get(), H, 1, cuda::MatvecOut{P.get(), false, gin.dev.out}, s);
         }),
         mat_bytes(gin.dev));
  cuda::GdnDecodeArgs ga;
  ga.conv = conv_out.get();
  ga.beta = beta.get();
  ga.g = g.get();
  ga.n_k_heads = NK;
  ga.n_v_heads = NV;
  ga.state = S.get();
  ga.z = P.get() + C;
  ga.norm_w = gnw.get();
  ga.eps = 1e-6f;
  ga.o = o.get();
  ga.counters = counters.get();
  ga.y = mix.get();
  report("gdn recurrence + norms", time_launches([&](cudaStream_t s) { cuda::gdn_decode_step(ga, s); }),
         2.0 * NV * D * D * 4);
  TestMatrix gout = make_matrix(WFormat::kAffine4, H, VD);
  report("gdn out_proj [2048x4096]", time_launches([&](cudaStream_t s) {
           cuda::matvec(gout.dev, mix.get(), VD, 1, cuda::MatvecOut{r.get(), false, H}, s);
         }),
         mat_bytes(gout.dev));
  DeviceBuffer<float> hres = to_device(nc.h), ssr(cuda::kNormParts);
  report("  same + residual epilogue", time_launches([&](cudaStream_t s) {
           cuda::matvec_residual(gout.dev, mix.get(), cuda::ResidualOut{hres.get(), ssr.get()}, s);
         }),
         mat_bytes(gout.dev));
  TestMatrix router = make_matrix(WFormat::kAffine8, E + 2, H);
  DeviceBuffer<int> idx(K + 1);
  DeviceBuffer<float> wts(K + 1);
  cuda::RouteEpilogue re;
  re.E = E;
  re.k = K;
  re.shared_slot = true;
  re.idx = idx.get();
  re.w = wts.get();
  re.counter = rc.get();
  report("router + norm + top-k [258x2048 8-bit]", time_launches([&](cudaStream_t s) {
           cuda::matvec_norm_route(router.dev, nd.in, logits.get(), re, s);
         }),
         mat_bytes(router.dev));
  report("  router plain matvec", time_launches([&](cudaStream_t s) {
           cuda::matvec(router.dev, dxn.get(), H, 1, cuda::MatvecOut{logits.get(), true, E + 2}, s);
         }),
         mat_bytes(router.dev));
  report("  route_topk alone", time_launches([&](cudaStream_t s) {
           cuda::route_topk(logits.get(), E + 2, 1, E, K, idx.get(), wts.get(), s);
         }),
         0);
  TestMatrix gu = make_matrix(WFormat::kAffine4, (E + 1) * 2 * I, H);
  TestMatrix dn = make_matrix(WFormat::kAffine4, (E + 1) * H, I);
  report("experts gate|up, 9 slots", time_launches([&](cudaStream_t s) {
           cuda::matvec_swiglu_experts(gu.dev, E + 1, idx.get(), 1, K + 1, dxn.get(), H, act.get(), s);
         }),
         9 * mat_bytes(gu.dev.rows(0, 2 * I)));
  report("experts down + combine, 9 slots", time_launches([&](cudaStream_t s) {
           cuda::moe_down_combine(dn.dev, E + 1, idx.get(), wts.get(), act.get(), 1, K + 1, nullptr, nullptr,
                                  0, r.get(), s);
         }),
         9 * mat_bytes(dn.dev.rows(0, H)));
  report("  same + residual epilogue", time_launches([&](cudaStream_t s) {
           cuda::moe_down_residual(dn.dev, E + 1, idx.get(), wts.get(), act.get(), K + 1, nullptr, nullptr,
                                   cuda::ResidualOut{hres.get(), ssr.get()}, s);
         }),
         9 * mat_bytes(dn.dev.rows(0, H)));
  TestMatrix ain = make_matrix(WFormat::kAffine4, 9216, H);
  report("attn in_proj + norm [9216x2048]", time_launches([&](cudaStream_t s) {
           cuda::matvec_norm(ain.dev, nd.in, cuda::MatvecOut{P.get(), false, 9216}, s);
         }),
         mat_bytes(ain.dev));
  report("add_rmsnorm", time_launches([&](cudaStream_t s) {
           cuda::add_rmsnorm(hres.get(), r.get(), nd.w.get(), 1, H, 1e-6f, nd.xn.get(), s);
         }),
         0);
  // attention of one token at the real shapes (16 query heads over 2 kv heads): the unfused
  // qk_norm_rope + split + merge against the fused kernel + merge, at several split counts
  for (int ctx : {256, 4096, 32768, 131071}) {
    const int NH = 16, NKV = 2, hd = 256;
    cuda::QkvLayout L;
    L.n_heads = NH;
    L.n_kv = NKV;
    L.ld = L.v_off() + NKV * hd;
    auto drow = to_device_bf16(randn(size_t(L.ld)));
    L.base = drow.get();
    DeviceBuffer<float> qn = to_device(randn(hd, 0.1f, 1.f)), kn = to_device(randn(hd, 0.1f, 1.f));
    auto dK = to_device_bf16(randn(size_t(ctx + 1) * NKV * hd)),
         dV = to_device_bf16(randn(size_t(ctx + 1) * NKV * hd));
    DeviceBuffer<int> dpos = to_device(std::vector<int>{ctx});
    DeviceBuffer<float> scr(cuda::attn_scratch_floats(1, NH, 256));
    DeviceBuffer<bf16> ao(size_t(NH) * hd);
    const double kv_bytes = 2.0 * (ctx + 1) * NKV * hd * 2;
    char name[96];
    std::snprintf(name, sizeof name, "attn ctx %d: qk_norm_rope + split/merge (128)", ctx);
    report(name, time_launches([&](cudaStream_t s) {
             cuda::qk_norm_rope(L, 1, dpos.get(), qn.get(), kn.get(), 1e-6f, 64, 1e7, dK.get(), dV.get(), s);
             cuda::attention_decode(L, 1, dpos.get(), dK.get(), dV.get(), 128, scr.get(), ao.get(), NH * hd,
                                    s);
           }),
           kv_bytes);
    for (int splits : {32, 64, 128}) {
      std::snprintf(name, sizeof name, "attn ctx %d: fused + merge (%d)", ctx, splits);
      report(name, time_launches([&](cudaStream_t s) {
               cuda::attention_decode_fused(L, dpos.get(), qn.get(), kn.get(), 1e-6f, 64, 1e7, dK.get(),
                                            dV.get(), splits, scr.get(), ao.get(), NH * hd, s);
             }),
             kv_bytes);
    }
  }
  TestMatrix lm = make_matrix(WFormat::kAffine4, 248320, H);
  report("lm_head [248320x2048]",
         time_launches(
             [&](cudaStream_t s) {
               cuda::matvec(lm.dev, dxn.get(), H, 1, cuda::MatvecOut{y32.get(), true, 248320}, s);
             },
             20),
         mat_bytes(lm.dev));
  {
    DeviceBuffer<unsigned long long> scratch(cuda::lm_head_scratch());
    DeviceBuffer<unsigned> counter(1);
    CUDA_CHECK(cudaMemset(counter.get(), 0, 4));
    DeviceBuffer<int> tok(1), pos(1);
    cuda::LmHeadArgs a;
    a.W = lm.dev;
    a.x = nd.in;
    a.logits = y32.get();
    a.limit = 248320;
    a.token = tok.get();
    a.pos = pos.get();
    a.scratch = scratch.get();
    a.counter = counter.get();
    report("lm_head fused: norm + product + argmax + pos",
           time_launches([&](cudaStream_t s) { cuda::lm_head_argmax(a, s); }, 20), mat_bytes(lm.dev));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace tansy
