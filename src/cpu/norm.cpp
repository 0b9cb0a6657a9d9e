#include <cmath>

#include "cpu/ops.h"

namespace tansy::cpu {

void rmsnorm(const float* x, const float* w, int dim, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < dim; ++i) ss += double(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(float(ss / dim) + eps);
  for (int i = 0; i < dim; ++i) y[i] = x[i] * inv * w[i];
}

void rmsnorm_gated(const float* o, const float* z, const float* w, int dim, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < dim; ++i) ss += double(o[i]) * o[i];
  const float inv = 1.0f / std::sqrt(float(ss / dim) + eps);
  for (int i = 0; i < dim; ++i) {
    const float silu = z[i] / (1.0f + std::exp(-z[i]));
    y[i] = w[i] * (o[i] * inv) * silu;
  }
}

}  // namespace tansy::cpu
