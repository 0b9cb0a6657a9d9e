// The f32 plan's operations: the CPU reference's operations (src/cpu/ops.h) in plain f32 on the
// device, with the same arguments as device pointers, or batched over the tokens of a call where
// the CPU forward pass loops a CPU op over them (each comment names the CPU op it must equal).
// No bf16 anywhere: weights are dequantized exactly as Linear::row does (s * q + b in f32), every
// activation, the KV cache and the GDN state are f32, sums are f32 (double where the CPU op uses
// double). Simple kernels: this plan exists to give the CPU oracle's answers on the GPU (the
// bundled demo model), not speed; the bf16 plan (backend.cu) is the fast one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/common/cuda_util.h"
#include "model/weights.h"

namespace tansy::cuda::f32 {

// What the kernels support, checked by each launcher and, by the f32 model, for every matrix and
// shape at load (so an unsupported checkpoint fails there, naming the part, and never halfway
// through a forward pass). Each throws Error.
void check_linear(const Linear& W, const std::string& what);  // in % 8 == 0 (and group), out rows
void check_gdn(int n_k, int n_v, int dk, int dv);
void check_attention(int n_heads, int n_kv, int hd, int rotary_dim);
void check_route(int n_experts, int k);

// A Linear whose q / scales / biases / bf16 / f32 pointers are device pointers. `in` must be a
// multiple of 8 (and of the quant group for affine formats).
// Y[t, o] = sum_i W[o, i] * X[t, i] for t < n — cpu::matmul.
void matmul(const Linear& W, const float* X, int n, float* Y);
// Row r < rows: Y[r, :] = Ws[idx[r]] * X[r / x_div, :] — cpu::matmul(Ws[idx[r]], X + (r / x_div) * in, 1,
// ...) per row. Ws: device array of n_w matrices of `shape`'s format, out and in (the routed experts).
void matmul_indexed(const Linear* Ws, int n_w, const Linear& shape, const int32_t* idx, const float* X,
                    int x_div, int rows, float* Y);
// out[t, :] = row ids[t] of E — cpu::embed_row per token (ids on the device, checked in range by the caller).
void embed(const Linear& E, const int32_t* ids, int n, float* out);
// Row r < rows of x [rows, dim] — cpu::rmsnorm per row.
void rmsnorm(const float* x, const float* w, int rows, int dim, float eps, float* y);
// h[i] += x[i].
void add(float* h, const float* x, size_t n);
// Tokens t < n of x [n, C] in order — cpu::conv1d_step per token (window updated, y [n, C]).
void conv1d(const float* x, int n, float* window, const float* w, int C, int kernel, float* y);

// One GDN layer's recurrent part for n tokens in order, per token exactly the CPU forward pass's
// sequence: cpu::l2norm_heads (q scaled by 1/sqrt(dk), k), cpu::gdn_gates, cpu::gdn_recurrent_step,
// cpu::rmsnorm_gated per value head.
struct GdnCoreArgs {
  const float* y;        // [n, conv_dim]: conv outputs q (n_k*dk) | k (n_k*dk) | v (n_v*dv)
  const float* z;        // [n, n_v*dv]
  const float* a;        // [n, n_v]
  const float* b;        // [n, n_v]
  const float* A_log;    // [n_v]
  const float* dt_bias;  // [n_v]
  const float* norm;     // [dv]
  float* S;              // [n_v, dk, dv], updated
  float* out;            // [n, n_v*dv] gated-normed outputs
  int n, n_k, n_v, dk, dv;
  float eps;
};
void gdn_core(const GdnCoreArgs& a);

// Gated attention's per-token preparation at positions pos0 + t, as the CPU forward pass: each
// key head cpu::rmsnorm (k_norm) + cpu::rope, written with the raw value to the caches K/V
// [positions, n_kv*hd]; each query head (the first hd of its [q | gate] pair in qg [n, n_heads*2*hd])
// cpu::rmsnorm (q_norm) + cpu::rope into q [n, n_heads*hd].
struct AttnPrepArgs {
  const float* qg;  // [n, n_heads*2*hd]
  const float* k;   // [n, n_kv*hd]
  const float* v;   // [n, n_kv*hd]
  const float* q_norm;
  const float* k_norm;
  float* q;  // [n, n_heads*hd]
  float* K;  // cache [>= pos0+n, n_kv*hd]
  float* V;
  int n, pos0, n_heads, n_kv, hd, rotary_dim;
  float eps;
  double theta;
};
void attention_prep(const AttnPrepArgs& a);
// Token t < n attends to cache positions [0, pos0 + t] — cpu::attention per token, then each
// output times sigmoid(gate) (the second hd of the head's [q | gate] pair in qg). out [n, n_heads*hd].
void attention(const float* q, const float* qg, const float* K, const float* V, int n, int pos0, int n_heads,
               int n_kv, int hd, float* out);

// Token t < n — cpu::route_topk on logits [n, stride] (its first n_experts), idx/weight [n, k].
void route_topk(const float* logits, int n, int stride, int n_experts, int k, int32_t* idx, float* weight);
// cpu::swiglu.
void swiglu(const float* g, const float* u, size_t n, float* y);
// out[t, c] = sum_j weight[t, j] * D[t*k + j, c] + sigmoid(sgate[t]) * sd[t, c]: the MoE output of
// the CPU forward pass (routed experts weighted, summed in ascending expert index idx[t, j] as the
// CPU does, plus the gated shared expert).
void moe_combine(const float* D, const int32_t* idx, const float* weight, int n, int k, const float* sd,
                 const float* sgate, int H, float* out);

}  // namespace tansy::cuda::f32
