// Prefill GEMM with fused affine dequant, grouped MoE variant.
//
// Tile: 64 rows x BN outputs per block, BN = 32 x warps (8 warps: 256 columns, 4 warps: 128 for
// launches too small to fill the machine); every warp owns a 64 x 32 output tile over all 64 rows,
// so each weight column is dequantized by exactly one warp. k-tile 64 = one quant group: one
// (scale, bias) per weight row per k-tile. 4 cp.async stages of the X tile and of the weight tile
// in its packed form; one barrier per k-tile.
//
// The weights never go through a dequantized shared tile. Each lane reads its packed codes from the
// stage and dequantizes them straight into mma B fragments. That works because a dot product does
// not care about the order of k as long as A and B agree: in a 64-wide k-tile, lane (g, t) (g =
// lane/4, t = lane%4) takes the 16-element chunks j = 2t and 2t+1 (physical k 8j..8j+7) for its two
// k32 halves c = 0, 1, and inside a chunk the mma pair (s = 0, 1) of that half sees
//   logical k {2t, 2t+1}   (a0/a1, b0) = physical 8j + 4s + {0, 1}
//   logical k {2t+8, 2t+9} (a2/a3, b1) = physical 8j + 4s + {2, 3}.
// So one 16-byte load of X row g at chunk j holds (a0, a2) of both mmas, and one packed word (4-bit)
// or two (8-bit) or one 16-byte chunk (bf16) of weight row g holds (b0, b1) of both: a lane reads
// exactly the codes it dequantizes, with no redundancy, no ldmatrix and no second barrier.
// Shared-memory reads are conflict-free: X and bf16 weight rows use the XOR swizzle (chunk ^ row%8;
// the 8 lanes of a 16-byte load phase are rows 2q, 2q+1 whose chunk sets then differ in parity),
// packed rows are 32 (4-bit) or 64 (8-bit) contiguous bytes read as 8 / 16 bytes per lane.
#include <algorithm>

#include "core/error.h"
#include "cuda/common/device_math.cuh"
#include "cuda/common/tensor_core.cuh"
#include "cuda/gemm/gemm.cuh"

namespace tansy::cuda {
namespace {

using tc::swz;

constexpr int BM = 64;  // == kGroupedBM: moe_route_sort's tiles are this kernel's row tiles
static_assert(BM == kGroupedBM);
constexpr int BK = 64;
constexpr int kStages = 4;
constexpr int kWideWarps = 8, kNarrowWarps = 4;

// Bytes of one weight row in one k-tile, as stored.
template <WFormat F>
constexpr int kWRowBytes = F == WFormat::kAffine4   ? BK / 2
                           : F == WFormat::kAffine8 ? BK
                                                    : BK * 2;

// Shared memory carve-up (bytes) for one instantiation.
template <int kWarps, WFormat F>
struct Layout {
  static constexpr int BN = 32 * kWarps;
  static constexpr int kA = BM * BK * 2;         // one X stage
  static constexpr int kW = BN * kWRowBytes<F>;  // one weight stage
  static constexpr int kTotal = kStages * (kA + kW);
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

// 8 4-bit codes (one u32, low nibble first) -> 8 bf16 values s·q + b, as 4 bf16 pairs in k order.
// Codes become exact bf16 integers through the 128+c bit trick (exponent of 128, mantissa c),
// then one subtraction and one fused multiply-add per pair (exact product, one rounding to bf16).
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

__device__ __forceinline__ uint4 lds128(const void* p) { return *reinterpret_cast<const uint4*>(p); }

template <int kWarps, WFormat F>
__global__ void __launch_bounds__(32 * kWarps, 16 / kWarps) gemm_kernel(const Params p) {
  using L = Layout<kWarps, F>;
  constexpr int kThreads = 32 * kWarps;
  constexpr int BN = L::BN;
  constexpr int kMT = BM / 16;                           // m16 tiles per warp (the warp covers all 64 rows)
  constexpr int kNT = 4;                                 // n8 tiles per warp (32 columns)
  constexpr int kAChunks = BM * (BK / 8) / kThreads;     // 16-byte X chunks per thread per stage
  constexpr int kWRowChunks = kWRowBytes<F> / 16;        // 16-byte chunks of one weight row
  constexpr int kWChunks = BN * kWRowChunks / kThreads;  // ... per thread per stage
  constexpr bool kAffine = F != WFormat::kBF16;
  static_assert(kWChunks * kThreads == BN * kWRowChunks && kAChunks * kThreads == BM * (BK / 8));

  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* const As = reinterpret_cast<__nv_bfloat16*>(smem);
  unsigned char* const Ws = smem + kStages * L::kA;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.y * BN;  // first output column of this block

  // Row range of this block and the weight matrix it multiplies.
  int row0, row_end;
  const uint32_t* q = p.q;
  const __nv_bfloat16 *scales = p.scales, *biases = p.biases, *wdense = p.w;
  if (p.tile_offsets) {
    const int tile = blockIdx.x;
    if (tile >= p.tile_offsets[p.n_experts]) return;  // grid is an upper bound on the tile count
    int lo = 0, hi = p.n_experts - 1;                 // last expert whose first tile is <= tile
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.tile_offsets[mid] <= tile)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int e = lo;
    row0 = p.expert_offsets[e] + (tile - p.tile_offsets[e]) * BM;
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

  // Sources of this thread's 16-byte copies at k-tile 0 (fixed rows; advanced by one k-tile per
  // stage; null: past the tile's end). X chunk idx = tid + i*kThreads -> tile row idx/8, chunk idx%8.
  const __nv_bfloat16* a_src[kAChunks];
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int grow = row0 + (tid + i * kThreads) / 8;
    a_src[i] = nullptr;
    if (grow < row_end) {
      const int xrow = p.sorted_slot ? p.sorted_slot[grow] / p.gather_k : grow;
      a_src[i] = p.X + size_t(xrow) * p.ldx + (tid % 8) * 8;
    }
  }
  // Weight chunk idx = tid + i*kThreads -> tile row idx / kWRowChunks, chunk idx % kWRowChunks.
  const unsigned char* w_src[kWChunks];
  {
    const unsigned char* base =
        kAffine ? reinterpret_cast<const unsigned char*>(q) : reinterpret_cast<const unsigned char*>(wdense);
    const size_t row_bytes = size_t(p.in) * kWRowBytes<F> / BK;
#pragma unroll
    for (int i = 0; i < kWChunks; ++i) {
      const int idx = tid + i * kThreads, r = idx / kWRowChunks;
      w_src[i] = n0 + r < p.out ? base + size_t(n0 + r) * row_bytes + (idx % kWRowChunks) * 16 : nullptr;
    }
  }

  const int KT = p.in / BK;
  const int groups = p.in / kQuantGroup;

  auto load_stage = [&](int kt, int stage) {
    __nv_bfloat16* as = As + stage * (BM * BK);
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int r = (tid + i * kThreads) / 8;
      tc::cp_async16(as + swz<BK / 8>(r, (tid % 8) * 8), a_src[i] ? a_src[i] + kt * BK : p.X,
                     a_src[i] != nullptr);
    }
    unsigned char* ws = Ws + stage * L::kW;
#pragma unroll
    for (int i = 0; i < kWChunks; ++i) {
      const int idx = tid + i * kThreads, r = idx / kWRowChunks, c = idx % kWRowChunks;
      unsigned char* dst =
          F == WFormat::kBF16 ? ws + swz<BK / 8>(r, c * 8) * 2 : ws + r * kWRowBytes<F> + c * 16;
      const void* src = w_src[i] ? w_src[i] + size_t(kt) * kWRowBytes<F> : static_cast<const void*>(p.X);
      tc::cp_async16(dst, src, w_src[i] != nullptr);
    }
  };

  // (scale, bias) of the lane's 4 weight rows (n-tiles) for one k-tile, fetched a k-tile ahead.
  const int wcol = warp * 32 + g;  // tile row (output column) of n-tile 0 for this lane
  __nv_bfloat162 sb_next[kNT];     // (scale, bias)
  auto load_sb = [&](int kt) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int col = n0 + wcol + nt * 8;
      if (kAffine && col < p.out && kt < KT) {
        const size_t i = size_t(col) * groups + kt;
        sb_next[nt] = __halves2bfloat162(scales[i], biases[i]);
      } else {
        sb_next[nt] = __floats2bfloat162_rn(0.f, 0.f);
      }
    }
  };

  float acc[kMT][kNT][4] = {};

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    tc::cp_async_commit();
  }
  load_sb(0);

  for (int kt = 0; kt < KT; ++kt) {
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt visible to all; everyone is done with stage kt-1
    if (kt + kStages - 1 < KT) load_stage(kt + kStages - 1, (kt + kStages - 1) % kStages);
    tc::cp_async_commit();

    const int stage = kt % kStages;
    const __nv_bfloat16* as = As + stage * (BM * BK);
    const unsigned char* ws = Ws + stage * L::kW;
    __nv_bfloat162 sb[kNT];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) sb[nt] = sb_next[nt];
    load_sb(kt + 1);

    // Packed codes of this lane's rows for the whole k-tile: chunks 2t and 2t+1.
    [[maybe_unused]] uint32_t packed[kNT][F == WFormat::kAffine4 ? 2 : 4];
    if constexpr (F == WFormat::kAffine4) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const uint2 v = *reinterpret_cast<const uint2*>(ws + (wcol + nt * 8) * kWRowBytes<F> + t * 8);
        packed[nt][0] = v.x;
        packed[nt][1] = v.y;
      }
    } else if constexpr (F == WFormat::kAffine8) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const uint4 v = lds128(ws + (wcol + nt * 8) * kWRowBytes<F> + t * 16);
        packed[nt][0] = v.x;
        packed[nt][1] = v.y;
        packed[nt][2] = v.z;
        packed[nt][3] = v.w;
      }
    }

#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int chunk = 2 * t + c;  // physical k 8*chunk .. +7 of this k-tile
      uint4 b[kNT];                 // (b0, b1) of mma s=0, then of s=1
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        if constexpr (F == WFormat::kAffine4) {
          b[nt] = dequant4(packed[nt][c], __low2bfloat162(sb[nt]), __high2bfloat162(sb[nt]));
        } else if constexpr (F == WFormat::kAffine8) {
          b[nt] =
              dequant8(packed[nt][2 * c], packed[nt][2 * c + 1], __low2float(sb[nt]), __high2float(sb[nt]));
        } else {
          b[nt] = lds128(reinterpret_cast<const __nv_bfloat16*>(ws) + swz<BK / 8>(wcol + nt * 8, chunk * 8));
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const uint4 lo = lds128(as + swz<BK / 8>(mt * 16 + g, chunk * 8));
        const uint4 hi = lds128(as + swz<BK / 8>(mt * 16 + g + 8, chunk * 8));
        const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          tc::mma_bf16(acc[mt][nt], a0, b[nt].x, b[nt].y);
          tc::mma_bf16(acc[mt][nt], a1, b[nt].z, b[nt].w);
        }
      }
    }
  }
  tc::cp_async_wait<0>();

  // Epilogue straight from the accumulators: lane holds rows g, g+8 and column pairs 2t, 2t+1.
  const int c2 = t * 2;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + g + half * 8;
      if (row >= row_end) continue;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int col = n0 + warp * 32 + nt * 8 + c2;
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

template <int kWarps, WFormat F>
void launch(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = Layout<kWarps, F>::kTotal;
  static const bool attr_set = [] {
    return cudaFuncSetAttribute(gemm_kernel<kWarps, F>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) ==
           cudaSuccess;
  }();
  if (!attr_set) fail("gemm: cannot reserve {} bytes of shared memory per block", kSmem);
  gemm_kernel<kWarps, F><<<grid, 32 * kWarps, kSmem, stream>>>(p);
  launch_check("gemm");
}

template <int kWarps>
void dispatch(const Params& p, WFormat fmt, dim3 grid, cudaStream_t stream) {
  switch (fmt) {
    case WFormat::kAffine4:
      return launch<kWarps, WFormat::kAffine4>(p, grid, stream);
    case WFormat::kAffine8:
      return launch<kWarps, WFormat::kAffine8>(p, grid, stream);
    case WFormat::kBF16:
      return launch<kWarps, WFormat::kBF16>(p, grid, stream);
    default:
      fail("gemm: weight format {} is not supported", wformat_name(fmt));
  }
}

// 256-column tiles halve the X re-reads; fall back to 128 columns when 256 would leave the
// multiprocessors short of two blocks each (small n, narrow matrices).
void dispatch_tiles(const Params& p, WFormat fmt, long row_tiles, cudaStream_t stream, const char* what) {
  const long wide = (p.out + 32L * kWideWarps - 1) / (32L * kWideWarps);
  const long narrow = (p.out + 32L * kNarrowWarps - 1) / (32L * kNarrowWarps);
  TANSY_CHECK(narrow <= 65535 && row_tiles <= 0x7fffffffL, "{}: out {} or {} row tiles exceed the grid limit",
              what, p.out, row_tiles);
  if (row_tiles * wide >= 2L * sm_count()) {
    dispatch<kWideWarps>(p, fmt, dim3(unsigned(row_tiles), unsigned(wide)), stream);
  } else {
    dispatch<kNarrowWarps>(p, fmt, dim3(unsigned(row_tiles), unsigned(narrow)), stream);
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
  dispatch_tiles(p, W.fmt, (n + BM - 1) / BM, stream, "gemm");
}

void gemm_grouped(const DevLinear& W, int n_experts, const __nv_bfloat16* X, int64_t ldx, bool gather, int n,
                  int k, const MoeRouting& r, const GemmOutput& Y, cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && n_experts >= 1 && n_experts <= kGroupedMaxExperts,
              "gemm_grouped: bad n={} k={} n_experts={}", n, k, n_experts);
  TANSY_CHECK(r.expert_offsets && r.tile_offsets && r.sorted_slot, "gemm_grouped: routing arrays missing");
  TANSY_CHECK(W.out % n_experts == 0, "gemm_grouped: {} stacked rows do not split into {} experts", W.out,
              n_experts);
  const long rows = long(n) * k;
  TANSY_CHECK(rows < (1L << 30), "gemm_grouped: n*k = {} too large", rows);
  Params p = make_params(W, W.out / n_experts, X, ldx, int(rows), Y, "gemm_grouped");
  p.tile_offsets = r.tile_offsets;
  p.expert_offsets = r.expert_offsets;
  p.sorted_slot = gather ? r.sorted_slot : nullptr;
  p.gather_k = k;
  p.n_experts = n_experts;
  // Each expert's last tile may be partial: at most rows/BM full tiles plus one per non-empty expert.
  const long max_tiles = (rows + BM - 1) / BM + std::min<long>(n_experts, rows);
  dispatch_tiles(p, W.fmt, max_tiles, stream, "gemm_grouped");
}

}  // namespace tansy::cuda
