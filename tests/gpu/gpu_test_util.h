// Shared helpers of the GPU tests: random host data, device copies, error norms.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

#include "core/bf16.h"
#include "cuda/common/cuda_util.h"

namespace tansy::gpu_test {

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

}  // namespace tansy::gpu_test
