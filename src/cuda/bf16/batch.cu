// Continuous batching on the bf16 plan: an engine step's sequences in one call (feed_batch), the
// one-token ones in one batched decode step (run_decode_batch).
//
// Batch invariance: each sequence's arithmetic is what it gets alone. A prompt piece runs alone,
// as feeding it alone would. The batched decode step runs the per-op decode kernels with every
// sequence in its own grid row, each row computed by the same blocks in the same order as the
// one-row launch (matvec.cuh's DecodeRows), and ends with each row's fused head; alone, a
// one-token step runs the persistent step, which equals the per-op kernels bit for bit on a
// 132-multiprocessor card (plan_decode_step allows batching only there). The experts' gate|up is
// the exception to one row per grid row: the step's slots are grouped by expert, up to 8 as the
// columns of one tensor-core tile (matvec_swiglu_experts_grouped), each slot's column computing
// exactly what its one-slot launch computes. What batching saves: a layer's weights are read from
// memory once for all rows (the other rows' blocks find them in L2, the grouped experts' tiles
// are read once for their slots), and the launches are shared.
#include "cuda/bf16/plan.h"

namespace tansy::cuda {

void CudaModel::run_decode_batch(std::span<CudaState* const> sts, std::span<const int> limits) {
  const ModelConfig& c = cfg_;
  const int n = int(sts.size());
  const int H = c.hidden_size, E = c.num_experts, K = c.experts_per_tok;
  const int C = c.lin_conv_dim(), VD = c.lin_value_dim(), NV = c.lin_num_v_heads;
  const int64_t mix_ld = std::max(VD, c.q_dim());  // mix_'s rows: GDN outputs, attention outputs
  TANSY_CHECK(n >= 1 && n <= kMaxBatch && int(limits.size()) == n, "batched decode: {} rows outside 1..{}", n,
              kMaxBatch);
  float* h = h_.get();
  const int64_t ssl = ss_row_ld();
  auto ss = [&](int point) { return ss_parts_.get() + size_t(point) * kNormParts; };
  auto norm_in = [&](int point, const float* w, bf16* xn_out) {
    NormIn in;
    in.h = h;
    in.ss = ss(point);
    in.w = w;
    in.eps = c.rms_eps;
    in.xn_out = xn_out;
    return in;
  };
  DecodeRows rows;
  rows.n = n;
  rows.h = H;
  rows.ss = ssl;
  rows.xn = H;
  rows.conv = C;
  rows.gates = NV;
  rows.route = K + 1;
  // Stage marks (profile_decode_batch): bytes are what the stage must move at least, the dense
  // weights once for all rows, each row's experts, cache and recurrent state its own.
  const double gu1 = wbytes(layers_[0].experts_gu.view.rows(0, 2 * c.moe_intermediate));
  const double dn1 = wbytes(layers_[0].experts_down.view.rows(0, H));
  mark("embed", double(n) * H * 4);
  embed(embed_.view, d_ids_.get(), n, h, stream_, ss(0), ssl);
  for (int i = 0; i < c.num_layers; ++i) {
    DevLayer& L = layers_[i];
    bf16* P = proj_.get();
    const NormIn in = norm_in(2 * i, L.in_norm.get(), nullptr);
    const ResidualOut mixer_out{h, ss(2 * i + 1)};
    DecodeRows mixed = rows;  // the mixer's output rows in mix_
    mixed.y = mix_ld;
    if (L.kind == LayerKind::kLinear) {
      GdnInEpilogue ge;
      ge.conv_dim = C;
      ge.value_dim = VD;
      ge.n_v_heads = NV;
      ge.kernel = c.conv_kernel;
      ge.conv_w = L.conv_w.get();
      ge.window = sts[0]->layers[i].window.get();
      ge.A_log = L.A_log.get();
      ge.dt_bias = L.dt_bias.get();
      ge.conv_out = conv_f32_.get();
      ge.beta = beta_.get();
      ge.g = g_.get();
      DecodeRows pr = rows;
      pr.y = proj_ld_;
      for (int t = 0; t < n; ++t) pr.window[t] = sts[t]->layers[i].window.get();
      mark("gdn.in_proj+norm+conv+gates", wbytes(L.gdn_in.view));
      matvec_norm_gdn(L.gdn_in.view, in, P, ge, stream_, &pr);  // [qkv | z | a | b]
      GdnDecodeArgs ga;
      ga.conv = conv_f32_.get();
      ga.beta = beta_.get();
      ga.g = g_.get();
      ga.n_k_heads = c.lin_num_k_heads;
      ga.n_v_heads = NV;
      ga.state = sts[0]->layers[i].S.get();
      ga.z = P + C;
      ga.norm_w = L.gnorm.get();
      ga.eps = c.rms_eps;
      ga.o = o_.get();
      ga.counters = gdn_counters_.get();
      ga.y = mix_.get();
      GdnDecodeRows gr;
      gr.n = n;
      gr.conv = C;
      gr.gates = NV;
      gr.z = proj_ld_;
      gr.o = VD;
      gr.y = mix_ld;
      for (int t = 0; t < n; ++t) gr.state[t] = sts[t]->layers[i].S.get();
      mark("gdn.recurrence+norms", double(n) * 2.0 * NV * kGdnDim * kGdnDim * 4);
      gdn_decode_step(ga, stream_, &gr);
      mark("gdn.out_proj+residual", wbytes(L.gdn_out.view));
      matvec_residual(L.gdn_out.view, mix_.get(), mixer_out, stream_, &mixed);
    } else {
      mark("attn.in_proj+norm", wbytes(L.attn_in.view));
      matvec_norm(L.attn_in.view, in, MatvecOut{P, false, proj_ld_}, stream_, &rows);  // [q+gate | k | v]
      AttnDecodeRows ar;
      ar.n = n;
      for (int t = 0; t < n; ++t) {
        ar.pos[t] = sts[t]->pos.get();
        ar.k_cache[t] = sts[t]->layers[i].K.get();
        ar.v_cache[t] = sts[t]->layers[i].V.get();
      }
      QkvLayout lay{P, proj_ld_, c.num_heads, c.num_kv_heads};
      double kv = 0;
      for (int t = 0; t < n; ++t) kv += 2.0 * (sts[t]->n + 1) * c.kv_dim() * 2;
      mark("attn.q/k norm+rope+cache+split, merge", kv, 0, 2);
      attention_decode_fused(lay, ar.pos[0], L.q_norm.get(), L.k_norm.get(), c.rms_eps, c.rotary_dim,
                             c.rope_theta, ar.k_cache[0], ar.v_cache[0], kFusedDecodeSplits,
                             attn_scratch_.get(), mix_.get(), mix_ld, stream_, &ar);
      mark("attn.o_proj+residual", wbytes(L.attn_o.view));
      matvec_residual(L.attn_o.view, mix_.get(), mixer_out, stream_, &mixed);
    }
    // MoE: router (+ norm, + routing) -> experts gate|up (k + the shared one) -> down + combine + residual.
    const NormIn pin = norm_in(2 * i + 1, L.post_norm.get(), xn_.get());
    const ResidualOut moe_out{h, ss(2 * i + 2)};
    RouteEpilogue re;
    re.E = E;
    re.k = K;
    re.shared_slot = true;
    re.idx = topk_idx_.get();
    re.w = topk_w_.get();
    re.counter = route_counter_.get();
    DecodeRows rr = rows;
    rr.y = router_ld_;
    mark("moe.router+norm+topk", wbytes(L.router.view));
    matvec_norm_route(L.router.view, pin, router_logits_.get(), re, stream_, &rr);
    // Bytes: each row's slots read their expert's tiles (an upper bound when rows share experts,
    // which the grouped launch reads once for up to 8 slots).
    mark("moe.experts gate|up (k+shared)", double(n) * (K + 1) * gu1);
    if (batch_gu_grouped_)
      matvec_swiglu_experts_grouped(
          L.experts_gu.view, E + 1, topk_idx_.get(), n, K + 1, xn_.get(), H, act_.get(),
          ExpertGroups{group_sorted_.get(), group_items_.get(), group_count_.get()}, stream_);
    else
      matvec_swiglu_experts(L.experts_gu.view, E + 1, topk_idx_.get(), n, K + 1, xn_.get(), H, act_.get(),
                            stream_);
    mark("moe.experts down+combine+residual", double(n) * (K + 1) * dn1);
    moe_down_residual(L.experts_down.view, E + 1, topk_idx_.get(), topk_w_.get(), act_.get(), K + 1, nullptr,
                      nullptr, moe_out, stream_, &rows);
  }
  // The rows' fused head, kLmHeadRows rows per launch (the lm_head's weights read once for them),
  // each row's logits and token as the decode graph's lm_head_argmax computes them.
  for (int t0 = 0; t0 < n; t0 += kLmHeadRows) {
    LmHeadArgs a;
    a.W = lm_head_.view;
    a.x.h = h + size_t(t0) * H;
    a.x.ss = ss(2 * c.num_layers) + t0 * ssl;
    a.x.w = final_norm_.get();
    a.x.eps = c.rms_eps;
    a.x.xn_out = xn_.get() + size_t(t0) * H;
    a.logits = d_logits_.get() + size_t(t0) * c.vocab_size;
    a.limit = limits[t0];
    a.token = d_rows_tok_.get() + t0;
    a.scratch = d_head_scratch_.get();
    a.counter = head_counter_.get();
    LmHeadRows hr;
    hr.n = std::min(kLmHeadRows, n - t0);
    hr.h = H;
    hr.ss = ssl;
    hr.xn = H;
    for (int t = 0; t < hr.n; ++t) {
      hr.pos[t] = sts[t0 + t]->pos.get();
      hr.limit[t] = limits[t0 + t];
    }
    mark("final norm + lm_head + argmax + position", wbytes(lm_head_.view));
    lm_head_argmax_rows(a, hr, stream_);
  }
}

std::vector<StageTime> CudaModel::profile_decode_batch(std::span<SequenceState* const> states,
                                                       std::span<const int32_t> tokens) {
  TANSY_CHECK(batch_ok_, "profile_decode_batch: this plan does not batch ({})", step_why_);
  TANSY_CHECK(states.size() == tokens.size() && !states.empty() && int(states.size()) <= kMaxBatch,
              "profile_decode_batch: {} states for {} tokens (1..{})", states.size(), tokens.size(),
              kMaxBatch);
  std::vector<CudaState*> sts;
  std::vector<int> limits(states.size(), cfg_.vocab_size);
  for (size_t t = 0; t < states.size(); ++t) {
    auto& st = dynamic_cast<CudaState&>(*states[t]);
    check_ids(st, tokens.subspan(t, 1));
    sts.push_back(&st);
    h_rows_ids_[t] = tokens[t];
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpyAsync(d_ids_.get(), h_rows_ids_, sizeof(int32_t) * sts.size(), cudaMemcpyHostToDevice,
                             stream_));
  std::vector<Mark> marks;
  marks_ = &marks;
  try {
    run_decode_batch(sts, limits);
    mark("");
  } catch (...) {
    marks_ = nullptr;
    throw;
  }
  marks_ = nullptr;
  for (CudaState* st : sts) st->n += 1;
  return collect(marks);
}

int32_t CudaModel::batch_token(int row) {
  TANSY_CHECK(row >= 0 && row < kMaxBatch, "batch_token: row {} outside 0..{}", row, kMaxBatch - 1);
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // the step's tokens were copied to the host with it
  return h_rows_tok_[row];
}

// One token on a state with a decode graph: alone, the decode graph (the persistent step and
// the fused head) would run it, so in a batch it is a row of the batched decode step.
static bool decode_row(const FeedEntry& e) {
  const auto* st = dynamic_cast<const CudaState*>(e.state);
  return e.ids.size() == 1 && st && st->decode_graph != nullptr;
}

void CudaModel::feed_batch(std::span<const FeedEntry> entries) {
  if (entries.size() <= 1 || !batch_ok_ || hooked()) {
    if (entries.size() == 1 && entries[0].cut && cut_in_one_pass_ && !hooked()) {
      check_batch(entries);
      const FeedEntry& e = entries[0];
      return feed_cut_in_one_pass(e, [&](std::span<const int32_t> ids) {
        if (e.sampler)
          e.sampler->feed(*e.state, ids);
        else
          feed_device(dynamic_cast<CudaState&>(*e.state), ids, false);
      });
    }
    return Model::feed_batch(entries);
  }
  check_batch(entries);
  const size_t V = size_t(cfg_.vocab_size);
  // The previous step's copy of h_rows_ids_ (pinned: the copy reads it when the stream gets there)
  // must be done before the ids are overwritten; a step whose entries all lacked a sampler was not
  // waited for by anyone.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  // Decode rows first (0 .. D-1), then the prompt pieces that want a choice.
  std::vector<CudaState*> dec;
  std::vector<int> limits;
  std::vector<int> row_of(entries.size(), -1);
  for (size_t i = 0; i < entries.size(); ++i) {
    const FeedEntry& e = entries[i];
    auto& st = dynamic_cast<CudaState&>(*e.state);
    if (!decode_row(e)) continue;
    check_ids(st, e.ids);
    auto* rs = dynamic_cast<CudaRowSampler*>(e.sampler);
    row_of[i] = int(dec.size());
    h_rows_ids_[dec.size()] = e.ids[0];
    dec.push_back(&st);
    limits.push_back(rs ? rs->limit() : int(V));
  }
  int rows = int(dec.size());
  // Prompt pieces, each as feeding it alone would run it: each leaves its last row's logits in
  // row 0, moved to a row of its own (and for the plan's samplers its argmax taken) at once. Row
  // 0 is the first decode row's, written after every piece; in a step without decode rows it is
  // the last choosing piece's, so that piece is fed last (no later piece overwrites its logits).
  size_t keeps_row0 = entries.size();
  if (dec.empty())
    for (size_t i = 0; i < entries.size(); ++i)
      if (entries[i].sampler) keeps_row0 = i;
  auto feed_piece = [&](size_t i) {
    const FeedEntry& e = entries[i];
    auto& st = dynamic_cast<CudaState&>(*e.state);
    check_ids(st, e.ids);
    if (e.cut && cut_in_one_pass_) {
      feed_cut_in_one_pass(e, [&](std::span<const int32_t> ids) { feed_device(st, ids, false); });
    } else {
      std::span<const int32_t> ids = e.ids;
      if (e.cut) {  // the state at the cut, then the rest, as Model::feed_batch does
        feed_device(st, ids.first(e.cut), false);
        e.on_cut(st);
        ids = ids.subspan(e.cut);
      }
      feed_device(st, ids, false);
    }
    if (!e.sampler) return;
    const int r = i == keeps_row0 ? 0 : rows++;
    TANSY_CHECK(r < std::max(kLogitRows, kMaxBatch), "feed_batch: more rows than the batch logits hold");
    row_of[i] = r;
    if (r > 0)
      CUDA_CHECK(cudaMemcpyAsync(d_logits_.get() + size_t(r) * V, d_logits_.get(), sizeof(float) * V,
                                 cudaMemcpyDeviceToDevice, stream_));
    if (auto* rs = dynamic_cast<CudaRowSampler*>(e.sampler))
      argmax(d_logits_.get() + size_t(r) * V, rs->limit(), d_argmax_.get(), d_rows_tok_.get() + r, nullptr,
             nullptr, stream_);
  };
  if (keeps_row0 < entries.size()) rows = 1;
  for (size_t i = 0; i < entries.size(); ++i)
    if (!decode_row(entries[i]) && i != keeps_row0) feed_piece(i);
  if (keeps_row0 < entries.size()) feed_piece(keeps_row0);
  if (!dec.empty()) {
    CUDA_CHECK(cudaMemcpyAsync(d_ids_.get(), h_rows_ids_, sizeof(int32_t) * dec.size(),
                               cudaMemcpyHostToDevice, stream_));
    run_decode_batch(dec, limits);
    for (CudaState* st : dec) st->n += 1;
  }
  CUDA_CHECK(cudaMemcpyAsync(h_rows_tok_, d_rows_tok_.get(), sizeof(int32_t) * rows, cudaMemcpyDeviceToHost,
                             stream_));
  // Each sampler learns its row; host samplers (requests that asked for one) take theirs now.
  std::vector<float> host_row;
  for (size_t i = 0; i < entries.size(); ++i) {
    const FeedEntry& e = entries[i];
    if (!e.sampler) continue;
    auto& st = dynamic_cast<CudaState&>(*e.state);
    if (auto* rs = dynamic_cast<CudaRowSampler*>(e.sampler)) {
      rs->fed_row(st, row_of[i]);
      continue;
    }
    host_row.resize(V);
    CUDA_CHECK(cudaMemcpyAsync(host_row.data(), batch_logits(row_of[i]), sizeof(float) * V,
                               cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (!give_host_logits(e.sampler, host_row)) fail("feed_batch: a sampler of another backend");
  }
}

}  // namespace tansy::cuda
