#include "model/model.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "core/error.h"
#include "cpu/backend.h"
#include "model/backend_choice.h"
#ifdef TANSY_HAVE_CUDA_BACKEND
#include "cuda/backend.h"
#endif

namespace tansy {

int32_t argmax(std::span<const float> v) {
  if (v.empty()) fail("argmax of an empty vector");
  size_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[best]) best = i;
  return int32_t(best);
}

void Model::generate_greedy(SequenceState& state, std::span<const int32_t> prompt, int n,
                            const std::function<bool(int32_t)>& on_token) {
  std::vector<float> logits(size_t(config().vocab_size));
  forward(state, prompt, logits, false);
  for (int i = 0; i < n; ++i) {
    int32_t next = argmax(logits);
    if (!on_token(next) || i + 1 == n) return;
    forward(state, std::span<const int32_t>(&next, 1), logits, false);
  }
}

int32_t Model::greedy_step(SequenceState& state, std::span<const int32_t> ids, int limit) {
  const int V = config().vocab_size;
  if (limit < 1 || limit > V) fail("greedy_step: limit {} outside 1..{}", limit, V);
  if (ids.empty()) fail("greedy_step: no ids to feed");
  std::vector<float> logits(static_cast<size_t>(V));
  forward(state, ids, logits, false);
  return argmax(std::span<const float>(logits.data(), size_t(limit)));
}

namespace {

// forward() into host logits, the reference Sampler, logprobs of the raw distribution.
class HostSampler final : public TokenSampler {
 public:
  HostSampler(Model& m, const SamplerSpec& spec)
      : m_(m),
        limit_(spec.limit),
        n_logprobs_(spec.logprobs),
        sampler_(spec.params, spec.prompt),
        logits_(size_t(m.config().vocab_size)) {
    TANSY_CHECK(limit_ >= 1 && limit_ <= m.config().vocab_size, "sampler: limit {} outside 1..{}", limit_,
                m.config().vocab_size);
  }
  void feed(SequenceState& state, std::span<const int32_t> ids) override {
    m_.forward(state, ids, logits_, false);
    std::fill(logits_.begin() + limit_, logits_.end(), -std::numeric_limits<float>::infinity());
    fed_ = true;
  }
  SampleChoice next(const uint32_t* allowed, int32_t forced) override {
    TANSY_CHECK(fed_, "sampler: next() before anything was fed");
    SampleChoice c;
    std::span<const float> raw(logits_.data(), size_t(limit_));
    if (forced >= 0) {
      c.token = forced;
    } else {
      scratch_.assign(raw.begin(), raw.end());
      c.token = sampler_.sample(scratch_, allowed);
    }
    if (n_logprobs_ >= 0) c.logprobs = logprobs_of(raw, c.token, n_logprobs_);
    sampler_.accept(c.token);
    fed_ = false;
    return c;
  }

 private:
  Model& m_;
  int limit_, n_logprobs_;
  Sampler sampler_;
  std::vector<float> logits_, scratch_;
  bool fed_ = false;
};

}  // namespace

std::unique_ptr<TokenSampler> Model::make_host_sampler(const SamplerSpec& spec) {
  return std::make_unique<HostSampler>(*this, spec);
}

std::unique_ptr<TokenSampler> Model::make_sampler(const SamplerSpec& spec) { return make_host_sampler(spec); }

std::unique_ptr<Model> open_model(const std::filesystem::path& dir, const ModelOptions& opt) {
  if (opt.backend == "cpu") return make_cpu_model(dir, opt);
  if (opt.backend == "cuda") {
    [[maybe_unused]] const PrecisionChoice pc = choose_cuda_precision(
        opt.cuda_precision, opt.cuda_precision == "auto" ? checkpoint_bytes(dir.string()) : 0);
#ifdef TANSY_HAVE_CUDA_BACKEND
    return pc.precision == "f32" ? make_cuda_f32_model(dir) : make_cuda_model(dir);
#else
    fail("this build of tansy has no CUDA backend (built without nvcc)");
#endif
  }
  fail("unknown backend '{}' (expected cpu or cuda)", opt.backend);
}

}  // namespace tansy
