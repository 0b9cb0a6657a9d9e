// The bf16 plan's per-sequence state: KV cache, conv windows, GDN state, the decode graph.
#include "cuda/bf16/plan.h"

namespace tansy::cuda {

std::unique_ptr<CudaState> CudaModel::make_state(int max_tokens, bool with_graph) {
  if (max_tokens <= 0) fail("new_state: max_tokens must be positive");
  auto s = std::make_unique<CudaState>();
  s->max_tokens = max_tokens;
  s->pos.resize(1);
  CUDA_CHECK(cudaMemset(s->pos.get(), 0, sizeof(int)));
  s->layers.resize(cfg_.num_layers);
  for (int i = 0; i < cfg_.num_layers; ++i) {
    auto& L = s->layers[i];
    if (cfg_.layers[i] == LayerKind::kFull) {
      L.K.resize(size_t(max_tokens) * cfg_.kv_dim());
      L.V.resize(size_t(max_tokens) * cfg_.kv_dim());
    } else {
      L.window.resize(size_t(cfg_.conv_kernel - 1) * cfg_.lin_conv_dim());
      L.S.resize(size_t(cfg_.lin_num_v_heads) * kGdnDim * kGdnDim);
      CUDA_CHECK(cudaMemset(L.window.get(), 0, L.window.bytes()));
      CUDA_CHECK(cudaMemset(L.S.get(), 0, L.S.bytes()));
    }
  }
  if (with_graph) capture_decode_graph(*s);
  return s;
}

bool CudaModel::reset_state(SequenceState& state) {
  auto& st = dynamic_cast<CudaState&>(state);
  if (!st.reset_graph)
    capture(st.reset_graph, [&] {
      CUDA_CHECK(cudaMemsetAsync(st.pos.get(), 0, sizeof(int), stream_));
      for (auto& L : st.layers)
        if (L.S.size()) {
          CUDA_CHECK(cudaMemsetAsync(L.window.get(), 0, L.window.bytes(), stream_));
          CUDA_CHECK(cudaMemsetAsync(L.S.get(), 0, L.S.bytes(), stream_));
        }
    });
  CUDA_CHECK(cudaGraphLaunch(st.reset_graph, stream_));
  st.n = 0;  // the KV cache needs no clearing: attention reads positions < n only
  return true;
}

std::unique_ptr<SequenceState> CudaModel::clone_state(const SequenceState& src) {
  const auto& a = dynamic_cast<const CudaState&>(src);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  auto s = make_state(a.max_tokens, true);
  copy_state(a, *s);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return s;
}

// The keys and values of the first n tokens (attention reads positions < n only).
void CudaModel::copy_keys(const CudaState& a, CudaState& b, int n) {
  const size_t kv = size_t(n) * cfg_.kv_dim() * sizeof(bf16);
  if (!kv) return;
  for (size_t i = 0; i < a.layers.size(); ++i)
    if (a.layers[i].K.size()) {
      CUDA_CHECK(
          cudaMemcpyAsync(b.layers[i].K.get(), a.layers[i].K.get(), kv, cudaMemcpyDeviceToDevice, stream_));
      CUDA_CHECK(
          cudaMemcpyAsync(b.layers[i].V.get(), a.layers[i].V.get(), kv, cudaMemcpyDeviceToDevice, stream_));
    }
}

// No host synchronisation: every use of either state is enqueued on stream_, after these copies,
// so src cannot change and dst cannot be read before they are done (and a state freed meanwhile
// waits for them: cudaFree synchronises the device).
bool CudaModel::copy_state(const SequenceState& src, SequenceState& dst) {
  const auto& a = dynamic_cast<const CudaState&>(src);
  auto& b = dynamic_cast<CudaState&>(dst);
  check_copy_capacity(b.max_tokens, a.max_tokens);
  if (&a == &b) return true;
  b.n = a.n;
  CUDA_CHECK(cudaMemcpyAsync(b.pos.get(), a.pos.get(), sizeof(int), cudaMemcpyDeviceToDevice, stream_));
  copy_keys(a, b, a.n);
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const auto& A = a.layers[i];
    auto& B = b.layers[i];
    if (A.S.size()) {
      CUDA_CHECK(cudaMemcpyAsync(B.window.get(), A.window.get(), A.window.bytes(), cudaMemcpyDeviceToDevice,
                                 stream_));
      CUDA_CHECK(cudaMemcpyAsync(B.S.get(), A.S.get(), A.S.bytes(), cudaMemcpyDeviceToDevice, stream_));
    }
  }
  return true;
}

}  // namespace tansy::cuda
