// The bf16 plan's weights: uploaded in the checkpoint's layout, projections fused at load (plan.h).
#include <cstring>

#include "cuda/bf16/plan.h"

namespace tansy::cuda {

namespace {

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

// The same rows as upload_matrix, dequantized to bf16 (s·q + b in f32, rounded once: the values the
// affine kernels' dequant feeds their products), for the products that run on bf16 weights.
DevMatrix upload_dequantized(Uploader& up, const std::vector<RowRef>& rows, const char* what) {
  TANSY_CHECK(!rows.empty() && rows[0].L, "{}: no rows", what);
  const int in = rows[0].L->in;
  DevMatrix m;
  m.view.fmt = WFormat::kBF16;
  m.view.out = int(rows.size());
  m.view.in = in;
  std::vector<float> f(in);
  std::vector<uint16_t> tmp(in, 0);
  m.w.resize(rows.size() * in);
  up.rows(m.w.get(), size_t(in) * 2, rows.size(), [&](size_t i) -> const void* {
    const RowRef& rr = rows[i];
    if (!rr.L) return std::memset(tmp.data(), 0, tmp.size() * 2);
    TANSY_CHECK(rr.L->in == in, "{}: parts differ in input size", what);
    rr.L->row(rr.r, f.data());
    for (int c = 0; c < in; ++c) tmp[c] = f32_to_bf16(f[c]);
    return tmp.data();
  });
  m.view.w = m.w.get();
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

}  // namespace

void CudaModel::upload(const ModelWeights& w) {
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
    L.router_bf16 = upload_dequantized(up, rows, "mlp.gate|shared_expert_gate (bf16 copy)");
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

}  // namespace tansy::cuda
