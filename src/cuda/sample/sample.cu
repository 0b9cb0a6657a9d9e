// The device sampler (sample.cuh): one cooperative kernel, the phases of the file comment there.
#include <algorithm>
#include <vector>

#include "cuda/common/grid_sync.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/sample/sample.cuh"
#include "engine/sample_math.h"

namespace tansy::cuda {

namespace sm = tansy::sample_math;

namespace {

constexpr int kThreads = 512;  // 16 warps; a slice of up to kThreads * kPerThread ids per block
constexpr int kPerThread = 8;  // registers per thread for the slice
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 256;
constexpr int kBins = 256;  // 8 bits of key per radix pass

using u64 = unsigned long long;

// Cross-block accumulators, two sets: a launch uses acc[parity] and zeroes acc[parity ^ 1] for
// the next launch (stream order makes that safe; no memset per step).
struct Acc {
  u64 best;          // max rank_key of the penalised logits (the greedy choice)
  u64 best_finite;   // the same over the finite ones (the sampling's maximum)
  unsigned raw_max;  // max order_key of the raw logits
  unsigned n_valid;  // finite penalised logits
  unsigned n_minp;   // of those, s >= log(min_p)
  unsigned n_gather, n_gather_raw;
  unsigned pad;
  u64 total_mass;
  u64 w[3][4][kBins];       // radix histograms: [select][pass][bin] weight
  unsigned n[3][4][kBins];  // and count
};
struct Scratch {
  unsigned bar[2];  // grid barrier: arrivals, generation
  unsigned pad[2];
  Acc acc[2];
  // Per-block values: tied counts of the raw, count and mass cuts; kept masses of the draw.
  u64 blk_raw[kMaxBlocks], blk_count[kMaxBlocks], blk_mass[kMaxBlocks], blk_draw[kMaxBlocks];
  double block_lse[kMaxBlocks];
  u64 gather[kSampleGather];
  u64 gather_raw[kMaxTopLogprobs];
};
enum Select { kSelCount = 0, kSelMass = 1, kSelRaw = 2 };

struct Args {
  const float* logits;
  int limit, per_block, parity;
  int* counts;
  uint32_t* seen;
  const float* bias;
  const uint32_t* allowed;  // null: all
  sm::Penalties pen;
  bool has_bias, track_seen, greedy, use_min_p;
  float inv_t, log_min_p;
  int top_k;  // 0: off
  double top_p;
  u64 R;
  int forced;      // >= 0: no draw
  int n_logprobs;  // -1: none
  Scratch* sc;
  SampleOutput* out;   // mapped host memory
  int32_t* token_out;  // null, or where the chosen token is also stored (device)
};

// Every block of the (cooperative, co-resident) grid waits here; the last to arrive resets the
// count and moves the generation on.
__device__ void grid_sync(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = ld_acquire_gpu(bar + 1);
    if (atom_add_acq_rel_gpu(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      st_release_gpu(bar + 1, gen + 1);
    } else {
      while (ld_acquire_gpu(bar + 1) == gen) {
      }
    }
  }
  __syncthreads();
}

// The block's reduction of v by op; `identity` fills the lanes past the last warp's partial.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T* sh /* [kWarps + 1] */, T identity = T(0)) {
  for (int o = 16; o; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  __syncthreads();  // sh may still be read by a previous reduction
  if (l == 0) sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = l < kWarps ? sh[l] : identity;
    for (int o = 16; o; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (l == 0) sh[kWarps] = v;
  }
  __syncthreads();
  return sh[kWarps];
}
struct Max {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};
struct Min {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a < b ? a : b;
  }
};
struct Sum {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// Exclusive prefix sum over the block's threads (thread order); returns the block total too.
template <typename T>
__device__ T block_exclusive_scan(T v, T* sh /* [kWarps + 1] */, T& total) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  T x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (l >= o) x += y;
  }
  __syncthreads();
  if (l == 31) sh[w] = x;
  __syncthreads();
  if (w == 0) {
    T s = l < kWarps ? sh[l] : T(0);
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, s, o);
      if (l >= o) s += y;
    }
    if (l < kWarps) sh[l] = s;  // inclusive over warps
  }
  __syncthreads();
  total = sh[kWarps - 1];
  const T before = w ? sh[w - 1] : T(0);
  return before + x - v;
}

struct Shared {
  u64 w[kBins];
  unsigned n[kBins];
  u64 sorted[kSampleGather];  // finish_gathered: keys, then (id, rank) pairs
  u64 mass[kSampleGather];    // masses in rank order
  u64 scan[kSampleGather];    // running masses
  int chosen;
  u64 red64[kWarps + 1];
  unsigned red32[kWarps + 1];
  double redd[kWarps + 1];
  int digit;
  u64 p1_best[kWarps], p1_fin[kWarps];  // phase 1's per-warp maxima, finite counts, raw maxima
  unsigned p1_valid[kWarps], p1_raw[kWarps];
};

// The slice of one block, in registers: element j of thread t is id base + j * kThreads + t.
struct Slice {
  float l[kPerThread];     // penalised logits (-inf outside the slice)
  uint32_t k[kPerThread];  // order_key(l)
  bool in[kPerThread];     // in the candidate set
};

struct Selected {
  uint32_t theta;       // the key of the crossing element
  u64 above_w, tied_w;  // weight strictly above theta, and at theta, among the candidates
  unsigned above_n, tied_n;
};

// The key theta at which the running weight of the candidates, taken from the largest key down,
// first reaches `need` (count: need = the rank wanted; mass: double(weight) >= need). 4 barriers.
template <bool kMass>
__device__ Selected radix_select(const uint32_t* key, const bool* in, const u64* w, double need, Acc& A,
                                 int sel, Scratch& S, Shared& sh) {
  uint32_t prefix = 0, mask = 0;
  u64 above_w = 0;
  unsigned above_n = 0;
  Selected r{};
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.w[b] = 0, sh.n[b] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPerThread; ++j)
      if (in[j] && (key[j] & mask) == prefix) {
        const int bin = int(key[j] >> shift) & 255;
        atomicAdd(&sh.n[bin], 1u);
        if (kMass) atomicAdd(&sh.w[bin], w[j]);
      }
    __syncthreads();
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      if (sh.n[b]) atomicAdd(&A.n[sel][pass][b], sh.n[b]);
      if (kMass && sh.w[b]) atomicAdd(&A.w[sel][pass][b], sh.w[b]);
    }
    grid_sync(S.bar);
    // Suffix sums over the bins (bin 255 first), thread b holding bin 255 - b.
    const int t = threadIdx.x;
    u64 cw = 0;
    unsigned cn = 0;
    if (t < kBins) {
      cn = __ldcg(&A.n[sel][pass][255 - t]);
      cw = kMass ? __ldcg(&A.w[sel][pass][255 - t]) : u64(cn);
    }
    __syncthreads();
    if (t < kBins) sh.w[t] = cw, sh.n[t] = cn;  // per bin (index = 255 - bin)
    if (t == 0) sh.digit = -1;
    __syncthreads();
    u64 tw;
    unsigned tn;
    const u64 ew = block_exclusive_scan<u64>(t < kBins ? cw : 0, sh.red64, tw);
    const unsigned en = block_exclusive_scan<unsigned>(t < kBins ? cn : 0u, sh.red32, tn);
    if (t < kBins) {
      const u64 incl = above_w + ew + cw;
      const bool cross = kMass ? double(incl) >= need : double(above_n + en + cn) >= need;
      const bool cross_before = kMass ? double(above_w + ew) >= need : double(above_n + en) >= need;
      if (cross && !cross_before) sh.digit = t;  // exactly one thread: the crossing is monotone
    }
    __syncthreads();
    const int d = sh.digit < 0 ? kBins - 1 : sh.digit;  // index into the suffix order; bin = 255 - d
    // Weights strictly above the chosen bin: the exclusive sums at d.
    if (t == d) sh.red64[kWarps] = ew, sh.red32[kWarps] = en;
    __syncthreads();
    above_w += sh.red64[kWarps];
    above_n += sh.red32[kWarps];
    const uint32_t bin = uint32_t(255 - d);
    prefix |= bin << shift;
    mask |= 255u << shift;
    r.tied_w = sh.w[d];
    r.tied_n = sh.n[d];
    __syncthreads();
  }
  r.theta = prefix;
  r.above_w = above_w;
  r.above_n = above_n;
  return r;
}

// The rank, by id, of each flagged element among all flagged elements of the grid. 1 barrier.
__device__ void id_ranks(const bool* flag, unsigned* rank, u64* block_counts, Scratch& S, Shared& sh) {
  unsigned c = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) c += flag[j];
  c = block_reduce<unsigned>(c, Sum{}, sh.red32);
  if (threadIdx.x == 0) block_counts[blockIdx.x] = c;
  grid_sync(S.bar);
  unsigned off = 0;
  for (int b = threadIdx.x; b < int(blockIdx.x); b += kThreads) off += unsigned(__ldcg(&block_counts[b]));
  off = block_reduce<unsigned>(off, Sum{}, sh.red32);
  for (int j = 0; j < kPerThread; ++j) {
    unsigned tot;
    const unsigned ex = block_exclusive_scan<unsigned>(flag[j] ? 1u : 0u, sh.red32, tot);
    rank[j] = off + ex;
    off += tot;
  }
}

// Keeps the candidates above theta and the first `keep` at theta by id.
__device__ void cut_at(Slice& s, const Selected& r, unsigned keep, u64* block_counts, Scratch& S,
                       Shared& sh) {
  if (keep >= r.tied_n) {  // every tied candidate stays: no ranks needed
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) s.in[j] = s.in[j] && s.k[j] >= r.theta;
    return;
  }
  bool tied[kPerThread];
  unsigned rank[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) tied[j] = s.in[j] && s.k[j] == r.theta;
  id_ranks(tied, rank, block_counts, S, sh);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) s.in[j] = s.in[j] && (s.k[j] > r.theta || (tied[j] && rank[j] < keep));
}

__device__ __forceinline__ u64 mass_at(float l, float top, float inv_t) {
  return sm::mass_of(sm::fmul(sm::fsub(l, top), inv_t));
}

// Bitonic sort of n (a power of two, <= kSampleGather) keys in shared memory, descending.
__device__ void bitonic_desc(u64* v, int n) {
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const int p = i ^ j;
        if (p > i) {
          const bool desc = (i & k) == 0;
          const u64 a = v[i], b = v[p];
          if (desc ? a < b : a > b) v[i] = b, v[p] = a;
        }
      }
      __syncthreads();
    }
}

// Inclusive prefix sums of v[0, n) in place (n <= kSampleGather), exact in integers.
__device__ void block_inclusive_scan_array(u64* v, int n, Shared& sh) {
  constexpr int kPer = kSampleGather / kThreads;
  const int i0 = threadIdx.x * kPer;
  u64 local[kPer];
  u64 run = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    run += (i0 + q < n) ? v[i0 + q] : 0;
    local[q] = run;
  }
  u64 tot;
  const u64 ex = block_exclusive_scan<u64>(run, sh.red64, tot);
#pragma unroll
  for (int q = 0; q < kPer; ++q)
    if (i0 + q < n) v[i0 + q] = ex + local[q];
  __syncthreads();
}

// One block finishes n <= kSampleGather gathered candidates: top_p over them in rank order, then
// the draw over the kept ones in id order. Returns the token.
__device__ int finish_gathered(const Args& a, int n, float top, Scratch& S, Shared& sh) {
  int p2 = 1;
  while (p2 < n) p2 <<= 1;
  for (int i = threadIdx.x; i < p2; i += kThreads) sh.sorted[i] = i < n ? __ldcg(&S.gather[i]) : 0ull;
  __syncthreads();
  bitonic_desc(sh.sorted, p2);
  for (int i = threadIdx.x; i < n; i += kThreads)
    sh.mass[i] = mass_at(sm::key_value(uint32_t(sh.sorted[i] >> 32)), top, a.inv_t);
  __syncthreads();
  int kept = n;
  if (a.top_p < 1.0) {
    for (int i = threadIdx.x; i < n; i += kThreads) sh.scan[i] = sh.mass[i];
    __syncthreads();
    block_inclusive_scan_array(sh.scan, n, sh);
    const double need = a.top_p * double(sh.scan[n - 1]);
    unsigned first = unsigned(n - 1);
    for (int i = threadIdx.x; i < n; i += kThreads)
      if (double(sh.scan[i]) >= need) first = min(first, unsigned(i));
    kept = int(block_reduce<unsigned>(first, Min{}, sh.red32, ~0u)) + 1;
  }
  // The kept ones by id, ascending: a descending sort of ~(id << 32 | rank); padding (0) sorts last.
  for (int i = threadIdx.x; i < p2; i += kThreads)
    sh.sorted[i] = i < kept ? ~((u64(uint32_t(sm::rank_key_id(sh.sorted[i]))) << 32) | uint32_t(i)) : 0ull;
  __syncthreads();
  bitonic_desc(sh.sorted, p2);
  for (int i = threadIdx.x; i < kept; i += kThreads) sh.scan[i] = sh.mass[uint32_t(~sh.sorted[i])];
  __syncthreads();
  block_inclusive_scan_array(sh.scan, kept, sh);
  const u64 target = sm::mulhi64(a.R, sh.scan[kept - 1]);
  unsigned q = unsigned(kept - 1);
  for (int i = threadIdx.x; i < kept; i += kThreads)
    if (sh.scan[i] > target) q = min(q, unsigned(i));
  q = block_reduce<unsigned>(q, Min{}, sh.red32, ~0u);
  return int(~sh.sorted[q] >> 32);
}

__global__ void __launch_bounds__(kThreads) sample_kernel(Args a) {
  Scratch& S = *a.sc;
  Acc& A = S.acc[a.parity];
  __shared__ Shared sh;
  const int base = blockIdx.x * a.per_block, end = min(base + a.per_block, a.limit);
  if (blockIdx.x == 0) {  // the other set, for the next launch
    unsigned* z = reinterpret_cast<unsigned*>(&S.acc[a.parity ^ 1]);
    for (size_t i = threadIdx.x; i < sizeof(Acc) / 4; i += kThreads) z[i] = 0;
  }
  if (threadIdx.x == 0) sh.chosen = -1;
  auto id_of = [&](int j) { return base + j * kThreads + int(threadIdx.x); };

  // ---- phase 1: penalised logits, their maxima, the finite count, the raw maximum ----
  Slice s;
  u64 best = 0, best_fin = 0;
  unsigned valid = 0, raw_max = 0;
  const float ninf = -__builtin_huge_valf(), pinf = __builtin_huge_valf();
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = id_of(j);
    float l = ninf;
    bool fin = false;
    if (i < end) {
      const float raw = a.logits[i];
      l = sm::penalized(raw, a.pen, a.track_seen && (a.seen[i / 32] >> (i % 32) & 1u),
                        a.pen.presence_frequency ? a.counts[i] : 0, a.has_bias, a.has_bias ? a.bias[i] : 0.f);
      if (a.allowed && !(a.allowed[i / 32] >> (i % 32) & 1u)) l = ninf;
      fin = l > ninf && l < pinf;
      best = max(best, u64(sm::rank_key(l, i)));
      if (fin) best_fin = max(best_fin, u64(sm::rank_key(l, i)));
      valid += fin;
      if (a.n_logprobs >= 0) raw_max = max(raw_max, raw != raw ? 0u : sm::order_key(raw));
    }
    s.l[j] = l;
    s.k[j] = sm::order_key(l);
    s.in[j] = fin;
  }
  {  // the four block reductions at once: one exchange through shared memory
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int o = 16; o; o >>= 1) {
      best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
      best_fin = max(best_fin, __shfl_xor_sync(0xffffffffu, best_fin, o));
    }
    valid = __reduce_add_sync(0xffffffffu, valid);
    raw_max = __reduce_max_sync(0xffffffffu, raw_max);  // 0 without logprobs
    if (lane == 0)
      sh.p1_best[w] = best, sh.p1_fin[w] = best_fin, sh.p1_valid[w] = valid, sh.p1_raw[w] = raw_max;
    __syncthreads();
    best = best_fin = 0, valid = raw_max = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      best = max(best, sh.p1_best[i]);
      best_fin = max(best_fin, sh.p1_fin[i]);
      valid += sh.p1_valid[i];
      raw_max = max(raw_max, sh.p1_raw[i]);
    }
  }
  if (threadIdx.x == 0) {
    atomicMax(&A.best, best);
    atomicMax(&A.best_finite, best_fin);
    atomicAdd(&A.n_valid, valid);
    if (a.n_logprobs >= 0) atomicMax(&A.raw_max, raw_max);
  }
  grid_sync(S.bar);
  best = __ldcg(&A.best);
  const unsigned n_valid = __ldcg(&A.n_valid);
  const float top = sm::key_value(uint32_t(__ldcg(&A.best_finite) >> 32));

  // ---- logprobs: the raw distribution's normaliser (per block) and its best ids ----
  if (a.n_logprobs >= 0) {
    const double raw_top = double(sm::key_value(__ldcg(&A.raw_max)));
    double e = 0;
    for (int i = base + int(threadIdx.x); i < end; i += kThreads) e += exp(double(a.logits[i]) - raw_top);
    e = block_reduce<double>(e, Sum{}, sh.redd);
    if (threadIdx.x == 0) S.block_lse[blockIdx.x] = e;
    if (a.n_logprobs > 0) {
      Slice r;
      const unsigned want = unsigned(min(a.n_logprobs, a.limit));
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int i = id_of(j);
        const float raw = i < end ? a.logits[i] : 0.f;
        r.l[j] = raw;
        r.k[j] = i < end && raw == raw ? sm::order_key(raw) : 0u;
        r.in[j] = i < end;
      }
      const Selected sel = radix_select<false>(r.k, r.in, nullptr, double(want), A, kSelRaw, S, sh);
      cut_at(r, sel, want - sel.above_n, S.blk_raw, S, sh);
#pragma unroll
      for (int j = 0; j < kPerThread; ++j)
        if (r.in[j]) {
          const unsigned slot = atomicAdd(&A.n_gather_raw, 1u);
          if (slot < kMaxTopLogprobs) S.gather_raw[slot] = sm::rank_key(r.l[j], id_of(j));
        }
    }
    grid_sync(S.bar);  // the partial sums and the gathered ids are visible from here on
  }

  // ---- the choice ----
  const bool draw = a.forced < 0 && !a.greedy && n_valid > 0;
  if (!draw) {
    if (blockIdx.x == 0 && threadIdx.x == 0) sh.chosen = a.forced >= 0 ? a.forced : sm::rank_key_id(best);
  } else {
    unsigned n = n_valid;
    if (a.top_k > 0) n = min(n, unsigned(a.top_k));
    if (a.use_min_p) {
      unsigned c = 0;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j)
        c += s.in[j] && sm::fmul(sm::fsub(s.l[j], top), a.inv_t) >= a.log_min_p;
      c = block_reduce<unsigned>(c, Sum{}, sh.red32);
      if (threadIdx.x == 0) atomicAdd(&A.n_minp, c);
      grid_sync(S.bar);
      n = min(n, __ldcg(&A.n_minp));
    }
    n = max(n, 1u);
    if (n < n_valid) {
      const Selected sel = radix_select<false>(s.k, s.in, nullptr, double(n), A, kSelCount, S, sh);
      cut_at(s, sel, n - sel.above_n, S.blk_count, S, sh);
    }
    if (n <= unsigned(kSampleGather)) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j)
        if (s.in[j]) S.gather[atomicAdd(&A.n_gather, 1u)] = sm::rank_key(s.l[j], id_of(j));
      grid_sync(S.bar);
      if (blockIdx.x == 0) {
        const int tok = finish_gathered(a, int(n), top, S, sh);
        if (threadIdx.x == 0) sh.chosen = tok;
      }
    } else {
      u64 w[kPerThread];
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) w[j] = s.in[j] ? mass_at(s.l[j], top, a.inv_t) : 0ull;
      if (a.top_p < 1.0) {
        u64 t = 0;
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) t += w[j];
        t = block_reduce<u64>(t, Sum{}, sh.red64);
        if (threadIdx.x == 0) atomicAdd(&A.total_mass, t);
        grid_sync(S.bar);
        const double need = a.top_p * double(__ldcg(&A.total_mass));
        const Selected sel = radix_select<true>(s.k, s.in, w, need, A, kSelMass, S, sh);
        // The fewest tied candidates (each of mass m) that reach `need`, as the reference counts.
        const u64 m = mass_at(sm::key_value(sel.theta), top, a.inv_t);
        unsigned c = 1;
        if (m > 0) {
          const double est = (need - double(sel.above_w)) / double(m);
          c = est > 1.0 ? unsigned(min(est, double(sel.tied_n))) : 1u;
          while (c > 1 && double(sel.above_w + u64(c - 1) * m) >= need) --c;
          while (c < sel.tied_n && double(sel.above_w + u64(c) * m) < need) ++c;
        }
        cut_at(s, sel, c, S.blk_mass, S, sh);
#pragma unroll
        for (int j = 0; j < kPerThread; ++j)
          if (!s.in[j]) w[j] = 0;
      }
      // The draw: block prefix sums of the kept masses in id order.
      u64 mine = 0;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) mine += w[j];
      mine = block_reduce<u64>(mine, Sum{}, sh.red64);
      if (threadIdx.x == 0) S.blk_draw[blockIdx.x] = mine;
      grid_sync(S.bar);
      u64 before = 0, total = 0;
      for (int b = threadIdx.x; b < int(gridDim.x); b += kThreads) {
        const u64 v = __ldcg(&S.blk_draw[b]);
        total += v;
        if (b < int(blockIdx.x)) before += v;
      }
      before = block_reduce<u64>(before, Sum{}, sh.red64);
      total = block_reduce<u64>(total, Sum{}, sh.red64);
      const u64 target = sm::mulhi64(a.R, total);
      if (target >= before && target < before + mine) {  // this block holds the token
        u64 run = before;
        for (int j = 0; j < kPerThread; ++j) {
          u64 tot;
          const u64 ex = block_exclusive_scan<u64>(w[j], sh.red64, tot);
          if (w[j] > 0 && target >= run + ex && target < run + ex + w[j]) sh.chosen = id_of(j);
          run += tot;
        }
      }
    }
  }
  __syncthreads();
  const int chosen = sh.chosen;
  if (chosen < 0) return;  // another block decided

  // ---- the deciding block: output and penalty state ----
  SampleOutput& o = *a.out;
  if (a.n_logprobs >= 0) {
    double e = 0;
    for (int b = threadIdx.x; b < int(gridDim.x); b += kThreads) e += __ldcg(&S.block_lse[b]);
    e = block_reduce<double>(e, Sum{}, sh.redd);
    const double lse = double(sm::key_value(__ldcg(&A.raw_max))) + log(e);
    if (threadIdx.x == 0) {
      o.logprob = float(double(a.logits[chosen]) - lse);
      const int n = a.n_logprobs > 0 ? min(int(__ldcg(&A.n_gather_raw)), kMaxTopLogprobs) : 0;
      u64 k[kMaxTopLogprobs];
      for (int i = 0; i < n; ++i) {
        u64 v = __ldcg(&S.gather_raw[i]);
        int p = i;
        for (; p > 0 && k[p - 1] < v; --p) k[p] = k[p - 1];
        k[p] = v;
      }
      for (int i = 0; i < n; ++i) {
        const int id = sm::rank_key_id(k[i]);
        o.top_id[i] = id;
        o.top_logprob[i] = float(double(a.logits[id]) - lse);
      }
      o.n_top = n;
    }
  }
  if (threadIdx.x == 0) {
    o.token = chosen;
    if (a.token_out) *a.token_out = chosen;
    a.counts[chosen] += 1;
    if (a.track_seen) atomicOr(&a.seen[chosen / 32], 1u << (chosen % 32));
  }
}

}  // namespace

DeviceSampler::DeviceSampler(int vocab) : vocab_(vocab) {
  blocks_ = std::min(sm_count(), kMaxBlocks);
  TANSY_CHECK(int64_t(blocks_) * kThreads * kPerThread >= vocab,
              "device sampler: a vocabulary of {} exceeds {} blocks of {} ids", vocab, blocks_,
              kThreads * kPerThread);
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sample_kernel, kThreads, 0));
  TANSY_CHECK(per_sm >= 1, "device sampler: the kernel does not fit on a multiprocessor");
  const size_t words = size_t(vocab + 31) / 32;
  counts_.resize(size_t(vocab));
  seen_.resize(words);
  bias_.resize(size_t(vocab));
  allowed_.resize(words);
  scratch_.resize(sizeof(Scratch));
  CUDA_CHECK(cudaMemset(scratch_.get(), 0, sizeof(Scratch)));
  // The kernel writes its output straight into pinned host memory: no copy on the stream.
  CUDA_CHECK(cudaHostAlloc(&out_host_, sizeof(SampleOutput), cudaHostAllocMapped));
  *out_host_ = SampleOutput{};
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&out_dev_), out_host_, 0));
  CUDA_CHECK(cudaMallocHost(&mask_host_, words * 4));
}

DeviceSampler::~DeviceSampler() {
  if (out_host_) cudaFreeHost(out_host_);
  if (mask_host_) cudaFreeHost(mask_host_);
}

void DeviceSampler::begin(const SamplingParams& p, std::span<const int32_t> prompt, cudaStream_t stream) {
  p_ = p;
  const size_t words = size_t(vocab_ + 31) / 32;
  CUDA_CHECK(cudaMemsetAsync(counts_.get(), 0, counts_.bytes(), stream));
  if (p.repetition_penalty != 1.0) {
    std::vector<uint32_t> seen(words, 0);
    for (int32_t id : prompt)
      if (id >= 0 && id < vocab_) seen[size_t(id) / 32] |= 1u << (id % 32);
    seen_.upload(seen.data(), words);
  }
  has_bias_ = !p.logit_bias.empty();
  if (has_bias_) {
    std::vector<float> bias(size_t(vocab_), 0.f);
    for (auto [id, b] : p.logit_bias)
      if (id >= 0 && id < vocab_) bias[size_t(id)] = float(b);
    bias_.upload(bias.data(), bias.size());
  }
}

void DeviceSampler::enqueue(const float* logits, int limit, uint64_t R, const uint32_t* allowed,
                            int32_t forced, int n_logprobs, cudaStream_t stream, int32_t* token_out) {
  TANSY_CHECK(limit >= 1 && limit <= vocab_, "device sampler: limit {} outside 1..{}", limit, vocab_);
  TANSY_CHECK(n_logprobs <= kMaxTopLogprobs, "device sampler: {} logprobs exceed {}", n_logprobs,
              kMaxTopLogprobs);
  TANSY_CHECK(forced < vocab_, "device sampler: forced token {} outside the vocabulary", forced);
  Args a{};
  a.logits = logits;
  a.limit = limit;
  a.per_block = (limit + blocks_ - 1) / blocks_;
  a.parity = parity_;
  parity_ ^= 1;
  a.counts = counts_.get();
  a.seen = seen_.get();
  a.bias = bias_.get();
  if (allowed) {
    const size_t words = size_t(limit + 31) / 32;
    std::memcpy(mask_host_, allowed, words * 4);
    CUDA_CHECK(cudaMemcpyAsync(allowed_.get(), mask_host_, words * 4, cudaMemcpyHostToDevice, stream));
    a.allowed = allowed_.get();
  }
  a.pen.repetition = p_.repetition_penalty != 1.0;
  a.pen.rep = float(p_.repetition_penalty);
  a.pen.presence_frequency = p_.presence_penalty != 0.0 || p_.frequency_penalty != 0.0;
  a.pen.presence = p_.presence_penalty;
  a.pen.frequency = p_.frequency_penalty;
  a.has_bias = has_bias_;
  a.track_seen = a.pen.repetition;
  a.inv_t = p_.temperature > 0.0 ? float(1.0 / p_.temperature) : 0.f;
  a.greedy = p_.temperature <= 0.0 || !std::isfinite(a.inv_t);
  a.top_k = p_.top_k > 0 ? p_.top_k : 0;
  a.use_min_p = p_.min_p > 0.0;
  a.log_min_p = a.use_min_p ? float(std::log(p_.min_p)) : 0.f;
  a.top_p = p_.top_p;
  a.R = R;
  a.forced = forced;
  a.n_logprobs = n_logprobs;
  a.sc = reinterpret_cast<Scratch*>(scratch_.get());
  a.out = out_dev_;
  a.token_out = token_out;

  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(blocks_));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // every block resident: the grid barriers need it
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, sample_kernel, a));
  launch_check("sample_kernel");
}

}  // namespace tansy::cuda
