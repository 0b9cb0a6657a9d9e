// The CUDA backend's f32 plan: the CPU reference forward pass (src/cpu/forward.cpp) step for step
// on the device, with the f32 operations of f32_ops.cu. Every activation, the KV cache and the GDN
// state are f32 and the weights are dequantized exactly, so its logits equal the CPU backend's to
// float rounding (about 1e-6 of the largest logit; the sums run in other orders, and the device's
// expf differs from glibc's by an ulp or two) and its greedy answers are the CPU's except at ties
// closer than that — where the bf16 plan (backend.cu) moves logits by ~1e-2 and so leaves the
// CPU's answer at near-ties of 0.002 logits. Its kernels are simple and its decode is a sequence of
// small launches (no graph): meant for small models (the bundled demo), selected by
// ModelOptions::cuda_precision. Shapes are checked at load (f32::check_*): any head_dim or head
// counts within one block's shared memory, input sizes multiples of 8. A prompt longer than
// kChunk tokens goes through the layers in passes of kChunk, and the trace hooks report per pass.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "cuda/backend.h"
#include "cuda/common/cuda_util.h"
#include "cuda/f32/ops.cuh"
#include "model/weights.h"

namespace tansy {
namespace cuda {
namespace {

constexpr int kChunk = 1024;    // tokens per pass through the layers (bounds the scratch buffers)
constexpr int kLogitRows = 64;  // lm_head rows per pass when all positions are wanted

// A Linear copied to the device; `view` has the device pointers.
struct DevLinear32 {
  DeviceBuffer<uint32_t> q;
  DeviceBuffer<uint16_t> scales, biases, w16;
  DeviceBuffer<float> w32;
  Linear view;
};

template <typename T>
void copy_in(DeviceBuffer<T>& b, const T* host, size_t n) {
  b.resize(n);
  b.upload(host, n);
}

std::unique_ptr<DevLinear32> upload(const Linear& L) {
  auto d = std::make_unique<DevLinear32>();
  d->view = L;
  const size_t rows = size_t(L.out);
  switch (L.fmt) {
    case WFormat::kAffine4:
    case WFormat::kAffine8: {
      const size_t words = size_t(L.in) * L.bits() / 32, groups = size_t(L.in / L.group);
      copy_in(d->q, L.q, rows * words);
      copy_in(d->scales, L.scales, rows * groups);
      copy_in(d->biases, L.biases, rows * groups);
      break;
    }
    case WFormat::kBF16:
      copy_in(d->w16, L.bf16, rows * L.in);
      break;
    case WFormat::kF32:
      copy_in(d->w32, L.f32, rows * L.in);
      break;
  }
  d->view.q = d->q.get();  // null where the format has no such part
  d->view.scales = d->scales.get();
  d->view.biases = d->biases.get();
  d->view.bf16 = d->w16.get();
  d->view.f32 = d->w32.get();
  return d;
}

DeviceBuffer<float> upload_vec(const std::vector<float>& v) {
  DeviceBuffer<float> b;
  copy_in(b, v.data(), v.size());
  return b;
}

struct F32State final : SequenceState {
  int n = 0;
  int max_tokens = 0;
  int capacity = 0;  // positions the attention caches hold (grown on demand up to max_tokens)
  struct Layer {
    DeviceBuffer<float> K, V;  // [capacity, kv_dim] post-norm post-RoPE keys, raw values
    DeviceBuffer<float> conv;  // [kernel-1, conv_dim]
    DeviceBuffer<float> S;     // [n_v_heads, dk, dv]
  };
  std::vector<Layer> layers;
  int n_tokens() const override { return n; }
};

void copy_d2d(DeviceBuffer<float>& dst, const DeviceBuffer<float>& src, size_t n) {
  if (n) CUDA_CHECK(cudaMemcpy(dst.get(), src.get(), n * sizeof(float), cudaMemcpyDeviceToDevice));
}

class F32Model final : public Model {
 public:
  explicit F32Model(const std::filesystem::path& dir) : cfg_(load_config(dir)) {
    TensorStore store = TensorStore::open(dir);
    const ModelWeights w = load_weights(cfg_, store);
    validate(w);
    embed_ = upload(w.embed);
    lm_head_ = upload(w.lm_head);
    final_norm_ = upload_vec(w.final_norm);
    for (const LayerWeights& lw : w.layers) {
      Layer L;
      L.kind = lw.kind;
      L.in_norm = upload_vec(lw.in_norm);
      L.post_norm = upload_vec(lw.post_norm);
      if (lw.kind == LayerKind::kLinear) {
        L.in_qkv = upload(lw.gdn.in_qkv);
        L.in_z = upload(lw.gdn.in_z);
        L.in_a = upload(lw.gdn.in_a);
        L.in_b = upload(lw.gdn.in_b);
        L.out = upload(lw.gdn.out);
        L.conv = upload_vec(lw.gdn.conv);
        L.A_log = upload_vec(lw.gdn.A_log);
        L.dt_bias = upload_vec(lw.gdn.dt_bias);
        L.gdn_norm = upload_vec(lw.gdn.norm);
      } else {
        L.q = upload(lw.attn.q);
        L.k = upload(lw.attn.k);
        L.v = upload(lw.attn.v);
        L.o = upload(lw.attn.o);
        L.q_norm = upload_vec(lw.attn.q_norm);
        L.k_norm = upload_vec(lw.attn.k_norm);
      }
      const MoeWeights& m = lw.moe;
      L.router = upload(m.router);
      L.sh_gate = upload(m.sh_gate);
      L.sh_up = upload(m.sh_up);
      L.sh_down = upload(m.sh_down);
      L.sh_router = upload(m.sh_router);
      upload_experts(m.gate, L.gate, L.gate_views, "gate");
      upload_experts(m.up, L.up, L.up_views, "up");
      upload_experts(m.down, L.down, L.down_views, "down");
      layers_.push_back(std::move(L));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend_name() const override { return "cuda"; }
  std::string backend_plan() const override { return "cuda-f32"; }

  // F32State at its largest (the attention caches grow on demand up to max_tokens).
  size_t state_bytes(int max_tokens) const override { return state_bytes_of(cfg_, max_tokens, 4, 4, 4); }
  bool states_on_device() const override { return true; }
  std::optional<size_t> free_state_memory() const override {
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  }

  std::unique_ptr<SequenceState> new_state(int max_tokens) override {
    if (max_tokens <= 0) fail("new_state: max_tokens must be positive");
    auto s = std::make_unique<F32State>();
    s->max_tokens = max_tokens;
    s->layers.resize(cfg_.num_layers);
    for (int i = 0; i < cfg_.num_layers; ++i) {
      if (cfg_.layers[i] != LayerKind::kLinear) continue;
      auto& L = s->layers[i];
      L.conv.resize(size_t(cfg_.conv_kernel - 1) * cfg_.lin_conv_dim());
      L.S.resize(size_t(cfg_.lin_num_v_heads) * cfg_.lin_k_head_dim * cfg_.lin_v_head_dim);
    }
    clear(*s);
    return s;
  }

  bool reset_state(SequenceState& state) override {
    clear(dynamic_cast<F32State&>(state));
    return true;
  }

  std::unique_ptr<SequenceState> clone_state(const SequenceState& state) override {
    auto s = new_state(dynamic_cast<const F32State&>(state).max_tokens);
    copy_state(state, *s);
    return s;
  }

  // The attention caches grow to hold src's tokens as feeding them would have grown them (this
  // plan allocates them on demand); every other buffer is dst's own.
  bool copy_state(const SequenceState& from, SequenceState& to) override {
    const auto& src = dynamic_cast<const F32State&>(from);
    auto& dst = dynamic_cast<F32State&>(to);
    check_copy_capacity(dst.max_tokens, src.max_tokens);
    if (&src == &dst) return true;
    dst.n = 0;  // nothing of dst's own is kept: reserve() copies no rows
    reserve(dst, src.n);
    dst.n = src.n;
    const size_t kvd = size_t(cfg_.kv_dim());
    for (size_t i = 0; i < src.layers.size(); ++i) {
      const auto& a = src.layers[i];
      auto& b = dst.layers[i];
      if (a.K.size()) {
        copy_d2d(b.K, a.K, size_t(src.n) * kvd);
        copy_d2d(b.V, a.V, size_t(src.n) * kvd);
      }
      copy_d2d(b.conv, a.conv, a.conv.size());
      copy_d2d(b.S, a.S, a.S.size());
    }
    return true;
  }

  void forward(SequenceState& state, std::span<const int32_t> ids, std::span<float> logits,
               bool all_positions) override {
    auto& st = dynamic_cast<F32State&>(state);
    const int n = int(ids.size());
    if (n == 0) fail("forward: no tokens");
    if (st.n + n > st.max_tokens)
      fail("forward: {} + {} tokens exceed the state's capacity {}", st.n, n, st.max_tokens);
    const size_t V = size_t(cfg_.vocab_size), need = all_positions ? V * n : V;
    if (logits.size() < need) fail("forward: logits buffer holds {} floats, needs {}", logits.size(), need);
    for (int32_t id : ids)
      if (id < 0 || id >= cfg_.vocab_size)
        fail("token id {} is outside the vocabulary (0..{})", id, cfg_.vocab_size - 1);
    if (route_override_) fail("f32 plan: route overrides are for the CPU reference and the bf16 plan only");
    ensure_scratch(std::min(n, kChunk), all_positions);  // allocations before the state changes
    reserve(st, st.n + n);
    for (int c0 = 0; c0 < n; c0 += kChunk) {
      const int m = std::min(kChunk, n - c0);
      const bool last = c0 + m == n;
      float* out = all_positions ? logits.data() + size_t(c0) * V : (last ? logits.data() : nullptr);
      chunk(st, ids.subspan(c0, m), out, all_positions);
    }
  }

 private:
  struct Layer {
    LayerKind kind = LayerKind::kLinear;
    DeviceBuffer<float> in_norm, post_norm;
    std::unique_ptr<DevLinear32> in_qkv, in_z, in_a, in_b, out;  // GDN
    DeviceBuffer<float> conv, A_log, dt_bias, gdn_norm;
    std::unique_ptr<DevLinear32> q, k, v, o;  // attention
    DeviceBuffer<float> q_norm, k_norm;
    std::unique_ptr<DevLinear32> router, sh_gate, sh_up, sh_down, sh_router;
    std::vector<std::unique_ptr<DevLinear32>> gate, up, down;
    DeviceBuffer<Linear> gate_views, up_views, down_views;  // device arrays of the experts' views
  };

  // The routed experts of one projection, each its own device copy, plus a device array of their views.
  static void upload_experts(const std::vector<Linear>& src, std::vector<std::unique_ptr<DevLinear32>>& dst,
                             DeviceBuffer<Linear>& views, const char* what) {
    std::vector<Linear> v;
    for (size_t e = 0; e < src.size(); ++e) {
      const Linear& a = src[e];
      const Linear& b = src[0];
      if (a.fmt != b.fmt || a.out != b.out || a.in != b.in || a.group != b.group)
        fail("f32 plan: routed expert {}'s {} differs in format or shape from expert 0's", e, what);
      dst.push_back(upload(a));
      v.push_back(dst.back()->view);
    }
    views.resize(v.size());
    views.upload(v.data(), v.size());
  }

  void clear(F32State& s) {
    s.n = 0;
    for (auto& L : s.layers) {
      if (L.conv.size()) CUDA_CHECK(cudaMemset(L.conv.get(), 0, L.conv.bytes()));
      if (L.S.size()) CUDA_CHECK(cudaMemset(L.S.get(), 0, L.S.bytes()));
    }
  }

  // Grows the attention caches (doubling, up to max_tokens) to hold `need` positions.
  void reserve(F32State& s, int need) {
    if (need <= s.capacity) return;
    const int cap = std::min(s.max_tokens, std::max({need, 2 * s.capacity, 256}));
    const size_t kvd = size_t(cfg_.kv_dim());
    for (int i = 0; i < cfg_.num_layers; ++i) {
      if (cfg_.layers[i] == LayerKind::kLinear) continue;
      auto& L = s.layers[i];
      DeviceBuffer<float> K(size_t(cap) * kvd), V(size_t(cap) * kvd);
      copy_d2d(K, L.K, size_t(s.n) * kvd);
      copy_d2d(V, L.V, size_t(s.n) * kvd);
      L.K = std::move(K);
      L.V = std::move(V);
    }
    s.capacity = cap;
  }

  // Every shape the kernels must support, so an unsupported checkpoint fails here naming the part.
  void validate(const ModelWeights& w) const {
    f32::check_linear(w.embed, "embed_tokens");
    f32::check_linear(w.lm_head, "lm_head");
    for (int i = 0; i < cfg_.num_layers; ++i) {
      const LayerWeights& lw = w.layers[i];
      const std::string at = "layer " + std::to_string(i) + " ";
      auto check = [&](const Linear& L, const std::string& name) { f32::check_linear(L, at + name); };
      if (lw.kind == LayerKind::kLinear) {
        check(lw.gdn.in_qkv, "in_proj_qkv");
        check(lw.gdn.in_z, "in_proj_z");
        check(lw.gdn.in_a, "in_proj_a");
        check(lw.gdn.in_b, "in_proj_b");
        check(lw.gdn.out, "out_proj");
      } else {
        check(lw.attn.q, "q_proj");
        check(lw.attn.k, "k_proj");
        check(lw.attn.v, "v_proj");
        check(lw.attn.o, "o_proj");
      }
      check(lw.moe.router, "router");
      check(lw.moe.sh_gate, "shared gate_proj");
      check(lw.moe.sh_up, "shared up_proj");
      check(lw.moe.sh_down, "shared down_proj");
      check(lw.moe.sh_router, "shared expert gate");
      for (size_t e = 0; e < lw.moe.gate.size(); ++e) {
        const std::string ex = "expert " + std::to_string(e) + " ";
        check(lw.moe.gate[e], ex + "gate_proj");
        check(lw.moe.up[e], ex + "up_proj");
        check(lw.moe.down[e], ex + "down_proj");
      }
    }
    if (cfg_.num_linear_layers() > 0) {
      f32::check_gdn(cfg_.lin_num_k_heads, cfg_.lin_num_v_heads, cfg_.lin_k_head_dim, cfg_.lin_v_head_dim);
      if (cfg_.conv_kernel < 1) fail("f32 plan: conv kernel {}", cfg_.conv_kernel);
    }
    if (cfg_.num_full_layers() > 0)
      f32::check_attention(cfg_.num_heads, cfg_.num_kv_heads, cfg_.head_dim, cfg_.rotary_dim);
    f32::check_route(cfg_.num_experts, cfg_.experts_per_tok);
  }

  // Scratch for passes of up to m tokens (grown, never shrunk), allocated before a forward pass
  // touches the state, so that running out of memory cannot leave a state half-updated.
  void ensure_scratch(int m, bool all_positions) {
    const size_t n = size_t(m), H = size_t(cfg_.hidden_size), C = size_t(cfg_.lin_conv_dim());
    const size_t VD = size_t(cfg_.lin_value_dim()), NV = size_t(cfg_.lin_num_v_heads);
    const size_t QD = size_t(cfg_.q_dim()), KVD = size_t(cfg_.kv_dim()), E = size_t(cfg_.num_experts);
    const size_t K = size_t(cfg_.experts_per_tok), I = size_t(cfg_.moe_intermediate);
    const size_t SI = size_t(cfg_.shared_intermediate);
    const size_t logit_rows = all_positions ? std::min<size_t>(n, kLogitRows) : 1;
    auto grow = [](auto& b, size_t count) {
      if (b.size() < count) b.resize(count);
    };
    grow(ids_, n);
    for (auto* b : {&h_, &xn_, &mix_, &sd_}) grow(*b, n * H);
    grow(qkv_, n * C);
    grow(conv_y_, n * C);
    grow(z_, n * VD);
    grow(normed_, n * VD);
    grow(a_, n * NV);
    grow(b_, n * NV);
    grow(qg_, n * 2 * QD);
    grow(k_, n * KVD);
    grow(v_, n * KVD);
    grow(q_, n * QD);
    grow(o_, n * QD);
    grow(router_logits_, n * E);
    grow(idx_, n * K);
    grow(wts_, n * K);
    grow(G_, n * K * I);
    grow(U_, n * K * I);
    grow(D_, n * K * H);
    grow(sg_, n * SI);
    grow(su_, n * SI);
    grow(gate_, n);
    grow(logits_, logit_rows * size_t(cfg_.vocab_size));
  }

  // Trace hook: row `row` of x [*, hidden] from the device.
  void trace_row(const std::string& name, const float* x, int row) {
    std::vector<float> h(cfg_.hidden_size);
    CUDA_CHECK(
        cudaMemcpy(h.data(), x + size_t(row) * h.size(), sizeof(float) * h.size(), cudaMemcpyDeviceToHost));
    trace_(name, h);
  }

  void report(int layer, const char* what, const float* x, int n) {
    if (trace_) trace_row("layer." + std::to_string(layer) + "." + what, x, n - 1);
  }

  // Tokens ids (at most kChunk) after st.n; writes logits (all positions, or the last) to the host.
  void chunk(F32State& st, std::span<const int32_t> ids, float* logits, bool all_positions) {
    const int n = int(ids.size()), H = cfg_.hidden_size;
    float *h = h_.get(), *xn = xn_.get(), *mix = mix_.get();
    CUDA_CHECK(cudaMemcpy(ids_.get(), ids.data(), sizeof(int32_t) * n, cudaMemcpyHostToDevice));
    f32::embed(embed_->view, ids_.get(), n, h);
    for (int i = 0; i < cfg_.num_layers; ++i) {
      Layer& L = layers_[i];
      f32::rmsnorm(h, L.in_norm.get(), n, H, cfg_.rms_eps, xn);
      if (L.kind == LayerKind::kLinear)
        gdn(L, st.layers[i], xn, n, mix);
      else
        attn(L, st.layers[i], st.n, xn, n, mix);
      report(i, "mixer_out", mix, n);
      f32::add(h, mix, size_t(n) * H);
      f32::rmsnorm(h, L.post_norm.get(), n, H, cfg_.rms_eps, xn);
      moe(i, L, xn, n, mix);
      report(i, "moe_out", mix, n);
      f32::add(h, mix, size_t(n) * H);
      report(i, "hidden", h, n);
    }
    st.n += n;
    if (!logits) return;
    const int first = all_positions ? 0 : n - 1;
    const size_t V = size_t(cfg_.vocab_size);
    for (int r0 = first; r0 < n; r0 += kLogitRows) {
      const int rows = std::min(kLogitRows, n - r0);
      f32::rmsnorm(h + size_t(r0) * H, final_norm_.get(), rows, H, cfg_.rms_eps, xn);
      if (trace_ && r0 + rows == n) trace_row("final_norm", xn, rows - 1);
      f32::matmul(lm_head_->view, xn, rows, logits_.get());
      CUDA_CHECK(cudaMemcpy(logits + size_t(r0 - first) * V, logits_.get(), sizeof(float) * rows * V,
                            cudaMemcpyDeviceToHost));
    }
  }

  // Gated DeltaNet (docs/MODEL.md §5), as CpuModel::gdn.
  void gdn(Layer& L, F32State::Layer& S, const float* xn, int n, float* out) {
    const int C = cfg_.lin_conv_dim(), NV = cfg_.lin_num_v_heads;
    f32::matmul(L.in_qkv->view, xn, n, qkv_.get());
    f32::matmul(L.in_z->view, xn, n, z_.get());
    f32::matmul(L.in_a->view, xn, n, a_.get());
    f32::matmul(L.in_b->view, xn, n, b_.get());
    f32::conv1d(qkv_.get(), n, S.conv.get(), L.conv.get(), C, cfg_.conv_kernel, conv_y_.get());
    f32::gdn_core({conv_y_.get(), z_.get(), a_.get(), b_.get(), L.A_log.get(), L.dt_bias.get(),
                   L.gdn_norm.get(), S.S.get(), normed_.get(), n, cfg_.lin_num_k_heads, NV,
                   cfg_.lin_k_head_dim, cfg_.lin_v_head_dim, cfg_.rms_eps});
    f32::matmul(L.out->view, normed_.get(), n, out);
  }

  // Gated attention (MODEL.md §4), as CpuModel::attn; pos0 = tokens already cached.
  void attn(Layer& L, F32State::Layer& S, int pos0, const float* xn, int n, float* out) {
    f32::matmul(L.q->view, xn, n, qg_.get());
    f32::matmul(L.k->view, xn, n, k_.get());
    f32::matmul(L.v->view, xn, n, v_.get());
    f32::attention_prep({qg_.get(), k_.get(), v_.get(), L.q_norm.get(), L.k_norm.get(), q_.get(), S.K.get(),
                         S.V.get(), n, pos0, cfg_.num_heads, cfg_.num_kv_heads, cfg_.head_dim,
                         cfg_.rotary_dim, cfg_.rms_eps, cfg_.rope_theta});
    f32::attention(q_.get(), qg_.get(), S.K.get(), S.V.get(), n, pos0, cfg_.num_heads, cfg_.num_kv_heads,
                   cfg_.head_dim, o_.get());
    f32::matmul(L.o->view, o_.get(), n, out);
  }

  // Sparse MoE with the gated shared expert (MODEL.md §6), as CpuModel::moe.
  void moe(int layer, Layer& L, const float* xn, int n, float* out) {
    const int H = cfg_.hidden_size, E = cfg_.num_experts, K = cfg_.experts_per_tok;
    const int I = cfg_.moe_intermediate, SI = cfg_.shared_intermediate;
    int32_t* idx = idx_.get();
    float *G = G_.get(), *sg = sg_.get();
    f32::matmul(L.router->view, xn, n, router_logits_.get());
    f32::route_topk(router_logits_.get(), n, E, E, K, idx, wts_.get());
    if (route_trace_) {
      std::vector<int32_t> h(size_t(n) * K);
      CUDA_CHECK(cudaMemcpy(h.data(), idx, sizeof(int32_t) * h.size(), cudaMemcpyDeviceToHost));
      route_trace_(layer, h);
    }
    f32::matmul_indexed(L.gate_views.get(), E, L.gate[0]->view, idx, xn, K, n * K, G);
    f32::matmul_indexed(L.up_views.get(), E, L.up[0]->view, idx, xn, K, n * K, U_.get());
    f32::swiglu(G, U_.get(), size_t(n) * K * I, G);
    f32::matmul_indexed(L.down_views.get(), E, L.down[0]->view, idx, G, 1, n * K, D_.get());
    f32::matmul(L.sh_gate->view, xn, n, sg);
    f32::matmul(L.sh_up->view, xn, n, su_.get());
    f32::swiglu(sg, su_.get(), size_t(n) * SI, sg);
    f32::matmul(L.sh_down->view, sg, n, sd_.get());
    f32::matmul(L.sh_router->view, xn, n, gate_.get());
    f32::moe_combine(D_.get(), idx, wts_.get(), n, K, sd_.get(), gate_.get(), H, out);
  }

  ModelConfig cfg_;
  std::unique_ptr<DevLinear32> embed_, lm_head_;
  DeviceBuffer<float> final_norm_;
  std::vector<Layer> layers_;
  // Scratch, grown to the largest call.
  DeviceBuffer<int32_t> ids_, idx_;
  DeviceBuffer<float> h_, xn_, mix_, qkv_, conv_y_, z_, a_, b_, normed_, qg_, k_, v_, q_, o_;
  DeviceBuffer<float> router_logits_, wts_, G_, U_, D_, sg_, su_, sd_, gate_, logits_;
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Model> make_cuda_f32_model(const std::filesystem::path& dir) {
  return std::make_unique<cuda::F32Model>(dir);
}

}  // namespace tansy
