#include <cmath>
#include <cstring>

#include "cpu/ops.h"

namespace tansy::cpu {

void conv1d_step(const float* x, float* window, const float* w, int C, int kernel, float* y) {
  const int hist = kernel - 1;
  for (int c = 0; c < C; ++c) {
    float acc = w[size_t(c) * kernel + hist] * x[c];
    for (int j = 0; j < hist; ++j) acc += w[size_t(c) * kernel + j] * window[size_t(j) * C + c];
    y[c] = acc / (1.0f + std::exp(-acc));
  }
  if (hist > 0) {
    std::memmove(window, window + C, sizeof(float) * size_t(hist - 1) * C);
    std::memcpy(window + size_t(hist - 1) * C, x, sizeof(float) * C);
  }
}

void gdn_gates(const float* a, const float* b, const float* A_log, const float* dt_bias, int n_v_heads,
               float* beta, float* g) {
  for (int h = 0; h < n_v_heads; ++h) {
    beta[h] = 1.0f / (1.0f + std::exp(-b[h]));
    const float x = a[h] + dt_bias[h];
    const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
    g[h] = -std::exp(A_log[h]) * softplus;
  }
}

void l2norm_heads(float* x, int n_heads, int dim, float scale) {
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + size_t(h) * dim;
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(v[i]) * v[i];
    const float inv = 1.0f / std::sqrt(float(ss) + 1e-6f) * scale;
    for (int i = 0; i < dim; ++i) v[i] *= inv;
  }
}

void gdn_recurrent_step(const float* q, const float* k, const float* v, const float* beta, const float* g,
                        int n_k_heads, int n_v_heads, int dk, int dv, float* S, float* o) {
  const int ratio = n_v_heads / n_k_heads;
  for (int h = 0; h < n_v_heads; ++h) {
    const float* qh = q + size_t(h / ratio) * dk;
    const float* kh = k + size_t(h / ratio) * dk;
    const float* vh = v + size_t(h) * dv;
    float* Sh = S + size_t(h) * dk * dv;  // [dk][dv]
    float* oh = o + size_t(h) * dv;
    const float decay = std::exp(g[h]);
    for (size_t i = 0; i < size_t(dk) * dv; ++i) Sh[i] *= decay;
    for (int c = 0; c < dv; ++c) {
      float u = 0;
      for (int r = 0; r < dk; ++r) u += Sh[size_t(r) * dv + c] * kh[r];
      const float d = beta[h] * (vh[c] - u);
      float acc = 0;
      for (int r = 0; r < dk; ++r) {
        float& s = Sh[size_t(r) * dv + c];
        s += kh[r] * d;
        acc += s * qh[r];
      }
      oh[c] = acc;
    }
  }
}

}  // namespace tansy::cpu
