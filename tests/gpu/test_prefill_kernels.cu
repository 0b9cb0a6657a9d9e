// Prefill kernels against the CPU reference (src/cpu/ops.h) on fresh random inputs, at the real
// model's shapes and at edge sizes (1 token, 63/64/65 around the GDN chunk and the tile sizes,
// 200, 4096, a 32K-token context for attention).
//
// Tolerances (||out - ref|| / ||ref||, METHOD.md):
//  - kTolExact 1e-5: the GEMM against cpu::matmul on the *same* bf16-rounded dequantized weights
//    (the kernel rounds s·q+b to bf16 once before the tensor cores), f32 output: only the f32
//    summation order differs, so any tile/index/scale mistake shows up at O(1).
//  - kTolBf16 1e-2: bf16 operands or outputs against the plain f32 reference.
//  - kTolF32Chunked 1e-4: chunked GDN with f32 output/state against the token-by-token loop:
//    the same math re-associated through a 64x64 triangular solve per chunk.
// Outputs are poisoned with NaN bytes first; NaN fails every check. Rows of very large cases are
// sampled (the CPU reference is the cost), and the unsampled rows are still checked for being written.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "core/threadpool.h"
#include "cpu/ops.h"
#include "cuda/attention/attention.cuh"
#include "cuda/gdn/gdn.cuh"
#include "cuda/gemm/gemm.cuh"
#include "cuda/moe/moe.cuh"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

constexpr double kTolExact = 1e-5;
constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32Chunked = 1e-4;

std::string str(int v) { return std::to_string(v); }

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// A random weight matrix in its stored form on host (Linear) and device (DevLinear), plus the
// bf16-rounded dequantized copy the GEMM's tensor cores effectively multiply by.
struct Weight {
  std::vector<uint32_t> q;
  std::vector<uint16_t> s, b, w;
  Linear host;
  DeviceBuffer<uint32_t> dq;
  DeviceBuffer<bf16> ds, db, dw;
  cuda::DevLinear dev;

  std::vector<uint16_t> rounded;  // [out, in] bf16 of the dequantized weights
  Linear exact() {
    if (rounded.empty()) {
      rounded.resize(size_t(host.out) * host.in);
      std::vector<float> row(host.in);
      for (int r = 0; r < host.out; ++r) {
        host.row(r, row.data());
        for (int c = 0; c < host.in; ++c) rounded[size_t(r) * host.in + c] = f32_to_bf16(row[c]);
      }
    }
    Linear e = host;
    e.fmt = WFormat::kBF16;
    e.q = nullptr;
    e.scales = e.biases = nullptr;
    e.bf16 = rounded.data();
    return e;
  }
};

// Scales/biases like MLX's: codes span roughly [-range/2, range/2]·s around a small offset.
Weight random_weight(WFormat fmt, int out, int in) {
  Weight m;
  m.host.fmt = m.dev.fmt = fmt;
  m.host.out = m.dev.out = out;
  m.host.in = m.dev.in = in;
  m.host.group = 64;
  auto upload16 = [](DeviceBuffer<bf16>& d, const std::vector<uint16_t>& h) {
    d.resize(h.size());
    CUDA_CHECK(cudaMemcpy(d.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  };
  if (fmt == WFormat::kBF16) {
    m.w = to_bf16(randn(size_t(out) * in, 0.05f));
    m.host.bf16 = m.w.data();
    upload16(m.dw, m.w);
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
  upload16(m.ds, m.s);
  upload16(m.db, m.b);
  m.dev.q = m.dq.get();
  m.dev.scales = m.ds.get();
  m.dev.biases = m.db.get();
  return m;
}

// Rows to check against the CPU: all of them up to 256, else the edges, the tile/chunk
// boundaries and a random sample.
std::vector<int> rows_to_check(int n, int n_random) {
  std::vector<int> r;
  if (n <= 256) {
    r.resize(n);
    std::iota(r.begin(), r.end(), 0);
    return r;
  }
  for (int x : {0, 1, 63, 64, 65, 127, 128, 129, n - 65, n - 64, n - 1}) r.push_back(x);
  std::uniform_int_distribution<int> u(0, n - 1);
  for (int i = 0; i < n_random; ++i) r.push_back(u(rng()));
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

std::vector<float> take_rows(const std::vector<float>& m, int64_t ld, int cols,
                             const std::vector<int>& rows) {
  std::vector<float> o;
  o.reserve(rows.size() * cols);
  for (int r : rows) o.insert(o.end(), m.begin() + r * ld, m.begin() + r * ld + cols);
  return o;
}

float silu(float x) { return x / (1.f + std::exp(-x)); }
float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// ================================ GEMM ================================

struct GemmCase {
  WFormat fmt;
  int out, in, n;
  const char* what;
};

TEST(PrefillKernels, Gemm) {
  const GemmCase cases[] = {
      {WFormat::kAffine4, 8192, 2048, 1, "in_qkv"},     {WFormat::kAffine4, 8192, 2048, 63, "in_qkv"},
      {WFormat::kAffine4, 8192, 2048, 64, "in_qkv"},    {WFormat::kAffine4, 8192, 2048, 65, "in_qkv"},
      {WFormat::kAffine4, 8192, 2048, 200, "in_qkv"},   {WFormat::kAffine4, 8192, 2048, 4096, "in_qkv"},
      {WFormat::kAffine4, 2048, 4096, 200, "out_proj"}, {WFormat::kAffine4, 4096, 2048, 130, "in_z"},
      {WFormat::kAffine4, 512, 2048, 300, "k_proj"},    {WFormat::kAffine4, 2048, 512, 129, "shared down"},
      {WFormat::kAffine8, 256, 2048, 65, "router"},     {WFormat::kAffine8, 1, 2048, 63, "shared gate"},
      {WFormat::kAffine4, 37, 192, 3, "odd rows"},      {WFormat::kAffine8, 70, 128, 17, "8-bit small"},
      {WFormat::kBF16, 513, 2048, 130, "bf16"},         {WFormat::kBF16, 72, 64, 1, "bf16 small"},
  };
  for (const auto& c : cases) {
    Weight W = random_weight(c.fmt, c.out, c.in);
    // X rows ldx = in + 8 apart, to exercise the stride.
    const int64_t ldx = c.in + 8;
    auto x = randn(size_t(c.n) * ldx);
    round_bf16_inplace(x);
    auto dx = to_device_bf16(x);
    const auto rows = rows_to_check(c.n, 48);
    std::vector<float> xs;
    for (int r : rows) xs.insert(xs.end(), x.begin() + r * ldx, x.begin() + r * ldx + c.in);
    std::vector<float> ref(rows.size() * c.out), ref_exact(rows.size() * c.out);
    cpu::matmul(W.host, xs.data(), int(rows.size()), ref.data());
    cpu::matmul(W.exact(), xs.data(), int(rows.size()), ref_exact.data());
    const std::string label = std::string("gemm ") + c.what + " " + wformat_name(c.fmt) + " [" + str(c.out) +
                              "x" + str(c.in) + "] n=" + str(c.n);

    // f32 output with padded rows (ld = out + 2, rounded up to even: the kernel stores pairs and
    // the launcher refuses an odd ld)
    const int64_t ld = (c.out + 3) / 2 * 2;
    DeviceBuffer<float> y32(size_t(c.n) * ld);
    poison(y32);
    cuda::gemm(W.dev, dx.get(), ldx, c.n,
               {y32.get(), cuda::GemmOutType::kF32, ld, cuda::GemmEpilogue::kStore}, 0);
    auto h32 = from_device(y32.get(), y32.size());
    EXPECT_TRUE(all_finite(take_rows(h32, ld, c.out,
                                     [&] {
                                       std::vector<int> all(c.n);
                                       std::iota(all.begin(), all.end(), 0);
                                       return all;
                                     }())))
        << label << ": unwritten or non-finite output";
    const auto got = take_rows(h32, ld, c.out, rows);
    EXPECT_REL(got, ref_exact, kTolExact, label + " f32 vs bf16 weights");
    EXPECT_REL(got, ref, kTolBf16, label + " f32 vs f32 weights");

    // bf16 output (ld = out rounded up to even)
    const int64_t ld16 = (c.out + 1) / 2 * 2;
    DeviceBuffer<bf16> y16(size_t(c.n) * ld16);
    poison(y16);
    cuda::gemm(W.dev, dx.get(), ldx, c.n,
               {y16.get(), cuda::GemmOutType::kBF16, ld16, cuda::GemmEpilogue::kStore}, 0);
    EXPECT_REL(take_rows(from_device_bf16(y16.get(), y16.size()), ld16, c.out, rows), ref, kTolBf16,
               label + " bf16");
  }
}

TEST(PrefillKernels, GemmEpilogues) {
  for (const GemmCase c :
       {GemmCase{WFormat::kAffine4, 1024, 2048, 100, "expert gate|up"},
        GemmCase{WFormat::kAffine4, 1024, 2048, 300, "shared gate|up"},
        GemmCase{WFormat::kAffine8, 64, 256, 5, "8-bit"}, GemmCase{WFormat::kBF16, 256, 128, 70, "bf16"}}) {
    Weight W = random_weight(c.fmt, c.out, c.in);
    auto x = randn(size_t(c.n) * c.in);
    round_bf16_inplace(x);
    auto dx = to_device_bf16(x);
    std::vector<float> ref(size_t(c.n) * c.out);
    cpu::matmul(W.exact(), x.data(), c.n, ref.data());
    const std::string label = std::string(c.what) + " " + wformat_name(c.fmt) + " n=" + str(c.n);

    // Accumulate into an existing f32 and bf16 Y (the residual add).
    auto y0 = randn(size_t(c.n) * c.out);
    round_bf16_inplace(y0);
    std::vector<float> want(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) want[i] = y0[i] + ref[i];
    auto d32 = to_device(y0);
    cuda::gemm(W.dev, dx.get(), c.in, c.n,
               {d32.get(), cuda::GemmOutType::kF32, c.out, cuda::GemmEpilogue::kAccumulate}, 0);
    EXPECT_REL(from_device(d32.get(), d32.size()), want, kTolExact, "gemm accumulate f32 " + label);
    auto d16 = to_device_bf16(y0);
    cuda::gemm(W.dev, dx.get(), c.in, c.n,
               {d16.get(), cuda::GemmOutType::kBF16, c.out, cuda::GemmEpilogue::kAccumulate}, 0);
    EXPECT_REL(from_device_bf16(d16.get(), d16.size()), want, kTolBf16, "gemm accumulate bf16 " + label);

    // SwiGLU on interleaved rows, written into a column slice of a wider row (ld = out).
    const int I = c.out / 2;
    std::vector<float> sw(size_t(c.n) * I);
    for (int t = 0; t < c.n; ++t)
      for (int i = 0; i < I; ++i)
        sw[size_t(t) * I + i] = silu(ref[size_t(t) * c.out + 2 * i]) * ref[size_t(t) * c.out + 2 * i + 1];
    DeviceBuffer<bf16> ys(size_t(c.n) * c.out);
    poison(ys);
    cuda::gemm(W.dev, dx.get(), c.in, c.n,
               {ys.get() + 2, cuda::GemmOutType::kBF16, c.out, cuda::GemmEpilogue::kSwiGlu}, 0);
    const auto hs = from_device_bf16(ys.get(), ys.size());
    std::vector<float> got(sw.size());
    for (int t = 0; t < c.n; ++t)
      for (int i = 0; i < I; ++i) got[size_t(t) * I + i] = hs[size_t(t) * c.out + 2 + i];
    EXPECT_REL(got, sw, kTolBf16, "gemm swiglu " + label);
  }
}

TEST(PrefillKernels, GemmRejectsBadShapes) {
  Weight W = random_weight(WFormat::kAffine4, 8, 128);
  DeviceBuffer<bf16> x(4 * 136);
  DeviceBuffer<float> y(4 * 16);
  const cuda::GemmOutput out{y.get(), cuda::GemmOutType::kF32, 8, cuda::GemmEpilogue::kStore};
  EXPECT_NO_THROW(cuda::gemm(W.dev, x.get(), 128, 4, out, 0));
  W.dev.in = 96;  // not a multiple of the quant group
  EXPECT_THROW(cuda::gemm(W.dev, x.get(), 128, 4, out, 0), Error);
  W.dev.in = 128;
  EXPECT_THROW(cuda::gemm(W.dev, x.get(), 100, 4, out, 0), Error);      // ldx < in
  EXPECT_THROW(cuda::gemm(W.dev, x.get(), 132, 4, out, 0), Error);      // ldx not a multiple of 8
  EXPECT_THROW(cuda::gemm(W.dev, x.get() + 1, 128, 4, out, 0), Error);  // misaligned X
  EXPECT_THROW(cuda::gemm(W.dev, x.get(), 128, 0, out, 0), Error);
  EXPECT_THROW(cuda::gemm(W.dev, x.get(), 128, 4,
                          {y.get(), cuda::GemmOutType::kF32, 7, cuda::GemmEpilogue::kStore}, 0),
               Error);
  EXPECT_THROW(cuda::gemm(W.dev, x.get(), 128, 4,
                          {y.get(), cuda::GemmOutType::kF32, 9, cuda::GemmEpilogue::kStore}, 0),
               Error);  // odd ld
  W.dev.fmt = WFormat::kF32;
  EXPECT_THROW(cuda::gemm(W.dev, x.get(), 128, 4, out, 0), Error);
  CUDA_CHECK(cudaDeviceSynchronize());
}

// ================================ MoE ================================

// Top-k ids (distinct per token) and renormalised weights.
void random_routing(int n, int E, int k, std::vector<int>& idx, std::vector<float>& wts) {
  idx.resize(size_t(n) * k);
  wts.resize(size_t(n) * k);
  std::vector<int> perm(E);
  for (int t = 0; t < n; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    float s = 0;
    for (int j = 0; j < k; ++j) {
      idx[size_t(t) * k + j] = perm[j];
      s += wts[size_t(t) * k + j] = std::uniform_real_distribution<float>(0.05f, 1.f)(rng());
    }
    for (int j = 0; j < k; ++j) wts[size_t(t) * k + j] /= s;
  }
}

struct DeviceRouting {
  DeviceBuffer<int> offsets, tiles, sorted, slot_row;
  cuda::MoeRouting view(int E, int rows) {
    offsets.resize(E + 1);
    tiles.resize(E + 1);
    sorted.resize(rows);
    slot_row.resize(rows);
    return {offsets.get(), tiles.get(), sorted.get(), slot_row.get()};
  }
};

void check_moe(WFormat fmt, int E, int H, int I, int k, int n) {
  const std::string label =
      "moe E=" + str(E) + " H=" + str(H) + " I=" + str(I) + " k=" + str(k) + " n=" + str(n);
  Weight GU = random_weight(fmt, E * 2 * I, H);  // per expert: interleaved gate/up rows
  Weight D = random_weight(fmt, E * H, I);
  auto x = randn(size_t(n) * H);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  std::vector<int> idx;
  std::vector<float> wts;
  random_routing(n, E, k, idx, wts);
  auto didx = to_device(idx);
  auto dw = to_device(wts);
  const int rows = n * k;

  // Routing sort: a permutation grouping slots by expert, with consistent offsets and tiles.
  DeviceRouting R;
  const cuda::MoeRouting rv = R.view(E, rows);
  CUDA_CHECK(cudaMemset(R.sorted.get(), 0xff, R.sorted.bytes()));
  CUDA_CHECK(cudaMemset(R.slot_row.get(), 0xff, R.slot_row.bytes()));
  cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
  const auto off = from_device(R.offsets.get(), E + 1), tiles = from_device(R.tiles.get(), E + 1);
  const auto sorted = from_device(R.sorted.get(), rows), slot_row = from_device(R.slot_row.get(), rows);
  std::vector<int> count(E, 0);
  for (int e : idx) ++count[e];
  bool ok = off[0] == 0 && tiles[0] == 0;
  for (int e = 0; e < E && ok; ++e)
    ok = off[e + 1] - off[e] == count[e] &&
         tiles[e + 1] - tiles[e] == (count[e] + cuda::kGroupedBM - 1) / cuda::kGroupedBM;
  std::vector<int> seen(rows, 0);
  for (int e = 0; e < E && ok; ++e)
    for (int r = off[e]; r < off[e + 1] && ok; ++r) {
      const int s = sorted[r];
      ok = s >= 0 && s < rows && idx[s] == e && slot_row[s] == r && ++seen[s] == 1;
    }
  ASSERT_TRUE(ok) << label << ": routing sort produced an inconsistent permutation";

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

TEST(PrefillKernels, MoeGrouped) {
  check_moe(WFormat::kAffine4, 256, 2048, 512, 8, 1);    // real shapes, one token
  check_moe(WFormat::kAffine4, 256, 2048, 512, 8, 200);  // real shapes, most experts 1 partial tile
  check_moe(WFormat::kAffine4, 8, 256, 128, 2, 300);     // ~75 rows per expert: 2 tiles each
  check_moe(WFormat::kAffine8, 4, 128, 64, 1, 65);       // 8-bit, top-1
  check_moe(WFormat::kBF16, 16, 192, 64, 4, 33);
}

TEST(PrefillKernels, MoeRejectsBadShapes) {
  DeviceRouting R;
  DeviceBuffer<int> idx(8);
  EXPECT_THROW(cuda::moe_route_sort(idx.get(), 4, 2, cuda::kRouteMaxExperts + 1, R.view(4, 8), 0), Error);
  EXPECT_THROW(cuda::moe_route_sort(idx.get(), 4, 0, 4, R.view(4, 8), 0), Error);
  Weight W = random_weight(WFormat::kAffine4, 3 * 64, 128);
  DeviceBuffer<bf16> x(8 * 128), y(8 * 64);
  // 192 stacked rows do not split into 5 experts
  EXPECT_THROW(cuda::gemm_grouped(W.dev, 5, x.get(), 128, true, 4, 2, R.view(5, 8),
                                  {y.get(), cuda::GemmOutType::kBF16, 64, cuda::GemmEpilogue::kStore}, 0),
               Error);
  EXPECT_THROW(cuda::moe_combine(y.get(), R.slot_row.get(), nullptr, 4, 2, 60, nullptr, nullptr, nullptr, 0,
                                 y.get(), 0),
               Error);
}

// ================================ attention ================================

struct AttnCase {
  int n_heads, n_kv, p0, n;
  bool gate;
  int n_random;  // sampled query rows when n > 256
};

void check_attention(const AttnCase& c) {
  constexpr int hd = cuda::kHeadDim;
  const int ctx = c.p0 + c.n, pad_rows = 40;
  const std::string label = "attention heads " + str(c.n_heads) + "/" + str(c.n_kv) + " p0=" + str(c.p0) +
                            " n=" + str(c.n) + (c.gate ? " gated" : "");
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
  DeviceBuffer<bf16> out(size_t(c.n) * ldo);
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
  cuda::attention_prefill(a, 0);
  const auto got_all = from_device_bf16(out.get(), out.size());
  EXPECT_TRUE(all_finite(got_all)) << label << ": unwritten or non-finite output";

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

TEST(PrefillKernels, Attention) {
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

TEST(PrefillKernels, AttentionLongContext) {
  // ~32K cached positions; a few query rows checked (each reference row costs 32K x 16 heads).
  check_attention({16, 2, 32768 - 64, 64, true, 0});
  check_attention({16, 2, 32768 - 600, 600, false, 3});
}

TEST(PrefillKernels, AttentionRejectsBadShapes) {
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
}

// ================================ Gated DeltaNet ================================

void check_gdn(int n_k, int n_v, int n, bool f32_out) {
  constexpr int D = cuda::kGdnDim;
  const std::string label =
      "gdn heads " + str(n_k) + "/" + str(n_v) + " n=" + str(n) + (f32_out ? " f32" : " bf16");
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
  cuda::GdnPrefillArgs a;
  a.q = dy.get();
  a.k = dy.get() + key_dim;
  a.v = dy.get() + 2 * key_dim;
  a.q_stride = a.k_stride = a.v_stride = conv_dim;
  a.beta = dbeta.get();
  a.g = dg.get();
  a.n = n;
  a.n_k_heads = n_k;
  a.n_v_heads = n_v;
  a.state = dS.get();
  a.o_f32 = f32_out ? o32.get() : nullptr;
  a.o_bf16 = f32_out ? nullptr : o16.get();
  a.o_stride = ldo;
  cuda::gdn_prefill(a, 0);
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

TEST(PrefillKernels, GdnChunked) {
  for (int n : {1, 63, 64, 65, 200}) check_gdn(16, 32, n, n % 2 == 1);  // real heads
  check_gdn(16, 32, 129, false);
  check_gdn(2, 4, 4096, true);  // long sequence (fewer heads keep the CPU loop short)
  check_gdn(2, 4, 1000, false);
  check_gdn(4, 4, 130, true);  // ratio 1
  check_gdn(1, 3, 70, false);  // ratio 3
}

TEST(PrefillKernels, GdnRejectsBadShapes) {
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
}

// ================================ timings (print, never assert) ================================

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

TEST(PrefillKernels, Timing) {
  constexpr int n = 4096;
  std::printf("prefill kernel timings at n=%d (median of 15; 4-bit weights; random data)\n", n);
  auto x = randn(size_t(n) * 4096);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  {
    Weight W = random_weight(WFormat::kAffine4, 8192, 2048);
    DeviceBuffer<bf16> y(size_t(n) * 8192);
    const double ms = median_ms([&] {
      cuda::gemm(W.dev, dx.get(), 2048, n,
                 {y.get(), cuda::GemmOutType::kBF16, 8192, cuda::GemmEpilogue::kStore}, 0);
    });
    report("gemm in_qkv [8192x2048] -> bf16", ms, 2.0 * n * 8192 * 2048);
  }
  {
    Weight W = random_weight(WFormat::kAffine4, 2048, 4096);
    DeviceBuffer<bf16> y(size_t(n) * 2048);
    const double ms = median_ms([&] {
      cuda::gemm(W.dev, dx.get(), 4096, n,
                 {y.get(), cuda::GemmOutType::kBF16, 2048, cuda::GemmEpilogue::kAccumulate}, 0);
    });
    report("gemm out_proj [2048x4096] += bf16", ms, 2.0 * n * 2048 * 4096);
  }
  {
    constexpr int E = 256, k = 8, H = 2048, I = 512;
    Weight GU = random_weight(WFormat::kAffine4, E * 2 * I, H);
    Weight Dn = random_weight(WFormat::kAffine4, E * H, I);
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

}  // namespace
}  // namespace tansy
