// Shared helpers of the GPU tests: random host data and weight matrices, device copies, error norms,
// and the inputs that several kernel families' tests build alike (the normed residual, routing).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "cpu/ops.h"
#include "cuda/common/cuda_util.h"
#include "cuda/gemm/gemm.cuh"
#include "cuda/matvec/matvec.cuh"
#include "model/weights.h"

namespace tansy::gpu_test {

using cuda::bf16;
using cuda::DeviceBuffer;

// A fresh seed per process (printed), so every run draws new inputs.
inline std::mt19937_64& rng() {
  static std::mt19937_64 r = [] {
    const uint64_t seed = std::random_device{}();
    std::printf("gpu tests: random seed %llu\n", static_cast<unsigned long long>(seed));
    return std::mt19937_64(seed);
  }();
  return r;
}

inline std::vector<float> randn(size_t n, float scale = 1.f, float mean = 0.f) {
  std::normal_distribution<float> d(mean, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng());
  return v;
}

inline void round_bf16_inplace(std::vector<float>& v) {
  for (auto& x : v) x = round_bf16(x);
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16(v[i]);
  return o;
}

template <typename T>
cuda::DeviceBuffer<T> to_device(const std::vector<T>& v) {
  cuda::DeviceBuffer<T> b(v.size());
  b.upload(v.data(), v.size());
  return b;
}

inline cuda::DeviceBuffer<cuda::bf16> to_device_bf16(const std::vector<float>& v) {
  const auto h = to_bf16(v);
  cuda::DeviceBuffer<cuda::bf16> b(h.size());
  CUDA_CHECK(cudaMemcpy(b.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return b;
}

// NaN bytes everywhere, so an unwritten element can never pass.
template <typename T>
void poison(cuda::DeviceBuffer<T>& b) {
  CUDA_CHECK(cudaMemset(b.get(), 0xff, b.bytes()));
}

inline std::vector<float> from_device_bf16(const cuda::bf16* p, size_t n) {
  std::vector<uint16_t> h(n);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = bf16_to_f32(h[i]);
  return f;
}

template <typename T>
std::vector<T> from_device(const T* p, size_t n) {
  std::vector<T> h(n);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

inline double l2norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * x;
  return std::sqrt(s);
}

// ||out - ref||; infinite when out has a NaN/inf or the sizes differ.
inline double diff_norm(const std::vector<float>& out, const std::vector<float>& ref) {
  if (out.size() != ref.size()) return INFINITY;
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    s += double(out[i] - ref[i]) * (out[i] - ref[i]);
  }
  return std::sqrt(s);
}

// ||out - ref|| / ||ref||; infinite when out has a NaN/inf or the sizes differ.
inline double rel_err(const std::vector<float>& out, const std::vector<float>& ref) {
  if (out.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += double(out[i] - ref[i]) * (out[i] - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    m = std::max(m, double(std::fabs(a[i] - b[i])));
  }
  return m;
}

// The largest value of `row` other than row[top] (the runner-up of its argmax `top`).
inline float runner_up(std::span<const float> row, int top) {
  float second = -INFINITY;
  for (int i = 0; i < int(row.size()); ++i)
    if (i != top) second = std::max(second, row[i]);
  return second;
}

#define EXPECT_REL(out, ref, tol, label)                                                           \
  do {                                                                                             \
    const double e_ = ::tansy::gpu_test::rel_err(out, ref);                                        \
    std::printf("  %-48s rel err %.3e (tol %.0e)\n", std::string(label).c_str(), e_, double(tol)); \
    EXPECT_LE(e_, tol) << label;                                                                   \
  } while (0)

// Tolerances (||out - ref|| / ||ref||, METHOD.md): f32 outputs ~1e-5 (accumulation order only),
// bf16 operands or outputs 1e-2 (one rounding of the result) against the plain f32 reference.
constexpr double kTolF32 = 2e-5;
constexpr double kTolBf16 = 1e-2;

// A random weight matrix in its stored form on the host (Linear view) and on the device (DevLinear
// view), plus, on demand, the bf16-rounded dequantized copy the GEMM's tensor cores effectively
// multiply by (exact()).
struct TestMatrix {
  std::vector<uint32_t> q;
  std::vector<uint16_t> s, b, w;
  Linear host;
  DeviceBuffer<uint32_t> dq;
  DeviceBuffer<bf16> ds, db, dw;
  cuda::DevLinear dev;

  std::vector<uint16_t> rounded;  // [out, in] bf16 of the dequantized weights
  Linear exact() {
    if (rounded.empty()) {
      rounded.resize(size_t(host.out) * host.in);
      std::vector<float> row(host.in);
      for (int r = 0; r < host.out; ++r) {
        host.row(r, row.data());
        for (int c = 0; c < host.in; ++c) rounded[size_t(r) * host.in + c] = f32_to_bf16(row[c]);
      }
    }
    Linear e = host;
    e.fmt = WFormat::kBF16;
    e.q = nullptr;
    e.scales = e.biases = nullptr;
    e.bf16 = rounded.data();
    return e;
  }
};

// Scales/biases like MLX's: codes span roughly [-range/2, range/2]·s around a small offset.
inline TestMatrix make_matrix(WFormat fmt, int out, int in) {
  TestMatrix m;
  m.host.fmt = fmt;
  m.host.out = out;
  m.host.in = in;
  m.host.group = 64;
  m.dev.fmt = fmt;
  m.dev.out = out;
  m.dev.in = in;
  if (fmt == WFormat::kBF16) {
    m.w = to_bf16(randn(size_t(out) * in, 0.05f));
    m.host.bf16 = m.w.data();
    m.dw.resize(m.w.size());
    CUDA_CHECK(cudaMemcpy(m.dw.get(), m.w.data(), m.w.size() * 2, cudaMemcpyHostToDevice));
    m.dev.w = m.dw.get();
    return m;
  }
  const int bits = fmt == WFormat::kAffine4 ? 4 : 8, groups = in / 64;
  m.q.resize(size_t(out) * in * bits / 32);
  for (auto& x : m.q) x = uint32_t(rng()());
  std::uniform_real_distribution<float> us(0.002f, 0.02f);
  std::normal_distribution<float> nb(0.f, 1.f);
  m.s.resize(size_t(out) * groups);
  m.b.resize(size_t(out) * groups);
  const float mid = bits == 4 ? 7.5f : 127.5f;
  for (size_t i = 0; i < m.s.size(); ++i) {
    const float s = us(rng()) * (bits == 4 ? 1.f : 1.f / 16);
    m.s[i] = f32_to_bf16(s);
    m.b[i] = f32_to_bf16(-mid * s + s * nb(rng()));
  }
  m.host.q = m.q.data();
  m.host.scales = m.s.data();
  m.host.biases = m.b.data();
  m.dq = to_device(m.q);
  m.ds.resize(m.s.size());
  m.db.resize(m.b.size());
  CUDA_CHECK(cudaMemcpy(m.ds.get(), m.s.data(), m.s.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(m.db.get(), m.b.data(), m.b.size() * 2, cudaMemcpyHostToDevice));
  m.dev.q = m.dq.get();
  m.dev.scales = m.ds.get();
  m.dev.biases = m.db.get();
  return m;
}

inline const char* fmt_name(WFormat f) { return wformat_name(f); }

inline std::string str(int v) { return std::to_string(v); }

inline bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// Rows to check against the CPU: all of them up to 256, else the edges, the tile/chunk
// boundaries and a random sample.
inline std::vector<int> rows_to_check(int n, int n_random) {
  std::vector<int> r;
  if (n <= 256) {
    r.resize(n);
    std::iota(r.begin(), r.end(), 0);
    return r;
  }
  for (int x : {0, 1, 63, 64, 65, 127, 128, 129, n - 65, n - 64, n - 1}) r.push_back(x);
  std::uniform_int_distribution<int> u(0, n - 1);
  for (int i = 0; i < n_random; ++i) r.push_back(u(rng()));
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

inline std::vector<float> take_rows(const std::vector<float>& m, int64_t ld, int cols,
                                    const std::vector<int>& rows) {
  std::vector<float> o;
  o.reserve(rows.size() * cols);
  for (int r : rows) o.insert(o.end(), m.begin() + r * ld, m.begin() + r * ld + cols);
  return o;
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// silu(bf16(g)) * bf16(u), the kernels' SwiGLU.
inline std::vector<float> swiglu_ref(const std::vector<float>& gu_rows, int n, int pairs) {
  std::vector<float> g(size_t(n) * pairs), u(size_t(n) * pairs), y(size_t(n) * pairs);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < pairs; ++i) {
      g[size_t(t) * pairs + i] = round_bf16(gu_rows[size_t(t) * 2 * pairs + 2 * i]);
      u[size_t(t) * pairs + i] = round_bf16(gu_rows[size_t(t) * 2 * pairs + 2 * i + 1]);
    }
  cpu::swiglu(g.data(), u.data(), n * pairs, y.data());
  return y;
}

// The normed residual as the fused kernels compute it: x = bf16(rmsnorm(h)·w), the scale from
// partial sums of h² spread over a few of the kNormParts slots (as several producer blocks leave them).
struct NormCase {
  std::vector<float> h, w, x, ss;
};

inline NormCase make_norm_case(int H) {
  NormCase c;
  c.h = randn(H, 2.f);
  c.w = randn(H, 0.2f, 1.f);
  c.x.resize(H);
  cpu::rmsnorm(c.h.data(), c.w.data(), H, 1e-6f, c.x.data());
  round_bf16_inplace(c.x);
  c.ss.assign(cuda::kNormParts, 0.f);
  for (int i = 0; i < H; ++i) c.ss[(i * 7) % 61] += c.h[i] * c.h[i];
  return c;
}

struct NormDev {
  DeviceBuffer<float> h, w, ss;
  DeviceBuffer<bf16> xn;
  cuda::NormIn in;
  explicit NormDev(const NormCase& c)
      : h(to_device(c.h)), w(to_device(c.w)), ss(to_device(c.ss)), xn(c.h.size()) {
    poison(xn);
    in.h = h.get();
    in.ss = ss.get();
    in.w = w.get();
    in.eps = 1e-6f;
    in.xn_out = xn.get();
  }
};

// Top-k ids (distinct per token) and renormalised weights.
inline void random_routing(int n, int E, int k, std::vector<int>& idx, std::vector<float>& wts) {
  idx.resize(size_t(n) * k);
  wts.resize(size_t(n) * k);
  std::vector<int> perm(E);
  for (int t = 0; t < n; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    float s = 0;
    for (int j = 0; j < k; ++j) {
      idx[size_t(t) * k + j] = perm[j];
      s += wts[size_t(t) * k + j] = std::uniform_real_distribution<float>(0.05f, 1.f)(rng());
    }
    for (int j = 0; j < k; ++j) wts[size_t(t) * k + j] /= s;
  }
}

struct DeviceRouting {
  DeviceBuffer<int> offsets, tiles, sorted, slot_row, work;
  cuda::MoeRouting view(int E, int rows, int tile_rows = cuda::kGroupedBM) {
    offsets.resize(E + 1);
    tiles.resize(E + 1);
    sorted.resize(rows);
    slot_row.resize(rows);
    if (work.size() != size_t(2 * E + 1)) {
      work.resize(2 * E + 1);
      CUDA_CHECK(cudaMemset(work.get(), 0, work.bytes()));
    }
    return {offsets.get(), tiles.get(), sorted.get(), slot_row.get(), work.get(), tile_rows};
  }
};

}  // namespace tansy::gpu_test
