#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/ops.h"

namespace tansy::cpu {

void route_topk(const float* logits, int n_experts, int k, int* idx, float* weight) {
  float mx = -INFINITY;
  for (int e = 0; e < n_experts; ++e) mx = std::max(mx, logits[e]);
  std::vector<float> p(n_experts);
  double sum = 0;
  for (int e = 0; e < n_experts; ++e) sum += (p[e] = std::exp(logits[e] - mx));
  for (auto& x : p) x = float(x / sum);
  std::vector<int> order(n_experts);
  for (int e = 0; e < n_experts; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float tot = 0;
  for (int i = 0; i < k; ++i) tot += p[order[i]];
  for (int i = 0; i < k; ++i) {
    idx[i] = order[i];
    weight[i] = p[order[i]] / tot;
  }
}

void swiglu(const float* g, const float* u, int n, float* y) {
  for (int i = 0; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

}  // namespace tansy::cpu
