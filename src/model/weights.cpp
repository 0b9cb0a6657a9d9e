#include "model/weights.h"

#include <set>

#include "core/bf16.h"
#include "core/error.h"
#include "core/safetensors.h"

namespace tansy {

const char* wformat_name(WFormat f) {
  switch (f) {
    case WFormat::kAffine4:
      return "affine4";
    case WFormat::kAffine8:
      return "affine8";
    case WFormat::kBF16:
      return "bf16";
    case WFormat::kF32:
      return "f32";
  }
  return "?";
}

namespace {
// Codes are unpacked with compile-time widths so the compiler turns the shifts into vector ops.
template <int kBits>
void dequant_row(const uint32_t* qr, const uint16_t* sr, const uint16_t* br, int in, int group, float* out) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  for (int w = 0; w < in / kPerWord; ++w) {
    const uint32_t v = qr[w];
    for (int k = 0; k < kPerWord; ++k) out[w * kPerWord + k] = float((v >> (kBits * k)) & kMask);
  }
  for (int g = 0; g < in / group; ++g) {
    const float s = bf16_to_f32(sr[g]), b = bf16_to_f32(br[g]);
    for (int c = g * group; c < (g + 1) * group; ++c) out[c] = s * out[c] + b;
  }
}
}  // namespace

void Linear::row(int r, float* out_row) const {
  switch (fmt) {
    case WFormat::kAffine4:
    case WFormat::kAffine8: {
      const size_t words = size_t(in) * bits() / 32, groups = size_t(in / group);
      const uint32_t* qr = q + size_t(r) * words;
      if (fmt == WFormat::kAffine4)
        dequant_row<4>(qr, scales + r * groups, biases + r * groups, in, group, out_row);
      else
        dequant_row<8>(qr, scales + r * groups, biases + r * groups, in, group, out_row);
      break;
    }
    case WFormat::kBF16:
      for (int c = 0; c < in; ++c) out_row[c] = bf16_to_f32(bf16[size_t(r) * in + c]);
      break;
    case WFormat::kF32:
      for (int c = 0; c < in; ++c) out_row[c] = f32[size_t(r) * in + c];
      break;
  }
}

size_t Linear::stored_bytes() const {
  switch (fmt) {
    case WFormat::kAffine4:
    case WFormat::kAffine8:
      return size_t(out) * (size_t(in) * bits() / 8 + size_t(in / group) * 4);
    case WFormat::kBF16:
      return size_t(out) * in * 2;
    case WFormat::kF32:
      return size_t(out) * in * 4;
  }
  return 0;
}

Linear Linear::rows(int r0, int n) const {
  if (r0 < 0 || n < 0 || r0 + n > out) fail("Linear::rows({}, {}) outside {} rows", r0, n, out);
  Linear v = *this;
  v.out = n;
  if (q) {
    v.q = q + size_t(r0) * (size_t(in) * bits() / 32);
    v.scales = scales + size_t(r0) * (in / group);
    v.biases = biases + size_t(r0) * (in / group);
  }
  if (bf16) v.bf16 = bf16 + size_t(r0) * in;
  if (f32) v.f32 = f32 + size_t(r0) * in;
  return v;
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Records every tensor it hands out; finish() rejects whatever was left over.
class Loader {
 public:
  Loader(const ModelConfig& cfg, const TensorStore& st, CheckpointFormat fmt)
      : cfg_(cfg), st_(st), fmt_(fmt) {}

  const TensorView& take(const std::string& name, const std::vector<int64_t>& shape,
                         std::initializer_list<DType> dtypes) {
    const TensorView* t = st_.find(name);
    if (!t) fail("checkpoint is missing tensor '{}' (expected {})", name, shape_str(shape));
    if (used_.count(name)) fail("tensor '{}' consumed twice (loader bug)", name);
    bool ok = false;
    for (auto d : dtypes) ok |= t->dtype == d;
    if (!ok) {
      std::string want;
      for (auto d : dtypes) want += std::string(want.empty() ? "" : " or ") + dtype_name(d);
      fail("tensor '{}' has dtype {}, expected {}", name, dtype_name(t->dtype), want);
    }
    if (t->shape != shape)
      fail("tensor '{}' has shape {}, expected {}", name, t->shape_str(), shape_str(shape));
    used_.insert(name);
    return *t;
  }

  // A dense or affine-quantized matrix [out, in]; `lead` > 0 adds a leading expert dimension.
  // Returns one Linear per leading index (or a single one when lead == 0).
  std::vector<Linear> linear(const std::string& base, int lead, int out, int in) {
    std::vector<int64_t> pre;
    if (lead) pre.push_back(lead);
    auto with = [&](std::vector<int64_t> tail) {
      auto s = pre;
      s.insert(s.end(), tail.begin(), tail.end());
      return s;
    };
    const int n = lead ? lead : 1;
    std::vector<Linear> res(n);
    if (fmt_ == CheckpointFormat::kMlxAffine) {
      const std::string wname = base + ".weight";
      const TensorView* w = st_.find(wname);
      if (!w) fail("checkpoint is missing tensor '{}'", wname);
      if (w->dtype != DType::U32)
        fail("tensor '{}' has dtype {}, expected U32 (MLX affine-quantized)", wname, dtype_name(w->dtype));
      if (w->shape.size() != pre.size() + 2 || w->shape.back() <= 0)
        fail("tensor '{}' has shape {}, expected {}", wname, w->shape_str(), shape_str(with({out, in / 8})));
      const int64_t packed = w->shape.back();
      // Bits follow from the shapes: in * bits / 32 packed words per row.
      if ((packed * 32) % in != 0)
        fail("tensor '{}': {} packed columns do not fit {} inputs", wname, packed, in);
      const int bits = int(packed * 32 / in);
      if (bits != 4 && bits != 8)
        fail("tensor '{}' has shape {}: that is {}-bit codes for {} inputs; only 4 and 8 bits are supported",
             wname, w->shape_str(), bits, in);
      const int declared = declared_bits(base);
      if (declared != bits)
        fail("tensor '{}' holds {}-bit codes but config.json's quantization declares {} bits for '{}'", wname,
             bits, declared, base);
      const int group = cfg_.quant->group_size;
      if (in % group != 0)
        fail("tensor '{}': input dimension {} is not a multiple of the group size {}", wname, in, group);
      auto& q = take(wname, with({out, packed}), {DType::U32});
      auto& s = take(base + ".scales", with({out, in / group}), {DType::BF16});
      auto& b = take(base + ".biases", with({out, in / group}), {DType::BF16});
      for (int e = 0; e < n; ++e) {
        Linear& L = res[e];
        L.fmt = bits == 4 ? WFormat::kAffine4 : WFormat::kAffine8;
        L.out = out;
        L.in = in;
        L.group = group;
        L.q = q.as<uint32_t>() + size_t(e) * out * packed;
        L.scales = s.as<uint16_t>() + size_t(e) * out * (in / group);
        L.biases = b.as<uint16_t>() + size_t(e) * out * (in / group);
        bytes_ += L.stored_bytes();
      }
    } else {
      const std::string wname = lead ? base : base + ".weight";
      auto& w = take(wname, with({out, in}), {DType::BF16, DType::F32});
      for (int e = 0; e < n; ++e) {
        Linear& L = res[e];
        L.out = out;
        L.in = in;
        if (w.dtype == DType::BF16) {
          L.fmt = WFormat::kBF16;
          L.bf16 = w.as<uint16_t>() + size_t(e) * out * in;
        } else {
          L.fmt = WFormat::kF32;
          L.f32 = w.as<float>() + size_t(e) * out * in;
        }
        bytes_ += L.stored_bytes();
      }
    }
    return res;
  }
  Linear linear1(const std::string& base, int out, int in) { return linear(base, 0, out, in)[0]; }

  // A small parameter, converted to f32. add_one turns a zero-centred HF norm weight into its multiplier.
  std::vector<float> vec(const std::string& name, const std::vector<int64_t>& shape, bool add_one) {
    auto& t = take(name, shape, {DType::BF16, DType::F32, DType::F16});
    std::vector<float> v(size_t(t.numel()));
    for (size_t i = 0; i < v.size(); ++i) {
      float x = t.dtype == DType::F32    ? t.as<float>()[i]
                : t.dtype == DType::BF16 ? bf16_to_f32(t.as<uint16_t>()[i])
                                         : f16_to_f32(t.as<uint16_t>()[i]);
      v[i] = add_one ? 1.0f + x : x;
    }
    bytes_ += t.nbytes;
    return v;
  }

  // Every tensor must have been consumed, except the explicitly skipped vision tower and MTP head.
  void finish(const std::vector<std::string>& skip_prefixes) {
    for (auto& [name, t] : st_.tensors()) {
      if (used_.count(name)) continue;
      bool skipped = false;
      for (auto& p : skip_prefixes) skipped |= name.rfind(p, 0) == 0;
      if (!skipped)
        fail("unexpected tensor '{}' {} {} (not part of the {} text model)", name, t.shape_str(),
             dtype_name(t.dtype), cfg_.name);
    }
  }

  size_t bytes() const { return bytes_; }

 private:
  int declared_bits(const std::string& module) const {
    const QuantConfig& q = *cfg_.quant;
    // Override keys name module paths; accept them with or without the wrapper's prefixes.
    for (const std::string& strip : {std::string(), std::string("language_model."), std::string("model.")}) {
      for (auto& [k, b] : q.bits_override) {
        std::string kk = k.rfind(strip, 0) == 0 ? k.substr(strip.size()) : k;
        std::string mm = module.rfind(strip, 0) == 0 ? module.substr(strip.size()) : module;
        if (kk == mm) return b;
      }
    }
    return q.bits;
  }

  const ModelConfig& cfg_;
  const TensorStore& st_;
  CheckpointFormat fmt_;
  std::set<std::string> used_;
  size_t bytes_ = 0;
};

}  // namespace

ModelWeights load_weights(const ModelConfig& cfg, const TensorStore& st) {
  ModelWeights W;
  // Name scheme: MLX (language_model.model.*, language_model.lm_head) or Hugging Face
  // (model.language_model.*, lm_head); text-only exports use model.* for either.
  std::string P, head;
  std::vector<std::string> skip;
  if (st.find("language_model.model.embed_tokens.weight")) {
    P = "language_model.model.";
    head = "language_model.lm_head";
    skip = {"vision_tower.", "language_model.mtp.", "mtp."};
  } else if (st.find("model.language_model.embed_tokens.weight")) {
    P = "model.language_model.";
    head = "lm_head";
    skip = {"model.visual.", "mtp.", "model.mtp."};
  } else if (st.find("model.embed_tokens.weight")) {
    P = "model.";
    head = "lm_head";
    skip = {"mtp.", "model.mtp."};
  } else {
    fail(
        "checkpoint has no embedding tensor (looked for language_model.model.embed_tokens.weight, "
        "model.language_model.embed_tokens.weight, model.embed_tokens.weight)");
  }
  W.format = cfg.quant ? CheckpointFormat::kMlxAffine : CheckpointFormat::kHfBf16;
  const bool mlx = W.format == CheckpointFormat::kMlxAffine;
  {
    const TensorView* e = st.find(P + "embed_tokens.weight");
    if (mlx && e->dtype != DType::U32)
      fail("config.json declares MLX quantization but tensor '{}' is {} (expected U32 codes)", e->name,
           dtype_name(e->dtype));
    if (!mlx && e->dtype == DType::U32)
      fail("tensor '{}' is quantized (U32) but config.json has no 'quantization' block", e->name);
  }
  Loader L(cfg, st, W.format);
  const int H = cfg.hidden_size, V = cfg.vocab_size;
  W.embed = L.linear1(P + "embed_tokens", V, H);
  W.final_norm = L.vec(P + "norm.weight", {H}, !mlx);
  W.lm_head = L.linear1(head, V, H);

  for (int i = 0; i < cfg.num_layers; ++i) {
    const std::string p = P + "layers." + std::to_string(i) + ".";
    LayerWeights lw;
    lw.kind = cfg.layers[i];
    lw.in_norm = L.vec(p + "input_layernorm.weight", {H}, !mlx);
    lw.post_norm = L.vec(p + "post_attention_layernorm.weight", {H}, !mlx);
    if (lw.kind == LayerKind::kLinear) {
      const std::string a = p + "linear_attn.";
      GdnWeights& g = lw.gdn;
      const int C = cfg.lin_conv_dim(), VD = cfg.lin_value_dim(), NV = cfg.lin_num_v_heads;
      g.in_qkv = L.linear1(a + "in_proj_qkv", C, H);
      g.in_z = L.linear1(a + "in_proj_z", VD, H);
      g.in_b = L.linear1(a + "in_proj_b", NV, H);
      g.in_a = L.linear1(a + "in_proj_a", NV, H);
      g.out = L.linear1(a + "out_proj", H, VD);
      // MLX stores conv1d as [C, K, 1], Hugging Face as [C, 1, K]: both are [C][K] in memory.
      g.conv = L.vec(
          a + "conv1d.weight",
          mlx ? std::vector<int64_t>{C, cfg.conv_kernel, 1} : std::vector<int64_t>{C, 1, cfg.conv_kernel},
          false);
      g.A_log = L.vec(a + "A_log", {NV}, false);
      g.dt_bias = L.vec(a + "dt_bias", {NV}, false);
      g.norm = L.vec(a + "norm.weight", {cfg.lin_v_head_dim}, false);
    } else {
      const std::string a = p + "self_attn.";
      AttnWeights& t = lw.attn;
      t.q = L.linear1(a + "q_proj", 2 * cfg.q_dim(), H);
      t.k = L.linear1(a + "k_proj", cfg.kv_dim(), H);
      t.v = L.linear1(a + "v_proj", cfg.kv_dim(), H);
      t.o = L.linear1(a + "o_proj", H, cfg.q_dim());
      t.q_norm = L.vec(a + "q_norm.weight", {cfg.head_dim}, !mlx);
      t.k_norm = L.vec(a + "k_norm.weight", {cfg.head_dim}, !mlx);
    }
    const std::string m = p + "mlp.";
    MoeWeights& e = lw.moe;
    const int E = cfg.num_experts, I = cfg.moe_intermediate, S = cfg.shared_intermediate;
    e.router = L.linear1(m + "gate", E, H);
    if (mlx) {
      e.gate = L.linear(m + "switch_mlp.gate_proj", E, I, H);
      e.up = L.linear(m + "switch_mlp.up_proj", E, I, H);
      e.down = L.linear(m + "switch_mlp.down_proj", E, H, I);
    } else {
      // Hugging Face fuses gate and up: gate_up_proj[e] rows 0..I-1 = gate, I..2I-1 = up.
      auto gu = L.linear(m + "experts.gate_up_proj", E, 2 * I, H);
      for (auto& x : gu) {
        e.gate.push_back(x.rows(0, I));
        e.up.push_back(x.rows(I, I));
      }
      e.down = L.linear(m + "experts.down_proj", E, H, I);
    }
    e.sh_gate = L.linear1(m + "shared_expert.gate_proj", S, H);
    e.sh_up = L.linear1(m + "shared_expert.up_proj", S, H);
    e.sh_down = L.linear1(m + "shared_expert.down_proj", H, S);
    e.sh_router = L.linear1(m + "shared_expert_gate", 1, H);
    W.layers.push_back(std::move(lw));
  }
  L.finish(skip);
  W.stored_bytes = L.bytes();
  return W;
}

}  // namespace tansy
