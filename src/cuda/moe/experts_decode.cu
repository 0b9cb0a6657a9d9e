// The routed experts' down projections fused with the weighted combine, for decode (the gate|up
// side is matvec_swiglu_experts, an instance of the GEMV mainloop in matvec/matvec.cu). Built on
// the GEMV chunk machinery (matvec/chunk.cuh). CPU reference: cpu::matmul per expert, then the
// weighted sum of docs/MODEL.md §6 step 5 (CpuModel::moe).
#include <algorithm>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/matvec/chunk.cuh"
#include "cuda/matvec/fused.cuh"
#include "cuda/moe/moe.cuh"

namespace tansy::cuda {
namespace {

using namespace gemv;

// The pipelined kernel's shared memory at most: two blocks a multiprocessor (227 KiB).
constexpr size_t kDownSmemMax = 112 * 1024;

// G lanes per output row: in = I is small (512 on the real model: 16 chunks of 4-bit), so a warp
// works on 32/G rows at once instead of leaving lanes idle. Lane `sub` of row r adds the (slot,
// chunk) pairs it = sub, sub + G, ... (slot-major) as fmaf(w_slot, chunk dot, acc), then the G
// lanes are summed: both kernels below, and the persistent step's experts_down, in that order.

// The row r's finish: the shared expert (when given apart), then the residual or the output.
__device__ __forceinline__ float down_finish(float acc, int t, int r, bool valid, int sub, float sg,
                                             const bf16* shared, int H, bf16* out, const ResidualOut& res,
                                             int64_t res_h_ld) {
  float sq = 0.f;
  if (valid && sub == 0) {
    float y = acc;
    if (shared) y += sg * __bfloat162float(shared[int64_t(t) * H + r]);
    if (res.h) {
      float* h = res.h + t * res_h_ld;  // token t's residual row (a batched decode step)
      const float v = h[r] + y;
      h[r] = v;
      sq = v * v;
    } else {
      out[int64_t(t) * H + r] = __float2bfloat16(y);
    }
  }
  return sq;
}

// Weights through registers (the rows do not fit shared memory): token blockIdx.y, row block
// blockIdx.x (kThreads / G rows, partial sum blockIdx.x).
template <int BITS, int G>
__global__ void __launch_bounds__(kThreads, 3)
    moe_down_kernel(DevLinear Wd, int H, const int* __restrict__ idx, const float* __restrict__ wts,
                    const bf16* __restrict__ act, int k, const bf16* shared, const float* sh_logit,
                    int64_t sh_ld, bf16* out, ResidualOut res, int64_t res_h_ld, int64_t res_ss_ld) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ int s_e[kRouteMaxTopK];
  __shared__ float s_w[kRouteMaxTopK];
  __shared__ float red[kWarps];
  constexpr int S = Chunk<BITS>::kStride;
  const int t = blockIdx.y, cpr = Wd.in / Chunk<BITS>::kCols;
  pdl_wait();
  pdl_launch_dependents();
  stage_rows<BITS>(act + int64_t(t) * k * Wd.in, Wd.in, k, k, Wd.in, xs);
  if (threadIdx.x < k) {
    s_e[threadIdx.x] = idx[t * k + threadIdx.x];
    s_w[threadIdx.x] = wts[t * k + threadIdx.x];
  }
  __syncthreads();
  const float sg = shared ? sigmoid_fast(sh_logit[int64_t(t) * sh_ld]) : 0.f;
  // One row per G lanes, one pass: rows past H compute nothing (shuffles need the whole warp).
  // The (expert, chunk) pairs of a row are one flat loop so that several loads are in flight:
  // up to kU chunks per lane are loaded in one batch (codes, scales, biases), then used (the
  // batch size keeps the kernel at three blocks per multiprocessor).
  const int sub = threadIdx.x % G;
  const int r = blockIdx.x * (kThreads / G) + threadIdx.x / G;
  const bool valid = r < H;
  float acc = 0.f;
  if (valid) {
    constexpr int kU = 8;
    for (int base = sub; base < k * cpr; base += kU * G) {
      uint4 wv[kU];
      float sc[kU], bi[kU];
      int off[kU];
      float wt[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int it = base + u * G;
        if (it >= k * cpr) break;
        const int j = it / cpr, c = it - j * cpr;
        const int64_t row = int64_t(s_e[j]) * H + r;
        wv[u] = load_chunk<BITS>(Wd, row, c);
        load_sb<BITS>(Wd, row, c, sc[u], bi[u]);
        off[u] = (j * cpr + c) * S;
        wt[u] = s_w[j];
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (base + u * G >= k * cpr) break;
        acc = fmaf(wt[u], chunk_dot<BITS>(wv[u], xs + off[u], sc[u], bi[u]), acc);
      }
    }
  }
  acc = group_sum<G>(acc);
  const float sq = down_finish(acc, t, r, valid, sub, sg, shared, H, out, res, res_h_ld);
  if (res.h) residual_partial(sq, res.ss + t * res_ss_ld, red);
}

// Weights through shared memory, pipelined: an item is (token t, row block v) and a block takes a
// contiguous range of the n · row-blocks items (all of them of a one-token launch: one each), so
// that a batch keeps every multiprocessor's copies in flight instead of one wave of blocks after
// another. Item i+1's rows of every slot (and their scales and biases) are bulk-copied into the
// other buffer while item i computes; a token's activations are staged when its first item comes.
// Each row's arithmetic is moe_down_kernel's: a token's values do not depend on the batch.
struct DownSmem {
  size_t xs, buf, total;  // byte offsets: staged x, buffer 0 (buffer 1 at buf + per); bytes
  size_t per, sb;         // bytes of a buffer; offset of its scales in it (biases after them)
};
template <int BITS>
__host__ __device__ inline DownSmem down_smem(int in, int k, int R) {
  DownSmem d;
  d.xs = 0;
  d.buf = align16(size_t(k) * (in / Chunk<BITS>::kCols) * Chunk<BITS>::kStride * sizeof(float));
  d.sb = size_t(k) * R * in * BITS / 8;
  d.per = d.sb + (BITS == 16 ? 0 : size_t(k) * R * (in / kQuantGroup) * 4);
  d.total = d.buf + 2 * d.per;
  return d;
}

template <int BITS, int G>
__global__ void __launch_bounds__(kThreads, 2)
    moe_down_smem_kernel(DevLinear Wd, int H, const int* __restrict__ idx, const float* __restrict__ wts,
                         const bf16* __restrict__ act, int n, int k, const bf16* shared,
                         const float* sh_logit, int64_t sh_ld, bf16* out, ResidualOut res, int64_t res_h_ld,
                         int64_t res_ss_ld) {
  extern __shared__ float4 smem4[];
  __shared__ alignas(8) uint64_t wbar[2];  // buffer b's copies have landed
  __shared__ int s_e[kRouteMaxTopK];
  __shared__ float s_w[kRouteMaxTopK];
  __shared__ float red[kWarps];
  constexpr int S = Chunk<BITS>::kStride, R = kThreads / G;  // R rows per item
  uint8_t* const base = reinterpret_cast<uint8_t*>(smem4);
  float* const xs = reinterpret_cast<float*>(base);
  const int cpr = Wd.in / Chunk<BITS>::kCols, groups = Wd.in / kQuantGroup;
  const int64_t row_bytes = int64_t(Wd.in) * BITS / 8;
  const int row_blocks = (H + R - 1) / R, items = n * row_blocks;
  const int first = int(int64_t(items) * blockIdx.x / gridDim.x);
  const int last = int(int64_t(items) * (blockIdx.x + 1) / gridDim.x);  // exclusive
  const DownSmem L = down_smem<BITS>(Wd.in, k, R);
  if (threadIdx.x == 0) {
    bulk::mbar_init(&wbar[0]);
    bulk::mbar_init(&wbar[1]);
    bulk::fence_init();
  }
  __syncthreads();
  pdl_wait();  // the routing and the activations come from the previous kernels
  pdl_launch_dependents();
  // Warp 0: item it's rows of every slot into buffer b (lane j < k: slot j's rows, scales, biases).
  auto issue = [&](int it, int b) {
    if (threadIdx.x >= 32) return;
    const int t = it / row_blocks, r0 = (it % row_blocks) * R, rows = min(R, H - r0);
    uint8_t* dst = base + L.buf + b * L.per;
    if (threadIdx.x == 0) {
      bulk::fence_before_copy();  // the block's reads of the buffer (before the barrier) come first
      const int64_t per = rows * row_bytes + (BITS == 16 ? 0 : 2 * int64_t(rows) * groups * 2);
      bulk::mbar_expect_tx(&wbar[b], unsigned(k * per));
    }
    __syncwarp();
    if (int(threadIdx.x) < k) {
      const int j = threadIdx.x;
      bulk::fence_before_copy();
      const int64_t g0 = int64_t(idx[t * k + j]) * H + r0;
      const uint8_t* gw = BITS == 16 ? reinterpret_cast<const uint8_t*>(Wd.w + g0 * Wd.in)
                                     : reinterpret_cast<const uint8_t*>(Wd.q) + g0 * row_bytes;
      bulk::copy(dst + int64_t(j) * R * row_bytes, gw, unsigned(rows * row_bytes), &wbar[b]);
      if constexpr (BITS != 16) {
        uint8_t* sb = dst + L.sb;
        bulk::copy(sb + int64_t(j) * R * groups * 2, Wd.scales + g0 * groups, unsigned(rows * groups * 2),
                   &wbar[b]);
        bulk::copy(sb + int64_t(k) * R * groups * 2 + int64_t(j) * R * groups * 2, Wd.biases + g0 * groups,
                   unsigned(rows * groups * 2), &wbar[b]);
      }
    }
  };
  if (first < last) issue(first, 0);
  const int sub = threadIdx.x % G, rl = threadIdx.x / G;
  unsigned phases = 0;  // bit b: the parity of buffer b's next wait
  int staged = -1;
  float sg = 0.f;
  for (int it = first, b = 0; it < last; ++it, b ^= 1) {
    if (it + 1 < last) issue(it + 1, b ^ 1);  // its buffer was freed by the barrier ending it - 1
    const int t = it / row_blocks, v = it % row_blocks;
    if (t != staged) {  // xs and s_e / s_w are free: the previous item ended with a barrier
      stage_rows<BITS>(act + int64_t(t) * k * Wd.in, Wd.in, k, k, Wd.in, xs);
      if (threadIdx.x < k) {
        s_e[threadIdx.x] = idx[t * k + threadIdx.x];
        s_w[threadIdx.x] = wts[t * k + threadIdx.x];
      }
      sg = shared ? sigmoid_fast(sh_logit[int64_t(t) * sh_ld]) : 0.f;
      staged = t;
    }
    bulk::mbar_wait(&wbar[b], (phases >> b) & 1u);
    phases ^= 1u << b;
    __syncthreads();  // x staged
    const uint8_t* wsm = base + L.buf + b * L.per;
    const bf16* ssm = reinterpret_cast<const bf16*>(wsm + L.sb);
    const bf16* bsm = ssm + int64_t(k) * R * groups;
    const int r = v * R + rl;
    const bool valid = r < H;
    float acc = 0.f;
    if (valid) {
#pragma unroll 4
      for (int i = sub; i < k * cpr; i += G) {
        const int j = i / cpr, c = i - j * cpr;
        const int lr = j * R + rl;
        const uint4 wv = *reinterpret_cast<const uint4*>(wsm + lr * row_bytes + int64_t(c) * 16);
        float sc = 0.f, bi = 0.f;
        if constexpr (BITS != 16) {
          const int g = (c * Chunk<BITS>::kCols) / kQuantGroup;
          sc = __bfloat162float(ssm[lr * groups + g]);
          bi = __bfloat162float(bsm[lr * groups + g]);
        }
        acc = fmaf(s_w[j], chunk_dot<BITS>(wv, xs + (j * cpr + c) * S, sc, bi), acc);
      }
    }
    acc = group_sum<G>(acc);
    const float sq = down_finish(acc, t, r, valid, sub, sg, shared, H, out, res, res_h_ld);
    if (res.h) residual_part(sq, res.ss + t * res_ss_ld + v, red, BlockSync{});
    __syncthreads();  // the buffer, xs, s_e and s_w are free
  }
}

void launch_moe_down(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                     int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                     const ResidualOut& res, int64_t res_h_ld, int64_t res_ss_ld, cudaStream_t stream) {
  Wd.check("moe_down_combine");
  TANSY_CHECK(n_experts > 0 && Wd.out % n_experts == 0, "moe_down_combine: {} rows over {} experts", Wd.out,
              n_experts);
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK, "moe_down_combine: k = {} outside 1..{}", k, kRouteMaxTopK);
  TANSY_CHECK(n >= 1 && n <= 65535, "moe_down_combine: {} tokens outside the grid limit", n);
  TANSY_CHECK(idx && wts && act && (out || res.h) && aligned16(act),
              "moe_down_combine: missing or misaligned buffers");
  TANSY_CHECK(!res.h || (res.ss && (n == 1 || (res_h_ld >= Wd.out / n_experts && res_ss_ld >= kNormParts))),
              "moe_down_combine: the residual output needs its ss, and rows apart for several tokens");
  TANSY_CHECK(!shared || sh_logit, "moe_down_combine: shared expert output without its gate logit");
  const int H = Wd.out / n_experts;
  auto go = [&]<int BITS>() {
    const int cpr = Wd.in / Chunk<BITS>::kCols;
    auto launch = [&]<int G>() {
      constexpr int R = kThreads / G;  // output rows per item
      const unsigned row_blocks = ceil_div(H, R);
      TANSY_CHECK(!res.h || row_blocks <= unsigned(kNormParts),
                  "moe_down_combine: {} rows need more than {} partial sums", H, kNormParts);
      // Shared-memory staging of the slots' rows (two items' worth) when they fit two blocks a
      // multiprocessor (and scales come in 16-byte pieces); else the weights through registers.
      const DownSmem L = down_smem<BITS>(Wd.in, k, R);
      if (L.total <= kDownSmemMax && (BITS == 16 || (Wd.in / kQuantGroup) % 8 == 0)) {
        constexpr auto kern = moe_down_smem_kernel<BITS, G>;
        allow_smem<kern>(L.total, "moe_down_combine");
        const unsigned items = row_blocks * unsigned(n);
        const unsigned grid = std::min(items, 2u * unsigned(sm_count()));
        pdl_launch(kern, dim3(grid), dim3(kThreads), L.total, stream, Wd, H, idx, wts, act, n, k, shared,
                   sh_logit, sh_ld, out, res, res_h_ld, res_ss_ld);
      } else {
        const size_t smem = stage_bytes<BITS>(Wd.in, k);
        constexpr auto kern = moe_down_kernel<BITS, G>;
        allow_smem<kern>(smem, "moe_down_combine");
        pdl_launch(kern, dim3(row_blocks, n), dim3(kThreads), smem, stream, Wd, H, idx, wts, act, k, shared,
                   sh_logit, sh_ld, out, res, res_h_ld, res_ss_ld);
      }
    };
    if (cpr >= 32)
      launch.template operator()<32>();
    else if (cpr >= 16)
      launch.template operator()<16>();
    else
      launch.template operator()<8>();
  };
  with_bits(Wd.fmt, go);
}

}  // namespace

void moe_down_combine(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                      int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                      cudaStream_t stream) {
  TANSY_CHECK(out, "moe_down_combine: no output");
  launch_moe_down(Wd, n_experts, idx, wts, act, n, k, shared, sh_logit, sh_ld, out, ResidualOut{}, 0, 0,
                  stream);
}

void moe_down_residual(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                       int k, const bf16* shared, const float* sh_logit, const ResidualOut& out,
                       cudaStream_t stream, const DecodeRows* rows) {
  TANSY_CHECK(out.h && out.ss, "moe_down_residual: missing h or ss");
  TANSY_CHECK(!shared || !rows || rows->n == 1,
              "moe_down_residual: batched rows take the shared expert as a slot");
  launch_moe_down(Wd, n_experts, idx, wts, act, rows ? rows->n : 1, k, shared, sh_logit, 0, nullptr, out,
                  rows ? rows->h : 0, rows ? rows->ss : 0, stream);
}

}  // namespace tansy::cuda
