#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/ops.h"

namespace tansy::cpu {

void rope(float* x, int rotary_dim, int pos, double theta) {
  const int half = rotary_dim / 2;
  for (int j = 0; j < half; ++j) {
    const double inv_freq = std::pow(theta, -2.0 * j / rotary_dim);
    const double ang = double(pos) * inv_freq;
    const float c = float(std::cos(ang)), s = float(std::sin(ang));
    const float a = x[j], b = x[j + half];
    x[j] = a * c - b * s;
    x[j + half] = b * c + a * s;
  }
}

void attention(const float* q, const float* K, const float* V, int n_ctx, int n_heads, int n_kv, int hd,
               float* out) {
  const int group = n_heads / n_kv;
  const float scale = 1.0f / std::sqrt(float(hd));
  std::vector<float> p(n_ctx);
  for (int h = 0; h < n_heads; ++h) {
    const int kvh = h / group;
    const float* qh = q + size_t(h) * hd;
    float mx = -INFINITY;
    for (int t = 0; t < n_ctx; ++t) {
      const float* k = K + (size_t(t) * n_kv + kvh) * hd;
      float s = 0;
      for (int i = 0; i < hd; ++i) s += qh[i] * k[i];
      p[t] = s * scale;
      mx = std::max(mx, p[t]);
    }
    double sum = 0;
    for (int t = 0; t < n_ctx; ++t) sum += (p[t] = std::exp(p[t] - mx));
    float* o = out + size_t(h) * hd;
    std::fill(o, o + hd, 0.0f);
    for (int t = 0; t < n_ctx; ++t) {
      const float w = float(p[t] / sum);
      const float* v = V + (size_t(t) * n_kv + kvh) * hd;
      for (int i = 0; i < hd; ++i) o[i] += w * v[i];
    }
  }
}

}  // namespace tansy::cpu
