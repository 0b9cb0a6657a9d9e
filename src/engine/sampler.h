// Token sampling: OpenAI / vLLM sampling parameters applied to one position's logits.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace tansy {

struct SamplingParams {
  double temperature = 1.0;         // 0: greedy (argmax, lowest id on ties)
  double top_p = 1.0;               // (0, 1]
  int top_k = 0;                    // 0 or -1: off
  double min_p = 0.0;               // [0, 1]: drop tokens below min_p * p(max)
  double presence_penalty = 0.0;    // OpenAI: on generated tokens
  double frequency_penalty = 0.0;   // OpenAI: on generated tokens, per occurrence
  double repetition_penalty = 1.0;  // HF/vLLM: on prompt and generated tokens
  std::map<int32_t, double> logit_bias;
  std::optional<uint64_t> seed;  // absent: a random one per request
};

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
};

// Log-probabilities of the model's own distribution (raw logits, before penalties and
// temperature): what vLLM reports by default, and the only choice independent of sampling settings.
struct LogprobInfo {
  float logprob = 0;              // of the chosen token
  std::vector<TokenLogprob> top;  // best first
};

// The request's seed, or a random one when it gives none.
uint64_t sampling_seed(const SamplingParams& p);

// The reference sampler (engine/sample_math.h states the rule; the CUDA plan's device sampler
// follows it bit for bit). The draw for the token at sequence position p depends only on
// (seed, p), so a seeded request gives the same tokens on every run and on every backend.
class Sampler {
 public:
  // `prompt` seeds the repetition-penalty set; the first sampled token is at position prompt.size().
  Sampler(const SamplingParams& p, std::span<const int32_t> prompt);

  // Chooses the next token. `logits` is scratch: it is modified. `allowed`, when given, is a
  // bitmask over the ids of `logits` (bit i % 32 of word i / 32): ids whose bit is clear are never
  // chosen (structured output). A mask must allow at least one id.
  int32_t sample(std::span<float> logits, const uint32_t* allowed = nullptr);
  // Records a generated token (penalties count it from now on) and moves to the next position.
  void accept(int32_t id);

  const SamplingParams& params() const { return p_; }
  uint64_t seed() const { return seed_; }
  int64_t position() const { return position_; }
  const std::unordered_map<int32_t, int>& counts() const { return out_counts_; }

 private:
  void apply_penalties(std::span<float> logits) const;
  SamplingParams p_;
  uint64_t seed_;
  int64_t position_;
  std::unordered_map<int32_t, int> out_counts_;
  std::unordered_set<int32_t> seen_;
};

// The choice among logits that already carry penalties, bias and mask (-inf: never chosen) for
// temperature > 0, given the draw R (sample_math::draw_bits). Exposed for the device sampler's tests.
int32_t sample_adjusted(std::span<const float> logits, const SamplingParams& p, uint64_t R);

// log(sum(exp(v))), stable.
double logsumexp(std::span<const float> v);
// The k most likely tokens of `logits` with their log-probabilities, best first (ties: lower id).
LogprobInfo logprobs_of(std::span<const float> logits, int32_t chosen, int k);

}  // namespace tansy
