// The prefill GEMMs on tensor cores (src/cuda/gemm/) against cpu::matmul on fresh random inputs,
// at the real model's shapes and at edge sizes (1 token, 63/64/65 around the tile sizes, 200, 4096).
// Tolerances (||out - ref|| / ||ref||): kTolExact 1e-5 against cpu::matmul on the *same*
// bf16-rounded dequantized weights (TestMatrix::exact(): the kernel rounds s·q+b to bf16 once before
// the tensor cores), f32 output: only the f32 summation order differs, so any tile/index/scale
// mistake shows up at O(1); kTolBf16 (gpu_test_util.h) against the plain f32 reference. Outputs are
// poisoned with NaN bytes first; rows of very large cases are sampled (rows_to_check), and the
// unsampled rows are still checked for being written.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "cpu/ops.h"
#include "cuda/gemm/gemm.cuh"
#include "cuda/gemm/gemm_impl.cuh"
#include "cuda/moe/moe.cuh"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

constexpr double kTolExact = 1e-5;

struct GemmCase {
  WFormat fmt;
  int out, in, n;
  const char* what;
};

// Runs cases under one prefill GEMM kernel (gemm_set_kernel), restoring the default after.
struct GemmKernelScope {
  cuda::GemmKernel saved = cuda::gemm_kernel();
  explicit GemmKernelScope(cuda::GemmKernel k) { cuda::gemm_set_kernel(k); }
  ~GemmKernelScope() { cuda::gemm_set_kernel(saved); }
};
const char* kernel_name() {
  switch (cuda::gemm_kernel()) {
    case cuda::GemmKernel::kWgmma:
      return "wgmma ";
    case cuda::GemmKernel::kWgmmaGrouped:
      return "wgmma-grouped ";
    default:
      return "mma ";
  }
}

void plain_cases() {
  const GemmCase cases[] = {
      {WFormat::kAffine4, 8192, 2048, 1, "in_qkv"},
      {WFormat::kAffine4, 8192, 2048, 63, "in_qkv"},
      {WFormat::kAffine4, 8192, 2048, 64, "in_qkv"},
      {WFormat::kAffine4, 8192, 2048, 65, "in_qkv"},
      {WFormat::kAffine4, 8192, 2048, 200, "in_qkv"},
      {WFormat::kAffine4, 8192, 2048, 4096, "in_qkv"},
      {WFormat::kAffine4, 2048, 4096, 200, "out_proj"},
      {WFormat::kAffine4, 4096, 2048, 130, "in_z"},
      {WFormat::kAffine4, 512, 2048, 300, "k_proj"},
      {WFormat::kAffine4, 2048, 512, 129, "shared down"},
      {WFormat::kAffine8, 256, 2048, 65, "router"},
      {WFormat::kAffine8, 257, 2048, 4096, "router and shared gate (one-column last tile)"},
      {WFormat::kAffine8, 1, 2048, 63, "shared gate"},
      {WFormat::kAffine4, 37, 192, 3, "odd rows"},
      {WFormat::kAffine8, 70, 128, 17, "8-bit small"},
      {WFormat::kBF16, 513, 2048, 130, "bf16"},
      {WFormat::kBF16, 72, 64, 1, "bf16 small"},
      // 256-column tiles (enough tiles to fill the machine), partial last column tile
      {WFormat::kAffine4, 12352, 2048, 4096, "gdn in_proj"},
      {WFormat::kAffine4, 2048, 4096, 4096, "gdn out_proj"},
      {WFormat::kAffine4, 12352, 2048, 65, "gdn in_proj"},
      {WFormat::kAffine4, 1100, 128, 4096, "partial tile"},
      {WFormat::kAffine8, 1300, 256, 4096, "8-bit wide"},
      {WFormat::kBF16, 2000, 512, 4096, "bf16 wide"},
      // bf16 wgmma (gemm_bf16_wgmma.cu): the prefill router's bf16 copy, 128- and 64-token tiles,
      // partial row and column tiles, one k-tile
      {WFormat::kBF16, 258, 2048, 4096, "bf16 router shape"},
      {WFormat::kBF16, 258, 2048, 256, "bf16 router shape, 64-token tiles"},
      {WFormat::kBF16, 258, 2048, 4033, "bf16 router shape, partial"},
      {WFormat::kBF16, 258, 2048, 63, "bf16 router shape, one partial 64-token tile"},
      {WFormat::kBF16, 258, 2048, 64, "bf16 router shape, one full 64-token tile"},
      {WFormat::kBF16, 258, 2048, 65, "bf16 router shape, one row past a 64-token tile"},
      {WFormat::kBF16, 130, 64, 200, "bf16 one k-tile"},
      // wgmma tiles: 128 rows x 128 columns (partial last row and column tiles), one and two k-tiles
      {WFormat::kAffine4, 2048, 2048, 4000, "128-row tiles, partial"},
      {WFormat::kAffine4, 1100, 64, 4033, "one k-tile"},
      {WFormat::kAffine4, 300, 64, 70, "one k-tile, 64-row tiles"},
      {WFormat::kAffine4, 2048, 4096, 127, "out_proj"},
      {WFormat::kAffine4, 2048, 4096, 129, "out_proj"},
  };
  for (const auto& c : cases) {
    TestMatrix W = make_matrix(c.fmt, c.out, c.in);
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
    const std::string label = std::string("gemm ") + kernel_name() + c.what + " " + wformat_name(c.fmt) +
                              " [" + str(c.out) + "x" + str(c.in) + "] n=" + str(c.n);

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

TEST(Gemm, Plain) {
  GemmKernelScope scope(cuda::GemmKernel::kMma);
  plain_cases();
}
TEST(Gemm, PlainWgmma) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmma);
  plain_cases();
}

// A random product: W, X [n, in] rounded to bf16 (on the device too) and, unless a test compares
// only kernel with kernel (with_ref false), the CPU's Y on W's bf16 weights (TestMatrix::exact()),
// which the tensor-core kernels match to kTolExact.
struct RandomProduct {
  TestMatrix W;
  std::vector<float> x, ref;
  DeviceBuffer<bf16> dx;
  RandomProduct(WFormat fmt, int out, int in, int n, bool with_ref = true)
      : W(make_matrix(fmt, out, in)), x(randn(size_t(n) * in)) {
    round_bf16_inplace(x);
    dx = to_device_bf16(x);
    if (!with_ref) return;
    ref.resize(size_t(n) * out);
    cpu::matmul(W.exact(), x.data(), n, ref.data());
  }
  // Y for X's first `rows` rows through cuda::gemm, f32 (ld = out), into NaN-poisoned memory.
  std::vector<float> run(int rows) const {
    DeviceBuffer<float> y(size_t(rows) * W.host.out);
    poison(y);
    cuda::gemm(W.dev, dx.get(), W.host.in, rows,
               {y.get(), cuda::GemmOutType::kF32, W.host.out, cuda::GemmEpilogue::kStore}, 0);
    return from_device(y.get(), y.size());
  }
};

// The bf16 wgmma kernel (the prefill router) gives a row the same bits whatever else is in the
// product: a 4,096-token chunk (128-token tiles), a 200-token piece (64-token tiles) and one token.
TEST(Gemm, Bf16WgmmaRowsDoNotDependOnTheOthers) {
  GemmKernelScope scope(cuda::GemmKernel::kAuto);
  constexpr int n = 4096;
  const RandomProduct P(WFormat::kBF16, 258, 2048, n, /*with_ref=*/false);  // rows against rows only
  const auto all = P.run(n), piece = P.run(200), one = P.run(1);
  ASSERT_TRUE(all_finite(all));
  EXPECT_EQ(0, std::memcmp(piece.data(), all.data(), piece.size() * sizeof(float)))
      << "rows 0..199 differ between 200 and 4,096 rows";
  EXPECT_EQ(0, std::memcmp(one.data(), all.data(), one.size() * sizeof(float))) << "row 0 differs alone";
}

// Every wgmma tile shape forced (the automatic choice never picks some of them at these sizes).
TEST(Gemm, WgmmaTiles) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmma);
  const GemmCase cases[] = {{WFormat::kAffine4, 300, 192, 1, "one row"},
                            {WFormat::kAffine4, 1100, 128, 129, "partial tiles"},
                            {WFormat::kAffine4, 2048, 2048, 300, "in_proj-like"}};
  for (const auto& [rows, wg] :
       {std::pair{64, 2}, std::pair{64, 4}, std::pair{128, 2}, std::pair{128, 4}, std::pair{256, 2}}) {
    cuda::gemm_impl::set_wgmma_tiles(rows, wg);
    for (const auto& c : cases) {
      const RandomProduct P(c.fmt, c.out, c.in, c.n);
      EXPECT_REL(P.run(c.n), P.ref, kTolExact,
                 std::string("gemm wgmma tiles ") + str(rows) + "x" + str(64 * wg) + " " + c.what +
                     " n=" + str(c.n));
    }
  }
  cuda::gemm_impl::set_wgmma_tiles(0, 0);
  EXPECT_THROW(cuda::gemm_impl::set_wgmma_tiles(96, 2), Error);
  EXPECT_THROW(cuda::gemm_impl::set_wgmma_tiles(256, 4), Error);
}

// Dense products of too few 64-row tiles for the machine run split over k, in clusters whose
// blocks add their partial tiles in a fixed order (gemm_wgmma.cu): exact against the CPU on the
// same bf16 weights, the same bits on every launch, and within f32 rounding of the unsplit tiles.
TEST(Gemm, WgmmaSplitOverK) {
  GemmKernelScope scope(cuda::GemmKernel::kAuto);
  const GemmCase cases[] = {{WFormat::kAffine4, 2048, 4096, 1, "out_proj, one token"},
                            {WFormat::kAffine4, 2048, 4096, 63, "out_proj"},
                            {WFormat::kAffine4, 2048, 4096, 100, "out_proj"},
                            {WFormat::kAffine4, 2048, 4096, 256, "out_proj, 256 tokens"},
                            {WFormat::kAffine4, 2048, 4096, 300, "out_proj, partial row tile"},
                            {WFormat::kAffine4, 1024, 2048, 256, "shared gate|up"},
                            {WFormat::kAffine4, 1100, 1024, 70, "partial column tile"}};
  for (const auto& c : cases) {
    const int splits = cuda::gemm_impl::wgmma_k_splits(c.out, c.in, c.n, true);
    const std::string label = std::string("gemm split over k ") + c.what + " [" + str(c.out) + "x" +
                              str(c.in) + "] n=" + str(c.n) + " splits=" + str(splits);
    ASSERT_GT(splits, 1) << label << ": not split (this case is sized to be)";
    const RandomProduct P(c.fmt, c.out, c.in, c.n);
    const auto a = P.run(c.n), b = P.run(c.n);
    ASSERT_TRUE(all_finite(a)) << label << ": unwritten or non-finite output";
    EXPECT_REL(a, P.ref, kTolExact, label);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << label << ": launches differ";
    cuda::gemm_impl::set_wgmma_tiles(64, 2);  // the same tiles, unsplit
    const auto whole = P.run(c.n);
    cuda::gemm_impl::set_wgmma_tiles(0, 0);
    EXPECT_REL(a, whole, kTolExact, label + " vs unsplit");
  }
  EXPECT_EQ(1, cuda::gemm_impl::wgmma_k_splits(2048, 4096, 4096, true))
      << "a 4,096-token product fills the machine";
  EXPECT_EQ(1, cuda::gemm_impl::wgmma_k_splits(2048, 4096, 200, false)) << "unstaged scales are not split";
  EXPECT_EQ(1, cuda::gemm_impl::wgmma_k_splits(2048, 512, 200, true))
      << "8 k-tiles: one run of staged scales";
}

void epilogue_cases() {
  for (const GemmCase c :
       {GemmCase{WFormat::kAffine4, 1024, 2048, 100, "expert gate|up"},
        GemmCase{WFormat::kAffine4, 1024, 2048, 300, "shared gate|up"},
        GemmCase{WFormat::kAffine8, 64, 256, 5, "8-bit"}, GemmCase{WFormat::kBF16, 256, 128, 70, "bf16"},
        GemmCase{WFormat::kAffine4, 4224, 128, 1030, "128-row tiles"},
        // 256-row tiles under the automatic rule (15 x 16 tiles, the last one 16 rows short)
        GemmCase{WFormat::kAffine4, 2048, 256, 3824, "256-row tiles"}}) {
    TestMatrix W = make_matrix(c.fmt, c.out, c.in);
    auto x = randn(size_t(c.n) * c.in);
    round_bf16_inplace(x);
    auto dx = to_device_bf16(x);
    std::vector<float> ref(size_t(c.n) * c.out);
    cpu::matmul(W.exact(), x.data(), c.n, ref.data());
    const std::string label =
        std::string(kernel_name()) + c.what + " " + wformat_name(c.fmt) + " n=" + str(c.n);

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

TEST(Gemm, Epilogues) {
  GemmKernelScope scope(cuda::GemmKernel::kMma);
  epilogue_cases();
}
TEST(Gemm, EpiloguesWgmma) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmma);
  epilogue_cases();
}

// ---- grouped (per-expert) GEMM on the persistent warpgroup kernel (GemmKernel::kWgmmaGrouped) ----
//
// At the real shapes (256 experts, gate|up [1024 x 2048] per expert gathered from the token rows,
// down [2048 x 512] over sorted rows), with uniform routing (~128 rows per expert at 4,096 tokens),
// with power-law popularity (the first experts take hundreds of rows, the last few or none) and with
// one expert pinned to 0 rows and one to exactly 1, under the automatic tile size and every built
// one. Reference: cpu::matmul per expert on the bf16-rounded dequantized weights (kTolExact for f32
// outputs, kTolBf16 for bf16 ones); every output row is checked for being written (NaN poison).

// Each token's k distinct experts drawn with probability ~ (rank+1)^-alpha (Gumbel top-k; alpha 0:
// uniform).
std::vector<int> power_law_routing(int n, int E, int k, double alpha) {
  std::vector<std::pair<double, int>> key(E);
  std::uniform_real_distribution<double> u(1e-12, 1.0);
  std::vector<int> idx(size_t(n) * k);
  for (int t = 0; t < n; ++t) {
    for (int e = 0; e < E; ++e)
      key[size_t(e)] = {-alpha * std::log(e + 1.0) - std::log(-std::log(u(rng()))), e};
    std::partial_sort(key.begin(), key.begin() + k, key.end(), std::greater<>());
    for (int j = 0; j < k; ++j) idx[size_t(t) * k + j] = key[size_t(j)].second;
  }
  return idx;
}

// Top-k choices of n tokens in which expert e is chosen counts[e] times (each <= n, summing to n*k),
// distinct per token: the experts' runs laid out slot j of every token, then slot j+1.
std::vector<int> routing_with_counts(int n, int k, const std::vector<int>& counts) {
  std::vector<int> runs;
  for (size_t e = 0; e < counts.size(); ++e) {
    EXPECT_LE(counts[e], n);
    runs.insert(runs.end(), size_t(counts[e]), int(e));
  }
  EXPECT_EQ(runs.size(), size_t(n) * k);
  runs.resize(size_t(n) * k);
  std::vector<int> idx(size_t(n) * k);
  for (int j = 0; j < k; ++j)
    for (int t = 0; t < n; ++t) idx[size_t(t) * k + j] = runs[size_t(j) * n + t];
  return idx;
}

// Moves choices so that expert `zero` has no rows and expert `one` exactly one (the first token that
// chose it keeps it; if none did, token 0 takes it). Replacements are experts the token has not chosen.
void pin_counts(std::vector<int>& idx, int n, int E, int k, int zero, int one) {
  std::uniform_int_distribution<int> ue(0, E - 1);
  bool kept = false;
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      int& e = idx[size_t(t) * k + j];
      if (e == one && !kept) {
        kept = true;
        continue;
      }
      if (e != zero && e != one) continue;
      for (;;) {
        const int c = ue(rng());
        if (c == zero || c == one) continue;
        if (std::find(idx.begin() + size_t(t) * k, idx.begin() + size_t(t + 1) * k, c) !=
            idx.begin() + size_t(t + 1) * k)
          continue;
        e = c;
        break;
      }
    }
  if (!kept) {
    int& e = idx[0];  // token 0's first choice (not `one`, not `zero` after the loop) becomes `one`
    e = one;
  }
}

// The sorted rows of expert e to compare: all of them up to 48, else the first two, the middle, the
// last two and 40 at random (every tile of an expert holds at least a third of its rows).
std::vector<int> expert_rows_to_check(int c) {
  std::vector<int> r;
  if (c <= 48) {
    r.resize(size_t(c));
    std::iota(r.begin(), r.end(), 0);
    return r;
  }
  for (int x : {0, 1, c / 2, c - 2, c - 1}) r.push_back(x);
  std::uniform_int_distribution<int> u(0, c - 1);
  for (int i = 0; i < 40; ++i) r.push_back(u(rng()));
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

// One grouped product (W stacks E experts of `out` rows) checked against the reference on the experts
// `check`, under every tile size in `sizes` (0: the automatic choice).
void check_grouped(const std::string& what, TestMatrix& W, int E, int n, int k, const std::vector<int>& idx,
                   bool gather, const std::vector<int>& check, const std::vector<int>& sizes) {
  const int out = W.dev.out / E, in = W.dev.in, rows = n * k;
  auto x = randn(size_t(gather ? n : rows) * in);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  auto didx = to_device(idx);
  DeviceRouting R;
  const cuda::MoeRouting rv = R.view(E, rows);
  cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
  const auto off = from_device(R.offsets.get(), E + 1), sorted = from_device(R.sorted.get(), rows);
  std::vector<int> count(E, 0);
  for (int e : idx) ++count[size_t(e)];
  for (int e = 0; e < E; ++e)
    ASSERT_EQ(off[e + 1] - off[e], count[e]) << what << ": routing sort, expert " << e;

  // References, once per expert: rows ref_rows[e] (sorted-row indices), values [row][out] (f32 sums on
  // the bf16-rounded weights) and their SwiGLU.
  std::vector<std::vector<int>> ref_rows(E);
  std::vector<std::vector<float>> ref(E), ref_sw(E);
  for (int e : check) {
    const int c = count[size_t(e)];
    if (c == 0 || !ref_rows[e].empty()) continue;
    for (int r : expert_rows_to_check(c)) ref_rows[e].push_back(off[e] + r);
    const Linear We = W.host.rows(e * out, out);
    std::vector<uint16_t> rounded(size_t(out) * in);
    std::vector<float> row(in);
    for (int j = 0; j < out; ++j) {
      We.row(j, row.data());
      for (int i = 0; i < in; ++i) rounded[size_t(j) * in + i] = f32_to_bf16(row[i]);
    }
    Linear ex = We;
    ex.fmt = WFormat::kBF16;
    ex.q = nullptr;
    ex.scales = ex.biases = nullptr;
    ex.bf16 = rounded.data();
    std::vector<float> xs;
    for (int r : ref_rows[e]) {
      const int xr = gather ? sorted[r] / k : r;
      xs.insert(xs.end(), x.begin() + size_t(xr) * in, x.begin() + size_t(xr + 1) * in);
    }
    const int nr = int(ref_rows[e].size());
    ref[e].resize(size_t(nr) * out);
    cpu::matmul(ex, xs.data(), nr, ref[e].data());
    ref_sw[e].resize(size_t(nr) * (out / 2));
    for (int i = 0; i < nr; ++i)
      for (int j = 0; j < out / 2; ++j)
        ref_sw[e][size_t(i) * (out / 2) + j] =
            silu(ref[e][size_t(i) * out + 2 * j]) * ref[e][size_t(i) * out + 2 * j + 1];
  }

  DeviceBuffer<float> y32(size_t(rows) * out);
  DeviceBuffer<bf16> y16(size_t(rows) * out);
  for (const int size : sizes) {
    cuda::gemm_impl::set_grouped_wgmma_rows(size);
    const std::string label =
        what + " tiles " + (size ? str(size) : "auto " + str(cuda::gemm_impl::grouped_wgmma_rows(rows, E))) +
        " rows, n=" + str(n);
    // f32 store (exact against the reference), then the product's bf16 output: SwiGLU for gate|up
    // (out/2 columns), a plain store for down.
    poison(y32);
    cuda::gemm_grouped(W.dev, E, dx.get(), in, gather, n, k, rv,
                       {y32.get(), cuda::GemmOutType::kF32, out, cuda::GemmEpilogue::kStore}, 0);
    const auto h32 = from_device(y32.get(), y32.size());
    const bool swiglu = gather;
    const int cols16 = swiglu ? out / 2 : out;
    poison(y16);
    cuda::gemm_grouped(W.dev, E, dx.get(), in, gather, n, k, rv,
                       {y16.get(), cuda::GemmOutType::kBF16, cols16,
                        swiglu ? cuda::GemmEpilogue::kSwiGlu : cuda::GemmEpilogue::kStore},
                       0);
    const auto h16 = from_device_bf16(y16.get(), size_t(rows) * cols16);
    EXPECT_TRUE(all_finite(h32)) << label << ": f32 output: unwritten or non-finite rows";
    EXPECT_TRUE(all_finite(h16)) << label << ": bf16 output: unwritten or non-finite rows";
    for (int e : check) {
      if (ref_rows[e].empty()) continue;
      const std::string le = label + " expert " + str(e) + " (" + str(count[size_t(e)]) + " rows)";
      EXPECT_REL(take_rows(h32, out, out, ref_rows[e]), ref[e], kTolExact, le + " f32");
      EXPECT_REL(take_rows(h16, cols16, cols16, ref_rows[e]), swiglu ? ref_sw[e] : ref[e], kTolBf16,
                 le + (swiglu ? " swiglu bf16" : " bf16"));
    }
  }
  cuda::gemm_impl::set_grouped_wgmma_rows(0);
}

// The grouped warpgroup kernel's tile size changes which tile holds a row, never the row's sums:
// the f32 outputs at every forced size and at the automatic per-launch choice are the same bits.
void expect_same_bits_at_every_size(const TestMatrix& W, int E, int n, int k, const std::vector<int>& idx,
                                    int in, int out, const std::string& what) {
  DeviceRouting R;
  const auto rv = R.view(E, n * k);
  auto didx = to_device(idx);
  cuda::moe_route_sort(didx.get(), n, k, E, rv, 0);
  auto x = randn(size_t(n) * in);
  round_bf16_inplace(x);
  auto dx = to_device_bf16(x);
  DeviceBuffer<float> y(size_t(n) * k * out);
  auto run = [&](int size) {
    cuda::gemm_impl::set_grouped_wgmma_rows(size);
    poison(y);
    cuda::gemm_grouped(W.dev, E, dx.get(), in, true, n, k, rv,
                       {y.get(), cuda::GemmOutType::kF32, out, cuda::GemmEpilogue::kStore}, 0);
    cuda::gemm_impl::set_grouped_wgmma_rows(0);
    return from_device(y.get(), y.size());
  };
  const auto automatic = run(0);
  ASSERT_TRUE(all_finite(automatic)) << what << ": automatic tiles left rows unwritten or non-finite";
  for (const int size : cuda::gemm_impl::kGroupedWgmmaRows) {
    const auto forced = run(size);
    EXPECT_EQ(0, std::memcmp(forced.data(), automatic.data(), forced.size() * sizeof(float)))
        << what << " routing: " << size << "-row tiles give other bits than the automatic choice";
  }
}

TEST(Gemm, GroupedWgmma) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmmaGrouped);
  constexpr int E = 256, k = 8, H = 2048, I = 512;
  TestMatrix GU = make_matrix(WFormat::kAffine4, E * 2 * I, H);  // per expert: interleaved gate/up rows
  TestMatrix Dn = make_matrix(WFormat::kAffine4, E * H, I);
  std::vector<int> all_sizes{0};
  for (int s : cuda::gemm_impl::kGroupedWgmmaRows) all_sizes.push_back(s);

  // Skewed: popularity ~ rank^-1 (expert 0 takes ~1,900 of the 32,768 rows), expert 100 pinned to
  // 0 rows and expert 200 to 1. Checked: the heaviest ones, the pinned ones, the lightest non-empty
  // one and a few in between.
  {
    constexpr int n = 4096;
    auto idx = power_law_routing(n, E, k, 1.0);
    pin_counts(idx, n, E, k, 100, 200);
    std::vector<int> count(E, 0);
    for (int e : idx) ++count[size_t(e)];
    ASSERT_EQ(count[100], 0);
    ASSERT_EQ(count[200], 1);
    ASSERT_GT(count[0], 256);
    int lightest = -1;
    for (int e = 0; e < E; ++e)
      if (count[size_t(e)] > 0 && (lightest < 0 || count[size_t(e)] < count[size_t(lightest)])) lightest = e;
    const std::vector<int> check{0, 1, 2, 7, 31, 100, 200, lightest, 128, 254};
    check_grouped("grouped gate|up skewed", GU, E, n, k, idx, true, check, all_sizes);
    check_grouped("grouped down skewed", Dn, E, n, k, idx, false, check, all_sizes);
    expect_same_bits_at_every_size(GU, E, n, k, idx, H, 2 * I, "skewed");
  }
  // Wide counts around the mean of 128 (the synthetic checkpoint's kind: 28-356 rows, where the
  // kernel's per-launch choice takes 192-row tiles) and Poisson-like ones (144-row tiles). The wide
  // counts are fixed (experts alternately 170 and 86 rows): random power-law counts fall on either
  // side of the choice from run to run.
  {
    constexpr int n = 4096;
    ASSERT_EQ(cuda::gemm_impl::grouped_wgmma_rows(long(n) * k, E), 144);  // the pair 144 | 192
    for (const bool wide : {true, false}) {
      std::vector<int> idx;
      if (wide) {
        std::vector<int> counts(E);
        for (int e = 0; e < E; ++e) counts[size_t(e)] = e % 2 ? 86 : 170;
        idx = routing_with_counts(n, k, counts);
      } else {
        idx = power_law_routing(n, E, k, 0.0);
      }
      std::vector<int> count(E, 0);
      for (int e : idx) ++count[size_t(e)];
      long t144 = 0, t192 = 0;  // the kernel's rule
      for (int c : count) t144 += (c + 143) / 144, t192 += (c + 191) / 192;
      constexpr int ov = cuda::gemm_impl::kGroupedTileOverheadRows;
      // each side of the choice is met: the wide counts take 192-row tiles, the uniform ones 144
      EXPECT_EQ(wide, t144 * (144 + ov) > t192 * (192 + ov)) << (wide ? "wide" : "uniform");
      expect_same_bits_at_every_size(GU, E, n, k, idx, H, 2 * I, wide ? "wide" : "uniform");
    }
  }
  // Uniform at 4,096 tokens (the automatic size: one tile per expert) and at a few small counts.
  for (const int n : {4096, 1, 63, 64, 65, 200}) {
    const auto idx = power_law_routing(n, E, k, 0.0);
    std::vector<int> count(E, 0);
    for (int e : idx) ++count[size_t(e)];
    std::vector<int> check{0, 77, 255};
    check.push_back(int(std::max_element(count.begin(), count.end()) - count.begin()));
    const std::vector<int> sizes = n == 4096 ? std::vector<int>{0, 128} : std::vector<int>{0};
    check_grouped("grouped gate|up uniform", GU, E, n, k, idx, true, check, sizes);
    check_grouped("grouped down uniform", Dn, E, n, k, idx, false, check, sizes);
  }
  EXPECT_THROW(cuda::gemm_impl::set_grouped_wgmma_rows(100), Error);
  CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(Gemm, RejectsBadShapes) {
  TestMatrix W = make_matrix(WFormat::kAffine4, 8, 128);
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

}  // namespace
}  // namespace tansy
