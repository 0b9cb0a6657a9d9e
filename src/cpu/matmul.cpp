// Affine-dequantized (or dense) products: each thread dequantizes a row once and reuses it
// for every token, so prefill costs one dequant per weight.
#include <vector>

#include "core/error.h"
#include "core/threadpool.h"
#include "cpu/ops.h"

namespace tansy::cpu {

namespace {
// Eight independent accumulators let the compiler keep a whole vector register of partial sums.
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
}  // namespace

void matmul(const Linear& W, const float* X, int n, float* Y, ThreadPool& pool) {
  if (n <= 0) return;
  const int in = W.in, out = W.out;
  auto body = [&](int64_t r0, int64_t r1) {
    std::vector<float> row(in);
    for (int64_t r = r0; r < r1; ++r) {
      W.row(int(r), row.data());
      for (int t = 0; t < n; ++t) Y[size_t(t) * out + r] = dot(row.data(), X + size_t(t) * in, in);
    }
  };
  // Small products are not worth waking the pool.
  if (int64_t(out) * in * (n + 2) < (1 << 18)) {
    body(0, out);
  } else {
    pool.parallel_for(out, body);
  }
}

void embed_row(const Linear& E, int row, float* out) {
  if (row < 0 || row >= E.out) fail("token id {} is outside the vocabulary (0..{})", row, E.out - 1);
  E.row(row, out);
}

}  // namespace tansy::cpu
