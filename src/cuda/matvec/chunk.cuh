// The GEMV building block shared by the decode products (matvec.cu) and the routed experts'
// down projections (moe/experts_decode.cu): 16-byte weight chunks, x staged in shared memory as f32
// chunks that carry their own Σx, and the affine dequant folded into one multiply-add per chunk.
//
// Each lane reads one 16-byte chunk of a weight row at a time (32 4-bit, 16 8-bit or 8 bf16
// columns: always inside one quant group); the token rows of x sit in shared memory as f32, each
// chunk padded by 16 bytes so that the lanes of a warp, which read chunks 144/80/48 bytes apart,
// hit distinct banks. The pad slot holds the chunk's Σx, which turns the affine dequant into one
// multiply-add per chunk: Σ(s·q+b)x = s·Σqx + b·Σx.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/matvec/matvec.cuh"

namespace tansy::cuda::gemv {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr size_t kSmemMatvecMax = 100 * 1024;  // two blocks per multiprocessor

template <int BITS>
struct Chunk {
  static constexpr int kCols = BITS == 4 ? 32 : BITS == 8 ? 16 : 8;  // columns per 16-byte chunk
  static constexpr int kStride = kCols + 4;                          // f32 slots per chunk in smem
};

__device__ __forceinline__ float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Row r, chunk c of W as 16 raw bytes.
template <int BITS>
__device__ __forceinline__ uint4 load_chunk(const DevLinear& W, int64_t r, int c) {
  if constexpr (BITS == 16)
    return load_stream(W.w + r * W.in + int64_t(c) * 8);
  else
    return load_stream(W.q + r * (int64_t(W.in) * BITS / 32) + int64_t(c) * 4);
}

// A chunk's quant scale and bias (unused for bf16), loaded with its codes so that one memory
// round trip brings all three.
template <int BITS>
__device__ __forceinline__ void load_sb(const DevLinear& W, int64_t r, int c, float& s, float& b) {
  if constexpr (BITS != 16) {
    const int64_t gi = r * (W.in / kQuantGroup) + (c * Chunk<BITS>::kCols) / kQuantGroup;
    s = __bfloat162float(W.scales[gi]);
    b = __bfloat162float(W.biases[gi]);
  } else {
    s = b = 0.f;
  }
}

// A chunk's contribution to its row: xs points at the chunk's staged x (kCols f32 + Σx).
template <int BITS>
__device__ __forceinline__ float chunk_dot(uint4 wv, const float* xs, float s, float b) {
  const uint32_t wd[4] = {wv.x, wv.y, wv.z, wv.w};
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  float raw = 0.f;
  if constexpr (BITS == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 xa = x4[2 * j], xb = x4[2 * j + 1];
      const float xl[4] = {xa.x, xa.y, xa.z, xa.w}, xh[4] = {xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // Nibbles k and k+4 of the word become bf16 128+q in the two halves.
        const uint32_t v = nibbles_bf16x2(wd[j] >> (4 * k));
        raw = fmaf(bf_lo(v), xl[k], raw);
        raw = fmaf(bf_hi(v), xh[k], raw);
      }
    }
  } else if constexpr (BITS == 8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 xa = x4[j];
      raw = fmaf(float(wd[j] & 0xffu), xa.x, raw);
      raw = fmaf(float((wd[j] >> 8) & 0xffu), xa.y, raw);
      raw = fmaf(float((wd[j] >> 16) & 0xffu), xa.z, raw);
      raw = fmaf(float(wd[j] >> 24), xa.w, raw);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // word m holds columns 2m (low half) and 2m+1
      const float4 xa = x4[j];
      raw = fmaf(bf_lo(wd[2 * j]), xa.x, raw);
      raw = fmaf(bf_hi(wd[2 * j]), xa.y, raw);
      raw = fmaf(bf_lo(wd[2 * j + 1]), xa.z, raw);
      raw = fmaf(bf_hi(wd[2 * j + 1]), xa.w, raw);
    }
  }
  if constexpr (BITS == 16) {
    return raw;
  } else {
    const float sum = xs[Chunk<BITS>::kCols];
    // 4-bit codes were read as 128+q: fold the offset into the bias term.
    return BITS == 4 ? fmaf(s, raw, (b - 128.f * s) * sum) : fmaf(s, raw, b * sum);
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for row r of W (codes or bf16 values, and its scales and biases), 128-byte lines
// spread over the warp's lanes.
template <int BITS>
__device__ __forceinline__ void prefetch_row(const DevLinear& W, int64_t r, int lane) {
  constexpr int kLine = 128;
  const int64_t bytes = int64_t(W.in) * BITS / 8;
  const char* row = BITS == 16 ? reinterpret_cast<const char*>(W.w + r * W.in)
                               : reinterpret_cast<const char*>(W.q + r * (int64_t(W.in) * BITS / 32));
  for (int64_t off = int64_t(lane) * kLine; off < bytes; off += 32 * kLine) prefetch_l2(row + off);
  if constexpr (BITS != 16) {
    const int groups = W.in / kQuantGroup;
    if (lane == 0) prefetch_l2(W.scales + r * groups);
    if (lane == 1) prefetch_l2(W.biases + r * groups);
  }
}

// Stages one chunk of x (kCols values) as f32 plus its Σx; zeros when `valid` is false. The
// chunk's loads all precede its shared-memory stores (which the compiler cannot tell apart from
// the source), so they are in flight together. They read L2 (ld.cg): in the persistent decode step
// other blocks of the same kernel wrote x.
template <int BITS>
__device__ __forceinline__ void stage_chunk(const bf16* src, bool valid, float* dst) {
  constexpr int C = Chunk<BITS>::kCols;
  uint4 raw[C / 8];
#pragma unroll
  for (int v = 0; v < C / 8; ++v)
    raw[v] = valid ? __ldcg(reinterpret_cast<const uint4*>(src + v * 8)) : make_uint4(0, 0, 0, 0);
  float sum = 0.f;
#pragma unroll
  for (int v = 0; v < C / 8; ++v) {
    const float f[8] = {bf_lo(raw[v].x), bf_hi(raw[v].x), bf_lo(raw[v].y), bf_hi(raw[v].y),
                        bf_lo(raw[v].z), bf_hi(raw[v].z), bf_lo(raw[v].w), bf_hi(raw[v].w)};
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += f[e];
    reinterpret_cast<float4*>(dst)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(dst)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
  }
  dst[C] = sum;
}

// Stages `rows` rows of X (`ldx` apart, `in` columns) into smem chunks, row j at xs + j*cpr*kStride;
// rows from `valid_rows` on are zeros. Threads [0, nthreads) (the block's by default) share all
// rows' chunks at once.
template <int BITS>
__device__ void stage_rows(const bf16* x, int64_t ldx, int rows, int valid_rows, int in, float* xs,
                           int nthreads = 0) {
  constexpr int C = Chunk<BITS>::kCols, S = Chunk<BITS>::kStride;
  const int cpr = in / C;
  const int stride = nthreads > 0 ? nthreads : int(blockDim.x);
  for (int it = threadIdx.x; it < rows * cpr; it += stride) {
    const int j = it / cpr, c = it - j * cpr;
    stage_chunk<BITS>(x + j * ldx + int64_t(c) * C, j < valid_rows, xs + (j * cpr + c) * S);
  }
}

__host__ __device__ constexpr size_t align16(size_t b) { return (b + 15) / 16 * 16; }

// Host: calls go.template operator()<BITS>() with the bits per weight of `fmt` (16: bf16; callers
// have checked the format with DevLinear::check).
template <typename Go>
void with_bits(WFormat fmt, Go&& go) {
  if (fmt == WFormat::kAffine4)
    go.template operator()<4>();
  else if (fmt == WFormat::kAffine8)
    go.template operator()<8>();
  else
    go.template operator()<16>();
}

template <int BITS>
size_t stage_bytes(int in, int rows) {
  return size_t(rows) * (in / Chunk<BITS>::kCols) * Chunk<BITS>::kStride * sizeof(float);
}

}  // namespace tansy::cuda::gemv
