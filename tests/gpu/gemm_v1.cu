// The previous prefill GEMM (ldmatrix on a dequantized shared tile, BM x 128 tiles), kept only so
// Timing.Gemm (test_gemm_timing.cu) can time old and new in one run. Not part of the product: the
// engine calls src/cuda/gemm/gemm.cu. Same interface as cuda::gemm / cuda::gemm_grouped, in
// namespace cuda::gemm_v1.
//
// Tile: BM x 128 outputs per block (BM = 128 or 64), k-tile 64 = one quant group, so each weight
// row needs exactly one (scale, bias) per k-tile. 8 warps as 2 (M) x 4 (N); warp tile BM/2 x 32.
// Pipeline: 3 cp.async stages for X and the packed weight tile; each k-tile the block dequantizes
// its packed stage into one bf16 tile (swizzled like the X tile) and both operands go through
// ldmatrix into mma.sync. bf16 weights skip the dequant and are read from their stage directly.
#include <algorithm>

#include "core/error.h"
#include "cuda/common/device_math.cuh"
#include "cuda/common/tensor_core.cuh"
#include "cuda/gemm/gemm.cuh"
#include "gemm_v1.h"

namespace tansy::cuda::gemm_v1 {
namespace {

using tc::swz;

constexpr int BN = 128;
constexpr int BK = 64;
constexpr int kThreads = 256;
constexpr int kStages = 3;

template <WFormat F>
constexpr int kWordsPerRowTile = F == WFormat::kAffine4   ? BK / 8
                                 : F == WFormat::kAffine8 ? BK / 4
                                                          : 0;

// Shared memory carve-up (bytes) for one instantiation.
template <int BM, WFormat F>
struct Layout {
  static constexpr int kA = BM * BK * 2;                                                       // one X stage
  static constexpr int kW = F == WFormat::kBF16 ? BN * BK * 2 : BN * kWordsPerRowTile<F> * 4;  // one W stage
  static constexpr int kB = F == WFormat::kBF16 ? 0 : BN * BK * 2;  // dequantized tile
  static constexpr int kTotal = kStages * (kA + kW) + kB;
};

struct Params {
  const uint32_t* q;
  const __nv_bfloat16* scales;
  const __nv_bfloat16* biases;
  const __nv_bfloat16* w;
  int out, in;
  const __nv_bfloat16* X;
  int64_t ldx;
  int n_rows;  // dense: n; grouped: n*k
  void* Y;
  int64_t ldy;
  GemmOutType out_type;
  GemmEpilogue epilogue;
  // grouped only (tile_offsets == nullptr for dense)
  const int* tile_offsets;
  const int* expert_offsets;
  const int* sorted_slot;  // non-null: gather X rows sorted_slot[r] / gather_k
  int gather_k;
  int n_experts;
};

// 8 4-bit codes (one u32, low nibble first) -> 8 bf16 values s·q + b, as one 16-byte chunk.
// Codes become exact bf16 integers through the 128+c bit trick (exponent of 128, mantissa c),
// then one subtraction and one fused multiply-add per pair.
__device__ __forceinline__ uint4 dequant4(uint32_t w, __nv_bfloat162 s2, __nv_bfloat162 b2) {
  const uint32_t even = w & 0x0f0f0f0fu;               // c0 c2 c4 c6 in bytes 0..3
  const uint32_t odd = (w >> 4) & 0x0f0f0f0fu;         // c1 c3 c5 c7
  const uint32_t lo = __byte_perm(even, odd, 0x5140);  // bytes c0 c1 c2 c3
  const uint32_t hi = __byte_perm(even, odd, 0x7362);  // bytes c4 c5 c6 c7
  const __nv_bfloat162 k128 = __floats2bfloat162_rn(128.f, 128.f);
  uint32_t r[4] = {__byte_perm(lo, 0x43u, 0x4140), __byte_perm(lo, 0x43u, 0x4342),
                   __byte_perm(hi, 0x43u, 0x4140), __byte_perm(hi, 0x43u, 0x4342)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&r[i]);
    v = __hfma2(__hsub2(v, k128), s2, b2);
    r[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

// 2 words of 8-bit codes -> 8 bf16 values. 8-bit codes exceed bf16's exact-integer trick, so go
// through f32 (only the router and shared-expert gate are 8-bit: tiny matrices).
__device__ __forceinline__ uint4 dequant8(uint32_t w0, uint32_t w1, float s, float b) {
  uint32_t r[4];
  const uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = w[i / 2];
    const int sh = (i % 2) * 16;
    const float c0 = __uint_as_float(0x4b000000u | ((word >> sh) & 0xffu)) - 8388608.f;
    const float c1 = __uint_as_float(0x4b000000u | ((word >> (sh + 8)) & 0xffu)) - 8388608.f;
    r[i] = tc::pack_bf16(fmaf(s, c0, b), fmaf(s, c1, b));
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

template <int BM, WFormat F>
__global__ void __launch_bounds__(kThreads, 2) gemm_kernel(const Params p) {
  using L = Layout<BM, F>;
  constexpr int kMT = BM / 32;                               // m16 tiles per warp (warp tile BM/2 rows)
  constexpr int kNT = 4;                                     // n8 tiles per warp (warp tile 32 cols)
  constexpr int kARowsPerThread = BM * (BK / 8) / kThreads;  // 16-byte chunks of X per thread per stage
  constexpr bool kAffine = F != WFormat::kBF16;

  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* const As = reinterpret_cast<__nv_bfloat16*>(smem);
  unsigned char* const Ws = smem + kStages * L::kA;
  __nv_bfloat16* const Bdq = reinterpret_cast<__nv_bfloat16*>(smem + kStages * (L::kA + L::kW));

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n0 = blockIdx.y * BN;  // first output column of this block

  // Row range of this block and the weight matrix it multiplies.
  int row0, row_end;
  const uint32_t* q = p.q;
  const __nv_bfloat16 *scales = p.scales, *biases = p.biases, *wdense = p.w;
  if (p.tile_offsets) {
    const int t = blockIdx.x;
    if (t >= p.tile_offsets[p.n_experts]) return;  // grid is an upper bound on the tile count
    int lo = 0, hi = p.n_experts - 1;              // last expert whose first tile is <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.tile_offsets[mid] <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int e = lo;
    row0 = p.expert_offsets[e] + (t - p.tile_offsets[e]) * BM;
    row_end = p.expert_offsets[e + 1];
    const size_t rows = size_t(p.out);
    if constexpr (kAffine) {
      q += size_t(e) * rows * (size_t(p.in) * (F == WFormat::kAffine4 ? 4 : 8) / 32);
      scales += size_t(e) * rows * (p.in / kQuantGroup);
      biases += size_t(e) * rows * (p.in / kQuantGroup);
    } else {
      wdense += size_t(e) * rows * p.in;
    }
  } else {
    row0 = blockIdx.x * BM;
    row_end = p.n_rows;
  }

  // X source rows this thread copies (fixed across k-tiles): chunk idx = tid + i*256 ->
  // tile row idx/8, chunk idx%8.
  const __nv_bfloat16* a_src[kARowsPerThread];
#pragma unroll
  for (int i = 0; i < kARowsPerThread; ++i) {
    const int r = (tid + i * kThreads) / 8, grow = row0 + r;
    if (grow < row_end) {
      const int xrow = p.sorted_slot ? p.sorted_slot[grow] / p.gather_k : grow;
      a_src[i] = p.X + size_t(xrow) * p.ldx + (tid % 8) * 8;
    } else {
      a_src[i] = nullptr;
    }
  }

  const int KT = p.in / BK;
  const int groups = p.in / kQuantGroup;
  // Weight row this thread copies and dequantizes (affine): row tid/2, half tid%2 of the k-tile.
  const int wrow = tid / 2, whalf = tid % 2;
  const bool wrow_ok = n0 + wrow < p.out;

  auto load_stage = [&](int kt, int stage) {
    __nv_bfloat16* as = As + stage * (BM * BK);
#pragma unroll
    for (int i = 0; i < kARowsPerThread; ++i) {
      const int r = (tid + i * kThreads) / 8;
      tc::cp_async16(as + swz<BK / 8>(r, (tid % 8) * 8), a_src[i] ? a_src[i] + kt * BK : p.X,
                     a_src[i] != nullptr);
    }
    if constexpr (F == WFormat::kBF16) {
      __nv_bfloat16* ws = reinterpret_cast<__nv_bfloat16*>(Ws + stage * L::kW);
#pragma unroll
      for (int i = 0; i < BN * (BK / 8) / kThreads; ++i) {
        const int idx = tid + i * kThreads, r = idx / 8, c = idx % 8;
        const bool ok = n0 + r < p.out;
        tc::cp_async16(ws + swz<BK / 8>(r, c * 8),
                       ok ? wdense + size_t(n0 + r) * p.in + kt * BK + c * 8 : wdense, ok);
      }
    } else {
      constexpr int kWords = kWordsPerRowTile<F>;  // per row per k-tile
      uint32_t* ws = reinterpret_cast<uint32_t*>(Ws + stage * L::kW) + wrow * kWords + whalf * (kWords / 2);
      const size_t wpr = size_t(p.in) * (F == WFormat::kAffine4 ? 4 : 8) / 32;
      const uint32_t* src = q + size_t(n0 + wrow) * wpr + size_t(kt) * kWords + whalf * (kWords / 2);
#pragma unroll
      for (int i = 0; i < kWords / 2 / 4; ++i) tc::cp_async16(ws + i * 4, wrow_ok ? src + i * 4 : q, wrow_ok);
    }
  };

  // (scale, bias) of this thread's weight row for one k-tile, fetched a k-tile ahead.
  float s_next = 0.f, b_next = 0.f;
  auto load_sb = [&](int kt) {
    if (kAffine && wrow_ok && kt < KT) {
      const size_t i = size_t(n0 + wrow) * groups + kt;
      s_next = __bfloat162float(scales[i]);
      b_next = __bfloat162float(biases[i]);
    }
  };

  float acc[kMT][kNT][4] = {};

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    tc::cp_async_commit();
  }
  load_sb(0);

  const int wm = warp / 4, wn = warp % 4;
  for (int kt = 0; kt < KT; ++kt) {
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt visible to all; everyone is done with kt-1 (its stage and Bdq)
    if (kt + kStages - 1 < KT) load_stage(kt + kStages - 1, (kt + kStages - 1) % kStages);
    tc::cp_async_commit();

    const int stage = kt % kStages;
    const __nv_bfloat16* as = As + stage * (BM * BK);
    const __nv_bfloat16* bs;
    if constexpr (kAffine) {
      constexpr int kWords = kWordsPerRowTile<F>;
      const uint32_t* ws =
          reinterpret_cast<const uint32_t*>(Ws + stage * L::kW) + wrow * kWords + whalf * (kWords / 2);
      const float s = s_next, b = b_next;
      load_sb(kt + 1);
      // This thread's 32 columns = 4 output chunks (whalf*4 .. +3) of row wrow.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 v;
        if constexpr (F == WFormat::kAffine4) {
          v = dequant4(ws[i], __floats2bfloat162_rn(s, s), __floats2bfloat162_rn(b, b));
        } else {
          v = dequant8(ws[2 * i], ws[2 * i + 1], s, b);
        }
        *reinterpret_cast<uint4*>(Bdq + swz<BK / 8>(wrow, (whalf * 4 + i) * 8)) = v;
      }
      __syncthreads();
      bs = Bdq;
    } else {
      bs = reinterpret_cast<const __nv_bfloat16*>(Ws + stage * L::kW);
    }

#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        tc::ldmatrix_x4(a[mt],
                        as + swz<BK / 8>(wm * (BM / 2) + mt * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t b[4];  // b0,b1 of n-tile 2np, then of n-tile 2np+1
        tc::ldmatrix_x4(b, bs + swz<BK / 8>(wn * 32 + np * 16 + (lane / 16) * 8 + (lane % 8),
                                            kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          tc::mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
          tc::mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
  tc::cp_async_wait<0>();

  // Epilogue straight from the accumulators: lane holds rows g, g+8 and column pairs 2c, 2c+1.
  const int g = lane / 4, c2 = (lane % 4) * 2;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + wm * (BM / 2) + mt * 16 + g + half * 8;
      if (row >= row_end) continue;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int col = n0 + wn * 32 + nt * 8 + c2;
        if (col >= p.out) continue;
        float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
        const bool pair = col + 1 < p.out;
        if (p.epilogue == GemmEpilogue::kSwiGlu) {
          const size_t i = size_t(row) * p.ldy + col / 2;  // (gate, up) = (col, col+1); out is even
          const float y = silu_fast(v0) * v1;
          if (p.out_type == GemmOutType::kF32)
            static_cast<float*>(p.Y)[i] = y;
          else
            static_cast<__nv_bfloat16*>(p.Y)[i] = __float2bfloat16(y);
          continue;
        }
        const size_t i = size_t(row) * p.ldy + col;
        if (p.out_type == GemmOutType::kF32) {
          float* y = static_cast<float*>(p.Y) + i;
          if (pair) {
            if (p.epilogue == GemmEpilogue::kAccumulate) {
              const float2 o = *reinterpret_cast<float2*>(y);
              v0 += o.x;
              v1 += o.y;
            }
            *reinterpret_cast<float2*>(y) = make_float2(v0, v1);
          } else {
            if (p.epilogue == GemmEpilogue::kAccumulate) v0 += *y;
            *y = v0;
          }
        } else {
          __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.Y) + i;
          if (pair) {
            if (p.epilogue == GemmEpilogue::kAccumulate) {
              const float2 o = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(y));
              v0 += o.x;
              v1 += o.y;
            }
            *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(v0, v1);
          } else {
            if (p.epilogue == GemmEpilogue::kAccumulate) v0 += __bfloat162float(*y);
            *y = __float2bfloat16(v0);
          }
        }
      }
    }
  }
}

template <int BM, WFormat F>
void launch(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = Layout<BM, F>::kTotal;
  static const bool attr_set = [] {
    return cudaFuncSetAttribute(gemm_kernel<BM, F>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) ==
           cudaSuccess;
  }();
  if (!attr_set) fail("gemm_v1: cannot reserve {} bytes of shared memory per block", kSmem);
  gemm_kernel<BM, F><<<grid, kThreads, kSmem, stream>>>(p);
  launch_check("gemm_v1");
}

template <int BM>
void dispatch(const Params& p, WFormat fmt, dim3 grid, cudaStream_t stream) {
  switch (fmt) {
    case WFormat::kAffine4:
      return launch<BM, WFormat::kAffine4>(p, grid, stream);
    case WFormat::kAffine8:
      return launch<BM, WFormat::kAffine8>(p, grid, stream);
    case WFormat::kBF16:
      return launch<BM, WFormat::kBF16>(p, grid, stream);
    default:
      fail("gemm_v1: weight format {} is not supported", wformat_name(fmt));
  }
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// `out` is the row count of one matrix (W.out / n_experts for stacked experts).
Params make_params(const DevLinear& W, int out, const __nv_bfloat16* X, int64_t ldx, int n_rows,
                   const GemmOutput& Y, const char* what) {
  TANSY_CHECK(W.fmt == WFormat::kAffine4 || W.fmt == WFormat::kAffine8 || W.fmt == WFormat::kBF16,
              "{}: weight format {} is not supported", what, wformat_name(W.fmt));
  TANSY_CHECK(out >= 1 && W.in >= kGemmInAlign && W.in % kGemmInAlign == 0,
              "{}: weight shape [{}, {}] unsupported (in must be a positive multiple of {})", what, out, W.in,
              kGemmInAlign);
  if (W.fmt == WFormat::kBF16) {
    TANSY_CHECK(W.w && aligned(W.w, 16), "{}: bf16 weight pointer missing or not 16-byte aligned", what);
  } else {
    TANSY_CHECK(W.q && W.scales && W.biases && aligned(W.q, 16),
                "{}: affine weight arrays missing or codes not 16-byte aligned", what);
  }
  TANSY_CHECK(n_rows >= 1, "{}: need at least one row, got {}", what, n_rows);
  TANSY_CHECK(X && aligned(X, 16) && ldx >= W.in && ldx % 8 == 0,
              "{}: X must be 16-byte aligned with ldx ({}) >= in ({}) and a multiple of 8", what, ldx, W.in);
  TANSY_CHECK(Y.ptr, "{}: null output", what);
  const int cols = Y.epilogue == GemmEpilogue::kSwiGlu ? out / 2 : out;
  if (Y.epilogue == GemmEpilogue::kSwiGlu)
    TANSY_CHECK(out % 2 == 0, "{}: SwiGLU epilogue needs an even row count, got {}", what, out);
  TANSY_CHECK(Y.ld >= cols && Y.ld % 2 == 0, "{}: output ld {} must be even and >= {}", what, Y.ld, cols);
  TANSY_CHECK(aligned(Y.ptr, Y.type == GemmOutType::kF32 ? 8 : 4),
              "{}: output pointer misaligned for paired stores", what);
  Params p{};
  p.q = W.q;
  p.scales = W.scales;
  p.biases = W.biases;
  p.w = W.w;
  p.out = out;
  p.in = W.in;
  p.X = X;
  p.ldx = ldx;
  p.n_rows = n_rows;
  p.Y = Y.ptr;
  p.ldy = Y.ld;
  p.out_type = Y.type;
  p.epilogue = Y.epilogue;
  return p;
}

}  // namespace

void gemm(const DevLinear& W, const __nv_bfloat16* X, int64_t ldx, int n, const GemmOutput& Y,
          cudaStream_t stream) {
  const Params p = make_params(W, W.out, X, ldx, n, Y, "gemm");
  const int ntiles = (W.out + BN - 1) / BN;
  TANSY_CHECK(ntiles <= 65535, "gemm_v1: out {} exceeds the grid limit", W.out);
  // 128-row tiles reuse each weight tile twice as much; fall back to 64 rows when 128 would leave
  // the multiprocessors short of two blocks each.
  const long tiles128 = long((n + 127) / 128) * ntiles;
  if (tiles128 >= 2L * sm_count()) {
    dispatch<128>(p, W.fmt, dim3((n + 127) / 128, ntiles), stream);
  } else {
    dispatch<64>(p, W.fmt, dim3((n + 63) / 64, ntiles), stream);
  }
}

void gemm_grouped(const DevLinear& W, int n_experts, const __nv_bfloat16* X, int64_t ldx, bool gather, int n,
                  int k, const MoeRouting& r, const GemmOutput& Y, cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && n_experts >= 1 && n_experts <= kGroupedMaxExperts,
              "gemm_grouped: bad n={} k={} n_experts={}", n, k, n_experts);
  TANSY_CHECK(r.expert_offsets && r.tile_offsets && r.sorted_slot, "gemm_grouped: routing arrays missing");
  TANSY_CHECK(W.out % n_experts == 0, "gemm_grouped: {} stacked rows do not split into {} experts", W.out,
              n_experts);
  TANSY_CHECK(r.tile_rows == kGroupedBM, "gemm_grouped (v1): {}-row tiles are not built (only {})",
              r.tile_rows, kGroupedBM);
  const long rows = long(n) * k;
  TANSY_CHECK(rows < (1L << 30), "gemm_grouped: n*k = {} too large", rows);
  Params p = make_params(W, W.out / n_experts, X, ldx, int(rows), Y, "gemm_grouped");
  p.tile_offsets = r.tile_offsets;
  p.expert_offsets = r.expert_offsets;
  p.sorted_slot = gather ? r.sorted_slot : nullptr;
  p.gather_k = k;
  p.n_experts = n_experts;
  // Each expert's last tile may be partial: at most rows/BM full tiles plus one per non-empty expert.
  const long max_tiles = (rows + kGroupedBM - 1) / kGroupedBM + std::min<long>(n_experts, rows);
  const int ntiles = (p.out + BN - 1) / BN;
  TANSY_CHECK(ntiles <= 65535, "gemm_grouped: {} rows per expert exceed the grid limit", p.out);
  dispatch<kGroupedBM>(p, W.fmt, dim3(unsigned(max_tiles), ntiles), stream);
}

}  // namespace tansy::cuda::gemm_v1
