// Sampling on the device for the bf16 plan: the decode step (or the prompt's last piece) leaves
// the logits in d_logits_, the device sampler chooses from them, and only its output comes back.
#include "cuda/bf16/plan.h"
#include "engine/sample_math.h"

namespace tansy::cuda {

namespace {

class CudaTokenSampler final : public TokenSampler {
 public:
  CudaTokenSampler(CudaModel& m, DeviceSampler& ds, const SamplerSpec& spec, bool& busy)
      : m_(m),
        ds_(ds),
        busy_(busy),
        seed_(sampling_seed(spec.params)),
        limit_(spec.limit),
        logprobs_(spec.logprobs) {
    TANSY_CHECK(!busy_, "cuda sampler: another request's sampler is still alive (one request at a time)");
    TANSY_CHECK(limit_ >= 1 && limit_ <= m.config().vocab_size, "sampler: limit {} outside 1..{}", limit_,
                m.config().vocab_size);
    TANSY_CHECK(logprobs_ <= kMaxTopLogprobs, "sampler: {} logprob alternatives exceed {}", logprobs_,
                kMaxTopLogprobs);
    busy_ = true;
    ds_.begin(spec.params, spec.prompt, m_.stream());
  }
  ~CudaTokenSampler() override { busy_ = false; }

  void feed(SequenceState& state, std::span<const int32_t> ids) override {
    auto& st = dynamic_cast<CudaState&>(state);
    // The last choice already sits in the decode graph's input when it is what is fed.
    const bool on_device = chosen_ >= 0 && ids.size() == 1 && ids[0] == chosen_;
    chosen_ = -1;
    m_.feed_device(st, ids, on_device);
    position_ = st.n;
    fed_ = true;
  }

  bool feed_is_async() const override { return true; }

  SampleChoice next(const uint32_t* allowed, int32_t forced) override {
    TANSY_CHECK(fed_, "sampler: next() before anything was fed");
    fed_ = false;
    ds_.enqueue(m_.device_logits(), limit_, sample_math::draw_bits(seed_, position_), allowed, forced,
                logprobs_, m_.stream(), m_.device_token());
    CUDA_CHECK(cudaStreamSynchronize(m_.stream()));
    const SampleOutput& o = ds_.output();
    SampleChoice c;
    c.token = o.token;
    chosen_ = o.token;
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
  DeviceSampler& ds_;
  bool& busy_;
  uint64_t seed_;
  int limit_, logprobs_;
  int64_t position_ = 0;
  bool fed_ = false;
  int32_t chosen_ = -1;  // the last choice, also in m_.device_token() until the next feed
};

}  // namespace

std::unique_ptr<TokenSampler> CudaModel::make_sampler(const SamplerSpec& spec) {
  // Traced runs synchronise per layer and go through forward(): the host sampler, by design.
  if (trace_ || route_trace_) return make_host_sampler(spec);
  if (!device_sampler_) device_sampler_ = std::make_unique<DeviceSampler>(cfg_.vocab_size);
  return std::make_unique<CudaTokenSampler>(*this, *device_sampler_, spec, sampler_busy_);
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
