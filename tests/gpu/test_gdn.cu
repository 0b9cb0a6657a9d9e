// Gated DeltaNet (src/cuda/gdn/) against cpu::conv1d_step, cpu::l2norm_heads, cpu::gdn_gates,
// cpu::gdn_recurrent_step and cpu::rmsnorm_gated: the decode conv/gates and recurrence, the fused
// in_proj + step of one token, and the chunked prefill (gdn_prefill on tensor cores). Tolerances in
// gpu_test_util.h, and
// kTolF32Chunked 1e-4: chunked GDN with f32 output/state against the token-by-token loop, the same
// math re-associated through a 64x64 triangular solve per chunk.
#include <cmath>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/ops.h"
#include "cuda/gdn/gdn.cuh"
#include "cuda/matvec/matvec.cuh"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

constexpr double kTolF32Chunked = 1e-4;

// ---- decode ----

struct GdnSetup {
  int NK, NV, n;
};

TEST(Gdn, ConvAndRecurrence) {
  for (auto [NK, NV, n] :
       {GdnSetup{16, 32, 1}, GdnSetup{16, 32, 16}, GdnSetup{16, 32, 17}, GdnSetup{16, 32, 40},
        GdnSetup{16, 32, 63}, GdnSetup{16, 32, 64}, GdnSetup{16, 32, 65}, GdnSetup{16, 32, 200},
        GdnSetup{16, 32, 1000}, GdnSetup{2, 4, 3}, GdnSetup{2, 4, 65}}) {
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

TEST(Gdn, InProjAndStep) {
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

// ---- prefill ----

// The chunked delta rule over `pieces` (successive calls, each continuing from the state the
// previous one left) against the token-by-token loop from the same random nonzero state.
// `window` > 0 caps gdn_prefill's window of chunks (the boundaries where the state kernel of one
// window hands its state to the next).
void check_gdn(int n_k, int n_v, const std::vector<int>& pieces, bool f32_out, int window = 0) {
  constexpr int D = cuda::kGdnDim;
  const int n = std::accumulate(pieces.begin(), pieces.end(), 0);
  std::string label = "gdn_prefill heads " + str(n_k) + "/" + str(n_v) + " n=" + str(n);
  if (pieces.size() > 1) {
    label += " (";
    for (size_t i = 0; i < pieces.size(); ++i) label += (i ? "+" : "") + str(pieces[i]);
    label += ")";
  }
  label += f32_out ? " f32" : " bf16";
  if (window > 0) label += " window " + str(window);
  const int key_dim = n_k * D, conv_dim = 2 * key_dim + n_v * D;
  // The conv output layout [n, q | k | v], used in place.
  std::vector<float> y(size_t(n) * conv_dim);
  for (int t = 0; t < n; ++t) {
    float* row = y.data() + size_t(t) * conv_dim;
    auto q = randn(key_dim), k = randn(key_dim), v = randn(size_t(n_v) * D);
    cpu::l2norm_heads(q.data(), n_k, D, 1.f / std::sqrt(float(D)));
    cpu::l2norm_heads(k.data(), n_k, D, 1.f);
    std::copy(q.begin(), q.end(), row);
    std::copy(k.begin(), k.end(), row + key_dim);
    std::copy(v.begin(), v.end(), row + 2 * key_dim);
  }
  round_bf16_inplace(y);
  // Gates: β in (0.05, 0.95); log-decay g = -exp(N(-2, 1.2)): mostly slow decay, some fast.
  std::vector<float> beta(size_t(n) * n_v), g(size_t(n) * n_v);
  std::uniform_real_distribution<float> ub(0.05f, 0.95f);
  std::normal_distribution<float> ng(-2.f, 1.2f);
  for (auto& b : beta) b = ub(rng());
  for (auto& x : g) x = -std::exp(ng(rng()));
  auto S0 = randn(size_t(n_v) * D * D, 0.3f);

  auto dy = to_device_bf16(y);
  auto dbeta = to_device(beta), dg = to_device(g), dS = to_device(S0);
  const int64_t ldo = int64_t(n_v) * D + 8;
  DeviceBuffer<float> o32(f32_out ? size_t(n) * ldo : 0);
  DeviceBuffer<bf16> o16(f32_out ? 0 : size_t(n) * ldo);
  if (f32_out)
    poison(o32);
  else
    poison(o16);
  int start = 0;
  for (const int m : pieces) {
    cuda::GdnPrefillArgs a;
    a.q = dy.get() + size_t(start) * conv_dim;
    a.k = a.q + key_dim;
    a.v = a.q + 2 * key_dim;
    a.q_stride = a.k_stride = a.v_stride = conv_dim;
    a.beta = dbeta.get() + size_t(start) * n_v;
    a.g = dg.get() + size_t(start) * n_v;
    a.n = m;
    a.n_k_heads = n_k;
    a.n_v_heads = n_v;
    a.state = dS.get();
    a.o_f32 = f32_out ? o32.get() + size_t(start) * ldo : nullptr;
    a.o_bf16 = f32_out ? nullptr : o16.get() + size_t(start) * ldo;
    a.o_stride = ldo;
    cuda::gdn_prefill(a, 0, window);
    start += m;
  }
  const auto got_o =
      take_rows(f32_out ? from_device(o32.get(), o32.size()) : from_device_bf16(o16.get(), o16.size()), ldo,
                n_v * D, [&] {
                  std::vector<int> all(n);
                  std::iota(all.begin(), all.end(), 0);
                  return all;
                }());
  const auto got_S = from_device(dS.get(), dS.size());

  // Reference: the one-token recurrence, token by token.
  std::vector<float> S = S0, ref_o(size_t(n) * n_v * D);
  for (int t = 0; t < n; ++t) {
    const float* row = y.data() + size_t(t) * conv_dim;
    cpu::gdn_recurrent_step(row, row + key_dim, row + 2 * key_dim, beta.data() + size_t(t) * n_v,
                            g.data() + size_t(t) * n_v, n_k, n_v, D, D, S.data(),
                            ref_o.data() + size_t(t) * n_v * D);
  }
  EXPECT_REL(got_o, ref_o, f32_out ? kTolF32Chunked : kTolBf16, label + " output");
  EXPECT_REL(got_S, S, kTolF32Chunked, label + " final state");
}

TEST(Gdn, Chunked) {
  for (int n : {1, 2, 3, 63, 64, 65, 127, 128, 129, 200}) check_gdn(16, 32, {n}, n % 2 == 1);  // real heads
  check_gdn(16, 32, {129}, false);
  check_gdn(2, 4, {4096}, true);  // long sequence (fewer heads keep the CPU loop short)
  check_gdn(2, 4, {1000}, false);
  check_gdn(4, 4, {130}, true);  // ratio 1
  check_gdn(1, 3, {70}, false);  // ratio 3
}

// Window boundaries (the state kernel of one window hands its f32 state to the next through
// memory): windows of 1, 2 and 3 chunks, prompts ending just before, on and after a boundary, and
// the real heads across the default 64-chunk window (4,096 tokens at 32 value heads).
TEST(Gdn, ChunkedWindows) {
  for (int n : {63, 64, 65, 127, 128, 129}) check_gdn(16, 32, {n}, n % 2 == 0, 1);
  check_gdn(16, 32, {191, 2}, true, 2);
  check_gdn(2, 4, {1000}, true, 3);
  check_gdn(2, 4, {640, 1, 383}, false, 2);
  check_gdn(16, 32, {4161}, true);
}

// Continuing from the state a previous call left: chunk boundaries that do not line up with the
// call boundaries, and calls of 1-3 tokens between longer ones.
TEST(Gdn, ChunkedContinues) {
  check_gdn(16, 32, {100, 77}, true);
  check_gdn(16, 32, {64, 1, 2, 3, 64}, true);
  check_gdn(2, 4, {1, 127, 300, 5}, false);
}

// The state's rounding compounds over the sequence: the real head configuration at 4,096 tokens and
// longer sequences at fewer heads (the CPU loop costs ~0.7 ms per token at 16/32 heads), f32 out,
// at the f32 tolerance.
TEST(Gdn, ChunkedLong) {
  check_gdn(16, 32, {4096}, true);
  check_gdn(2, 4, {5000, 3193}, true);
  check_gdn(2, 4, {32768}, true);
}

// The prefill's gated RMSNorm (one warp per token and head) against cpu::rmsnorm_gated: strided
// o, z and y as the prefill lays them out, token counts that leave the last block partly empty.
TEST(Gdn, GatedNorm) {
  constexpr int D = cuda::kGdnDim;
  for (auto [n, heads] : {std::pair{1, 32}, std::pair{3, 32}, std::pair{63, 32}, std::pair{64, 32},
                          std::pair{65, 32}, std::pair{4096, 32}, std::pair{7, 3}}) {
    const int64_t ldo = int64_t(heads) * D + 4, ldz = int64_t(heads) * D + 68, ldy = int64_t(heads) * D + 8;
    auto o = randn(size_t(n) * ldo, 0.7f), z = randn(size_t(n) * ldz, 1.5f), w = randn(D, 0.2f, 1.f);
    round_bf16_inplace(z);
    DeviceBuffer<float> dout = to_device(o), dw = to_device(w);
    auto dz = to_device_bf16(z);
    DeviceBuffer<bf16> y(size_t(n) * ldy);
    poison(y);
    cuda::GdnGatedNormArgs a;
    a.o = dout.get();
    a.ldo = ldo;
    a.z = dz.get();
    a.ldz = ldz;
    a.w = dw.get();
    a.n = n;
    a.n_heads = heads;
    a.eps = 1e-6f;
    a.y = y.get();
    a.ldy = ldy;
    cuda::gdn_gated_norm(a, 0);
    std::vector<float> ref(size_t(n) * heads * D);
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < heads; ++j)
        cpu::rmsnorm_gated(&o[size_t(t) * ldo + size_t(j) * D], &z[size_t(t) * ldz + size_t(j) * D], w.data(),
                           D, 1e-6f, &ref[(size_t(t) * heads + j) * D]);
    std::vector<int> all(n);
    std::iota(all.begin(), all.end(), 0);
    const auto got = take_rows(from_device_bf16(y.get(), y.size()), ldy, heads * D, all);
    EXPECT_REL(got, ref, kTolBf16, "gdn_gated_norm n=" + str(n) + " heads " + str(heads));
    // the padding between rows keeps its poison (NaN): nothing is written past a row's heads
    const auto raw = from_device_bf16(y.get(), y.size());
    int written = 0;
    for (int t = 0; t < n; ++t)
      for (int64_t c = int64_t(heads) * D; c < ldy; ++c) written += !std::isnan(raw[size_t(t) * ldy + c]);
    EXPECT_EQ(written, 0) << "gdn_gated_norm wrote padding, n=" << n;
  }
  cuda::GdnGatedNormArgs bad;
  EXPECT_THROW(cuda::gdn_gated_norm(bad, 0), Error);
}

TEST(Gdn, RejectsBadShapes) {
  DeviceBuffer<bf16> x(64 * 1024);
  DeviceBuffer<float> f(64 * 128 * 128);
  cuda::GdnPrefillArgs a;
  a.q = a.k = a.v = x.get();
  a.q_stride = a.k_stride = 256;
  a.v_stride = 512;
  a.beta = a.g = f.get();
  a.state = f.get();
  a.o_f32 = f.get();
  a.o_stride = 512;
  a.n = 2;
  a.n_k_heads = 2;
  a.n_v_heads = 3;  // not a multiple
  EXPECT_THROW(cuda::gdn_prefill(a, 0), Error);
  a.n_v_heads = 4;
  a.o_bf16 = x.get();  // both outputs
  EXPECT_THROW(cuda::gdn_prefill(a, 0), Error);
  a.o_bf16 = nullptr;
  a.q_stride = 260;  // not 16-byte rows
  EXPECT_THROW(cuda::gdn_prefill(a, 0), Error);
  a.q_stride = 256;
  a.n = 0;
  EXPECT_THROW(cuda::gdn_prefill(a, 0), Error);
  a.n = 2;
  EXPECT_THROW(cuda::gdn_prefill(a, 0, -1), Error);  // window of -1 chunks
}

}  // namespace
}  // namespace tansy
