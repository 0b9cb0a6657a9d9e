// Several tokens through the bf16 plan: the tensor-core kernels (or the GEMV kernels, for tests).
#include "cuda/bf16/plan.h"

namespace tansy::cuda {

void CudaModel::lm_head(int row0, int rows) {
  matvec(lm_head_.view, xn_.get() + size_t(row0) * cfg_.hidden_size, cfg_.hidden_size, rows,
         MatvecOut{d_logits_.get(), true, cfg_.vocab_size}, stream_);
}

void CudaModel::run_layers(CudaState& st, const int* ids, int m, bool tc, int cut) {
  TANSY_CHECK(cut >= 0 && cut < m && (cut == 0 || cut_.dst), "run_layers: cut {} of {} tokens", cut, m);
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
      gdn(L, st.layers[i], m, tc, cut, cut ? &cut_.dst->layers[i] : nullptr);
    else
      attention(L, st, st.layers[i], m, tc);
    trace_row("layer." + std::to_string(i) + ".mixer_out", r_.get(), m, H);
    mark("residual add + rmsnorm", norm_bytes);
    add_rmsnorm(h_.get(), r_.get(), L.post_norm.get(), m, H, c.rms_eps, xn_.get(), stream_);
    const float* next = i + 1 < c.num_layers ? layers_[i + 1].in_norm.get() : final_norm_.get();
    if (!moe(i, L, m, tc, next)) {
      trace_row("layer." + std::to_string(i) + ".moe_out", r_.get(), m, H);
      mark("residual add + rmsnorm", norm_bytes);
      add_rmsnorm(h_.get(), r_.get(), next, m, H, c.rms_eps, xn_.get(), stream_);
    }
    trace_row("layer." + std::to_string(i) + ".hidden", h_.get(), m, H);
  }
  trace_row("final_norm", xn_.get(), m, H);
  mark("position");
  if (cut) {
    CUDA_CHECK(
        cudaMemcpyAsync(cut_.dst->pos.get(), st.pos.get(), sizeof(int), cudaMemcpyDeviceToDevice, stream_));
    advance_pos(cut_.dst->pos.get(), cut, stream_);
  }
  advance_pos(st.pos.get(), m, stream_);
}

void CudaModel::project(const DevLinear& W, const bf16* X, int64_t ldx, int m, void* Y, bool f32, int64_t ldy,
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

void CudaModel::gdn(DevLayer& L, CudaState::Layer& S, int m, bool tc, int cut, CudaState::Layer* at_cut) {
  const ModelConfig& c = cfg_;
  const int H = c.hidden_size, C = c.lin_conv_dim(), KD = c.lin_key_dim(), VD = c.lin_value_dim();
  const int NK = c.lin_num_k_heads, NV = c.lin_num_v_heads;
  bf16* P = proj_.get();
  // The conv window after `cut` tokens: its last kernel-1 inputs, oldest first; the ones from
  // before this chunk are copied before gdn_conv advances the window, the rest from P below.
  const int W = c.conv_kernel - 1, from_old = at_cut ? std::max(0, W - cut) : 0;
  if (from_old)
    CUDA_CHECK(cudaMemcpyAsync(at_cut->window.get(), S.window.get() + size_t(W - from_old) * C,
                               sizeof(bf16) * size_t(from_old) * C, cudaMemcpyDeviceToDevice, stream_));
  mark("gdn.in_proj", wbytes(L.gdn_in.view), wflops(L.gdn_in.view, m));
  project(L.gdn_in.view, xn_.get(), H, m, P, false, proj_ld_, tc);  // [qkv | z | a | b]
  if (at_cut)
    CUDA_CHECK(cudaMemcpy2DAsync(at_cut->window.get() + size_t(from_old) * C, sizeof(bf16) * C,
                                 P + size_t(cut - (W - from_old)) * proj_ld_, sizeof(bf16) * proj_ld_,
                                 sizeof(bf16) * C, size_t(W - from_old), cudaMemcpyDeviceToDevice, stream_));
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
       tc ? 2.0 * 8 * double(m) * NV * kGdnDim * kGdnDim : 0, tc ? gdn_prefill_launches(m, NV) : 1);
  auto delta_rule = [&](const GdnPrefillArgs& a) {
    if (tc)
      gdn_prefill(a, stream_);
    else
      gdn_recurrent(a, stream_);
  };
  if (at_cut) {  // two segments, the state between them copied
    GdnPrefillArgs head = ra, tail = ra;
    head.n = cut;
    delta_rule(head);
    CUDA_CHECK(cudaMemcpyAsync(at_cut->S.get(), S.S.get(), S.S.bytes(), cudaMemcpyDeviceToDevice, stream_));
    tail.q += size_t(cut) * C;
    tail.k += size_t(cut) * C;
    tail.v += size_t(cut) * C;
    tail.beta += size_t(cut) * NV;
    tail.g += size_t(cut) * NV;
    tail.o_f32 += size_t(cut) * VD;
    tail.n = m - cut;
    delta_rule(tail);
  } else {
    delta_rule(ra);
  }
  mark("gdn.gated_norm");
  GdnGatedNormArgs na;
  na.o = o_.get();
  na.ldo = VD;
  na.z = P + C;
  na.ldz = proj_ld_;
  na.w = L.gnorm.get();
  na.n = m;
  na.n_heads = NV;
  na.eps = c.rms_eps;
  na.y = mix_.get();
  na.ldy = VD;
  gdn_gated_norm(na, stream_);
  mark("gdn.out_proj", wbytes(L.gdn_out.view), wflops(L.gdn_out.view, m));
  project(L.gdn_out.view, mix_.get(), VD, m, r_.get(), false, H, tc);
}

void CudaModel::attention(DevLayer& L, CudaState& st, CudaState::Layer& S, int m, bool tc) {
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
    attention_decode(lay, m, st.pos.get(), S.K.get(), S.V.get(), splits, attn_scratch_.get(), mix_.get(), QD,
                     stream_);
  }
  mark("attn.o_proj", wbytes(L.attn_o.view), wflops(L.attn_o.view, m));
  project(L.attn_o.view, mix_.get(), QD, m, r_.get(), false, H, tc);
}

bool CudaModel::moe(int layer, DevLayer& L, int m, bool tc, const float* next_norm) {
  const ModelConfig& c = cfg_;
  const int H = c.hidden_size, E = c.num_experts, K = c.experts_per_tok;
  const int I = c.moe_intermediate, SI = c.shared_intermediate;
  // router logits [m, E] and the shared-expert gate logit in column E
  // (on tensor cores from the router's bf16 copy: 62 -> ~15 µs at 4,096 tokens, gemm_bf16_wgmma.cu)
  const DevLinear& router = tc ? L.router_bf16.view : L.router.view;
  mark("moe.router", wbytes(router), wflops(router, m));
  project(router, xn_.get(), H, m, router_logits_.get(), true, router_ld_, tc);
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
    return false;
  }
  // The shared expert reads only xn: beside the routing sort and the grouped GEMMs it fills the
  // multiprocessors their last waves of tiles leave idle. Profiled runs keep it in line, so that
  // each stage's time is its own.
  const GemmOutput sh_gu{sh_act_.get(), GemmOutType::kBF16, SI, GemmEpilogue::kSwiGlu};
  const GemmOutput sh_dn{sh_out_.get(), GemmOutType::kBF16, H, GemmEpilogue::kStore};
  const bool beside = !marks_;
  if (beside) {
    CUDA_CHECK(cudaEventRecord(fork_, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(side_, fork_));
    gemm(L.sh_gu_v, xn_.get(), H, m, sh_gu, side_);
    gemm(L.sh_down_v, sh_act_.get(), SI, m, sh_dn, side_);
    CUDA_CHECK(cudaEventRecord(join_, side_));
  }
  MoeRouting rt;
  rt.expert_offsets = expert_offsets_.get();
  rt.tile_offsets = tile_offsets_.get();
  rt.sorted_slot = sorted_slot_.get();
  rt.slot_row = slot_row_.get();
  rt.work = route_work_.get();
  rt.tile_rows = grouped_tile_rows(L.routed_gu, L.routed_down, long(m) * K, E);
  mark("moe.route_sort", 0, 0, 2);
  moe_route_sort(topk_idx_.get(), m, K, E, rt, stream_);
  GemmOutput gu{act_.get(), GemmOutType::kBF16, I, GemmEpilogue::kSwiGlu};
  mark("moe.experts gate|up", gu_bytes, gu_flops);
  gemm_grouped(L.routed_gu, E, xn_.get(), H, true, m, K, rt, gu, stream_);
  GemmOutput dn{yd_.get(), GemmOutType::kBF16, H, GemmEpilogue::kStore};
  mark("moe.experts down", dn_bytes, dn_flops);
  gemm_grouped(L.routed_down, E, act_.get(), I, false, m, K, rt, dn, stream_);
  if (beside) {
    CUDA_CHECK(cudaStreamWaitEvent(stream_, join_));
  } else {
    mark("moe.shared expert", wbytes(L.sh_gu_v) + wbytes(L.sh_down_v),
         wflops(L.sh_gu_v, m) + wflops(L.sh_down_v, m), 2);
    gemm(L.sh_gu_v, xn_.get(), H, m, sh_gu, stream_);
    gemm(L.sh_down_v, sh_act_.get(), SI, m, sh_dn, stream_);
  }
  // With the next RMSNorm in the same pass, unless a trace wants the MoE output r itself.
  if (!trace_ && H <= kCombineNormMaxDim) {
    mark("moe.combine + rmsnorm", double(m) * H * (2 * K + 2 + 8 + 2));  // Yd, shared, h r+w, xn
    moe_combine_add_rmsnorm(yd_.get(), slot_row_.get(), topk_w_.get(), m, K, H, sh_out_.get(),
                            router_logits_.get() + E, router_ld_, h_.get(), next_norm, cfg_.rms_eps,
                            xn_.get(), stream_);
    return true;
  }
  mark("moe.combine");
  moe_combine(yd_.get(), slot_row_.get(), topk_w_.get(), m, K, H, nullptr, sh_out_.get(),
              router_logits_.get() + E, router_ld_, r_.get(), stream_);
  return false;
}

}  // namespace tansy::cuda
