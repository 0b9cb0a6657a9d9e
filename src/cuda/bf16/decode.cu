// One decode step of the bf16 plan: each norm, routing and GDN step fused into its neighbour.
#include "cuda/bf16/plan.h"

namespace tansy::cuda {

void CudaModel::decode_step(CudaState& st, int limit) {
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

void CudaModel::run_decode_fused(CudaState& st, const int* ids, bool head) {
  // The persistent step routes inside its kernel: a route override needs the per-op kernels.
  if (step_ok_ && (!marks_ || profile_step_) && !route_override_)
    run_decode_persistent(st, ids);
  else
    run_decode_per_op(st, ids);
  if (!head) return;
  mark("final_norm + position", 0, 0, 2);
  add_rmsnorm(h_.get(), nullptr, final_norm_.get(), 1, cfg_.hidden_size, cfg_.rms_eps, xn_.get(), stream_);
  advance_pos(st.pos.get(), 1, stream_);
}

void CudaModel::attention_mixer_decode(CudaState& st, int i) {
  const ModelConfig& c = cfg_;
  DevLayer& L = layers_[i];
  auto ss = [&](int point) { return ss_parts_.get() + size_t(point) * kNormParts; };
  NormIn in;
  in.h = h_.get();
  in.ss = ss(2 * i);
  in.w = L.in_norm.get();
  in.eps = c.rms_eps;
  bf16* P = proj_.get();
  mark("attn.in_proj+norm", wbytes(L.attn_in.view));
  matvec_norm(L.attn_in.view, in, MatvecOut{P, false, proj_ld_}, stream_);  // [q+gate | k | v]
  attention_core_decode(st, i);
  mark("attn.o_proj+residual", wbytes(L.attn_o.view));
  matvec_residual(L.attn_o.view, mix_.get(), ResidualOut{h_.get(), ss(2 * i + 1)}, stream_);
}

void CudaModel::attention_core_decode(CudaState& st, int i, unsigned* merge_counters) {
  const ModelConfig& c = cfg_;
  DevLayer& L = layers_[i];
  CudaState::Layer& S = st.layers[i];
  QkvLayout lay{proj_.get(), proj_ld_, c.num_heads, c.num_kv_heads};
  mark("attn.q/k norm+rope+cache+split, merge", 2.0 * (st.n + 1) * c.kv_dim() * 2, 0, 2);
  attention_decode_fused(lay, st.pos.get(), L.q_norm.get(), L.k_norm.get(), c.rms_eps, c.rotary_dim,
                         c.rope_theta, S.K.get(), S.V.get(), kFusedDecodeSplits, attn_scratch_.get(),
                         mix_.get(), c.q_dim(), stream_, nullptr, merge_counters);
}

StepArgs CudaModel::step_args() {
  const ModelConfig& c = cfg_;
  StepArgs a;
  a.H = c.hidden_size;
  a.conv_dim = c.lin_conv_dim();
  a.value_dim = c.lin_value_dim();
  a.n_k_heads = c.lin_num_k_heads;
  a.n_v_heads = c.lin_num_v_heads;
  a.conv_kernel = c.conv_kernel;
  a.E = c.num_experts;
  a.K = c.experts_per_tok;
  a.I = c.moe_intermediate;
  a.eps = c.rms_eps;
  a.h = h_.get();
  a.ss = ss_parts_.get();
  a.proj = proj_.get();
  a.conv_out = conv_f32_.get();
  a.beta = beta_.get();
  a.g = g_.get();
  a.o = o_.get();
  a.gdn_counters = gdn_counters_.get();
  a.mix = mix_.get();
  a.logits = router_logits_.get();
  a.topk_idx = topk_idx_.get();
  a.topk_w = topk_w_.get();
  a.xn = xn_.get();
  a.act = act_.get();
  a.route_log = route_log_.get();
  return a;
}

namespace {

// Layer i as an entry of a persistent-step launch (StepMixer): a GDN layer, or an attention
// layer's in_proj (before its core) or o_proj and MoE (after it).
StepLayer step_layer(DevLayer& L, CudaState::Layer* S, int index, int mixer) {
  StepLayer s;
  s.mixer = mixer;
  s.index = index;
  s.in_norm = L.in_norm.get();
  if (mixer == kStepGdn) {
    s.gdn_in = L.gdn_in.view;
    s.gdn_out = L.gdn_out.view;
    s.conv_w = L.conv_w.get();
    s.A_log = L.A_log.get();
    s.dt_bias = L.dt_bias.get();
    s.gnorm = L.gnorm.get();
    if (S) {
      s.window = S->window.get();
      s.state = S->S.get();
    }
  } else {
    s.attn_in = L.attn_in.view;
    s.attn_o = L.attn_o.view;
  }
  s.post_norm = L.post_norm.get();
  s.router = L.router.view;
  s.gu = L.experts_gu.view;
  s.down = L.experts_down.view;
  return s;
}

}  // namespace

// Launches: the entries between two attention cores per launch (the o_proj and MoE of the
// attention layer before, the GDN layers, the in_proj of the attention layer after), at most
// kStepMaxLayers; `attn(i)` enqueues attention layer i's core, `launch(args)` a run.
template <typename Attn, typename Launch>
static void for_each_step_launch(std::vector<DevLayer>& layers, CudaState* st, StepArgs a, Attn&& attn,
                                 Launch&& launch) {
  a.n_layers = 0;
  auto flush = [&] {
    if (a.n_layers > 0) launch(a);
    a.n_layers = 0;
  };
  for (int i = 0; i < int(layers.size()); ++i) {
    auto add = [&](int mixer) {
      if (a.n_layers == kStepMaxLayers) flush();
      a.layer[a.n_layers++] = step_layer(layers[i], st ? &st->layers[i] : nullptr, i, mixer);
    };
    if (layers[i].kind == LayerKind::kLinear) {
      add(kStepGdn);
    } else {
      add(kStepAttnIn);
      flush();
      attn(i);
      add(kStepAttnOut);
    }
  }
  flush();
}

void CudaModel::plan_decode_step(const CudaPlanOptions& opt) {
  step_ok_ = false;
  batch_ok_ = false;
  batch_gu_grouped_ = false;
  // The shapes of the persistent step are also those the batched decode step is built for (the
  // fused head, the shared expert as a slot, products that fit the shared-memory kernel).
  if (!head_fused_) {
    step_why_ = "the lm_head is not 4-bit";
    return;
  }
  StepArgs a = step_args();
  for (int i = 0; i < cfg_.num_layers; ++i) {
    if (!layers_[i].sh_folded) {
      step_why_ = "the shared expert is not shaped like a routed one";
      return;
    }
    const bool gdn = layers_[i].kind == LayerKind::kLinear;
    for (int mixer : {gdn ? kStepGdn : kStepAttnIn, gdn ? kStepGdn : kStepAttnOut})
      if (!step_supported(step_layer(layers_[i], nullptr, i, mixer), a, &step_why_)) return;
  }
  // Alone, a one-token step runs the persistent step, which equals the per-op kernels (and so a
  // batched step's rows) bit for bit on a 132-multiprocessor card only (tests/gpu/test_step.cu).
  batch_ok_ = opt.decode == DecodeKernels::kPerOp || sm_count() == 132;
  batch_gu_grouped_ = batch_ok_ && experts_grouped_ok(layers_[0].experts_gu.view, cfg_.num_experts + 1);
  if (batch_gu_grouped_) {
    const int slots = kMaxBatch * (cfg_.experts_per_tok + 1);
    group_sorted_.resize(slots);
    group_items_.resize(expert_group_items_max(slots, cfg_.num_experts + 1));
    group_count_.resize(1);
  }
  if (opt.decode == DecodeKernels::kPerOp) {
    step_why_ = "per-op decode kernels requested";
    return;
  }
  int launches = 0;
  for_each_step_launch(
      layers_, nullptr, a, [](int) {}, [&](const StepArgs&) { ++launches; });
  int attn_layers = 0;
  for (const DevLayer& L : layers_) attn_layers += L.kind == LayerKind::kLinear ? 0 : 1;
  step_launches_ = std::max(1, launches);
  step_barriers_.resize(size_t(step_launches_) + size_t(attn_layers) * cfg_.num_kv_heads);
  route_log_.resize(size_t(cfg_.num_layers) * (cfg_.experts_per_tok + 1));
  step_ok_ = true;
  step_why_.clear();
}

void CudaModel::run_decode_persistent(CudaState& st, const int* ids) {
  const ModelConfig& c = cfg_;
  CUDA_CHECK(cudaMemsetAsync(step_barriers_.get(), 0, step_barriers_.bytes(), stream_));
  mark("embed", double(c.hidden_size) * 4);
  embed(embed_.view, ids, 1, h_.get(), stream_, ss_parts_.get());
  unsigned* barrier = step_barriers_.get();
  unsigned* merge = step_barriers_.get() + step_launches_;
  for_each_step_launch(
      layers_, &st, step_args(),
      [&](int i) {
        attention_core_decode(st, i, merge);
        merge += cfg_.num_kv_heads;
      },
      [&](StepArgs a) {
        a.barrier = barrier++;
        if (profile_step_) {
          mark("step.launch");
          const size_t per = size_t(kStepMaxProducts) * kStepStamps * sm_count();
          TANSY_CHECK(step_prof_.size() >= (prof_launches_.size() + 1) * per,
                      "decode step profile: buffer too small");
          a.prof = step_prof_.get() + prof_launches_.size() * per;
          prof_launches_.push_back(a);
        }
        decode_step_layers(a, stream_);
      });
  if (route_trace_) {
    const int K = c.experts_per_tok;
    std::vector<int32_t> log(size_t(c.num_layers) * (K + 1));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(
        cudaMemcpy(log.data(), route_log_.get(), log.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    for (int i = 0; i < c.num_layers; ++i)
      route_trace_(
          i, std::vector<int32_t>(log.begin() + size_t(i) * (K + 1), log.begin() + size_t(i) * (K + 1) + K));
  }
}

void CudaModel::run_decode_per_op(CudaState& st, const int* ids) {
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
      attention_mixer_decode(st, i);
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
    const double gu1 = wbytes(L.experts_gu.view.rows(0, 2 * I)), dn1 = wbytes(L.experts_down.view.rows(0, H));
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
}

}  // namespace tansy::cuda
