#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "cpu/backend.h"
#include "model/backend_choice.h"
#ifdef TANSY_HAVE_CUDA_BACKEND
#include "cuda/backend.h"
#endif

namespace tansy {

void Model::check_copy_capacity(int dst_max_tokens, int src_max_tokens) {
  TANSY_CHECK(dst_max_tokens == src_max_tokens,
              "copy_state: the destination holds up to {} tokens, the source up to {}", dst_max_tokens,
              src_max_tokens);
}

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

size_t state_bytes_of(const ModelConfig& c, int max_tokens, size_t kv_elem, size_t window_elem,
                      size_t recurrent_elem) {
  size_t b = 0;
  for (LayerKind k : c.layers)
    b += k == LayerKind::kLinear ? size_t(c.conv_kernel - 1) * size_t(c.lin_conv_dim()) * window_elem +
                                       size_t(c.lin_num_v_heads) * size_t(c.lin_k_head_dim) *
                                           size_t(c.lin_v_head_dim) * recurrent_elem
                                 : 2 * size_t(max_tokens) * size_t(c.kv_dim()) * kv_elem;
  return b;
}

void Model::override_weights(const float* logits, int E, std::span<const int32_t> forced, float* w,
                             int w_stride) {
  const float mx = *std::max_element(logits, logits + E);
  float total = 0.f;
  for (size_t j = 0; j < forced.size(); ++j) {
    const int e = forced[j];
    if (e < 0 || e >= E) fail("route override: expert {} outside 0..{}", e, E - 1);
    total += w[j * w_stride] = std::exp(logits[e] - mx);
  }
  for (size_t j = 0; j < forced.size(); ++j) w[j * w_stride] /= total;
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
  // Model::feed_batch: this sampler's row of the batch's logits.
  void take_logits(const Model& m, std::span<const float> row) {
    TANSY_CHECK(&m == &m_, "feed_batch: a sampler of another model");
    std::copy(row.begin(), row.begin() + limit_, logits_.begin());
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

// Model::greedy_step's choice, for backends that feed one sequence at a time.
class GreedyStepSampler final : public TokenSampler {
 public:
  GreedyStepSampler(Model& m, int limit) : m_(m), limit_(limit) {}
  void feed(SequenceState& state, std::span<const int32_t> ids) override {
    next_ = m_.greedy_step(state, ids, limit_);
  }
  SampleChoice next(const uint32_t* allowed, int32_t forced) override {
    TANSY_CHECK(allowed == nullptr, "greedy sampler: a constrained request must sample with a mask");
    TANSY_CHECK(forced >= 0 || next_ >= 0, "sampler: next() before anything was fed");
    SampleChoice c;
    c.token = forced >= 0 ? forced : next_;
    next_ = -1;
    return c;
  }

 private:
  Model& m_;
  int limit_;
  int32_t next_ = -1;
};

}  // namespace

std::unique_ptr<TokenSampler> Model::make_greedy_sampler(int limit) {
  if (max_batch() == 1) return std::make_unique<GreedyStepSampler>(*this, limit);
  SamplingParams greedy;
  greedy.temperature = 0;
  return make_host_sampler(SamplerSpec{greedy, {}, limit, -1});
}

void Model::check_batch(std::span<const FeedEntry> entries) const {
  if (int(entries.size()) > max_batch())
    fail("feed_batch: {} sequences exceed the backend's batch of {}", entries.size(), max_batch());
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!entries[i].state || entries[i].ids.empty()) fail("feed_batch: entry {} has no state or no ids", i);
    if (entries[i].cut && (entries[i].cut >= entries[i].ids.size() || !entries[i].on_cut))
      fail("feed_batch: entry {}'s cut {} is not inside its {} ids or nobody takes it", i, entries[i].cut,
           entries[i].ids.size());
    for (size_t j = 0; j < i; ++j)
      if (entries[j].state == entries[i].state) fail("feed_batch: one state fed twice in a step");
  }
}

bool Model::give_host_logits(TokenSampler* sampler, std::span<const float> row) const {
  auto* h = dynamic_cast<HostSampler*>(sampler);
  if (!h) return false;
  h->take_logits(*this, row);
  return true;
}

std::span<const int32_t> Model::feed_to_cut(const FeedEntry& e) {
  if (!e.cut) return e.ids;
  scratch_logits_.resize(size_t(config().vocab_size));
  forward(*e.state, e.ids.first(e.cut), scratch_logits_, false);
  e.on_cut(*e.state);
  return e.ids.subspan(e.cut);
}

void Model::feed_batch(std::span<const FeedEntry> entries) {
  if (entries.empty()) return;
  check_batch(entries);
  if (max_batch() == 1 || entries.size() == 1) {
    for (const FeedEntry& e : entries) {
      const std::span<const int32_t> rest = feed_to_cut(e);
      if (e.sampler) {
        e.sampler->feed(*e.state, rest);
      } else {
        scratch_logits_.resize(size_t(config().vocab_size));
        forward(*e.state, rest, scratch_logits_, false);
      }
    }
    return;
  }
  for (const FeedEntry& e : entries)  // before anything is fed (a cut is fed ahead of the batch)
    if (e.sampler && !dynamic_cast<HostSampler*>(e.sampler))
      fail("feed_batch: a batched backend needs host samplers (the batch's logits come to the host)");
  std::vector<BatchPiece> pieces;
  std::vector<HostSampler*> takers;
  for (const FeedEntry& e : entries) {
    auto* h = dynamic_cast<HostSampler*>(e.sampler);
    pieces.push_back({e.state, feed_to_cut(e), h != nullptr});
    if (h) takers.push_back(h);
  }
  const size_t V = size_t(config().vocab_size);
  scratch_logits_.resize(std::max<size_t>(1, takers.size()) * V);
  forward_batch(pieces, scratch_logits_);
  for (size_t i = 0; i < takers.size(); ++i)
    takers[i]->take_logits(*this, std::span<const float>(scratch_logits_.data() + i * V, V));
}

void Model::forward_batch(std::span<const BatchPiece> pieces, std::span<float> logits) {
  const size_t V = size_t(config().vocab_size);
  std::vector<float> discard(V);
  size_t row = 0;
  for (const BatchPiece& p : pieces) {
    if (p.want_logits && (row + 1) * V > logits.size()) fail("forward_batch: logits buffer too small");
    forward(*p.state, p.ids, p.want_logits ? logits.subspan(row++ * V, V) : std::span<float>(discard), false);
  }
}

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
