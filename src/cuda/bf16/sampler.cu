// Sampling on the device for the bf16 plan: the decode step (or the prompt's last piece) leaves
// the logits in d_logits_ (a batched step: one row per sequence), the device sampler chooses from
// them, and only its output comes back.
#include "cuda/bf16/plan.h"
#include "engine/sample_math.h"

namespace tansy::cuda {

namespace {

class CudaTokenSampler final : public CudaRowSampler {
 public:
  CudaTokenSampler(CudaModel& m, const SamplerSpec& spec)
      : m_(m), seed_(sampling_seed(spec.params)), limit_(spec.limit), logprobs_(spec.logprobs) {
    TANSY_CHECK(limit_ >= 1 && limit_ <= m.config().vocab_size, "sampler: limit {} outside 1..{}", limit_,
                m.config().vocab_size);
    TANSY_CHECK(logprobs_ <= kMaxTopLogprobs, "sampler: {} logprob alternatives exceed {}", logprobs_,
                kMaxTopLogprobs);
    ds_ = m_.take_device_sampler();
    ds_->begin(spec.params, spec.prompt, m_.stream());
  }
  ~CudaTokenSampler() override { m_.return_device_sampler(std::move(ds_)); }

  void feed(SequenceState& state, std::span<const int32_t> ids) override {
    auto& st = dynamic_cast<CudaState&>(state);
    // The last choice already sits in the decode graph's input when it is what is fed (and the
    // choice was made alone: a batched step's choices stay in their rows).
    const bool on_device = chosen_on_device_ && chosen_ >= 0 && ids.size() == 1 && ids[0] == chosen_;
    chosen_ = -1;
    m_.feed_device(st, ids, on_device);
    position_ = st.n;
    row_ = -1;
    fed_ = true;
  }

  void fed_row(CudaState& st, int row) override {
    chosen_ = -1;
    position_ = st.n;
    row_ = row;
    fed_ = true;
  }
  int limit() const override { return limit_; }

  bool feed_is_async() const override { return true; }

  SampleChoice next(const uint32_t* allowed, int32_t forced) override {
    TANSY_CHECK(fed_, "sampler: next() before anything was fed");
    fed_ = false;
    const bool alone = row_ < 0;
    ds_->enqueue(alone ? m_.device_logits() : m_.batch_logits(row_), limit_,
                 sample_math::draw_bits(seed_, position_), allowed, forced, logprobs_, m_.stream(),
                 alone ? m_.device_token() : nullptr);
    CUDA_CHECK(cudaStreamSynchronize(m_.stream()));
    const SampleOutput& o = ds_->output();
    SampleChoice c;
    c.token = o.token;
    chosen_ = o.token;
    chosen_on_device_ = alone;
    if (logprobs_ >= 0) {
      LogprobInfo lp;
      lp.logprob = o.logprob;
      for (int i = 0; i < o.n_top; ++i) lp.top.push_back({o.top_id[i], o.top_logprob[i]});
      c.logprobs = std::move(lp);
    }
    return c;
  }

 private:
  CudaModel& m_;
  std::unique_ptr<DeviceSampler> ds_;
  uint64_t seed_;
  int limit_, logprobs_;
  int64_t position_ = 0;
  bool fed_ = false;
  int row_ = -1;                   // fed in a batched step: its row of the step's logits
  int32_t chosen_ = -1;            // the last choice
  bool chosen_on_device_ = false;  // ... also in m_.device_token() until the next feed
};

// The greedy choice: alone, greedy_step (the decode graph's fused argmax, only the id copied);
// in a batched step, its row's token from the fused head of that row.
class CudaGreedySampler final : public CudaRowSampler {
 public:
  CudaGreedySampler(CudaModel& m, int limit) : m_(m), limit_(limit) {
    TANSY_CHECK(limit_ >= 1 && limit_ <= m.config().vocab_size, "sampler: limit {} outside 1..{}", limit_,
                m.config().vocab_size);
  }
  void feed(SequenceState& state, std::span<const int32_t> ids) override {
    next_ = m_.greedy_step(state, ids, limit_);
    row_ = -1;
  }
  void fed_row(CudaState&, int row) override {
    next_ = -1;
    row_ = row;
  }
  int limit() const override { return limit_; }
  SampleChoice next(const uint32_t* allowed, int32_t forced) override {
    TANSY_CHECK(allowed == nullptr, "greedy sampler: a constrained request must sample with a mask");
    if (row_ >= 0 && forced < 0) next_ = m_.batch_token(row_);
    TANSY_CHECK(forced >= 0 || next_ >= 0, "sampler: next() before anything was fed");
    SampleChoice c;
    c.token = forced >= 0 ? forced : next_;
    next_ = -1;
    row_ = -1;
    return c;
  }

 private:
  CudaModel& m_;
  int limit_;
  int32_t next_ = -1;
  int row_ = -1;
};

}  // namespace

std::unique_ptr<TokenSampler> CudaModel::make_sampler(const SamplerSpec& spec) {
  // Traced runs synchronise per layer and go through forward(): the host sampler, by design.
  if (hooked()) return make_host_sampler(spec);
  return std::make_unique<CudaTokenSampler>(*this, spec);
}

std::unique_ptr<TokenSampler> CudaModel::make_greedy_sampler(int limit) {
  if (hooked()) return Model::make_greedy_sampler(limit);
  return std::make_unique<CudaGreedySampler>(*this, limit);
}

std::unique_ptr<DeviceSampler> CudaModel::take_device_sampler() {
  if (sampler_pool_.empty()) return std::make_unique<DeviceSampler>(cfg_.vocab_size);
  std::unique_ptr<DeviceSampler> ds = std::move(sampler_pool_.back());
  sampler_pool_.pop_back();
  return ds;
}

void CudaModel::return_device_sampler(std::unique_ptr<DeviceSampler> ds) {
  if (ds) sampler_pool_.push_back(std::move(ds));
}

void CudaModel::feed_device(CudaState& st, std::span<const int32_t> ids, bool token_on_device) {
  check_ids(st, ids);
  if (ids.size() == 1 && st.decode_graph) {
    if (!token_on_device) {
      *h_tok_ = ids[0];
      CUDA_CHECK(cudaMemcpyAsync(d_tok_.get(), h_tok_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    }
    CUDA_CHECK(cudaGraphLaunch(st.decode_graph, stream_));
    st.n += 1;
    return;
  }
  const int n = int(ids.size());
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int m = std::min(kChunk, n - c0);
    CUDA_CHECK(
        cudaMemcpyAsync(d_ids_.get(), ids.data() + c0, sizeof(int) * m, cudaMemcpyHostToDevice, stream_));
    run_chunk(st, m);
    if (c0 + m == n) lm_head(m - 1, 1);
  }
}

}  // namespace tansy::cuda
