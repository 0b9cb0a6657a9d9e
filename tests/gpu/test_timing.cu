// Kernel timings at the real shapes: not pass/fail, they print. Timing.DecodeRealShapes (µs and
// GB/s per launch, back to back on one stream as in the decode graph) runs only with
// TANSY_DECODE_TIMING=1; Timing.Prefill (median ms and TFLOP/s at n=4096) and Timing.Gdn (the
// chunked delta rule, µs per layer at 4,096 and 32,768 tokens; the gated norm beside norm/'s gated_rmsnorm
// and the conv at 4,096) are left out by tools/device/gpu_tests.sh's filters. Each keeps its own helpers in
// its own namespace.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/attention/attention.cuh"
#include "cuda/gdn/gdn.cuh"
#include "cuda/gemm/gemm.cuh"
#include "cuda/head/head.cuh"
#include "cuda/matvec/matvec.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/norm/norm.cuh"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

// ---- decode kernels at the real shapes (prints µs per launch) ----

namespace decode_timing {

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

TEST(Timing, DecodeRealShapes) {
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

}  // namespace decode_timing

// ---- prefill kernels at n = 4096 (prints median ms) ----

namespace prefill_timing {

// Median milliseconds of `reps` runs of fn on stream 0, after one warm-up.
template <typename F>
double median_ms(F&& fn, int reps = 15) {
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

void report(const char* what, double ms, double flop) {
  std::printf("  %-58s %8.3f ms  %7.1f TFLOP/s\n", what, ms, flop / (ms * 1e-3) / 1e12);
}

TEST(Timing, Prefill) {
  constexpr int n = 4096;
  std::printf("prefill kernel timings at n=%d (median of 15; 4-bit weights; random data)\n", n);
  auto x = randn(size_t(n) * 4096);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  {
    TestMatrix W = make_matrix(WFormat::kAffine4, 8192, 2048);
    DeviceBuffer<bf16> y(size_t(n) * 8192);
    const double ms = median_ms([&] {
      cuda::gemm(W.dev, dx.get(), 2048, n,
                 {y.get(), cuda::GemmOutType::kBF16, 8192, cuda::GemmEpilogue::kStore}, 0);
    });
    report("gemm in_qkv [8192x2048] -> bf16", ms, 2.0 * n * 8192 * 2048);
  }
  {
    TestMatrix W = make_matrix(WFormat::kAffine4, 2048, 4096);
    DeviceBuffer<bf16> y(size_t(n) * 2048);
    const double ms = median_ms([&] {
      cuda::gemm(W.dev, dx.get(), 4096, n,
                 {y.get(), cuda::GemmOutType::kBF16, 2048, cuda::GemmEpilogue::kAccumulate}, 0);
    });
    report("gemm out_proj [2048x4096] += bf16", ms, 2.0 * n * 2048 * 4096);
  }
  {
    constexpr int E = 256, k = 8, H = 2048, I = 512;
    TestMatrix GU = make_matrix(WFormat::kAffine4, E * 2 * I, H);
    TestMatrix Dn = make_matrix(WFormat::kAffine4, E * H, I);
    std::vector<int> idx;
    std::vector<float> wts;
    random_routing(n, E, k, idx, wts);
    auto didx = to_device(idx);
    auto dw = to_device(wts);
    DeviceRouting R;
    const auto rv = R.view(E, n * k);
    DeviceBuffer<bf16> act(size_t(n) * k * I), yd(size_t(n) * k * H), h(size_t(n) * H);
    CUDA_CHECK(cudaMemset(h.get(), 0, h.bytes()));
    const double ms_sort = median_ms([&] { cuda::moe_route_sort(didx.get(), n, k, E, rv, 0); });
    const double ms_gu = median_ms([&] {
      cuda::gemm_grouped(GU.dev, E, dx.get(), H, true, n, k, rv,
                         {act.get(), cuda::GemmOutType::kBF16, I, cuda::GemmEpilogue::kSwiGlu}, 0);
    });
    const double ms_dn = median_ms([&] {
      cuda::gemm_grouped(Dn.dev, E, act.get(), I, false, n, k, rv,
                         {yd.get(), cuda::GemmOutType::kBF16, H, cuda::GemmEpilogue::kStore}, 0);
    });
    const double ms_cb = median_ms([&] {
      cuda::moe_combine(yd.get(), R.slot_row.get(), dw.get(), n, k, H, h.get(), nullptr, nullptr, 0, h.get(),
                        0);
    });
    std::printf("  %-58s %8.3f ms\n", "moe_route_sort (256 experts, top-8)", ms_sort);
    report("gemm_grouped gate|up [256 x 1024x2048] swiglu", ms_gu, 2.0 * n * k * 2 * I * H);
    report("gemm_grouped down [256 x 2048x512]", ms_dn, 2.0 * n * k * H * I);
    std::printf("  %-58s %8.3f ms\n", "moe_combine", ms_cb);
  }
  {
    constexpr int hd = cuda::kHeadDim;
    DeviceBuffer<bf16> K(size_t(n) * 2 * hd), V(size_t(n) * 2 * hd), qg(size_t(n) * 16 * 512),
        out(size_t(n) * 16 * hd);
    const auto kr = to_bf16(randn(K.size())), qr = to_bf16(randn(qg.size()));
    CUDA_CHECK(cudaMemcpy(K.get(), kr.data(), kr.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(V.get(), kr.data(), kr.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(qg.get(), qr.data(), qr.size() * 2, cudaMemcpyHostToDevice));
    cuda::AttnPrefillArgs a;
    a.q = qg.get();
    a.q_stride_t = 16 * 512;
    a.q_stride_h = 512;
    a.gate = qg.get() + hd;
    a.gate_stride_t = 16 * 512;
    a.gate_stride_h = 512;
    a.k_cache = K.get();
    a.v_cache = V.get();
    a.n = n;
    a.n_heads = 16;
    a.n_kv = 2;
    a.out = out.get();
    a.out_stride_t = 16 * hd;
    a.out_stride_h = hd;
    const double ms = median_ms([&] { cuda::attention_prefill(a, 0); });
    // causal: sum over queries of (i+1) keys, 2 products (QK, PV) of 2*256 flop each, 16 heads
    report("attention_prefill 16/2 heads, causal 4096", ms, 4.0 * hd * 16 * (double(n) * (n + 1) / 2));
  }
  {
    constexpr int D = cuda::kGdnDim, nk = 16, nv = 32, conv = 2 * nk * D + nv * D;
    DeviceBuffer<bf16> y(size_t(n) * conv);
    const auto yr = to_bf16(randn(y.size(), 0.09f));
    CUDA_CHECK(cudaMemcpy(y.get(), yr.data(), yr.size() * 2, cudaMemcpyHostToDevice));
    std::vector<float> bg(size_t(n) * nv);
    for (auto& v : bg) v = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng());
    auto dbeta = to_device(bg);
    for (auto& v : bg) v = -v;
    auto dg = to_device(bg);
    DeviceBuffer<float> S(size_t(nv) * D * D);
    CUDA_CHECK(cudaMemset(S.get(), 0, S.bytes()));
    DeviceBuffer<bf16> o(size_t(n) * nv * D);
    cuda::GdnPrefillArgs a;
    a.q = y.get();
    a.k = y.get() + nk * D;
    a.v = y.get() + 2 * nk * D;
    a.q_stride = a.k_stride = a.v_stride = conv;
    a.beta = dbeta.get();
    a.g = dg.get();
    a.n = n;
    a.n_k_heads = nk;
    a.n_v_heads = nv;
    a.state = S.get();
    a.o_bf16 = o.get();
    a.o_stride = nv * D;
    const double ms = median_ms([&] { cuda::gdn_prefill(a, 0); });
    std::printf("  %-58s %8.3f ms  (x30 layers = %.1f ms)\n", "gdn_prefill 16/32 heads", ms, 30 * ms);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

// The chunked delta rule alone at the real heads (16 key, 32 value, d 128), f32 output as the
// prefill path uses it, then the gated norm and the conv: µs per layer.
TEST(Timing, Gdn) {
  constexpr int D = cuda::kGdnDim, nk = 16, nv = 32, conv = 2 * nk * D + nv * D;
  std::printf("gdn chunked delta rule per layer (median of 15; heads %d/%d; random data)\n", nk, nv);
  for (const int n : {4096, 32768}) {
    DeviceBuffer<bf16> y(size_t(n) * conv);
    const auto yr = to_bf16(randn(y.size(), 0.09f));
    CUDA_CHECK(cudaMemcpy(y.get(), yr.data(), yr.size() * 2, cudaMemcpyHostToDevice));
    std::vector<float> bg(size_t(n) * nv);
    for (auto& v : bg) v = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng());
    auto dbeta = to_device(bg);
    for (auto& v : bg) v = -v;
    auto dg = to_device(bg);
    DeviceBuffer<float> S(size_t(nv) * D * D), o(size_t(n) * nv * D);
    CUDA_CHECK(cudaMemset(S.get(), 0, S.bytes()));
    cuda::GdnPrefillArgs a;
    a.q = y.get();
    a.k = y.get() + nk * D;
    a.v = y.get() + 2 * nk * D;
    a.q_stride = a.k_stride = a.v_stride = conv;
    a.beta = dbeta.get();
    a.g = dg.get();
    a.n = n;
    a.n_k_heads = nk;
    a.n_v_heads = nv;
    a.state = S.get();
    a.o_f32 = o.get();
    a.o_stride = nv * D;
    const double tc = median_ms([&] { cuda::gdn_prefill(a, 0); });
    std::printf("  TIMING gdn n=%-6d gdn_prefill %9.1f us/layer\n", n, 1e3 * tc);
  }
  {
    // The gated RMSNorm after it, at the prefill's layout (z inside the in_proj rows).
    constexpr int n = 4096, VD = nv * D;
    const int64_t ldz = 2 * VD + conv + 2 * nv + 8;
    DeviceBuffer<float> o(size_t(n) * VD), w(D);
    DeviceBuffer<bf16> z(size_t(n) * ldz), y(size_t(n) * VD);
    CUDA_CHECK(cudaMemset(o.get(), 0x3c, o.bytes()));
    CUDA_CHECK(cudaMemset(w.get(), 0x3c, w.bytes()));
    CUDA_CHECK(cudaMemset(z.get(), 0x3c, z.bytes()));
    cuda::GdnGatedNormArgs na;
    na.o = o.get();
    na.ldo = VD;
    na.z = z.get() + conv;
    na.ldz = ldz;
    na.w = w.get();
    na.n = n;
    na.n_heads = nv;
    na.eps = 1e-6f;
    na.y = y.get();
    na.ldy = VD;
    const double fused = median_ms([&] { cuda::gdn_gated_norm(na, 0); });
    const double old = median_ms([&] {
      cuda::gated_rmsnorm(o.get(), VD, z.get() + conv, ldz, w.get(), n, nv, D, 1e-6f, y.get(), VD, 0);
    });
    const double gb = (double(n) * VD * (4 + 2 + 2)) / 1e9;
    std::printf(
        "  TIMING gdn n=%-6d gdn_gated_norm %6.1f us/layer (%.0f GB/s)   norm/gated_rmsnorm %6.1f us/layer\n",
        n, 1e3 * fused, gb / (fused * 1e-3), 1e3 * old);
  }
  {
    // Conv + SiLU + q/k l2norm + gates before it (gdn_conv), at the prefill's layout.
    constexpr int n = 4096, VD = nv * D, K = 4;
    const int64_t ld = conv + VD + 2 * nv + 8;
    DeviceBuffer<bf16> x(size_t(n) * ld), win(size_t(K - 1) * conv), y(size_t(n) * conv);
    DeviceBuffer<float> w(size_t(conv) * K), A_log(nv), dt(nv), beta(size_t(n) * nv), g(size_t(n) * nv);
    for (auto* b : {&x, &win}) CUDA_CHECK(cudaMemset(b->get(), 0x3c, b->bytes()));
    for (auto* b : {&w, &A_log, &dt}) CUDA_CHECK(cudaMemset(b->get(), 0x3c, b->bytes()));
    cuda::GdnConvArgs ca;
    ca.x = x.get();
    ca.ldx = ld;
    ca.a = x.get() + conv + VD;
    ca.b = x.get() + conv + VD + nv;
    ca.ld_ab = ld;
    ca.n = n;
    ca.n_k_heads = nk;
    ca.n_v_heads = nv;
    ca.kernel = K;
    ca.conv_w = w.get();
    ca.window = win.get();
    ca.A_log = A_log.get();
    ca.dt_bias = dt.get();
    ca.y = y.get();
    ca.beta = beta.get();
    ca.g = g.get();
    const double ms = median_ms([&] { cuda::gdn_conv(ca, 0); });
    const double gb = double(n) * conv * 2 * 2 / 1e9;
    std::printf(
        "  TIMING gdn n=%-6d gdn_conv (conv+gates) %6.1f us/layer (%.0f GB/s of x read + y written)\n", n,
        1e3 * ms, gb / (ms * 1e-3));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace prefill_timing

}  // namespace
}  // namespace tansy
