// Stage marks for `tansy bench --stages` (model/stage_profiler.h) and the trace hooks of the tests.
#include <algorithm>

#include "cuda/bf16/plan.h"

namespace tansy::cuda {

std::vector<StageTime> CudaModel::profile_decode_step(SequenceState& state, int32_t token) {
  auto& st = dynamic_cast<CudaState&>(state);
  check_ids(st, std::span<const int32_t>(&token, 1));
  std::vector<Mark> marks;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  *h_tok_ = token;
  CUDA_CHECK(cudaMemcpyAsync(d_tok_.get(), h_tok_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  marks_ = &marks;
  try {
    decode_step(st, cfg_.vocab_size);
    st.n += 1;
    mark("");
  } catch (...) {
    marks_ = nullptr;
    throw;
  }
  marks_ = nullptr;
  return collect(marks);
}

std::vector<StageTime> CudaModel::profile_prefill(SequenceState& state, std::span<const int32_t> ids) {
  auto& st = dynamic_cast<CudaState&>(state);
  check_ids(st, ids);
  std::vector<Mark> marks;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  marks_ = &marks;
  try {
    const int n = int(ids.size());
    for (int c0 = 0; c0 < n; c0 += kChunk) {
      const int m = std::min(kChunk, n - c0);
      mark("ids upload");
      CUDA_CHECK(
          cudaMemcpyAsync(d_ids_.get(), ids.data() + c0, sizeof(int) * m, cudaMemcpyHostToDevice, stream_));
      run_chunk(st, m);
    }
    mark("lm_head", wbytes(lm_head_.view), 2.0 * lm_head_.view.out * lm_head_.view.in, 1);
    lm_head(n > kChunk ? (n - 1) % kChunk : n - 1, 1);
    mark("");
  } catch (...) {
    marks_ = nullptr;
    throw;
  }
  marks_ = nullptr;
  return collect(marks);
}

void CudaModel::trace_row(const std::string& name, const bf16* rows, int n, int dim) {
  if (!trace_) return;
  std::vector<uint16_t> raw(dim);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(raw.data(), rows + size_t(n - 1) * dim, size_t(dim) * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(dim);
  for (int i = 0; i < dim; ++i) f[i] = bf16_to_f32(raw[i]);
  trace_(name, f);
}

void CudaModel::mark(std::string name, double bytes, double flops, int launches) {
  if (!marks_) return;
  Mark mk{std::move(name), nullptr, bytes, flops, launches};
  CUDA_CHECK(cudaEventCreate(&mk.ev));
  CUDA_CHECK(cudaEventRecord(mk.ev, stream_));
  marks_->push_back(std::move(mk));
}

std::vector<StageTime> CudaModel::collect(std::vector<Mark>& marks) {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<StageTime> out;
  for (size_t i = 0; i + 1 < marks.size(); ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i].ev, marks[i + 1].ev));
    auto it =
        std::find_if(out.begin(), out.end(), [&](const StageTime& t) { return t.name == marks[i].name; });
    if (it == out.end()) it = out.insert(out.end(), StageTime{marks[i].name, 0, 0, 0, 0});
    it->ms += ms;
    it->bytes += marks[i].bytes;
    it->flops += marks[i].flops;
    it->launches += marks[i].launches;
  }
  for (auto& mk : marks) cudaEventDestroy(mk.ev);
  return out;
}

double CudaModel::wbytes(const DevLinear& W) {
  const double codes = double(W.out) * W.in * W.bits() / 8;
  return W.fmt == WFormat::kBF16 ? codes : codes + double(W.out) * (W.in / kQuantGroup) * 4;
}

void CudaModel::report_routes(int layer, int m, int stride) {
  if (!route_trace_) return;
  const int K = cfg_.experts_per_tok;
  std::vector<int32_t> all(size_t(m) * stride), idx(size_t(m) * K);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(all.data(), topk_idx_.get(), all.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  for (int t = 0; t < m; ++t)
    for (int j = 0; j < K; ++j) idx[size_t(t) * K + j] = all[size_t(t) * stride + j];
  route_trace_(layer, idx);
}

void CudaModel::trace_row(const std::string& name, const float* rows, int n, int dim) {
  if (!trace_) return;
  std::vector<float> f(dim);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(f.data(), rows + size_t(n - 1) * dim, size_t(dim) * 4, cudaMemcpyDeviceToHost));
  trace_(name, f);
}

}  // namespace tansy::cuda
