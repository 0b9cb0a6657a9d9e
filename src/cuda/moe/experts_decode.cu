// The routed experts' down projections fused with the weighted combine, for decode (the gate|up
// side is matvec_swiglu_experts, an instance of the GEMV mainloop in matvec/matvec.cu). Built on
// the GEMV chunk machinery (matvec/chunk.cuh). CPU reference: cpu::matmul per expert, then the
// weighted sum of docs/MODEL.md §6 step 5 (CpuModel::moe).
#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/matvec/chunk.cuh"
#include "cuda/matvec/fused.cuh"
#include "cuda/moe/moe.cuh"

namespace tansy::cuda {
namespace {

using namespace gemv;

// G lanes per output row: in = I is small (512 on the real model: 16 chunks of 4-bit), so a warp
// works on 32/G rows at once instead of leaving lanes idle.
template <int BITS, int G, bool SMEM>
__global__ void __launch_bounds__(kThreads, 3)
    moe_down_kernel(DevLinear Wd, int H, const int* __restrict__ idx, const float* __restrict__ wts,
                    const bf16* __restrict__ act, int k, const bf16* shared, const float* sh_logit,
                    int64_t sh_ld, bf16* out, ResidualOut res, int64_t res_h_ld, int64_t res_ss_ld) {
  extern __shared__ float4 smem4[];
  __shared__ alignas(8) uint64_t wbar;  // bulk copies (SMEM): the slots' rows have landed
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ int s_e[kRouteMaxTopK];
  __shared__ float s_w[kRouteMaxTopK];
  __shared__ float red[kWarps];
  constexpr int S = Chunk<BITS>::kStride;
  // SMEM: the block's R rows of every slot's expert (and their scales and biases) in shared memory.
  constexpr int R = kThreads / G;
  const int t = blockIdx.y, cpr = Wd.in / Chunk<BITS>::kCols;
  const int groups = Wd.in / kQuantGroup, r0 = blockIdx.x * R, rows = min(R, H - r0);
  const int64_t row_bytes = int64_t(Wd.in) * BITS / 8;
  uint8_t* wsm = reinterpret_cast<uint8_t*>(smem4) + align16(size_t(k) * cpr * S * sizeof(float));
  bf16* ssm = reinterpret_cast<bf16*>(wsm + int64_t(k) * R * row_bytes);
  bf16* bsm = ssm + int64_t(k) * R * groups;
  if (SMEM && threadIdx.x == 0) {
    bulk::mbar_init(&wbar);
    bulk::fence_init();
  }
  pdl_wait();
  pdl_launch_dependents();
  if (SMEM && threadIdx.x < 32) {  // lane j < k copies slot j's rows, scales and biases
    if (threadIdx.x == 0) {
      const int64_t per = rows * row_bytes + (BITS == 16 ? 0 : 2 * int64_t(rows) * groups * 2);
      bulk::mbar_expect_tx(&wbar, unsigned(k * per));
    }
    __syncwarp();
    if (int(threadIdx.x) < k) {
      const int j = threadIdx.x;
      const int64_t g0 = int64_t(idx[t * k + j]) * H + r0;
      const uint8_t* gw = BITS == 16 ? reinterpret_cast<const uint8_t*>(Wd.w + g0 * Wd.in)
                                     : reinterpret_cast<const uint8_t*>(Wd.q) + g0 * row_bytes;
      bulk::copy(wsm + int64_t(j) * R * row_bytes, gw, unsigned(rows * row_bytes), &wbar);
      if constexpr (BITS != 16) {
        bulk::copy(ssm + int64_t(j) * R * groups, Wd.scales + g0 * groups, unsigned(rows * groups * 2),
                   &wbar);
        bulk::copy(bsm + int64_t(j) * R * groups, Wd.biases + g0 * groups, unsigned(rows * groups * 2),
                   &wbar);
      }
    }
  }
  stage_rows<BITS>(act + int64_t(t) * k * Wd.in, Wd.in, k, k, Wd.in, xs);
  if (threadIdx.x < k) {
    s_e[threadIdx.x] = idx[t * k + threadIdx.x];
    s_w[threadIdx.x] = wts[t * k + threadIdx.x];
  }
  __syncthreads();
  const float sg = shared ? sigmoid_fast(sh_logit[int64_t(t) * sh_ld]) : 0.f;

  // One row per G lanes, one pass: rows past H compute nothing (shuffles need the whole warp).
  // The (expert, chunk) pairs of a row are one flat loop so that several loads are in flight.
  const int sub = threadIdx.x % G;
  const int r = blockIdx.x * (kThreads / G) + threadIdx.x / G;
  const bool valid = r < H;
  float acc = 0.f;
  if constexpr (SMEM) {
    const int rl = threadIdx.x / G;
    bulk::mbar_wait(&wbar, 0);  // initialised before the barrier above
    __syncthreads();
    if (valid) {
#pragma unroll 4
      for (int it = sub; it < k * cpr; it += G) {
        const int j = it / cpr, c = it - j * cpr;
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
  } else if (valid) {
    // Up to kU chunks per lane are loaded in one batch (codes, scales, biases), then used (the
    // batch size keeps the kernel at three blocks per multiprocessor).
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
  if (res.h) residual_partial(sq, res.ss + t * res_ss_ld, red);
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
    const size_t smem = stage_bytes<BITS>(Wd.in, k);
    auto launch = [&]<int G>() {
      constexpr int R = kThreads / G;  // output rows per block
      TANSY_CHECK(!res.h || ceil_div(H, R) <= unsigned(kNormParts),
                  "moe_down_combine: {} rows need more than {} partial sums", H, kNormParts);
      auto run = [&]<bool STAGED>(size_t bytes) {
        constexpr auto kern = moe_down_kernel<BITS, G, STAGED>;
        allow_smem<kern>(bytes, "moe_down_combine");
        pdl_launch(kern, dim3(ceil_div(H, R), n), dim3(kThreads), bytes, stream, Wd, H, idx, wts, act, k,
                   shared, sh_logit, sh_ld, out, res, res_h_ld, res_ss_ld);
      };
      // Shared-memory staging of the slots' rows when they fit (and scales come in 16-byte pieces).
      const size_t big = align16(smem) + size_t(k) * R * Wd.in * BITS / 8 +
                         (BITS == 16 ? 0 : size_t(k) * R * (Wd.in / kQuantGroup) * 4);
      if (big <= kSmemMatvecMax && (BITS == 16 || (Wd.in / kQuantGroup) % 8 == 0))
        run.template operator()<true>(big);
      else
        run.template operator()<false>(smem);
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
