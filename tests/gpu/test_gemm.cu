// The prefill GEMMs on tensor cores (src/cuda/gemm/) against cpu::matmul on fresh random inputs,
// at the real model's shapes and at edge sizes (1 token, 63/64/65 around the tile sizes, 200, 4096).
// Tolerances (||out - ref|| / ||ref||): kTolExact 1e-5 against cpu::matmul on the *same*
// bf16-rounded dequantized weights (TestMatrix::exact(): the kernel rounds s·q+b to bf16 once before
// the tensor cores), f32 output: only the f32 summation order differs, so any tile/index/scale
// mistake shows up at O(1); kTolBf16 (gpu_test_util.h) against the plain f32 reference. Outputs are
// poisoned with NaN bytes first; rows of very large cases are sampled (rows_to_check), and the
// unsampled rows are still checked for being written.
#include <numeric>
#include <string>
#include <vector>

#include "cpu/ops.h"
#include "cuda/gemm/gemm.cuh"
#include "cuda/gemm/gemm_impl.cuh"
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
const char* kernel_name() { return cuda::gemm_kernel() == cuda::GemmKernel::kWgmma ? "wgmma " : "mma "; }

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

// Every wgmma tile shape forced (the automatic choice never picks some of them at these sizes).
TEST(Gemm, WgmmaTiles) {
  GemmKernelScope scope(cuda::GemmKernel::kWgmma);
  const GemmCase cases[] = {{WFormat::kAffine4, 300, 192, 1, "one row"},
                            {WFormat::kAffine4, 1100, 128, 129, "partial tiles"},
                            {WFormat::kAffine4, 2048, 2048, 300, "in_proj-like"}};
  for (const auto& [rows, wg] : {std::pair{64, 2}, std::pair{64, 4}, std::pair{128, 2}, std::pair{128, 4}}) {
    cuda::gemm_impl::set_wgmma_tiles(rows, wg);
    for (const auto& c : cases) {
      TestMatrix W = make_matrix(c.fmt, c.out, c.in);
      auto x = randn(size_t(c.n) * c.in);
      round_bf16_inplace(x);
      auto dx = to_device_bf16(x);
      std::vector<float> ref(size_t(c.n) * c.out);
      cpu::matmul(W.exact(), x.data(), c.n, ref.data());
      DeviceBuffer<float> y(size_t(c.n) * c.out);
      poison(y);
      cuda::gemm(W.dev, dx.get(), c.in, c.n,
                 {y.get(), cuda::GemmOutType::kF32, c.out, cuda::GemmEpilogue::kStore}, 0);
      EXPECT_REL(from_device(y.get(), y.size()), ref, kTolExact,
                 std::string("gemm wgmma tiles ") + str(rows) + "x" + str(64 * wg) + " " + c.what +
                     " n=" + str(c.n));
    }
  }
  cuda::gemm_impl::set_wgmma_tiles(0, 0);
  EXPECT_THROW(cuda::gemm_impl::set_wgmma_tiles(96, 2), Error);
}

void epilogue_cases() {
  for (const GemmCase c :
       {GemmCase{WFormat::kAffine4, 1024, 2048, 100, "expert gate|up"},
        GemmCase{WFormat::kAffine4, 1024, 2048, 300, "shared gate|up"},
        GemmCase{WFormat::kAffine8, 64, 256, 5, "8-bit"}, GemmCase{WFormat::kBF16, 256, 128, 70, "bf16"},
        GemmCase{WFormat::kAffine4, 4224, 128, 1030, "128-row tiles"}}) {
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
