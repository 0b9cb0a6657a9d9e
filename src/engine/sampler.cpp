#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <unordered_set>

#include "core/error.h"
#include "engine/sample_math.h"
#include "model/model.h"

namespace tansy {

uint64_t sampling_seed(const SamplingParams& p) {
  if (p.seed) return *p.seed;
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

namespace {

// Higher logit first; equal logits by lower id, so results never depend on sort stability.
struct ByLogit {
  std::span<const float> l;
  bool operator()(int32_t a, int32_t b) const { return l[a] > l[b] || (l[a] == l[b] && a < b); }
};

}  // namespace

Sampler::Sampler(const SamplingParams& p, std::span<const int32_t> prompt)
    : p_(p), seed_(sampling_seed(p)), position_(int64_t(prompt.size())) {
  if (p_.repetition_penalty != 1.0) seen_.insert(prompt.begin(), prompt.end());
}

void Sampler::accept(int32_t id) {
  out_counts_[id]++;
  if (p_.repetition_penalty != 1.0) seen_.insert(id);
  ++position_;
}

void Sampler::apply_penalties(std::span<float> logits) const {
  namespace sm = sample_math;
  const int32_t n = int32_t(logits.size());
  sm::Penalties pen;
  pen.repetition = p_.repetition_penalty != 1.0;
  pen.rep = float(p_.repetition_penalty);
  pen.presence_frequency = p_.presence_penalty != 0.0 || p_.frequency_penalty != 0.0;
  pen.presence = p_.presence_penalty;
  pen.frequency = p_.frequency_penalty;
  // Only ids that carry a penalty or a bias change; sm::penalized is the per-id rule the device
  // applies to every id. Each such id once: the seen set, then the other generated ids, then the
  // other biased ones.
  auto apply = [&](int32_t id) {
    if (id < 0 || id >= n) return;
    auto c = out_counts_.find(id);
    auto b = p_.logit_bias.find(id);
    logits[id] = sm::penalized(logits[id], pen, seen_.count(id) > 0, c == out_counts_.end() ? 0 : c->second,
                               b != p_.logit_bias.end(), b == p_.logit_bias.end() ? 0.f : float(b->second));
  };
  for (int32_t id : seen_) apply(id);
  for (auto [id, count] : out_counts_)
    if (!seen_.count(id)) apply(id);
  for (auto [id, bias] : p_.logit_bias)
    if (!seen_.count(id) && !out_counts_.count(id)) apply(id);
}

int32_t Sampler::sample(std::span<float> logits, const uint32_t* allowed) {
  TANSY_CHECK(!logits.empty(), "sampler: empty logits");
  apply_penalties(logits);
  for (size_t i = 0; i < logits.size(); ++i)
    if (std::isnan(logits[i]) || (allowed && !(allowed[i / 32] >> (i % 32) & 1u)))
      logits[i] = -std::numeric_limits<float>::infinity();
  if (p_.temperature <= 0.0) return argmax(logits);
  return sample_adjusted(logits, p_, sample_math::draw_bits(seed_, position_));
}

int32_t sample_adjusted(std::span<const float> logits, const SamplingParams& p, uint64_t R) {
  namespace sm = sample_math;
  const int32_t V = int32_t(logits.size());
  // Ranked candidates: the finite logits, best first by (logit, lower id) once sorted.
  std::vector<uint64_t> keys;
  keys.reserve(logits.size());
  float top = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < V; ++i)
    if (std::isfinite(logits[i])) keys.push_back(sm::rank_key(logits[i], i)), top = std::max(top, logits[i]);
  if (keys.empty()) return argmax(logits);  // everything masked: nothing sensible to sample
  const float inv_t = float(1.0 / p.temperature);
  if (!std::isfinite(inv_t)) return argmax(logits);  // a temperature too small for a float: greedy
  auto s_of = [&](int32_t id) { return sm::fmul(sm::fsub(logits[id], top), inv_t); };
  auto mass = [&](uint64_t key) { return sm::mass_of(s_of(sm::rank_key_id(key))); };

  size_t n = keys.size();
  if (p.top_k > 0) n = std::min(n, size_t(p.top_k));
  if (p.min_p > 0.0) {
    const float log_min_p = float(std::log(p.min_p));
    size_t above = 0;
    for (uint64_t k : keys) above += s_of(sm::rank_key_id(k)) >= log_min_p;
    n = std::min(n, above);
  }
  n = std::max<size_t>(n, 1);  // the best token always stays
  auto by_rank = std::greater<uint64_t>();
  if (n < keys.size()) {
    std::nth_element(keys.begin(), keys.begin() + std::ptrdiff_t(n - 1), keys.end(), by_rank);
    keys.resize(n);  // the n best, in no particular order
  }
  if (p.top_p < 1.0) {
    uint64_t total = 0;
    for (uint64_t k : keys) total += mass(k);
    const double need = p.top_p * double(total);
    // The nucleus is usually small: sort the best ones in growing prefixes.
    uint64_t acc = 0;
    size_t i = 0, sorted = 0;
    for (size_t chunk = 64;; chunk *= 8) {
      const size_t upto = std::min(chunk, keys.size());
      std::partial_sort(keys.begin() + std::ptrdiff_t(sorted), keys.begin() + std::ptrdiff_t(upto),
                        keys.end(), by_rank);
      sorted = upto;
      for (; i < sorted; ++i) {
        acc += mass(keys[i]);
        if (double(acc) >= need) break;
      }
      if (i < sorted || sorted == keys.size()) break;
    }
    keys.resize(std::min(keys.size(), i + 1));
  }
  // The draw walks the kept ids in ascending order.
  std::vector<int32_t> ids(keys.size());
  for (size_t j = 0; j < keys.size(); ++j) ids[j] = sm::rank_key_id(keys[j]);
  std::sort(ids.begin(), ids.end());
  uint64_t total = 0;
  for (int32_t id : ids) total += sm::mass_of(s_of(id));
  const uint64_t target = sm::mulhi64(R, total);
  uint64_t acc = 0;
  for (int32_t id : ids) {
    acc += sm::mass_of(s_of(id));
    if (acc > target) return id;
  }
  return ids.back();  // unreachable: acc reaches total > target
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
