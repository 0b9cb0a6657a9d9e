// Stage marks for `tansy bench --stages` (model/stage_profiler.h) and the trace hooks of the tests.
#include <algorithm>
#include <cstdio>
#include <utility>

#include "cuda/bf16/plan.h"

namespace tansy::cuda {

std::vector<StageTime> CudaModel::profile_decode_step(SequenceState& state, int32_t token) {
  auto& st = dynamic_cast<CudaState&>(state);
  check_ids(st, std::span<const int32_t>(&token, 1));
  std::vector<Mark> marks;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  *h_tok_ = token;
  CUDA_CHECK(cudaMemcpyAsync(d_tok_.get(), h_tok_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  profile_step_ = step_ok_;
  if (profile_step_) {
    const size_t need =
        size_t(cfg_.num_layers) * kStepMaxProducts * kStepStamps * sm_count();  // >= launches' share
    if (step_prof_.size() < need) step_prof_.resize(need);
    prof_launches_.clear();
    CUDA_CHECK(cudaMemsetAsync(step_prof_.get(), 0, step_prof_.bytes(), stream_));
  }
  marks_ = &marks;
  try {
    decode_step(st, cfg_.vocab_size);
    st.n += 1;
    mark("");
  } catch (...) {
    marks_ = nullptr;
    profile_step_ = false;
    throw;
  }
  marks_ = nullptr;
  const bool folded = std::exchange(profile_step_, false);
  std::vector<StageTime> out = collect(marks);
  return folded ? fold_step_profile(std::move(out)) : out;
}

std::vector<StageTime> CudaModel::fold_step_profile(std::vector<StageTime> stages) {
  static const char* kNames[kStepKinds] = {
      "step: gdn.in_proj+norm+conv+gates",    "step: gdn.recurrence+norms",
      "step: gdn.out_proj+residual",          "step: moe.router+norm (+ routing)",
      "step: moe.experts gate|up (k+shared)", "step: moe.experts down+combine+residual",
      "step: attn.o_proj+residual",           "step: attn.in_proj+norm"};
  const int G = sm_count();
  const size_t per = size_t(kStepMaxProducts) * kStepStamps * G;
  std::vector<unsigned long long> t(per * prof_launches_.size());
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (!t.empty()) step_prof_.download(t.data(), t.size());
  StageTime kind[kStepKinds], barriers{"step: grid barriers between products", 0, 0, 0, 0};
  for (int k = 0; k < kStepKinds; ++k) kind[k] = StageTime{kNames[k], 0, 0, 0, 0};
  const int H = cfg_.hidden_size, I = cfg_.moe_intermediate, k1 = cfg_.experts_per_tok + 1;
  double in_kernel = 0;
  // Inside each product kind (stderr, beside the stage table): staging, the first tile, the tiles,
  // the rest, as means over the blocks that had tiles.
  double detail_ms[kStepKinds][4] = {};
  int detail_n[kStepKinds] = {};
  for (size_t l = 0; l < prof_launches_.size(); ++l) {
    const StepArgs& a = prof_launches_[l];
    const unsigned long long* T = t.data() + l * per;
    std::vector<std::pair<int, const StepLayer*>> products;  // (kind, layer)
    for (int i = 0; i < a.n_layers; ++i)
      for (int j = 0; j < step_n_products(a.layer[i]); ++j)
        products.emplace_back(step_product(a.layer[i], j), &a.layer[i]);
    auto lo = [&](size_t p, int w) {
      unsigned long long v = ~0ull;
      for (int b = 0; b < G; ++b) v = std::min(v, T[(p * kStepStamps + w) * G + b]);
      return v;
    };
    auto hi = [&](size_t p, int w) {
      unsigned long long v = 0;
      for (int b = 0; b < G; ++b) v = std::max(v, T[(p * kStepStamps + w) * G + b]);
      return v;
    };
    for (size_t p = 0; p < products.size(); ++p) {
      const auto [k, L] = products[p];
      const double ms = double(hi(p, 1) - lo(p, 0)) / 1e6;
      kind[k].ms += ms;
      in_kernel += ms;
      const double bytes = k == kGdnIn       ? wbytes(L->gdn_in)
                           : k == kGdnRec    ? 2.0 * cfg_.lin_num_v_heads * kGdnDim * kGdnDim * 4
                           : k == kGdnOut    ? wbytes(L->gdn_out)
                           : k == kRouter    ? wbytes(L->router)
                           : k == kExpertsGu ? k1 * wbytes(L->gu.rows(0, 2 * I))
                           : k == kAttnOut   ? wbytes(L->attn_o)
                           : k == kAttnIn    ? wbytes(L->attn_in)
                                             : k1 * wbytes(L->down.rows(0, H));
      kind[k].bytes += bytes;
      // mean over the blocks that had tiles: staging, wait for the first tile, the tiles, the rest
      if (k != kGdnRec) {
        double n = 0, d[4] = {0, 0, 0, 0};
        for (int b = 0; b < G; ++b) {
          const unsigned long long* s0 = T + (p * kStepStamps) * G + b;
          const unsigned long long t0 = s0[0], t1 = s0[G], t2 = s0[2 * G], t3 = s0[3 * G], t4 = s0[4 * G];
          if (t2 == 0 || t3 == 0 || t4 == 0) continue;
          n += 1;
          d[0] += double(t2 - t0), d[1] += double(t3 - t2), d[2] += double(t4 - t3), d[3] += double(t1 - t4);
        }
        for (int q = 0; q < 4; ++q) detail_ms[k][q] += n > 0 ? d[q] / n / 1e6 : 0;
        detail_n[k] += 1;
      }
      if (p + 1 < products.size()) {
        const double b = (double(lo(p + 1, 0)) - double(hi(p, 1))) / 1e6;
        barriers.ms += b;
        in_kernel += b;
      }
    }
  }
  for (int k = 0; k < kStepKinds; ++k)
    if (detail_n[k])
      std::fprintf(
          stderr, "step detail %-44s x %.4f  first tile %.4f  tiles %.4f  rest %.4f ms (%d products)\n",
          kNames[k], detail_ms[k][0], detail_ms[k][1], detail_ms[k][2], detail_ms[k][3], detail_n[k]);
  std::vector<StageTime> out;
  for (auto& st : stages) {
    if (st.name != "step.launch") {
      out.push_back(st);
      continue;
    }
    for (auto& k : kind)
      if (k.ms > 0) out.push_back(k);
    out.push_back(barriers);
    out.push_back(StageTime{"step: launches, ramp and tail (rest of the launches' time)", st.ms - in_kernel,
                            0, 0, st.launches});
  }
  return out;
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
  if (!route_trace_ && !route_override_) return;
  const int E = cfg_.num_experts, K = cfg_.experts_per_tok;
  std::vector<int32_t> all(size_t(m) * stride), idx(size_t(m) * K);
  CUDA_CHECK(cudaMemcpyAsync(all.data(), topk_idx_.get(), all.size() * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (int t = 0; t < m; ++t)
    for (int j = 0; j < K; ++j) idx[size_t(t) * K + j] = all[size_t(t) * stride + j];
  if (route_override_ && route_override_(layer, m, idx)) {
    // Row t's logits are at t * router_ld_ (prefill) or row 0 (one token, any ld); a shared-expert
    // slot past K (decode's folded shared expert) keeps its id and weight.
    std::vector<float> w(all.size()), logits(size_t(m) * router_ld_);
    CUDA_CHECK(
        cudaMemcpyAsync(w.data(), topk_w_.get(), w.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaMemcpyAsync(logits.data(), router_logits_.get(), logits.size() * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (int t = 0; t < m; ++t) {
      const std::span<const int32_t> f(&idx[size_t(t) * K], K);
      override_weights(&logits[size_t(t) * router_ld_], E, f, &w[size_t(t) * stride]);
      std::copy(f.begin(), f.end(), &all[size_t(t) * stride]);
    }
    // Pageable sources: each copy has read its buffer when it returns; the stream orders the
    // copies before the kernels that read the routing.
    CUDA_CHECK(cudaMemcpyAsync(topk_idx_.get(), all.data(), all.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(
        cudaMemcpyAsync(topk_w_.get(), w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
  }
  if (route_trace_) route_trace_(layer, idx);
}

void CudaModel::trace_row(const std::string& name, const float* rows, int n, int dim) {
  if (!trace_) return;
  std::vector<float> f(dim);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(f.data(), rows + size_t(n - 1) * dim, size_t(dim) * 4, cudaMemcpyDeviceToHost));
  trace_(name, f);
}

}  // namespace tansy::cuda
