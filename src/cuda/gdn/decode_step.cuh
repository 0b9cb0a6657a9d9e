// One token of the GDN delta rule for one (value head, 32 state columns) unit of 128 threads,
// shared by gdn_decode_kernel (decode.cu) and the persistent decode step (step/step.cu) so that
// both compute the same values in the same order. `sync` is the barrier of the unit's 128 threads
// (__syncthreads in a 128-thread block, a named barrier inside a larger one); thread t of the unit
// is threadIdx.x == t.
#pragma once
#include "cuda/common/device_math.cuh"
#include "cuda/common/grid_sync.cuh"
#include "cuda/gdn/gdn.cuh"

namespace tansy::cuda::gdn_unit {

constexpr int kColsPerUnit = 32;
constexpr int kUnitThreads = 128;

struct Smem {
  float qs[kGdnDim], ks[kGdnDim];
  float red[4], red_u[4][32], red_o[4][32];
  int last;
};

template <typename Sync>
__device__ __forceinline__ float sum128(float v, float* red, Sync sync) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  sync();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  sync();
  return red[0] + red[1] + red[2] + red[3];
}

// One token of the delta rule for this thread's 32 state rows (warp w holds rows 32w..32w+31 of
// column c0 + lane), once qs/ks are published: decay, u = Sᵀk over the unit's four warps,
// S += k·beta·(v − u), and this warp's part of o = Sᵀq (the caller adds the four parts).
template <typename Sync>
__device__ __forceinline__ float delta_rule_step(float (&s)[32], const float* qs, const float* ks, float v,
                                                 float beta, float decay, float (*red_u)[32], int warp,
                                                 int lane, Sync sync) {
  float u = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    s[i] *= decay;
    u = fmaf(s[i], ks[warp * 32 + i], u);
  }
  red_u[warp][lane] = u;
  sync();
  const float d = beta * (v - (red_u[0][lane] + red_u[1][lane] + red_u[2][lane] + red_u[3][lane]));
  float o = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    s[i] = fmaf(ks[warp * 32 + i], d, s[i]);
    o = fmaf(s[i], qs[warp * 32 + i], o);
  }
  return o;
}

// The unit's state rows: thread (warp w, lane) holds rows 32w..32w+31 of column c0 + lane. The
// state is written only by its unit, so this may run before the unit's inputs are ready.
__device__ __forceinline__ float* state_column(const GdnDecodeArgs& A, int h, int c0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  return A.state + (int64_t(h) * kGdnDim + warp * 32) * kGdnDim + c0 + lane;
}
__device__ __forceinline__ void load_state(const float* S, float (&s)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = S[int64_t(i) * kGdnDim];
}

// Unit (value head h, columns cb*32 ..), one of `units_per_head`, with its state rows in s: the
// recurrence with q/k normalised in the unit, the state written back, and the gated norm of the
// head's 128 outputs done by whichever of the head's units finishes last.
template <typename Sync>
__device__ void decode_unit(const GdnDecodeArgs& A, int h, int cb, int units_per_head, float (&s)[32],
                            float* S, Smem& sm, Sync sync) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = threadIdx.x;
  const int c0 = cb * kColsPerUnit;
  const int hk = h / (A.n_v_heads / A.n_k_heads);
  const int KD = A.n_k_heads * kGdnDim;
  // The inputs come through L2 (ld.cg): in the persistent step other blocks wrote them.
  const float qv = __ldcg(A.conv + hk * kGdnDim + d), kv = __ldcg(A.conv + KD + hk * kGdnDim + d);
  const float v = __ldcg(A.conv + 2 * KD + h * kGdnDim + c0 + lane);
  const float beta = __ldcg(A.beta + h), decay = __expf(__ldcg(A.g + h));
  const float qn = rsqrtf(sum128(qv * qv, sm.red, sync) + 1e-6f) * rsqrtf(float(kGdnDim));
  const float kn = rsqrtf(sum128(kv * kv, sm.red, sync) + 1e-6f);
  sm.qs[d] = qv * qn;
  sm.ks[d] = kv * kn;
  sync();
  const float o = delta_rule_step(s, sm.qs, sm.ks, v, beta, decay, sm.red_u, warp, lane, sync);
#pragma unroll
  for (int i = 0; i < 32; ++i) S[int64_t(i) * kGdnDim] = s[i];
  sm.red_o[warp][lane] = o;
  sync();
  if (warp == 0)
    A.o[h * kGdnDim + c0 + lane] =
        sm.red_o[0][lane] + sm.red_o[1][lane] + sm.red_o[2][lane] + sm.red_o[3][lane];
  sync();  // the unit's outputs are written before thread 0 releases them (common/grid_sync.cuh)
  if (d == 0) sm.last = atom_add_acq_rel_gpu(A.counters + h, 1u) == unsigned(units_per_head - 1);
  sync();
  if (!sm.last) return;
  const float ov = __ldcg(A.o + h * kGdnDim + d);
  const float ss = sum128(ov * ov, sm.red, sync);
  const float zz = __bfloat162float(__ldcg(A.z + h * kGdnDim + d));
  const float gate = zz / (1.f + __expf(-zz));
  A.y[h * kGdnDim + d] = __float2bfloat16(A.norm_w[d] * ov * rsqrtf(ss / float(kGdnDim) + A.eps) * gate);
  if (d == 0) A.counters[h] = 0;
}

}  // namespace tansy::cuda::gdn_unit
