// The bf16 plan: the Model interface, scratch, decode graphs.
#include "cuda/bf16/plan.h"

namespace tansy::cuda {

CudaModel::CudaModel(const std::filesystem::path& dir, const CudaPlanOptions& opt)
    : cfg_(load_config(dir)), tc_prefill_(opt.prefill == PrefillKernels::kTensorCore) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) fail("cuda backend: no CUDA device");
  // A blocking stream: ordered after the default-stream memsets/copies of new_state and uploads.
  CUDA_CHECK(cudaStreamCreate(&stream_));
  CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  validate_config();
  greedy_limit_ = cfg_.vocab_size;
  {
    TensorStore store = TensorStore::open(dir);
    ModelWeights w = load_weights(cfg_, store);
    upload(w);
  }
  // The fused head reads 4-bit lm_heads only; other formats run the final norm, lm_head, argmax and
  // position as separate kernels.
  head_fused_ = lm_head_argmax_supports(lm_head_.view);
  allocate_scratch();
  plan_decode_step(opt);
  warm_up();
}

CudaModel::~CudaModel() {
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
  if (side_) cudaStreamDestroy(side_);
  if (stream_) cudaStreamDestroy(stream_);
  if (h_tok_) cudaFreeHost(h_tok_);
}

void CudaModel::forward(SequenceState& state, std::span<const int32_t> ids, std::span<float> logits,
                        bool all_positions) {
  auto& st = dynamic_cast<CudaState&>(state);
  const int n = int(ids.size());
  check_ids(st, ids);
  const size_t V = size_t(cfg_.vocab_size), need = all_positions ? V * n : V;
  if (logits.size() < need) fail("forward: logits buffer holds {} floats, needs {}", logits.size(), need);
  if (n == 1 && !hooked() && st.decode_graph) {  // one token: the decode graph (its argmax is unused here)
    *h_tok_ = ids[0];
    CUDA_CHECK(cudaMemcpyAsync(d_tok_.get(), h_tok_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaGraphLaunch(st.decode_graph, stream_));
    st.n += 1;
    CUDA_CHECK(
        cudaMemcpyAsync(logits.data(), d_logits_.get(), sizeof(float) * V, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int m = std::min(kChunk, n - c0);
    CUDA_CHECK(
        cudaMemcpyAsync(d_ids_.get(), ids.data() + c0, sizeof(int) * m, cudaMemcpyHostToDevice, stream_));
    run_chunk(st, m);
    if (all_positions) {
      for (int r0 = 0; r0 < m; r0 += kLogitRows) {
        const int rows = std::min(kLogitRows, m - r0);
        lm_head(r0, rows);
        CUDA_CHECK(cudaMemcpyAsync(logits.data() + (size_t(c0) + r0) * V, d_logits_.get(),
                                   sizeof(float) * V * rows, cudaMemcpyDeviceToHost, stream_));
      }
    } else if (c0 + m == n) {
      lm_head(m - 1, 1);
      CUDA_CHECK(cudaMemcpyAsync(logits.data(), d_logits_.get(), sizeof(float) * V, cudaMemcpyDeviceToHost,
                                 stream_));
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

int32_t CudaModel::greedy_step(SequenceState& state, std::span<const int32_t> ids, int limit) {
  if (hooked()) return Model::greedy_step(state, ids, limit);
  auto& st = dynamic_cast<CudaState&>(state);
  if (limit < 1 || limit > cfg_.vocab_size)
    fail("greedy_step: limit {} outside 1..{}", limit, cfg_.vocab_size);
  if (ids.empty()) fail("greedy_step: no ids to feed");
  check_ids(st, ids);
  if (ids.size() > 1) return prefill_argmax(st, ids, limit);  // a piece of prompt
  if (limit != st.graph_limit) {
    greedy_limit_ = limit;  // states made from now on capture this limit
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    capture_decode_graph(st);
  }
  *h_tok_ = ids[0];
  CUDA_CHECK(cudaMemcpyAsync(d_tok_.get(), h_tok_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaGraphLaunch(st.decode_graph, stream_));
  st.n += 1;
  return fetch_token();
}

void CudaModel::generate_greedy(SequenceState& state, std::span<const int32_t> prompt, int n,
                                const std::function<bool(int32_t)>& on_token) {
  if (hooked()) return Model::generate_greedy(state, prompt, n, on_token);  // traced runs go eagerly
  auto& st = dynamic_cast<CudaState&>(state);
  check_ids(st, prompt);
  if (n <= 0) return;
  if (st.graph_limit != cfg_.vocab_size) {
    const int saved = std::exchange(greedy_limit_, cfg_.vocab_size);
    capture_decode_graph(st);
    greedy_limit_ = saved;
  }
  int32_t tok = prefill_argmax(st, prompt, cfg_.vocab_size);
  for (int i = 0; i < n; ++i) {
    // The state holds exactly the tokens fed: a token is fed only after on_token accepted it.
    if (!on_token(tok) || i + 1 == n) return;
    if (st.n + 1 > st.max_tokens) fail("generate: the state's capacity {} is exhausted", st.max_tokens);
    CUDA_CHECK(cudaGraphLaunch(st.decode_graph, stream_));
    st.n += 1;
    tok = fetch_token();
  }
}

void CudaModel::validate_config() {
  const ModelConfig& c = cfg_;
  TANSY_CHECK(c.head_dim == kHeadDim, "cuda backend: head_dim {} unsupported (kernels are built for {})",
              c.head_dim, kHeadDim);
  TANSY_CHECK(c.lin_k_head_dim == kGdnDim && c.lin_v_head_dim == kGdnDim,
              "cuda backend: GDN head dims {}/{} unsupported (kernels are built for {})", c.lin_k_head_dim,
              c.lin_v_head_dim, kGdnDim);
  TANSY_CHECK(c.hidden_size % kQuantGroup == 0 && c.hidden_size <= kMatvecMaxIn,
              "cuda backend: hidden size {} unsupported", c.hidden_size);
  TANSY_CHECK(c.num_experts <= kRouteMaxExperts && c.experts_per_tok <= kRouteMaxTopK,
              "cuda backend: {} experts / top-{} unsupported", c.num_experts, c.experts_per_tok);
  TANSY_CHECK(c.conv_kernel >= 2 && c.conv_kernel <= kMaxConvKernel,
              "cuda backend: conv kernel {} unsupported", c.conv_kernel);
}

void CudaModel::check_ids(const CudaState& st, std::span<const int32_t> ids) {
  if (ids.empty()) fail("forward: no tokens");
  if (st.n + int64_t(ids.size()) > st.max_tokens)
    fail("forward: {} + {} tokens exceed the state's capacity {}", st.n, ids.size(), st.max_tokens);
  for (int32_t id : ids)
    if (id < 0 || id >= cfg_.vocab_size)
      fail("token id {} is outside the vocabulary (0..{})", id, cfg_.vocab_size - 1);
}

void CudaModel::allocate_scratch() {
  const ModelConfig& c = cfg_;
  const int H = c.hidden_size, E = c.num_experts, K = c.experts_per_tok;
  proj_ld_ = 0;
  for (const DevLayer& L : layers_)
    proj_ld_ =
        std::max<int64_t>(proj_ld_, L.kind == LayerKind::kLinear ? L.gdn_in.view.out : L.attn_in.view.out);
  proj_ld_ = (proj_ld_ + 7) / 8 * 8;
  router_ld_ = layers_[0].router.view.out;
  const size_t C = kChunk;
  d_ids_.resize(C);
  d_tok_.resize(1);
  h_.resize(C * H);
  ss_parts_.resize(size_t(kMaxBatch) * ss_row_ld());
  CUDA_CHECK(cudaMemset(ss_parts_.get(), 0, ss_parts_.bytes()));
  TANSY_CHECK(H <= kFusedNormMaxDim, "cuda backend: hidden size {} exceeds the fused decode norm's {}", H,
              kFusedNormMaxDim);
  conv_f32_.resize(size_t(kMaxBatch) * c.lin_conv_dim());
  gdn_counters_.resize(size_t(kMaxBatch) * std::max(1, c.lin_num_v_heads));
  route_counter_.resize(kMaxBatch);
  CUDA_CHECK(cudaMemset(gdn_counters_.get(), 0, gdn_counters_.bytes()));
  CUDA_CHECK(cudaMemset(route_counter_.get(), 0, route_counter_.bytes()));
  xn_.resize(C * H);
  r_.resize(C * H);
  proj_.resize(C * proj_ld_);
  conv_y_.resize(C * c.lin_conv_dim());
  beta_.resize(C * c.lin_num_v_heads);
  g_.resize(C * c.lin_num_v_heads);
  const size_t mix = std::max(c.lin_value_dim(), c.q_dim());
  o_.resize(C * mix);
  mix_.resize(C * mix);
  router_logits_.resize(C * router_ld_);
  topk_idx_.resize(C * K + 1);  // decode: k routed slots + the shared one
  topk_w_.resize(C * K + 1);
  act_.resize(C * K * c.moe_intermediate);
  sh_act_.resize(C * c.shared_intermediate);
  sh_out_.resize(C * H);
  // decode: kDecodeSplits partials; GEMV prefill keeps tokens x splits <= kChunk
  static_assert(kDecodeSplits <= kChunk && kFusedDecodeSplits <= kChunk);
  attn_scratch_.resize(attn_scratch_floats(kChunk, c.num_heads, 1));
  d_logits_.resize(size_t(std::max(kLogitRows, kMaxBatch)) * c.vocab_size);
  d_rows_tok_.resize(kMaxBatch);
  d_argmax_.resize(kArgmaxBlocks);
  if (head_fused_) {
    d_head_scratch_.resize(size_t(lm_head_scratch()) * kLmHeadRows);
    head_counter_.resize(1);
    CUDA_CHECK(cudaMemset(head_counter_.get(), 0, head_counter_.bytes()));
  }
  if (tc_prefill_) {
    expert_offsets_.resize(E + 1);
    tile_offsets_.resize(E + 1);
    sorted_slot_.resize(C * K);
    slot_row_.resize(C * K);
    route_work_.resize(2 * E + 1);
    CUDA_CHECK(cudaMemset(route_work_.get(), 0, route_work_.bytes()));
    yd_.resize(C * K * H);
  }
  CUDA_CHECK(cudaMallocHost(&h_tok_, sizeof(int32_t)));
  CUDA_CHECK(cudaMallocHost(&h_rows_tok_, sizeof(int32_t) * kMaxBatch));
  CUDA_CHECK(cudaMallocHost(&h_rows_ids_, sizeof(int32_t) * kMaxBatch));
}

void CudaModel::warm_up() {
  auto st = make_state(1, false);
  CUDA_CHECK(cudaMemsetAsync(d_tok_.get(), 0, sizeof(int), stream_));
  decode_step(*st, cfg_.vocab_size);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

int32_t CudaModel::fetch_token() {
  CUDA_CHECK(cudaMemcpyAsync(h_tok_, d_tok_.get(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return *h_tok_;
}

void CudaModel::capture_decode_graph(CudaState& st) {
  // Tracing synchronises the stream, which a capture forbids; graphs are never traced.
  TraceFn saved = std::exchange(trace_, nullptr);
  RouteTraceFn saved_routes = std::exchange(route_trace_, nullptr);
  RouteOverrideFn saved_override = std::exchange(route_override_, nullptr);
  auto restore = [&] {
    trace_ = std::move(saved);
    route_trace_ = std::move(saved_routes);
    route_override_ = std::move(saved_override);
  };
  try {
    capture(st.decode_graph, [&] { decode_step(st, greedy_limit_); });
  } catch (...) {
    restore();
    throw;
  }
  restore();
  st.graph_limit = greedy_limit_;
}

void CudaModel::run_chunk(CudaState& st, int m) {
  const bool inside = cut_.dst && cut_.at > st.n && cut_.at < st.n + m;
  run_layers(st, d_ids_.get(), m, tc_prefill_ && m > 1, inside ? cut_.at - st.n : 0);
  if (inside) {  // the keys and values before the cut: later tokens do not change them
    copy_keys(st, *cut_.dst, cut_.at);
    cut_.dst->n = cut_.at;
  }
  st.n += m;
  if (cut_.dst && cut_.at == st.n) copy_state(st, *cut_.dst);  // the cut at the chunk's end
}

void CudaModel::feed_cut_in_one_pass(const FeedEntry& e,
                                     const std::function<void(std::span<const int32_t>)>& feed) {
  auto& st = dynamic_cast<CudaState&>(*e.state);
  if (!cut_state_ || cut_state_->max_tokens != st.max_tokens) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old one may still be read
    cut_state_ = make_state(st.max_tokens, false);
  }
  const int at = st.n + int(e.cut);
  cut_ = Cut{cut_state_.get(), at};
  cut_state_->n = -1;  // run_chunk sets it when it writes the state at the cut
  try {
    feed(e.ids);
  } catch (...) {
    cut_ = Cut{};
    throw;
  }
  cut_ = Cut{};
  TANSY_CHECK(cut_state_->n == at, "feed_batch: the feed did not write the state at its cut {}", at);
  e.on_cut(*cut_state_);  // its copy is enqueued after the feed's writes, before the next feed's
}

int32_t CudaModel::prefill_argmax(CudaState& st, std::span<const int32_t> ids, int limit) {
  const int P = int(ids.size());
  int m = 0;
  for (int c0 = 0; c0 < P; c0 += m) {
    m = std::min(kChunk, P - c0);
    CUDA_CHECK(
        cudaMemcpyAsync(d_ids_.get(), ids.data() + c0, sizeof(int) * m, cudaMemcpyHostToDevice, stream_));
    run_chunk(st, m);
  }
  lm_head(m - 1, 1);
  argmax(d_logits_.get(), limit, d_argmax_.get(), d_tok_.get(), nullptr, nullptr, stream_);
  return fetch_token();
}

}  // namespace tansy::cuda

namespace tansy {

std::unique_ptr<Model> make_cuda_model(const std::filesystem::path& dir, const cuda::CudaPlanOptions& opt) {
  return std::make_unique<cuda::CudaModel>(dir, opt);
}

}  // namespace tansy
