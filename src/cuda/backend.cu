// The Hopper backend: the whole forward pass of docs/MODEL.md §2-§7 on one GPU.
//
// Weights are uploaded in their checkpoint layout (no dequantized copies), with projections that
// read the same input fused into one matrix at load:
//   GDN    [qkv | z | a | b]              (one product per layer instead of four)
//   attn   [q+gate | k | v]
//   router [experts | shared-expert gate | zero pad to an even row count]
//   shared expert and routed experts: gate/up rows interleaved (2i = gate_i, 2i+1 = up_i), which
//   both the decode kernels and the prefill GEMM's SwiGLU epilogue read.
//   the shared expert, when shaped like a routed one, as expert E of the stacked expert matrices
//   (decode runs it as a ninth slot with weight sigmoid(gate logit); prefill reads it as a view).
// The residual stream is f32; other activations between ops are bf16, accumulation f32, GDN state
// f32, KV cache bf16, logits f32.
//
// A decode step (one token, no tracing) fuses the neighbours of each product into it: every RMSNorm
// into the matvec that reads it (the residual add into the product before it), the routing into the router,
// the GDN conv and gates into in_proj, and the GDN norms into the recurrence.
//
// Decode (one token) runs the GEMV kernels, captured once per sequence state in a CUDA graph whose
// input id and position live on the device; prefill (several tokens) runs the tensor-core kernels
// (gemm, attention_prefill, gdn_prefill) unless TANSY_CUDA_PREFILL=gemv selects the GEMV kernels
// (a slower path kept for testing the two against each other).
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "cuda/attention_decode.cuh"
#include "cuda/attention_prefill.cuh"
#include "cuda/backend.h"
#include "cuda/cuda_util.h"
#include "cuda/embed.cuh"
#include "cuda/gdn_decode.cuh"
#include "cuda/gdn_prefill.cuh"
#include "cuda/gemm.cuh"
#include "cuda/lm_head.cuh"
#include "cuda/matvec.cuh"
#include "cuda/moe.cuh"
#include "cuda/norm.cuh"
#include "model/stage_profiler.h"
#include "model/weights.h"

namespace tansy {
namespace cuda {
namespace {

constexpr int kChunk = 4096;        // tokens per forward chunk (bounds the scratch buffers)
constexpr int kLogitRows = 32;      // lm_head rows computed per pass when all positions are wanted
constexpr int kDecodeSplits = 128;  // most key-range splits of decode attention (short contexts use fewer)
constexpr int kFusedDecodeSplits = 64;   // the same for the fused one-token kernel (2 x 64 blocks at 4,096)
constexpr int kPrefillSplitKeys = 2048;  // GEMV-path prefill: keys per split

// ---- weight upload ----

// A device matrix assembled from row ranges of host matrices (views into the mapped checkpoint).
struct DevMatrix {
  DeviceBuffer<uint32_t> q;
  DeviceBuffer<bf16> scales, biases, w;
  DevLinear view;
};

// Host staging through one pinned buffer: rows are gathered (fused, interleaved) on the host and
// copied in large pieces, instead of one small pageable copy per row.
class Uploader {
 public:
  Uploader() { CUDA_CHECK(cudaMallocHost(&buf_, kBytes)); }
  ~Uploader() { cudaFreeHost(buf_); }
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  // dst row i (row_bytes each) comes from src(i).
  template <typename Src>
  void rows(void* dst, size_t row_bytes, size_t n_rows, Src src) {
    TANSY_CHECK(row_bytes <= kBytes, "upload: row of {} bytes exceeds the staging buffer", row_bytes);
    const size_t per = kBytes / row_bytes;
    for (size_t r0 = 0; r0 < n_rows; r0 += per) {
      const size_t m = std::min(per, n_rows - r0);
      for (size_t i = 0; i < m; ++i) std::memcpy(buf_ + i * row_bytes, src(r0 + i), row_bytes);
      CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(dst) + r0 * row_bytes, buf_, m * row_bytes,
                            cudaMemcpyHostToDevice));
    }
  }

 private:
  static constexpr size_t kBytes = size_t(64) << 20;
  uint8_t* buf_ = nullptr;
};

struct RowRef {
  const Linear* L;  // nullptr: a zero row
  int r;
};

// Builds a device matrix whose row i is rows[i] (all parts share format and `in`).
DevMatrix upload_matrix(Uploader& up, const std::vector<RowRef>& rows, const char* what) {
  const Linear* first = nullptr;
  for (const RowRef& rr : rows)
    if (rr.L) {
      first = rr.L;
      break;
    }
  TANSY_CHECK(first, "{}: no rows", what);
  for (const RowRef& rr : rows)
    if (rr.L && (rr.L->fmt != first->fmt || rr.L->in != first->in || rr.L->group != first->group))
      fail("{}: fused parts differ in format ({} vs {}) or input size", what, wformat_name(rr.L->fmt),
           wformat_name(first->fmt));
  DevMatrix m;
  const int in = first->in;
  const size_t n = rows.size();
  m.view.out = int(n);
  m.view.in = in;
  if (first->fmt == WFormat::kAffine4 || first->fmt == WFormat::kAffine8) {
    TANSY_CHECK(first->group == kQuantGroup, "{}: quant group {} unsupported (only {})", what, first->group,
                kQuantGroup);
    m.view.fmt = first->fmt;
    const size_t words = size_t(in) * first->bits() / 32, groups = size_t(in) / kQuantGroup;
    std::vector<uint32_t> zq(words, 0);
    std::vector<uint16_t> zs(groups, 0);
    m.q.resize(n * words);
    m.scales.resize(n * groups);
    m.biases.resize(n * groups);
    up.rows(m.q.get(), words * 4, n, [&](size_t i) -> const void* {
      return rows[i].L ? rows[i].L->q + size_t(rows[i].r) * words : zq.data();
    });
    up.rows(m.scales.get(), groups * 2, n, [&](size_t i) -> const void* {
      return rows[i].L ? rows[i].L->scales + size_t(rows[i].r) * groups : zs.data();
    });
    up.rows(m.biases.get(), groups * 2, n, [&](size_t i) -> const void* {
      return rows[i].L ? rows[i].L->biases + size_t(rows[i].r) * groups : zs.data();
    });
    m.view.q = m.q.get();
    m.view.scales = m.scales.get();
    m.view.biases = m.biases.get();
  } else if (first->fmt == WFormat::kBF16 || first->fmt == WFormat::kF32) {
    // f32 matrices (possible in HF exports) are stored as bf16 like every activation product.
    m.view.fmt = WFormat::kBF16;
    std::vector<uint16_t> tmp(in, 0);
    m.w.resize(n * in);
    up.rows(m.w.get(), size_t(in) * 2, n, [&](size_t i) -> const void* {
      const RowRef& rr = rows[i];
      if (!rr.L) return std::memset(tmp.data(), 0, tmp.size() * 2);
      if (rr.L->fmt == WFormat::kBF16) return rr.L->bf16 + size_t(rr.r) * in;
      for (int c = 0; c < in; ++c) tmp[c] = f32_to_bf16(rr.L->f32[size_t(rr.r) * in + c]);
      return tmp.data();
    });
    m.view.w = m.w.get();
  } else {
    fail("{}: weight format {} unsupported", what, wformat_name(first->fmt));
  }
  m.view.check(what);
  return m;
}

void append_rows(std::vector<RowRef>& rows, const Linear& L) {
  for (int r = 0; r < L.out; ++r) rows.push_back({&L, r});
}
void append_interleaved(std::vector<RowRef>& rows, const Linear& g, const Linear& u) {
  TANSY_CHECK(g.out == u.out, "gate/up row counts differ ({} vs {})", g.out, u.out);
  for (int r = 0; r < g.out; ++r) {
    rows.push_back({&g, r});
    rows.push_back({&u, r});
  }
}

DeviceBuffer<float> upload_f32(const std::vector<float>& v) {
  DeviceBuffer<float> b(v.size());
  b.upload(v.data(), v.size());
  return b;
}

struct DevLayer {
  LayerKind kind = LayerKind::kLinear;
  DeviceBuffer<float> in_norm, post_norm;
  // GDN
  DevMatrix gdn_in, gdn_out;  // [conv_dim + value_dim + 2*n_v_heads, H], [H, value_dim]
  DeviceBuffer<float> conv_w, A_log, dt_bias, gnorm;
  // attention
  DevMatrix attn_in, attn_o;  // [2*q_dim + 2*kv_dim, H], [H, q_dim]
  DeviceBuffer<float> q_norm, k_norm;
  // MoE
  DevMatrix router;                  // [E + 1 (+1 pad), H]
  DevMatrix experts_gu;              // [E' * 2I, H] interleaved gate/up per expert (E' = E+1 when folded)
  DevMatrix experts_down;            // [E' * H, I]
  DevMatrix sh_gu, sh_down;          // [2S, H] interleaved, [H, S] (empty when folded)
  bool sh_folded = false;            // the shared expert is expert E of experts_gu/experts_down
  DevLinear routed_gu, routed_down;  // views: the E routed experts
  DevLinear sh_gu_v, sh_down_v;      // views: the shared expert
};

// ---- sequence state ----

struct CudaState final : SequenceState {
  int n = 0, max_tokens = 0;
  DeviceBuffer<int> pos;  // [1] == n whenever the stream is idle
  struct Layer {
    DeviceBuffer<bf16> K, V;    // [max_tokens, n_kv, 256]
    DeviceBuffer<bf16> window;  // [kernel-1, conv_dim]
    DeviceBuffer<float> S;      // [n_v_heads, 128, 128]
  };
  std::vector<Layer> layers;
  cudaGraphExec_t decode_graph = nullptr;
  int graph_limit = 0;                    // the decode graph's argmax covers ids [0, graph_limit)
  cudaGraphExec_t reset_graph = nullptr;  // zeroes pos and the GDN state: one launch, not 61 memsets
  ~CudaState() override {
    if (decode_graph) cudaGraphExecDestroy(decode_graph);
    if (reset_graph) cudaGraphExecDestroy(reset_graph);
  }
  int n_tokens() const override { return n; }
};

class CudaModel final : public Model, public StageProfiler {
 public:
  explicit CudaModel(const std::filesystem::path& dir) : cfg_(load_config(dir)) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) fail("cuda backend: no CUDA device");
    // A blocking stream: ordered after the default-stream memsets/copies of new_state and uploads.
    CUDA_CHECK(cudaStreamCreate(&stream_));
    const char* mode = std::getenv("TANSY_CUDA_PREFILL");
    if (mode && std::string(mode) == "gemv")
      tc_prefill_ = false;
    else if (mode && std::string(mode) != "tc")
      fail("TANSY_CUDA_PREFILL must be 'tc' or 'gemv', not '{}'", mode);
    // TANSY_ATTN_FUSED=0: decode attention as qk_norm_rope + split + merge (to compare).
    attn_fused_ = env_flag("TANSY_ATTN_FUSED", true);
    // TANSY_HEAD_FUSED=0: decode's final norm, lm_head, argmax and position as separate kernels
    // (to compare). The fused head reads 4-bit lm_heads only; other formats use the separate ones.
    head_fused_ = env_flag("TANSY_HEAD_FUSED", true);
    validate_config();
    greedy_limit_ = cfg_.vocab_size;
    {
      TensorStore store = TensorStore::open(dir);
      ModelWeights w = load_weights(cfg_, store);
      upload(w);
    }
    if (!lm_head_argmax_supports(lm_head_.view)) head_fused_ = false;
    allocate_scratch();
    warm_up();
  }
  ~CudaModel() override {
    if (stream_) cudaStreamDestroy(stream_);
    if (h_tok_) cudaFreeHost(h_tok_);
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend_name() const override { return "cuda"; }
  std::string backend_plan() const override { return "cuda-bf16"; }

  std::unique_ptr<SequenceState> new_state(int max_tokens) override { return make_state(max_tokens, true); }

  // The decode graph is captured with the state (it bakes in the state's buffers), so that the
  // first generated token does not pay for capture and instantiation.
  std::unique_ptr<CudaState> make_state(int max_tokens, bool with_graph) {
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

  bool reset_state(SequenceState& state) override {
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

  std::unique_ptr<SequenceState> clone_state(const SequenceState& src) override {
    const auto& a = dynamic_cast<const CudaState&>(src);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    auto s = make_state(a.max_tokens, true);
    s->n = a.n;
    CUDA_CHECK(cudaMemcpyAsync(s->pos.get(), a.pos.get(), sizeof(int), cudaMemcpyDeviceToDevice, stream_));
    for (size_t i = 0; i < a.layers.size(); ++i) {
      const auto& A = a.layers[i];
      auto& B = s->layers[i];
      const size_t kv = size_t(a.n) * cfg_.kv_dim() * sizeof(bf16);
      if (A.K.size() && kv) {
        CUDA_CHECK(cudaMemcpyAsync(B.K.get(), A.K.get(), kv, cudaMemcpyDeviceToDevice, stream_));
        CUDA_CHECK(cudaMemcpyAsync(B.V.get(), A.V.get(), kv, cudaMemcpyDeviceToDevice, stream_));
      }
      if (A.S.size()) {
        CUDA_CHECK(cudaMemcpyAsync(B.window.get(), A.window.get(), A.window.bytes(), cudaMemcpyDeviceToDevice,
                                   stream_));
        CUDA_CHECK(cudaMemcpyAsync(B.S.get(), A.S.get(), A.S.bytes(), cudaMemcpyDeviceToDevice, stream_));
      }
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return s;
  }

  void forward(SequenceState& state, std::span<const int32_t> ids, std::span<float> logits,
               bool all_positions) override {
    auto& st = dynamic_cast<CudaState&>(state);
    const int n = int(ids.size());
    check_ids(st, ids);
    const size_t V = size_t(cfg_.vocab_size), need = all_positions ? V * n : V;
    if (logits.size() < need) fail("forward: logits buffer holds {} floats, needs {}", logits.size(), need);
    if (n == 1 && !trace_ && !route_trace_ &&
        st.decode_graph) {  // one token: the decode graph (its argmax is unused here)
      *h_tok_ = ids[0];
      CUDA_CHECK(cudaMemcpyAsync(d_tok_.get(), h_tok_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaGraphLaunch(st.decode_graph, stream_));
      st.n += 1;
      CUDA_CHECK(cudaMemcpyAsync(logits.data(), d_logits_.get(), sizeof(float) * V, cudaMemcpyDeviceToHost,
                                 stream_));
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

  // ---- StageProfiler (`tansy bench --stages`): the same kernels launched eagerly, an event
  // between stages. Events break the launch overlap PDL gives the graph, so stage times sum to
  // more than a graph step.
  std::vector<StageTime> profile_decode_step(SequenceState& state, int32_t token) override {
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

  std::vector<StageTime> profile_prefill(SequenceState& state, std::span<const int32_t> ids) override {
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

  // One token: the decode graph with the token id moved in and out; a piece of prompt: the
  // chunked forward and the argmax of its last row. The logits stay on the device either way.
  int32_t greedy_step(SequenceState& state, std::span<const int32_t> ids, int limit) override {
    if (trace_ || route_trace_) return Model::greedy_step(state, ids, limit);
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

  void generate_greedy(SequenceState& state, std::span<const int32_t> prompt, int n,
                       const std::function<bool(int32_t)>& on_token) override {
    if (trace_ || route_trace_)
      return Model::generate_greedy(state, prompt, n, on_token);  // traced runs go eagerly
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

 private:
  void validate_config() {
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

  void check_ids(const CudaState& st, std::span<const int32_t> ids) {
    if (ids.empty()) fail("forward: no tokens");
    if (st.n + int64_t(ids.size()) > st.max_tokens)
      fail("forward: {} + {} tokens exceed the state's capacity {}", st.n, ids.size(), st.max_tokens);
    for (int32_t id : ids)
      if (id < 0 || id >= cfg_.vocab_size)
        fail("token id {} is outside the vocabulary (0..{})", id, cfg_.vocab_size - 1);
  }

  void upload(const ModelWeights& w) {
    Uploader up;
    const ModelConfig& c = cfg_;
    std::vector<RowRef> rows;
    auto matrix = [&](auto&& fill, const char* what) {
      rows.clear();
      fill();
      return upload_matrix(up, rows, what);
    };
    embed_ = matrix([&] { append_rows(rows, w.embed); }, "embed_tokens");
    lm_head_ = matrix([&] { append_rows(rows, w.lm_head); }, "lm_head");
    final_norm_ = upload_f32(w.final_norm);
    layers_.resize(c.num_layers);
    for (int i = 0; i < c.num_layers; ++i) {
      const LayerWeights& lw = w.layers[i];
      DevLayer& L = layers_[i];
      L.kind = lw.kind;
      L.in_norm = upload_f32(lw.in_norm);
      L.post_norm = upload_f32(lw.post_norm);
      if (lw.kind == LayerKind::kLinear) {
        const GdnWeights& g = lw.gdn;
        L.gdn_in = matrix(
            [&] {
              append_rows(rows, g.in_qkv);
              append_rows(rows, g.in_z);
              append_rows(rows, g.in_a);
              append_rows(rows, g.in_b);
            },
            "linear_attn in_proj");
        L.gdn_out = matrix([&] { append_rows(rows, g.out); }, "linear_attn out_proj");
        L.conv_w = upload_f32(g.conv);
        L.A_log = upload_f32(g.A_log);
        L.dt_bias = upload_f32(g.dt_bias);
        L.gnorm = upload_f32(g.norm);
      } else {
        const AttnWeights& a = lw.attn;
        L.attn_in = matrix(
            [&] {
              append_rows(rows, a.q);
              append_rows(rows, a.k);
              append_rows(rows, a.v);
            },
            "self_attn q|k|v");
        L.attn_o = matrix([&] { append_rows(rows, a.o); }, "self_attn o_proj");
        L.q_norm = upload_f32(a.q_norm);
        L.k_norm = upload_f32(a.k_norm);
      }
      const MoeWeights& m = lw.moe;
      L.router = matrix(
          [&] {
            append_rows(rows, m.router);
            append_rows(rows, m.sh_router);
            if (rows.size() % 2) rows.push_back({nullptr, 0});  // even row count: paired GEMM stores
          },
          "mlp.gate|shared_expert_gate");
      const Linear& g0 = m.gate[0];
      L.sh_folded = m.sh_gate.out == g0.out && m.sh_gate.fmt == g0.fmt && m.sh_gate.in == g0.in &&
                    m.sh_gate.group == g0.group && m.sh_down.fmt == m.down[0].fmt &&
                    m.sh_down.in == m.down[0].in && m.sh_down.group == m.down[0].group &&
                    m.sh_up.fmt == g0.fmt && m.sh_up.group == g0.group;
      L.experts_gu = matrix(
          [&] {
            for (int e = 0; e < c.num_experts; ++e) append_interleaved(rows, m.gate[e], m.up[e]);
            if (L.sh_folded) append_interleaved(rows, m.sh_gate, m.sh_up);
          },
          "experts gate|up");
      L.experts_down = matrix(
          [&] {
            for (int e = 0; e < c.num_experts; ++e) append_rows(rows, m.down[e]);
            if (L.sh_folded) append_rows(rows, m.sh_down);
          },
          "experts down");
      const int I = c.moe_intermediate;
      L.routed_gu = L.experts_gu.view.rows(0, c.num_experts * 2 * I);
      L.routed_down = L.experts_down.view.rows(0, c.num_experts * c.hidden_size);
      if (L.sh_folded) {
        L.sh_gu_v = L.experts_gu.view.rows(c.num_experts * 2 * I, 2 * I);
        L.sh_down_v = L.experts_down.view.rows(c.num_experts * c.hidden_size, c.hidden_size);
      } else {
        L.sh_gu = matrix([&] { append_interleaved(rows, m.sh_gate, m.sh_up); }, "shared_expert gate|up");
        L.sh_down = matrix([&] { append_rows(rows, m.sh_down); }, "shared_expert down");
        L.sh_gu_v = L.sh_gu.view;
        L.sh_down_v = L.sh_down.view;
      }
    }
  }

  void allocate_scratch() {
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
    ss_parts_.resize(size_t(2 * c.num_layers + 1) * kNormParts);
    CUDA_CHECK(cudaMemset(ss_parts_.get(), 0, ss_parts_.bytes()));
    TANSY_CHECK(H <= kFusedNormMaxDim, "cuda backend: hidden size {} exceeds the fused decode norm's {}", H,
                kFusedNormMaxDim);
    conv_f32_.resize(c.lin_conv_dim());
    gdn_counters_.resize(std::max(1, c.lin_num_v_heads));
    route_counter_.resize(1);
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
    d_logits_.resize(size_t(kLogitRows) * c.vocab_size);
    d_argmax_.resize(kArgmaxBlocks);
    if (head_fused_) {
      d_head_scratch_.resize(lm_head_scratch());
      head_counter_.resize(1);
      CUDA_CHECK(cudaMemset(head_counter_.get(), 0, head_counter_.bytes()));
    }
    if (tc_prefill_) {
      expert_offsets_.resize(E + 1);
      tile_offsets_.resize(E + 1);
      sorted_slot_.resize(C * K);
      slot_row_.resize(C * K);
      yd_.resize(C * K * H);
    }
    CUDA_CHECK(cudaMallocHost(&h_tok_, sizeof(int32_t)));
  }

  // One eager decode step on a throwaway state: loads every decode kernel and sets its
  // attributes outside of any graph capture (lazy module loading must not happen mid-capture).
  void warm_up() {
    auto st = make_state(1, false);
    CUDA_CHECK(cudaMemsetAsync(d_tok_.get(), 0, sizeof(int), stream_));
    decode_step(*st, cfg_.vocab_size);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  int32_t fetch_token() {
    CUDA_CHECK(cudaMemcpyAsync(h_tok_, d_tok_.get(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return *h_tok_;
  }

  // Captures what `body` enqueues on the stream into `exec` (replacing a graph already there).
  template <typename Body>
  void capture(cudaGraphExec_t& exec, Body&& body) {
    cudaGraph_t g = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    try {
      body();
    } catch (...) {
      cudaStreamEndCapture(stream_, &g);
      if (g) cudaGraphDestroy(g);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
    if (exec) {
      CUDA_CHECK(cudaGraphExecDestroy(exec));
      exec = nullptr;
    }
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    CUDA_CHECK(e);
  }

  void capture_decode_graph(CudaState& st) {
    // Tracing synchronises the stream, which a capture forbids; graphs are never traced.
    TraceFn saved = std::exchange(trace_, nullptr);
    RouteTraceFn saved_routes = std::exchange(route_trace_, nullptr);
    try {
      capture(st.decode_graph, [&] { decode_step(st, greedy_limit_); });
    } catch (...) {
      trace_ = std::move(saved);
      route_trace_ = std::move(saved_routes);
      throw;
    }
    trace_ = std::move(saved);
    route_trace_ = std::move(saved_routes);
    st.graph_limit = greedy_limit_;
  }

  // Feeds the m ids in d_ids_ (host state advanced here).
  void run_chunk(CudaState& st, int m) {
    run_layers(st, d_ids_.get(), m, tc_prefill_ && m > 1);
    st.n += m;
  }

  // Feeds `ids` in chunks, then lm_head and the argmax over [0, limit) of the last row only,
  // the id moved to the host (d_tok_ holds it for a decode step that feeds it).
  int32_t prefill_argmax(CudaState& st, std::span<const int32_t> ids, int limit) {
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

  // One decode step on the token id in d_tok_ (the decode graph's body): the layers, the final
  // norm, lm_head, the argmax over [0, limit) into d_tok_ and the position advance. The host's
  // st.n is the caller's to advance.
  void decode_step(CudaState& st, int limit) {
    if (!head_fused_ || trace_) {
      run_layers(st, d_tok_.get(), 1, /*tc=*/false);
      mark("lm_head", wbytes(lm_head_.view), 0, 1);
      lm_head(0, 1);
      mark("argmax", 4.0 * cfg_.vocab_size, 0, 2);
      argmax(d_logits_.get(), limit, d_argmax_.get(), d_tok_.get(), nullptr, nullptr, stream_);
      return;
    }
    run_decode_fused(st, d_tok_.get(), /*head=*/false);
    LmHeadArgs a;
    a.W = lm_head_.view;
    a.x.h = h_.get();
    a.x.ss = ss_parts_.get() + size_t(2 * cfg_.num_layers) * kNormParts;
    a.x.w = final_norm_.get();
    a.x.eps = cfg_.rms_eps;
    a.x.xn_out = xn_.get();
    a.logits = d_logits_.get();
    a.limit = limit;
    a.token = d_tok_.get();
    a.pos = st.pos.get();
    a.scratch = d_head_scratch_.get();
    a.counter = head_counter_.get();
    mark("final norm + lm_head + argmax + position", wbytes(lm_head_.view), 0, 1);
    lm_head_argmax(a, stream_);
  }

  void lm_head(int row0, int rows) {
    matvec(lm_head_.view, xn_.get() + size_t(row0) * cfg_.hidden_size, cfg_.hidden_size, rows,
           MatvecOut{d_logits_.get(), true, cfg_.vocab_size}, stream_);
  }

  void trace_row(const std::string& name, const bf16* rows, int n, int dim) {
    if (!trace_) return;
    std::vector<uint16_t> raw(dim);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaMemcpy(raw.data(), rows + size_t(n - 1) * dim, size_t(dim) * 2, cudaMemcpyDeviceToHost));
    std::vector<float> f(dim);
    for (int i = 0; i < dim; ++i) f[i] = bf16_to_f32(raw[i]);
    trace_(name, f);
  }
  struct Mark {
    std::string name;  // "" ends the last stage
    cudaEvent_t ev = nullptr;
    double bytes = 0, flops = 0;
    int launches = 0;
  };
  // Starts stage `name` (ending the previous one) when profiling; otherwise nothing.
  void mark(std::string name, double bytes = 0, double flops = 0, int launches = 1) {
    if (!marks_) return;
    Mark mk{std::move(name), nullptr, bytes, flops, launches};
    CUDA_CHECK(cudaEventCreate(&mk.ev));
    CUDA_CHECK(cudaEventRecord(mk.ev, stream_));
    marks_->push_back(std::move(mk));
  }
  std::vector<StageTime> collect(std::vector<Mark>& marks) {
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
  // Bytes a product must read: codes (or bf16 values) plus scales and biases.
  static double wbytes(const DevLinear& W) {
    const double codes = double(W.out) * W.in * W.bits() / 8;
    return W.fmt == WFormat::kBF16 ? codes : codes + double(W.out) * (W.in / kQuantGroup) * 4;
  }
  static double wflops(const DevLinear& W, int m) { return 2.0 * W.out * W.in * m; }

  // set_route_trace: the routed experts of the m tokens just routed (stride ids per token).
  void report_routes(int layer, int m, int stride) {
    if (!route_trace_) return;
    const int K = cfg_.experts_per_tok;
    std::vector<int32_t> all(size_t(m) * stride), idx(size_t(m) * K);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaMemcpy(all.data(), topk_idx_.get(), all.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    for (int t = 0; t < m; ++t)
      for (int j = 0; j < K; ++j) idx[size_t(t) * K + j] = all[size_t(t) * stride + j];
    route_trace_(layer, idx);
  }

  void trace_row(const std::string& name, const float* rows, int n, int dim) {
    if (!trace_) return;
    std::vector<float> f(dim);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaMemcpy(f.data(), rows + size_t(n - 1) * dim, size_t(dim) * 4, cudaMemcpyDeviceToHost));
    trace_(name, f);
  }

  // The whole stack for m tokens whose ids are at `ids` (device); leaves final-normed rows in xn_
  // and advances the device position. Graph-capturable when tc is false.
  void run_layers(CudaState& st, const int* ids, int m, bool tc) {
    if (m == 1 && !tc && !trace_) return run_decode_fused(st, ids);
    const ModelConfig& c = cfg_;
    const int H = c.hidden_size;
    const double norm_bytes = double(m) * H * (4 + 4 + 2 + 2);  // h read+written, r read, xn written
    mark("embed", double(m) * H * 4);
    embed(embed_.view, ids, m, h_.get(), stream_);
    mark("residual add + rmsnorm", norm_bytes);
    add_rmsnorm(h_.get(), nullptr, layers_[0].in_norm.get(), m, H, c.rms_eps, xn_.get(), stream_);
    for (int i = 0; i < c.num_layers; ++i) {
      DevLayer& L = layers_[i];
      if (L.kind == LayerKind::kLinear)
        gdn(L, st.layers[i], m, tc);
      else
        attention(L, st, st.layers[i], m, tc);
      trace_row("layer." + std::to_string(i) + ".mixer_out", r_.get(), m, H);
      mark("residual add + rmsnorm", norm_bytes);
      add_rmsnorm(h_.get(), r_.get(), L.post_norm.get(), m, H, c.rms_eps, xn_.get(), stream_);
      moe(i, L, m, tc);
      trace_row("layer." + std::to_string(i) + ".moe_out", r_.get(), m, H);
      const float* next = i + 1 < c.num_layers ? layers_[i + 1].in_norm.get() : final_norm_.get();
      mark("residual add + rmsnorm", norm_bytes);
      add_rmsnorm(h_.get(), r_.get(), next, m, H, c.rms_eps, xn_.get(), stream_);
      trace_row("layer." + std::to_string(i) + ".hidden", h_.get(), m, H);
    }
    trace_row("final_norm", xn_.get(), m, H);
    mark("position");
    advance_pos(st.pos.get(), m, stream_);
  }

  // One token, each norm / routing / GDN step fused into its neighbour (see the file comment).
  // The products that end a block add into the f32 residual row h_ in place and leave the partial
  // sums of its squares (ss_parts_, one row of kNormParts per norm point) for the next norm.
  // head == false leaves the final norm and the position to the fused head (decode_step).
  void run_decode_fused(CudaState& st, const int* ids, bool head = true) {
    const ModelConfig& c = cfg_;
    const int H = c.hidden_size, E = c.num_experts, K = c.experts_per_tok;
    const int I = c.moe_intermediate;
    float* h = h_.get();
    auto ss = [&](int point) { return ss_parts_.get() + size_t(point) * kNormParts; };
    mark("embed", double(H) * 4);
    embed(embed_.view, ids, 1, h, stream_, ss(0));
    auto norm_in = [&](int point, const float* w, bf16* xn_out) {
      NormIn in;
      in.h = h;
      in.ss = ss(point);
      in.w = w;
      in.eps = c.rms_eps;
      in.xn_out = xn_out;
      return in;
    };
    for (int i = 0; i < c.num_layers; ++i) {
      DevLayer& L = layers_[i];
      CudaState::Layer& S = st.layers[i];
      bf16* P = proj_.get();
      const NormIn in = norm_in(2 * i, L.in_norm.get(), nullptr);
      const ResidualOut mixer_out{h, ss(2 * i + 1)};
      if (L.kind == LayerKind::kLinear) {
        const int C = c.lin_conv_dim(), VD = c.lin_value_dim();
        GdnInEpilogue ge;
        ge.conv_dim = C;
        ge.value_dim = VD;
        ge.n_v_heads = c.lin_num_v_heads;
        ge.kernel = c.conv_kernel;
        ge.conv_w = L.conv_w.get();
        ge.window = S.window.get();
        ge.A_log = L.A_log.get();
        ge.dt_bias = L.dt_bias.get();
        ge.conv_out = conv_f32_.get();
        ge.beta = beta_.get();
        ge.g = g_.get();
        mark("gdn.in_proj+norm+conv+gates", wbytes(L.gdn_in.view));
        matvec_norm_gdn(L.gdn_in.view, in, P, ge, stream_);  // [qkv | z | a | b]
        GdnDecodeArgs ga;
        ga.conv = conv_f32_.get();
        ga.beta = beta_.get();
        ga.g = g_.get();
        ga.n_k_heads = c.lin_num_k_heads;
        ga.n_v_heads = c.lin_num_v_heads;
        ga.state = S.S.get();
        ga.z = P + C;
        ga.norm_w = L.gnorm.get();
        ga.eps = c.rms_eps;
        ga.o = o_.get();
        ga.counters = gdn_counters_.get();
        ga.y = mix_.get();
        mark("gdn.recurrence+norms", 2.0 * c.lin_num_v_heads * kGdnDim * kGdnDim * 4);
        gdn_decode_step(ga, stream_);
        mark("gdn.out_proj+residual", wbytes(L.gdn_out.view));
        matvec_residual(L.gdn_out.view, mix_.get(), mixer_out, stream_);
      } else {
        const int QD = c.q_dim();
        mark("attn.in_proj+norm", wbytes(L.attn_in.view));
        matvec_norm(L.attn_in.view, in, MatvecOut{P, false, proj_ld_}, stream_);  // [q+gate | k | v]
        QkvLayout lay{P, proj_ld_, c.num_heads, c.num_kv_heads};
        if (!attn_fused_) {
          mark("attn.qk_norm_rope");
          qk_norm_rope(lay, 1, st.pos.get(), L.q_norm.get(), L.k_norm.get(), c.rms_eps, c.rotary_dim,
                       c.rope_theta, S.K.get(), S.V.get(), stream_);
          mark("attn.decode (split+combine)", 2.0 * (st.n + 1) * c.kv_dim() * 2, 0, 2);
          attention_decode(lay, 1, st.pos.get(), S.K.get(), S.V.get(), kDecodeSplits, attn_scratch_.get(),
                           mix_.get(), QD, stream_);
        } else {
          mark("attn.q/k norm+rope+cache+split, merge", 2.0 * (st.n + 1) * c.kv_dim() * 2, 0, 2);
          attention_decode_fused(lay, st.pos.get(), L.q_norm.get(), L.k_norm.get(), c.rms_eps, c.rotary_dim,
                                 c.rope_theta, S.K.get(), S.V.get(), kFusedDecodeSplits, attn_scratch_.get(),
                                 mix_.get(), QD, stream_);
        }
        mark("attn.o_proj+residual", wbytes(L.attn_o.view));
        matvec_residual(L.attn_o.view, mix_.get(), mixer_out, stream_);
      }
      // MoE: router (+ norm, + routing) -> experts gate|up -> down + combine + residual.
      const NormIn pin = norm_in(2 * i + 1, L.post_norm.get(), xn_.get());
      const ResidualOut moe_out{h, ss(2 * i + 2)};
      RouteEpilogue re;
      re.E = E;
      re.k = K;
      re.shared_slot = L.sh_folded;
      re.idx = topk_idx_.get();
      re.w = topk_w_.get();
      re.counter = route_counter_.get();
      mark("moe.router+norm+topk", wbytes(L.router.view));
      matvec_norm_route(L.router.view, pin, router_logits_.get(), re, stream_);
      report_routes(i, 1, L.sh_folded ? K + 1 : K);
      const double gu1 = wbytes(L.experts_gu.view.rows(0, 2 * I)),
                   dn1 = wbytes(L.experts_down.view.rows(0, H));
      if (L.sh_folded) {
        mark("moe.experts gate|up (k+shared)", (K + 1) * gu1);
        matvec_swiglu_experts(L.experts_gu.view, E + 1, topk_idx_.get(), 1, K + 1, xn_.get(), H, act_.get(),
                              stream_);
        mark("moe.experts down+combine+residual", (K + 1) * dn1);
        moe_down_residual(L.experts_down.view, E + 1, topk_idx_.get(), topk_w_.get(), act_.get(), K + 1,
                          nullptr, nullptr, moe_out, stream_);
      } else {
        const int SI = c.shared_intermediate;
        mark("moe.shared expert", wbytes(L.sh_gu_v) + wbytes(L.sh_down_v), 0, 2);
        matvec_swiglu(L.sh_gu_v, xn_.get(), H, 1, sh_act_.get(), SI, stream_);
        matvec(L.sh_down_v, sh_act_.get(), SI, 1, MatvecOut{r_.get(), false, H}, stream_);
        mark("moe.experts gate|up (k+shared)", K * gu1);
        matvec_swiglu_experts(L.routed_gu, E, topk_idx_.get(), 1, K, xn_.get(), H, act_.get(), stream_);
        mark("moe.experts down+combine+residual", K * dn1);
        moe_down_residual(L.routed_down, E, topk_idx_.get(), topk_w_.get(), act_.get(), K, r_.get(),
                          router_logits_.get() + E, moe_out, stream_);
      }
    }
    if (!head) return;
    mark("final_norm + position", 0, 0, 2);
    add_rmsnorm(h, nullptr, final_norm_.get(), 1, H, c.rms_eps, xn_.get(), stream_);
    advance_pos(st.pos.get(), 1, stream_);
  }

  // Projection: GEMV for decode, tensor-core GEMM for prefill.
  void project(const DevLinear& W, const bf16* X, int64_t ldx, int m, void* Y, bool f32, int64_t ldy,
               bool tc) {
    if (tc) {
      GemmOutput out;
      out.ptr = Y;
      out.type = f32 ? GemmOutType::kF32 : GemmOutType::kBF16;
      out.ld = ldy;
      gemm(W, X, ldx, m, out, stream_);
    } else {
      matvec(W, X, ldx, m, MatvecOut{Y, f32, ldy}, stream_);
    }
  }

  void gdn(DevLayer& L, CudaState::Layer& S, int m, bool tc) {
    const ModelConfig& c = cfg_;
    const int H = c.hidden_size, C = c.lin_conv_dim(), KD = c.lin_key_dim(), VD = c.lin_value_dim();
    const int NK = c.lin_num_k_heads, NV = c.lin_num_v_heads;
    bf16* P = proj_.get();
    mark("gdn.in_proj", wbytes(L.gdn_in.view), wflops(L.gdn_in.view, m));
    project(L.gdn_in.view, xn_.get(), H, m, P, false, proj_ld_, tc);  // [qkv | z | a | b]
    GdnConvArgs ca;
    ca.x = P;
    ca.ldx = proj_ld_;
    ca.a = P + C + VD;
    ca.b = P + C + VD + NV;
    ca.ld_ab = proj_ld_;
    ca.n = m;
    ca.n_k_heads = NK;
    ca.n_v_heads = NV;
    ca.kernel = c.conv_kernel;
    ca.conv_w = L.conv_w.get();
    ca.window = S.window.get();
    ca.A_log = L.A_log.get();
    ca.dt_bias = L.dt_bias.get();
    ca.y = conv_y_.get();
    ca.beta = beta_.get();
    ca.g = g_.get();
    mark("gdn.conv+gates", 0, 0, m > kConvTokensPerBlock ? 2 : 1);
    gdn_conv(ca, stream_);
    GdnPrefillArgs ra;
    ra.q = conv_y_.get();
    ra.k = conv_y_.get() + KD;
    ra.v = conv_y_.get() + 2 * KD;
    ra.q_stride = ra.k_stride = ra.v_stride = C;
    ra.beta = beta_.get();
    ra.g = g_.get();
    ra.n = m;
    ra.n_k_heads = NK;
    ra.n_v_heads = NV;
    ra.state = S.S.get();
    ra.o_f32 = o_.get();
    ra.o_stride = VD;
    // chunked delta rule: per chunk of 64 and value head ~ (2 + 4 + 2) * 64 * 128 * 128 multiply-adds
    mark(tc ? "gdn.chunked delta rule" : "gdn.recurrence", 2.0 * NV * kGdnDim * kGdnDim * 4,
         tc ? 2.0 * 8 * double(m) * NV * kGdnDim * kGdnDim : 0);
    if (tc)
      gdn_prefill(ra, stream_);
    else
      gdn_recurrent(ra, stream_);
    mark("gdn.gated_norm");
    gated_rmsnorm(o_.get(), VD, P + C, proj_ld_, L.gnorm.get(), m, NV, kGdnDim, c.rms_eps, mix_.get(), VD,
                  stream_);
    mark("gdn.out_proj", wbytes(L.gdn_out.view), wflops(L.gdn_out.view, m));
    project(L.gdn_out.view, mix_.get(), VD, m, r_.get(), false, H, tc);
  }

  void attention(DevLayer& L, CudaState& st, CudaState::Layer& S, int m, bool tc) {
    const ModelConfig& c = cfg_;
    const int H = c.hidden_size, QD = c.q_dim();
    bf16* P = proj_.get();
    mark("attn.in_proj", wbytes(L.attn_in.view), wflops(L.attn_in.view, m));
    project(L.attn_in.view, xn_.get(), H, m, P, false, proj_ld_, tc);  // [q+gate per head | k | v]
    QkvLayout lay{P, proj_ld_, c.num_heads, c.num_kv_heads};
    mark("attn.qk_norm_rope");
    qk_norm_rope(lay, m, st.pos.get(), L.q_norm.get(), L.k_norm.get(), c.rms_eps, c.rotary_dim, c.rope_theta,
                 S.K.get(), S.V.get(), stream_);
    // causal: query t sees p0 + t + 1 keys; QK^T and PV are 2 * 2 * 256 flops per (head, key)
    const double pairs = double(m) * st.n + double(m) * (m + 1) / 2;
    mark(tc ? "attn.flash prefill" : "attn.decode (split+combine)", 2.0 * (st.n + m) * c.kv_dim() * 2,
         4.0 * c.num_heads * kHeadDim * pairs, tc ? 1 : 2);
    if (tc) {
      AttnPrefillArgs a;
      a.q = P;
      a.q_stride_t = proj_ld_;
      a.q_stride_h = 2 * kHeadDim;
      a.k_cache = S.K.get();
      a.v_cache = S.V.get();
      a.p0 = st.n;  // host copy of the position: prefill runs eagerly, never inside a graph
      a.n = m;
      a.n_heads = c.num_heads;
      a.n_kv = c.num_kv_heads;
      a.gate = P + kHeadDim;
      a.gate_stride_t = proj_ld_;
      a.gate_stride_h = 2 * kHeadDim;
      a.out = mix_.get();
      a.out_stride_t = QD;
      a.out_stride_h = kHeadDim;
      attention_prefill(a, stream_);
    } else {
      // Decode: a fixed split count (the graph is captured once; blocks past the context exit
      // at once). GEMV prefill: enough splits to bound each block's key run.
      int splits = kDecodeSplits;
      if (m > 1) splits = std::min(kMaxAttnSplits, (st.n + m + kPrefillSplitKeys - 1) / kPrefillSplitKeys);
      if (m > 1 && size_t(m) * splits > size_t(kChunk)) splits = std::max(1, kChunk / m);
      attention_decode(lay, m, st.pos.get(), S.K.get(), S.V.get(), splits, attn_scratch_.get(), mix_.get(),
                       QD, stream_);
    }
    mark("attn.o_proj", wbytes(L.attn_o.view), wflops(L.attn_o.view, m));
    project(L.attn_o.view, mix_.get(), QD, m, r_.get(), false, H, tc);
  }

  void moe(int layer, DevLayer& L, int m, bool tc) {
    const ModelConfig& c = cfg_;
    const int H = c.hidden_size, E = c.num_experts, K = c.experts_per_tok;
    const int I = c.moe_intermediate, SI = c.shared_intermediate;
    // router logits [m, E] and the shared-expert gate logit in column E
    mark("moe.router", wbytes(L.router.view), wflops(L.router.view, m));
    project(L.router.view, xn_.get(), H, m, router_logits_.get(), true, router_ld_, tc);
    mark("moe.route_topk");
    route_topk(router_logits_.get(), router_ld_, m, E, K, topk_idx_.get(), topk_w_.get(), stream_);
    report_routes(layer, m, K);
    // every expert's weights are read once per chunk (random routing touches all of them)
    const double gu_bytes = wbytes(L.routed_gu), dn_bytes = wbytes(L.routed_down);
    const double gu_flops = 2.0 * m * K * 2 * I * H, dn_flops = 2.0 * m * K * H * I;
    if (!tc) {
      mark("moe.shared expert", wbytes(L.sh_gu_v) + wbytes(L.sh_down_v),
           wflops(L.sh_gu_v, m) + wflops(L.sh_down_v, m), 2);
      matvec_swiglu(L.sh_gu_v, xn_.get(), H, m, sh_act_.get(), SI, stream_);
      matvec(L.sh_down_v, sh_act_.get(), SI, m, MatvecOut{r_.get(), false, H}, stream_);
      mark("moe.experts gate|up", gu_bytes, gu_flops);
      matvec_swiglu_experts(L.routed_gu, E, topk_idx_.get(), m, K, xn_.get(), H, act_.get(), stream_);
      mark("moe.experts down+combine", dn_bytes, dn_flops);
      moe_down_combine(L.routed_down, E, topk_idx_.get(), topk_w_.get(), act_.get(), m, K, r_.get(),
                       router_logits_.get() + E, router_ld_, r_.get(), stream_);
      return;
    }
    MoeRouting rt;
    rt.expert_offsets = expert_offsets_.get();
    rt.tile_offsets = tile_offsets_.get();
    rt.sorted_slot = sorted_slot_.get();
    rt.slot_row = slot_row_.get();
    mark("moe.route_sort");
    moe_route_sort(topk_idx_.get(), m, K, E, rt, stream_);
    GemmOutput gu{act_.get(), GemmOutType::kBF16, I, GemmEpilogue::kSwiGlu};
    mark("moe.experts gate|up", gu_bytes, gu_flops);
    gemm_grouped(L.routed_gu, E, xn_.get(), H, true, m, K, rt, gu, stream_);
    GemmOutput dn{yd_.get(), GemmOutType::kBF16, H, GemmEpilogue::kStore};
    mark("moe.experts down", dn_bytes, dn_flops);
    gemm_grouped(L.routed_down, E, act_.get(), I, false, m, K, rt, dn, stream_);
    mark("moe.shared expert", wbytes(L.sh_gu_v) + wbytes(L.sh_down_v),
         wflops(L.sh_gu_v, m) + wflops(L.sh_down_v, m), 2);
    gemm(L.sh_gu_v, xn_.get(), H, m, GemmOutput{sh_act_.get(), GemmOutType::kBF16, SI, GemmEpilogue::kSwiGlu},
         stream_);
    gemm(L.sh_down_v, sh_act_.get(), SI, m,
         GemmOutput{sh_out_.get(), GemmOutType::kBF16, H, GemmEpilogue::kStore}, stream_);
    mark("moe.combine");
    moe_combine(yd_.get(), slot_row_.get(), topk_w_.get(), m, K, H, nullptr, sh_out_.get(),
                router_logits_.get() + E, router_ld_, r_.get(), stream_);
  }

  ModelConfig cfg_;
  cudaStream_t stream_ = nullptr;
  bool tc_prefill_ = true;
  bool attn_fused_ = true;
  bool head_fused_ = true;
  DevMatrix embed_, lm_head_;
  DeviceBuffer<float> final_norm_;
  std::vector<DevLayer> layers_;

  // Scratch, sized for kChunk tokens (m = tokens in flight).
  int64_t proj_ld_ = 0, router_ld_ = 0;
  DeviceBuffer<int> d_ids_;       // [kChunk] input ids
  DeviceBuffer<int> d_tok_;       // [1] the decode step's input id, overwritten by its argmax
  DeviceBuffer<float> h_;         // [m, H] residual stream (f32)
  DeviceBuffer<float> ss_parts_;  // decode: [2 * layers + 1, kNormParts] partial sums of h² per norm point
  DeviceBuffer<bf16> xn_, r_;     // [m, H] normed input, mixer/MoE output
  DeviceBuffer<float> conv_f32_;  // decode: [conv_dim] GDN conv output
  DeviceBuffer<unsigned> gdn_counters_, route_counter_;  // last-block counters of fused decode kernels
  DeviceBuffer<bf16> proj_;                              // [m, proj_ld] fused input projections
  DeviceBuffer<bf16> conv_y_;                            // [m, conv_dim] conv output, q/k normalised
  DeviceBuffer<float> beta_, g_;                         // [m, n_v_heads]
  DeviceBuffer<float> o_;                                // [m, value_dim] GDN output before the gated norm
  DeviceBuffer<bf16> mix_;             // [m, max(value_dim, q_dim)] input of out_proj / o_proj
  DeviceBuffer<float> router_logits_;  // [m, router_ld]
  DeviceBuffer<int> topk_idx_;         // [m, k]
  DeviceBuffer<float> topk_w_;         // [m, k]
  DeviceBuffer<bf16> act_;             // [m*k, I] routed experts' SwiGLU activations
  DeviceBuffer<bf16> sh_act_;          // [m, S]
  DeviceBuffer<bf16> sh_out_;          // [m, H] shared expert output (prefill)
  DeviceBuffer<float> attn_scratch_;   // split-attention partials
  DeviceBuffer<float> d_logits_;       // [kLogitRows, vocab]
  DeviceBuffer<unsigned long long> d_argmax_;
  DeviceBuffer<unsigned long long> d_head_scratch_;  // fused head: one argmax candidate per block
  DeviceBuffer<unsigned> head_counter_;
  DeviceBuffer<int> expert_offsets_, tile_offsets_, sorted_slot_, slot_row_;  // prefill MoE routing
  DeviceBuffer<bf16> yd_;               // [m*k, H] routed experts' down outputs in sorted order
  int32_t* h_tok_ = nullptr;            // pinned
  int greedy_limit_ = 0;                // argmax range captured into new decode graphs
  std::vector<Mark>* marks_ = nullptr;  // set while a StageProfiler call runs
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Model> make_cuda_model(const std::filesystem::path& dir) {
  return std::make_unique<cuda::CudaModel>(dir);
}

}  // namespace tansy
