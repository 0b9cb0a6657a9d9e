// The arithmetic of sampling that the CPU reference (engine/sampler.cpp) and the device sampler
// (cuda/sample/sample.cu) share, written so that both produce the same bits: IEEE operations
// that are never contracted into fused multiply-adds, a polynomial exp instead of the libraries'
// (which differ in the last bit), integer masses summed exactly, and a counter-based random draw.
// Given the same logits, parameters, seed and position, both backends pick the same token.
//
// The sampling rule (docs/API.md "Sampling"):
//   l_i   = the logit after repetition / presence / frequency penalties, logit_bias and the
//           allowed-token mask (NaN and masked ids are -inf);
//   order = ids with finite l_i by (l_i descending, id ascending);
//   kept  = the first n of that order, n = min(#finite, top_k, #(s_i >= log(min_p))), then the
//           shortest prefix whose mass reaches top_p of the mass of those n;
//   s_i   = (l_i - max l) / T, mass m_i = floor(exp(s_i) * 2^40) (an integer);
//   draw  = R = mix(seed, position) (64 bits); target = floor(R * M / 2^64) with M = the kept mass;
//           the token is the first kept id, in ascending id order, whose running mass exceeds target.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define TANSY_HD __host__ __device__ __forceinline__
#else
#define TANSY_HD inline
#endif

namespace tansy::sample_math {

// Single and double precision operations, each rounded on its own (nvcc would otherwise fuse
// a * b + c into one fma, which rounds once and changes the result).
TANSY_HD float fmul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TANSY_HD float fadd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TANSY_HD float fsub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TANSY_HD float fdiv(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TANSY_HD double dmul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
TANSY_HD double dadd(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

TANSY_HD uint32_t float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
#endif
}
TANSY_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, 4);
  return v;
#endif
}

// Order-preserving key of a non-NaN float: a larger value has a larger key; -0 and +0 share one.
TANSY_HD uint32_t order_key(float v) {
  uint32_t u = float_bits(v == 0.f ? 0.f : v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
TANSY_HD float key_value(uint32_t k) { return bits_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }
constexpr uint32_t kNegInfKey = 0x007fffffu;  // order_key(-inf): the smallest key of a value

// A unique key for (logit, id): a larger key is a larger logit, then a lower id.
TANSY_HD uint64_t rank_key(float v, int32_t id) {
  return (uint64_t(order_key(v)) << 32) | (0xffffffffu - uint32_t(id));
}
TANSY_HD int32_t rank_key_id(uint64_t k) { return int32_t(0xffffffffu - uint32_t(k & 0xffffffffu)); }

constexpr int kMassBits = 40;
constexpr float kMassScale = 1099511627776.0f;  // 2^40

// exp(x) for x <= 0, to about float precision, with the same bits everywhere. Below -28 the
// result is under 2^-40 and its mass is zero, so it returns 0 there.
TANSY_HD float det_exp(float x) {
  if (!(x >= -28.0f)) return 0.0f;  // also NaN
  if (x > 0.0f) x = 0.0f;
  const float kInvLn2 = 1.44269504f, kLn2Hi = 0.693145752f, kLn2Lo = 1.42860677e-06f;
  const float kf = floorf(fadd(fmul(x, kInvLn2), 0.5f));  // -41 <= kf <= 0
  float r = fsub(x, fmul(kf, kLn2Hi));
  r = fsub(r, fmul(kf, kLn2Lo));  // |r| <= ~0.35
  // Taylor series to r^7 (relative error < 1e-8 on |r| <= 0.35), Horner's rule.
  float p = 1.98412698e-04f;              // 1/5040
  p = fadd(fmul(p, r), 1.38888889e-03f);  // 1/720
  p = fadd(fmul(p, r), 8.33333333e-03f);  // 1/120
  p = fadd(fmul(p, r), 4.16666667e-02f);  // 1/24
  p = fadd(fmul(p, r), 1.66666667e-01f);  // 1/6
  p = fadd(fmul(p, r), 0.5f);
  p = fadd(fmul(p, r), 1.0f);
  p = fadd(fmul(p, r), 1.0f);
  const int k = int(kf);
  return fmul(p, bits_float(uint32_t(127 + k) << 23));  // p * 2^k, exact
}

// The integer mass of s = (l - max) / T <= 0.
TANSY_HD uint64_t mass_of(float s) {
  const float v = fmul(det_exp(s), kMassScale);  // exact: a power-of-two scale
#ifdef __CUDA_ARCH__
  return __float2ull_rz(v);
#else
  return uint64_t(v);
#endif
}

TANSY_HD uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// The random draw of a request with `seed` for the token at sequence position `position`.
TANSY_HD uint64_t draw_bits(uint64_t seed, int64_t position) {
  return mix64(mix64(seed) ^ uint64_t(position));
}

TANSY_HD uint64_t mulhi64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return __umul64hi(a, b);
#else
  return uint64_t((unsigned __int128)a * b >> 64);
#endif
}

// Penalties and bias in the order the reference applies them; NaN becomes -inf.
struct Penalties {
  bool repetition = false;  // repetition_penalty != 1 (applies to prompt and generated ids)
  float rep = 1.0f;
  bool presence_frequency = false;  // either is nonzero (applies to generated ids)
  double presence = 0.0, frequency = 0.0;
};
TANSY_HD float penalized(float l, const Penalties& p, bool seen, int count, bool has_bias, float bias) {
  if (p.repetition && seen) l = l > 0.0f ? fdiv(l, p.rep) : fmul(l, p.rep);
  if (p.presence_frequency && count > 0)
    l = fsub(l, float(dadd(p.presence, dmul(p.frequency, double(count)))));
  if (has_bias) l = fadd(l, bias);
  return l != l ? -__builtin_huge_valf() : l;
}

}  // namespace tansy::sample_math
