#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "model/model.h"

namespace tansy {

namespace {

uint64_t pick_seed(const SamplingParams& p) {
  if (p.seed) return *p.seed;
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// Higher logit first; equal logits by lower id, so results never depend on sort stability.
struct ByLogit {
  std::span<const float> l;
  bool operator()(int32_t a, int32_t b) const { return l[a] > l[b] || (l[a] == l[b] && a < b); }
};

}  // namespace

Sampler::Sampler(const SamplingParams& p, std::span<const int32_t> prompt) : p_(p), rng_(pick_seed(p)) {
  if (p_.repetition_penalty != 1.0) seen_.insert(prompt.begin(), prompt.end());
}

void Sampler::accept(int32_t id) {
  out_counts_[id]++;
  if (p_.repetition_penalty != 1.0) seen_.insert(id);
}

void Sampler::apply_penalties(std::span<float> logits) const {
  const int32_t n = int32_t(logits.size());
  if (p_.repetition_penalty != 1.0) {
    const float r = float(p_.repetition_penalty);
    for (int32_t id : seen_)
      if (id >= 0 && id < n) logits[id] = logits[id] > 0 ? logits[id] / r : logits[id] * r;
  }
  if (p_.presence_penalty != 0.0 || p_.frequency_penalty != 0.0) {
    for (auto [id, count] : out_counts_)
      if (id >= 0 && id < n) logits[id] -= float(p_.presence_penalty + p_.frequency_penalty * count);
  }
  for (auto [id, bias] : p_.logit_bias)
    if (id >= 0 && id < n) logits[id] += float(bias);
}

int32_t Sampler::sample(std::span<float> logits, const uint32_t* allowed) {
  TANSY_CHECK(!logits.empty(), "sampler: empty logits");
  apply_penalties(logits);
  if (allowed) {
    for (size_t i = 0; i < logits.size(); ++i)
      if (!(allowed[i / 32] >> (i % 32) & 1u)) logits[i] = -std::numeric_limits<float>::infinity();
  }
  for (float& x : logits)
    if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
  if (p_.temperature <= 0.0) return argmax(logits);

  const int32_t n = int32_t(logits.size());
  std::vector<int32_t> cand(static_cast<size_t>(n));
  std::iota(cand.begin(), cand.end(), 0);
  ByLogit by{logits};
  // Candidates end up sorted best first, but only as far as the filters need to look.
  size_t sorted = 0;
  auto sort_prefix = [&](size_t k) {
    k = std::min(k, cand.size());
    if (k <= sorted) return;
    std::partial_sort(cand.begin() + sorted, cand.begin() + k, cand.end(), by);
    sorted = k;
  };
  if (p_.top_k > 0 && size_t(p_.top_k) < cand.size()) {
    sort_prefix(size_t(p_.top_k));
    cand.resize(size_t(p_.top_k));
  }
  sort_prefix(1);
  const float inv_t = float(1.0 / p_.temperature);
  const float top = logits[cand[0]];
  if (!std::isfinite(top)) return cand[0];  // everything masked: nothing sensible to sample
  auto weight = [&](int32_t id) { return std::exp((logits[id] - top) * inv_t); };
  double total = 0;
  for (int32_t id : cand) total += weight(id);

  if (p_.min_p > 0.0) {  // p(id) >= min_p * p(top)  <=>  weight(id) >= min_p
    size_t keep = 0;
    total = 0;
    for (int32_t id : cand)
      if (double w = weight(id); w >= p_.min_p) cand[keep++] = id, total += w;
    cand.resize(keep);
    sorted = std::min(sorted, keep);
    sort_prefix(1);
  }
  if (p_.top_p < 1.0) {
    // Grow the sorted prefix geometrically: the nucleus is usually small.
    const double need = p_.top_p * total;
    double acc = 0;
    size_t i = 0;
    for (size_t chunk = 64;; chunk *= 8) {
      sort_prefix(chunk);
      for (; i < sorted; ++i) {
        acc += weight(cand[i]);
        if (acc >= need) break;
      }
      if (i < sorted || sorted == cand.size()) break;
    }
    cand.resize(std::min(cand.size(), i + 1));
    total = 0;
    for (int32_t id : cand) total += weight(id);
  }
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_) * total;
  double acc = 0;
  for (int32_t id : cand) {
    acc += weight(id);
    if (u < acc) return id;
  }
  return cand.back();
}

double logsumexp(std::span<const float> v) {
  float m = -std::numeric_limits<float>::infinity();
  for (float x : v) m = std::max(m, x);
  if (!std::isfinite(m)) return m;
  double s = 0;
  for (float x : v) s += std::exp(double(x) - m);
  return m + std::log(s);
}

LogprobInfo logprobs_of(std::span<const float> logits, int32_t chosen, int k) {
  LogprobInfo r;
  const double lse = logsumexp(logits);
  r.logprob = float(logits[chosen] - lse);
  k = std::min<int>(k, int(logits.size()));
  if (k > 0) {
    std::vector<int32_t> idx(logits.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), ByLogit{logits});
    for (int i = 0; i < k; ++i) r.top.push_back({idx[i], float(logits[idx[i]] - lse)});
  }
  return r;
}

}  // namespace tansy
