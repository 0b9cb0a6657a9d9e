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

// The arithmetic of a down projection, the same in every kernel that computes one (this file's
// per-op kernel and grouped kernel, and the persistent step's experts_down) so that a token's
// result does not depend on which of them ran it or on what else was in its step:
//   1. per slot j, each of a row's G lanes adds its chunks c = sub, sub + G, ... (0.f + d first),
//   2. y_j = group_sum<G> of the lanes' sums (a slot's dot product, whole, in every lane),
//   3. acc = fmaf(w_j, y_j, acc) over j in slot order, from 0.
// Because y_j depends on the slot's expert row and activations only, a kernel may compute the
// slots of one expert together (moe_down_dots_kernel) and combine them per token later.
//
// moe_down_kernel: G lanes per output row (in = I is small, 512 on the real model: 16 chunks of
// 4-bit, so a warp works on 32/G rows at once instead of leaving lanes idle). SRC says where the
// weights come from: global memory, shared memory (the block's rows of every slot bulk-copied), or
// nowhere: the slots' dot products y_j were computed by moe_down_dots_kernel (dots [n*k, H] f32).
enum class DownSrc { kGlobal, kStaged, kDots };

template <int BITS, int G, DownSrc SRC>
__global__ void __launch_bounds__(kThreads, 3)
    moe_down_kernel(DevLinear Wd, int H, const int* __restrict__ idx, const float* __restrict__ wts,
                    const bf16* __restrict__ act, int k, const bf16* shared, const float* sh_logit,
                    int64_t sh_ld, bf16* out, ResidualOut res, int64_t res_h_ld, int64_t res_ss_ld,
                    const float* __restrict__ dots) {
  constexpr bool SMEM = SRC == DownSrc::kStaged;
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
  if constexpr (SRC != DownSrc::kDots) stage_rows<BITS>(act + int64_t(t) * k * Wd.in, Wd.in, k, k, Wd.in, xs);
  if (threadIdx.x < k) {
    s_e[threadIdx.x] = idx[t * k + threadIdx.x];
    s_w[threadIdx.x] = wts[t * k + threadIdx.x];
  }
  __syncthreads();
  const float sg = shared ? sigmoid_fast(sh_logit[int64_t(t) * sh_ld]) : 0.f;

  // One row per G lanes, one pass: rows past H load nothing (shuffles need the whole warp).
  const int sub = threadIdx.x % G, rl = threadIdx.x / G;
  const int r = blockIdx.x * R + rl;
  const bool valid = r < H;
  float acc = 0.f;
  if constexpr (SRC == DownSrc::kDots) {
    if (valid)
      for (int j = 0; j < k; ++j) acc = fmaf(s_w[j], dots[(int64_t(t) * k + j) * H + r], acc);
  } else {
    if constexpr (SMEM) {
      bulk::mbar_wait(&wbar, 0);  // initialised before the barrier above
      __syncthreads();
    }
    // The (slot, chunk) items of a lane, cpl a slot, as one flat loop: up to kU items' codes, scales
    // and biases are loaded in one batch, then used (the batch size keeps the kernel at three blocks
    // per multiprocessor). j and m are the same in every lane, so the slot sums' shuffles are too.
    constexpr int kU = 8;
    const int cpl = (cpr + G - 1) / G, n_it = k * cpl;
    float p = 0.f;
    for (int base = 0; base < n_it; base += kU) {
      uint4 wv[kU];
      float sc[kU], bi[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int it = base + u;
        if (it >= n_it) break;
        const int j = it / cpl, c = sub + (it - j * cpl) * G;
        wv[u] = make_uint4(0, 0, 0, 0);
        sc[u] = bi[u] = 0.f;
        if (!valid || c >= cpr) continue;
        if constexpr (SMEM) {
          const int lr = j * R + rl;
          wv[u] = *reinterpret_cast<const uint4*>(wsm + lr * row_bytes + int64_t(c) * 16);
          if constexpr (BITS != 16) {
            const int g = (c * Chunk<BITS>::kCols) / kQuantGroup;
            sc[u] = __bfloat162float(ssm[lr * groups + g]);
            bi[u] = __bfloat162float(bsm[lr * groups + g]);
          }
        } else {
          const int64_t row = int64_t(s_e[j]) * H + r;
          wv[u] = load_chunk<BITS>(Wd, row, c);
          load_sb<BITS>(Wd, row, c, sc[u], bi[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int it = base + u;
        if (it >= n_it) break;
        const int j = it / cpl, m = it - j * cpl, c = sub + m * G;
        if (valid && c < cpr) p += chunk_dot<BITS>(wv[u], xs + (j * cpr + c) * S, sc[u], bi[u]);
        if (m == cpl - 1) {
          acc = fmaf(s_w[j], group_sum<G>(p), acc);
          p = 0.f;
        }
      }
    }
  }
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

// The slots' dot products y_j (step 2 above) expert by expert: block (x, i) takes item i of the
// grouping (an expert and up to kGroupCols of its slots) and rows x·R·kDotRowSets.. of its matrix,
// R = kThreads / G rows at a time, and reads each weight chunk once for all the item's slots.
// dots f32 [n*k, H], slot s's row s.
constexpr int kDotRowSets = 4;  // 64 rows a block on the real model: 18 KiB of codes in flight

template <int BITS, int G>
__global__ void __launch_bounds__(kThreads)
    moe_down_dots_kernel(DevLinear Wd, int H, const bf16* __restrict__ act, ExpertGroups g, float* dots) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);  // the item's slots' activations, staged [count][cpr] chunks
  constexpr int R = kThreads / G, S = Chunk<BITS>::kStride, C = Chunk<BITS>::kCols;
  const int cpr = Wd.in / C, cpl = (cpr + G - 1) / G;
  const int sub = threadIdx.x % G, rl = threadIdx.x / G;
  pdl_wait();  // the grouping and the activations: this step's
  pdl_launch_dependents();
  if (int(blockIdx.y) >= *g.n_items) return;
  const int4 item = g.items[blockIdx.y];  // {expert, first sorted index, slots, 0}
  const int count = item.z;
  const int rb = blockIdx.x * R * kDotRowSets;
  // The lane's first chunk of each of its rows, before the staging (weights never wait on it).
  uint4 w0[kDotRowSets];
  float s0[kDotRowSets], b0[kDotRowSets];
#pragma unroll
  for (int q = 0; q < kDotRowSets; ++q) {
    const int r = rb + q * R + rl;
    w0[q] = make_uint4(0, 0, 0, 0);
    s0[q] = b0[q] = 0.f;
    if (r < H && sub < cpr) {
      const int64_t row = int64_t(item.x) * H + r;
      w0[q] = load_chunk<BITS>(Wd, row, sub);
      load_sb<BITS>(Wd, row, sub, s0[q], b0[q]);
    }
  }
  for (int it = threadIdx.x; it < count * cpr; it += kThreads) {
    const int q = it / cpr, c = it - q * cpr;
    const int s = g.sorted[item.y + q];
    stage_chunk<BITS>(act + int64_t(s) * Wd.in + int64_t(c) * C, true, xs + (q * cpr + c) * S);
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kDotRowSets; ++q) {
    const int r = rb + q * R + rl;
    float p[kGroupCols];
#pragma unroll
    for (int s = 0; s < kGroupCols; ++s) p[s] = 0.f;
    for (int m = 0; m < cpl; ++m) {
      const int c = sub + m * G;
      if (r >= H || c >= cpr) continue;
      uint4 wv = w0[q];
      float sc = s0[q], bi = b0[q];
      if (m > 0) {
        const int64_t row = int64_t(item.x) * H + r;
        wv = load_chunk<BITS>(Wd, row, c);
        load_sb<BITS>(Wd, row, c, sc, bi);
      }
#pragma unroll
      for (int s = 0; s < kGroupCols; ++s)
        if (s < count) p[s] += chunk_dot<BITS>(wv, xs + (s * cpr + c) * S, sc, bi);
    }
#pragma unroll
    for (int s = 0; s < kGroupCols; ++s) {
      if (s >= count) break;
      const float y = group_sum<G>(p[s]);
      if (sub == 0 && r < H) dots[int64_t(g.sorted[item.y + s]) * H + r] = y;
    }
  }
}

// Lanes per output row for `in` columns of BITS: one chunk per lane where a row has 16 or 32, the
// fewest lanes (8) for shorter rows; the same choice for every down kernel (the sums' order).
template <int BITS, typename Go>
void with_down_lanes(int in, Go&& go) {
  const int cpr = in / Chunk<BITS>::kCols;
  if (cpr >= 32)
    go.template operator()<32>();
  else if (cpr >= 16)
    go.template operator()<16>();
  else
    go.template operator()<8>();
}

// dots: the slots' dot products from moe_down_dots_kernel (then act is not read), or null.
void launch_moe_down(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                     int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                     const ResidualOut& res, int64_t res_h_ld, int64_t res_ss_ld, const float* dots,
                     cudaStream_t stream) {
  Wd.check("moe_down_combine");
  TANSY_CHECK(n_experts > 0 && Wd.out % n_experts == 0, "moe_down_combine: {} rows over {} experts", Wd.out,
              n_experts);
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK, "moe_down_combine: k = {} outside 1..{}", k, kRouteMaxTopK);
  TANSY_CHECK(n >= 1 && n <= 65535, "moe_down_combine: {} tokens outside the grid limit", n);
  TANSY_CHECK(idx && wts && (act || dots) && (out || res.h) && aligned16(act),
              "moe_down_combine: missing or misaligned buffers");
  TANSY_CHECK(!res.h || (res.ss && (n == 1 || (res_h_ld >= Wd.out / n_experts && res_ss_ld >= kNormParts))),
              "moe_down_combine: the residual output needs its ss, and rows apart for several tokens");
  TANSY_CHECK(!shared || sh_logit, "moe_down_combine: shared expert output without its gate logit");
  const int H = Wd.out / n_experts;
  auto go = [&]<int BITS>() {
    const size_t smem = stage_bytes<BITS>(Wd.in, k);
    auto launch = [&]<int G>() {
      constexpr int R = kThreads / G;  // output rows per block
      TANSY_CHECK(!res.h || ceil_div(H, R) <= unsigned(kNormParts),
                  "moe_down_combine: {} rows need more than {} partial sums", H, kNormParts);
      auto run = [&]<DownSrc SRC>(size_t bytes) {
        constexpr auto kern = moe_down_kernel<BITS, G, SRC>;
        allow_smem<kern>(bytes, "moe_down_combine");
        pdl_launch(kern, dim3(ceil_div(H, R), n), dim3(kThreads), bytes, stream, Wd, H, idx, wts, act, k,
                   shared, sh_logit, sh_ld, out, res, res_h_ld, res_ss_ld, dots);
      };
      // Shared-memory staging of the slots' rows when they fit (and scales come in 16-byte pieces).
      const size_t big = align16(smem) + size_t(k) * R * Wd.in * BITS / 8 +
                         (BITS == 16 ? 0 : size_t(k) * R * (Wd.in / kQuantGroup) * 4);
      if (dots)
        run.template operator()<DownSrc::kDots>(0);
      else if (big <= kSmemMatvecMax && (BITS == 16 || (Wd.in / kQuantGroup) % 8 == 0))
        run.template operator()<DownSrc::kStaged>(big);
      else
        run.template operator()<DownSrc::kGlobal>(smem);
    };
    with_down_lanes<BITS>(Wd.in, launch);
  };
  with_bits(Wd.fmt, go);
}

}  // namespace

void moe_down_combine(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                      int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                      cudaStream_t stream) {
  TANSY_CHECK(out, "moe_down_combine: no output");
  launch_moe_down(Wd, n_experts, idx, wts, act, n, k, shared, sh_logit, sh_ld, out, ResidualOut{}, 0, 0,
                  nullptr, stream);
}

void moe_down_residual(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                       int k, const bf16* shared, const float* sh_logit, const ResidualOut& out,
                       cudaStream_t stream, const DecodeRows* rows) {
  TANSY_CHECK(out.h && out.ss, "moe_down_residual: missing h or ss");
  TANSY_CHECK(!shared || !rows || rows->n == 1,
              "moe_down_residual: batched rows take the shared expert as a slot");
  launch_moe_down(Wd, n_experts, idx, wts, act, rows ? rows->n : 1, k, shared, sh_logit, 0, nullptr, out,
                  rows ? rows->h : 0, rows ? rows->ss : 0, nullptr, stream);
}

void moe_down_residual_grouped(const DevLinear& Wd, int n_experts, const int* idx, const float* wts,
                               const bf16* act, int k, const ResidualOut& out, const DecodeRows& rows,
                               const ExpertGroups& g, float* dots, cudaStream_t stream) {
  Wd.check("moe_down_residual_grouped");
  TANSY_CHECK(n_experts > 0 && Wd.out % n_experts == 0, "moe_down_residual_grouped: {} rows over {} experts",
              Wd.out, n_experts);
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK && rows.n >= 1 && rows.n <= kMaxBatch,
              "moe_down_residual_grouped: {} tokens of {} slots outside 1..{} of 1..{}", rows.n, k, kMaxBatch,
              kRouteMaxTopK);
  TANSY_CHECK(act && aligned16(act) && dots && g.sorted && g.items && g.n_items && out.h && out.ss,
              "moe_down_residual_grouped: missing or misaligned buffers");
  const int H = Wd.out / n_experts;
  const unsigned items = unsigned(expert_group_items_max(rows.n * k, n_experts));
  auto go = [&]<int BITS>() {
    const size_t smem = stage_bytes<BITS>(Wd.in, kGroupCols);
    auto launch = [&]<int G>() {
      constexpr auto kern = moe_down_dots_kernel<BITS, G>;
      allow_smem<kern>(smem, "moe_down_residual_grouped");
      pdl_launch(kern, dim3(ceil_div(H, (kThreads / G) * kDotRowSets), items), dim3(kThreads), smem, stream,
                 Wd, H, act, g, dots);
    };
    with_down_lanes<BITS>(Wd.in, launch);
  };
  with_bits(Wd.fmt, go);
  launch_moe_down(Wd, n_experts, idx, wts, nullptr, rows.n, k, nullptr, nullptr, 0, nullptr, out, rows.h,
                  rows.ss, dots, stream);
}

}  // namespace tansy::cuda
