// The CPU reference forward pass, top to bottom as docs/MODEL.md §2-§7, in f32.
// Prefill runs each projection over all new tokens at once (one dequant per weight row);
// the sequential parts (conv window, delta-rule recurrence, causal attention) go token by token,
// so a prompt fed whole, in pieces, or one token at a time gives the same result.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "core/threadpool.h"
#include "cpu/backend.h"
#include "cpu/ops.h"
#include "model/weights.h"

namespace tansy {
namespace {

struct CpuState final : SequenceState {
  int n = 0;
  int max_tokens = 0;
  // Per layer; only the members of the layer's kind are used.
  struct Layer {
    std::vector<float> K, V;  // [n, kv_dim] post-norm post-RoPE keys, raw values
    std::vector<float> conv;  // [kernel-1, conv_dim] previous conv inputs, oldest first
    std::vector<float> S;     // [n_v_heads, dk, dv] recurrent state
  };
  std::vector<Layer> layers;
  int n_tokens() const override { return n; }
};

class CpuModel final : public Model {
 public:
  CpuModel(const std::filesystem::path& dir, int threads)
      : cfg_(load_config(dir)),
        store_(TensorStore::open(dir)),
        w_(load_weights(cfg_, store_)),
        pool_(threads) {}

  const ModelConfig& config() const override { return cfg_; }
  std::string backend_name() const override { return "cpu"; }

  std::unique_ptr<SequenceState> new_state(int max_tokens) override {
    if (max_tokens <= 0) fail("new_state: max_tokens must be positive");
    auto s = std::make_unique<CpuState>();
    s->max_tokens = max_tokens;
    s->layers.resize(cfg_.num_layers);
    for (int i = 0; i < cfg_.num_layers; ++i) {
      auto& L = s->layers[i];
      if (cfg_.layers[i] == LayerKind::kLinear) {
        L.conv.assign(size_t(cfg_.conv_kernel - 1) * cfg_.lin_conv_dim(), 0.0f);
        L.S.assign(size_t(cfg_.lin_num_v_heads) * cfg_.lin_k_head_dim * cfg_.lin_v_head_dim, 0.0f);
      }
    }
    return s;
  }

  std::unique_ptr<SequenceState> clone_state(const SequenceState& s) override {
    return std::make_unique<CpuState>(dynamic_cast<const CpuState&>(s));
  }

  bool copy_state(const SequenceState& src, SequenceState& dst) override {
    const auto& a = dynamic_cast<const CpuState&>(src);
    auto& b = dynamic_cast<CpuState&>(dst);
    check_copy_capacity(b.max_tokens, a.max_tokens);
    b = a;  // vector assignment keeps b's buffers wherever they are large enough
    return true;
  }

  bool reset_state(SequenceState& state) override {
    auto& st = dynamic_cast<CpuState&>(state);
    st.n = 0;
    for (auto& L : st.layers) {
      L.K.clear();
      L.V.clear();
      std::fill(L.conv.begin(), L.conv.end(), 0.0f);
      std::fill(L.S.begin(), L.S.end(), 0.0f);
    }
    return true;
  }

  void forward(SequenceState& state, std::span<const int32_t> ids, std::span<float> logits,
               bool all_positions) override {
    const BatchPiece piece{&state, ids, true};
    run(std::span<const BatchPiece>(&piece, 1), logits, all_positions);
  }

  // Every sequence of a step in one pass: the products over all of their rows, the sequential
  // parts per row on its own state. Each row's arithmetic is the same at any batch size (the
  // products compute every output element alone, the experts add up in expert order), so the
  // batch changes no result.
  int max_batch() const override { return 256; }

  size_t state_bytes(int max_tokens) const override { return state_bytes_of(cfg_, max_tokens, 4, 4, 4); }

  std::optional<size_t> free_state_memory() const override {
    std::ifstream in("/proc/meminfo");
    std::string key;
    size_t kb = 0;
    std::string unit;
    while (in >> key >> kb >> unit)
      if (key == "MemAvailable:") return kb * 1024;
    return std::nullopt;
  }

 protected:
  void forward_batch(std::span<const BatchPiece> pieces, std::span<float> logits) override {
    run(pieces, logits, false);
  }

 private:
  // One row of a step: the state it extends and its position there.
  struct Row {
    CpuState* st;
    int pos;
  };

  // Feeds every piece after its state. Logits [n, vocab] for each piece with want_logits (its
  // last position; every position of a single piece when all_positions), in order.
  void run(std::span<const BatchPiece> pieces, std::span<float> logits, bool all_positions) {
    std::vector<Row> rows;
    std::vector<int32_t> ids;
    std::vector<int> logit_rows;
    for (size_t p = 0; p < pieces.size(); ++p) {
      auto& st = dynamic_cast<CpuState&>(*pieces[p].state);
      const int n = int(pieces[p].ids.size());
      if (n == 0) fail("forward: no tokens");
      if (st.n + n > st.max_tokens)
        fail("forward: {} + {} tokens exceed the state's capacity {}", st.n, n, st.max_tokens);
      for (size_t q = 0; q < p; ++q)
        if (pieces[q].state == pieces[p].state) fail("forward: one state fed twice in a batch");
      for (int j = 0; j < n; ++j) {
        const int32_t id = pieces[p].ids[size_t(j)];
        if (id < 0 || id >= cfg_.vocab_size)
          fail("token id {} is outside the vocabulary (0..{})", id, cfg_.vocab_size - 1);
        if (pieces[p].want_logits && (all_positions || j == n - 1)) logit_rows.push_back(int(rows.size()));
        rows.push_back({&st, st.n + j});
        ids.push_back(id);
      }
    }
    const size_t V = size_t(cfg_.vocab_size), need = V * logit_rows.size();
    if (logits.size() < need) fail("forward: logits buffer holds {} floats, needs {}", logits.size(), need);

    const int n = int(rows.size()), H = cfg_.hidden_size;
    std::vector<float> h(size_t(n) * H), xn(size_t(n) * H), mix(size_t(n) * H);
    for (int t = 0; t < n; ++t) cpu::embed_row(w_.embed, ids[size_t(t)], &h[size_t(t) * H]);

    for (int i = 0; i < cfg_.num_layers; ++i) {
      const LayerWeights& lw = w_.layers[i];
      for (int t = 0; t < n; ++t)
        cpu::rmsnorm(&h[size_t(t) * H], lw.in_norm.data(), H, cfg_.rms_eps, &xn[size_t(t) * H]);
      if (lw.kind == LayerKind::kLinear)
        gdn(lw.gdn, i, rows, xn.data(), mix.data());
      else
        attn(lw.attn, i, rows, xn.data(), mix.data());
      report(i, "mixer_out", mix.data(), n, H);
      for (size_t j = 0; j < h.size(); ++j) h[j] += mix[j];
      for (int t = 0; t < n; ++t)
        cpu::rmsnorm(&h[size_t(t) * H], lw.post_norm.data(), H, cfg_.rms_eps, &xn[size_t(t) * H]);
      moe(i, lw.moe, xn.data(), n, mix.data());
      report(i, "moe_out", mix.data(), n, H);
      for (size_t j = 0; j < h.size(); ++j) h[j] += mix[j];
      report(i, "hidden", h.data(), n, H);
    }
    for (const BatchPiece& p : pieces) dynamic_cast<CpuState&>(*p.state).n += int(p.ids.size());

    const int m = int(logit_rows.size());
    for (int r = 0; r < m; ++r)
      cpu::rmsnorm(&h[size_t(logit_rows[size_t(r)]) * H], w_.final_norm.data(), H, cfg_.rms_eps,
                   &xn[size_t(r) * H]);
    if (trace_ && m > 0) trace_("final_norm", std::span<const float>(&xn[size_t(m - 1) * H], H));
    cpu::matmul(w_.lm_head, xn.data(), m, logits.data(), pool_);
  }

  void report(int layer, const char* what, const float* x, int n, int H) {
    if (trace_)
      trace_("layer." + std::to_string(layer) + "." + what, std::span<const float>(x + size_t(n - 1) * H, H));
  }

  // Gated DeltaNet (MODEL.md §5).
  void gdn(const GdnWeights& w, int layer, const std::vector<Row>& rows, const float* xn, float* out) {
    const int n = int(rows.size());
    const int C = cfg_.lin_conv_dim(), KD = cfg_.lin_key_dim(), VD = cfg_.lin_value_dim();
    const int NK = cfg_.lin_num_k_heads, NV = cfg_.lin_num_v_heads, dk = cfg_.lin_k_head_dim,
              dv = cfg_.lin_v_head_dim;
    std::vector<float> qkv(size_t(n) * C), z(size_t(n) * VD), a(size_t(n) * NV), b(size_t(n) * NV);
    cpu::matmul(w.in_qkv, xn, n, qkv.data(), pool_);
    cpu::matmul(w.in_z, xn, n, z.data(), pool_);
    cpu::matmul(w.in_a, xn, n, a.data(), pool_);
    cpu::matmul(w.in_b, xn, n, b.data(), pool_);
    std::vector<float> y(C), beta(NV), g(NV), o(VD), normed(size_t(n) * VD);
    const float qscale = 1.0f / std::sqrt(float(dk));
    for (int t = 0; t < n; ++t) {
      CpuState::Layer& L = rows[size_t(t)].st->layers[size_t(layer)];
      cpu::conv1d_step(&qkv[size_t(t) * C], L.conv.data(), w.conv.data(), C, cfg_.conv_kernel, y.data());
      float* q = y.data();
      float* k = y.data() + KD;
      float* v = y.data() + 2 * KD;
      cpu::l2norm_heads(q, NK, dk, qscale);
      cpu::l2norm_heads(k, NK, dk, 1.0f);
      cpu::gdn_gates(&a[size_t(t) * NV], &b[size_t(t) * NV], w.A_log.data(), w.dt_bias.data(), NV,
                     beta.data(), g.data());
      cpu::gdn_recurrent_step(q, k, v, beta.data(), g.data(), NK, NV, dk, dv, L.S.data(), o.data());
      for (int hh = 0; hh < NV; ++hh)
        cpu::rmsnorm_gated(&o[size_t(hh) * dv], &z[size_t(t) * VD + size_t(hh) * dv], w.norm.data(), dv,
                           cfg_.rms_eps, &normed[size_t(t) * VD + size_t(hh) * dv]);
    }
    cpu::matmul(w.out, normed.data(), n, out, pool_);
  }

  // Gated attention (MODEL.md §4); each row at its position in its own sequence's cache.
  void attn(const AttnWeights& w, int layer, const std::vector<Row>& rows, const float* xn, float* out) {
    const int n = int(rows.size());
    const int NH = cfg_.num_heads, NKV = cfg_.num_kv_heads, hd = cfg_.head_dim, QD = cfg_.q_dim(),
              KVD = cfg_.kv_dim();
    std::vector<float> qg(size_t(n) * 2 * QD), k(size_t(n) * KVD), v(size_t(n) * KVD), o(size_t(n) * QD),
        q(QD);
    cpu::matmul(w.q, xn, n, qg.data(), pool_);
    cpu::matmul(w.k, xn, n, k.data(), pool_);
    cpu::matmul(w.v, xn, n, v.data(), pool_);
    for (const Row& r : rows) {  // rows of one sequence are in order: the last one sizes its cache
      CpuState::Layer& L = r.st->layers[size_t(layer)];
      L.K.resize(std::max(L.K.size(), size_t(r.pos + 1) * KVD));
      L.V.resize(std::max(L.V.size(), size_t(r.pos + 1) * KVD));
    }
    for (int t = 0; t < n; ++t) {
      CpuState::Layer& L = rows[size_t(t)].st->layers[size_t(layer)];
      const int pos = rows[size_t(t)].pos;
      float* kt = &L.K[size_t(pos) * KVD];
      std::memcpy(kt, &k[size_t(t) * KVD], sizeof(float) * KVD);
      std::memcpy(&L.V[size_t(pos) * KVD], &v[size_t(t) * KVD], sizeof(float) * KVD);
      for (int j = 0; j < NKV; ++j) {
        cpu::rmsnorm(kt + size_t(j) * hd, w.k_norm.data(), hd, cfg_.rms_eps, kt + size_t(j) * hd);
        cpu::rope(kt + size_t(j) * hd, cfg_.rotary_dim, pos, cfg_.rope_theta);
      }
      const float* qgt = &qg[size_t(t) * 2 * QD];
      for (int hh = 0; hh < NH; ++hh) {  // per head [q | gate]
        cpu::rmsnorm(qgt + size_t(hh) * 2 * hd, w.q_norm.data(), hd, cfg_.rms_eps, &q[size_t(hh) * hd]);
        cpu::rope(&q[size_t(hh) * hd], cfg_.rotary_dim, pos, cfg_.rope_theta);
      }
      float* ot = &o[size_t(t) * QD];
      cpu::attention(q.data(), L.K.data(), L.V.data(), pos + 1, NH, NKV, hd, ot);
      for (int hh = 0; hh < NH; ++hh)
        for (int d = 0; d < hd; ++d) {
          const float gate = qgt[size_t(hh) * 2 * hd + hd + d];
          ot[size_t(hh) * hd + d] *= 1.0f / (1.0f + std::exp(-gate));
        }
    }
    cpu::matmul(w.o, o.data(), n, out, pool_);
  }

  // Sparse MoE with the gated shared expert (MODEL.md §6). Tokens are grouped by expert so each
  // expert's weights are dequantized once per call.
  void moe(int layer, const MoeWeights& w, const float* xn, int n, float* out) {
    const int H = cfg_.hidden_size, E = cfg_.num_experts, K = cfg_.experts_per_tok;
    const int I = cfg_.moe_intermediate, S = cfg_.shared_intermediate;
    std::vector<float> logits(size_t(n) * E), wts(size_t(n) * K);
    std::vector<int> idx(size_t(n) * K);
    cpu::matmul(w.router, xn, n, logits.data(), pool_);
    for (int t = 0; t < n; ++t)
      cpu::route_topk(&logits[size_t(t) * E], E, K, &idx[size_t(t) * K], &wts[size_t(t) * K]);
    if (route_override_) override_routes(layer, logits, n, idx, wts);  // before the trace, as on CUDA
    if (route_trace_) route_trace_(layer, std::span<const int32_t>(idx.data(), idx.size()));
    std::fill(out, out + size_t(n) * H, 0.0f);
    std::vector<std::vector<std::pair<int, float>>> by_expert(E);
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < K; ++j) by_expert[idx[size_t(t) * K + j]].push_back({t, wts[size_t(t) * K + j]});
    std::vector<float> X, G, U, D;
    for (int e = 0; e < E; ++e) {
      auto& toks = by_expert[e];
      if (toks.empty()) continue;
      const int m = int(toks.size());
      X.resize(size_t(m) * H);
      G.resize(size_t(m) * I);
      U.resize(size_t(m) * I);
      D.resize(size_t(m) * H);
      for (int r = 0; r < m; ++r)
        std::memcpy(&X[size_t(r) * H], xn + size_t(toks[r].first) * H, sizeof(float) * H);
      cpu::matmul(w.gate[e], X.data(), m, G.data(), pool_);
      cpu::matmul(w.up[e], X.data(), m, U.data(), pool_);
      cpu::swiglu(G.data(), U.data(), m * I, G.data());
      cpu::matmul(w.down[e], G.data(), m, D.data(), pool_);
      for (int r = 0; r < m; ++r) {
        float* o = out + size_t(toks[r].first) * H;
        for (int c = 0; c < H; ++c) o[c] += toks[r].second * D[size_t(r) * H + c];
      }
    }
    std::vector<float> sg(size_t(n) * S), su(size_t(n) * S), sd(size_t(n) * H), gate(n);
    cpu::matmul(w.sh_gate, xn, n, sg.data(), pool_);
    cpu::matmul(w.sh_up, xn, n, su.data(), pool_);
    cpu::swiglu(sg.data(), su.data(), n * S, sg.data());
    cpu::matmul(w.sh_down, sg.data(), n, sd.data(), pool_);
    cpu::matmul(w.sh_router, xn, n, gate.data(), pool_);
    for (int t = 0; t < n; ++t) {
      const float s = 1.0f / (1.0f + std::exp(-gate[t]));
      for (int c = 0; c < H; ++c) out[size_t(t) * H + c] += s * sd[size_t(t) * H + c];
    }
  }

  // set_route_override: the given experts, weighted by this layer's softmax renormalised over them.
  void override_routes(int layer, const std::vector<float>& logits, int n, std::vector<int>& idx,
                       std::vector<float>& wts) {
    const int E = cfg_.num_experts, K = cfg_.experts_per_tok;
    std::vector<int32_t> forced(idx.begin(), idx.end());  // the layer's own choices
    if (!route_override_(layer, n, forced)) return;
    for (int t = 0; t < n; ++t) {
      const std::span<const int32_t> f(&forced[size_t(t) * K], K);
      override_weights(&logits[size_t(t) * E], E, f, &wts[size_t(t) * K]);
      std::copy(f.begin(), f.end(), &idx[size_t(t) * K]);
    }
  }

  ModelConfig cfg_;
  TensorStore store_;
  ModelWeights w_;
  ThreadPool pool_;  // ModelOptions::threads workers (0: one per core) for the large products
};

}  // namespace

std::unique_ptr<Model> make_cpu_model(const std::filesystem::path& dir, const ModelOptions& opt) {
  if (opt.threads < 0) fail("threads must be >= 0 (0: one per core), not {}", opt.threads);
  return std::make_unique<CpuModel>(dir, opt.threads);
}

}  // namespace tansy
