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
// (gemm, attention prefill, gdn_prefill) unless CudaPlanOptions asks for the GEMV kernels (a
// slower path kept for testing the two against each other).
#pragma once
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "cuda/attention/attention.cuh"
#include "cuda/backend.h"
#include "cuda/common/cuda_util.h"
#include "cuda/gdn/gdn.cuh"
#include "cuda/gemm/gemm.cuh"
#include "cuda/head/head.cuh"
#include "cuda/matvec/matvec.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/norm/norm.cuh"
#include "cuda/sample/sample.cuh"
#include "cuda/step/step.cuh"
#include "model/stage_profiler.h"
#include "model/weights.h"

namespace tansy::cuda {

constexpr int kChunk = 4096;             // tokens per forward chunk (bounds the scratch buffers)
constexpr int kLogitRows = 32;           // lm_head rows computed per pass when all positions are wanted
constexpr int kDecodeSplits = 128;       // key-range splits of the unfused decode attention (traced steps)
constexpr int kFusedDecodeSplits = 64;   // the same for the fused one-token kernel (2 x 64 blocks at 4,096)
constexpr int kPrefillSplitKeys = 2048;  // GEMV-path prefill: keys per split

// A device matrix assembled from row ranges of host matrices (views into the mapped checkpoint).
struct DevMatrix {
  DeviceBuffer<uint32_t> q;
  DeviceBuffer<bf16> scales, biases, w;
  DevLinear view;
};

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
  DevMatrix router_bf16;             // the same, dequantized: the prefill router's (gemm_bf16_wgmma.cu)
  DevMatrix experts_gu;              // [E' * 2I, H] interleaved gate/up per expert (E' = E+1 when folded)
  DevMatrix experts_down;            // [E' * H, I]
  DevMatrix sh_gu, sh_down;          // [2S, H] interleaved, [H, S] (empty when folded)
  bool sh_folded = false;            // the shared expert is expert E of experts_gu/experts_down
  DevLinear routed_gu, routed_down;  // views: the E routed experts
  DevLinear sh_gu_v, sh_down_v;      // views: the shared expert
};

// ---- per-sequence state ----

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

class CudaModel;

// The plan's samplers (greedy and the device sampler). Alone, a sequence's sampler feeds it
// (TokenSampler::feed); in a batched step (CudaModel::feed_batch) the plan feeds it and tells
// the sampler which row of the step's logits (and greedy tokens) is its own.
class CudaRowSampler : public TokenSampler {
 public:
  // The step that just ran left this sequence's logits in batch row `row` (st: after the feed).
  virtual void fed_row(CudaState& st, int row) = 0;
  // The argmax range of its greedy choice ([0, limit)).
  virtual int limit() const = 0;
};

class CudaModel final : public Model, public StageProfiler {
 public:
  CudaModel(const std::filesystem::path& dir, const CudaPlanOptions& opt);
  ~CudaModel() override;

  const ModelConfig& config() const override { return cfg_; }
  std::string backend_name() const override { return "cuda"; }
  std::string backend_plan() const override { return "cuda-bf16"; }
  // Whether one-token decode steps run the persistent step, and why not when they do not.
  bool decode_persistent() const { return step_ok_; }
  const std::string& decode_persistent_why() const { return step_why_; }
  // Tests: switches the decode kernels for states made from now on (their graphs are captured
  // with them); kPersistent takes effect only where the shapes allow it.
  void use_decode_kernels(DecodeKernels k) {
    plan_decode_step(CudaPlanOptions{tc_prefill_ ? PrefillKernels::kTensorCore : PrefillKernels::kGemv, k});
  }

  std::unique_ptr<SequenceState> new_state(int max_tokens) override { return make_state(max_tokens, true); }
  // CudaState: bf16 keys, values and conv windows, the f32 recurrent state.
  size_t state_bytes(int max_tokens) const override { return state_bytes_of(cfg_, max_tokens, 2, 2, 4); }
  bool states_on_device() const override { return true; }
  std::optional<size_t> free_state_memory() const override {
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  }

  // The decode graph is captured with the state (it bakes in the state's buffers), so that the
  // first generated token does not pay for capture and instantiation.
  std::unique_ptr<CudaState> make_state(int max_tokens, bool with_graph);

  bool reset_state(SequenceState& state) override;

  std::unique_ptr<SequenceState> clone_state(const SequenceState& src) override;
  // Enqueues the copies on the stream: the tokens' keys and values, pos, conv windows, GDN state.
  bool copy_state(const SequenceState& src, SequenceState& dst) override;

  void forward(SequenceState& state, std::span<const int32_t> ids, std::span<float> logits,
               bool all_positions) override;

  // ---- StageProfiler (`tansy bench --stages`): the same kernels launched eagerly, an event
  // between stages. Events break the launch overlap PDL gives the graph, so stage times sum to
  // more than a graph step.
  std::vector<StageTime> profile_decode_step(SequenceState& state, int32_t token) override;

  std::vector<StageTime> profile_prefill(SequenceState& state, std::span<const int32_t> ids) override;

  // One token: the decode graph with the token id moved in and out; a piece of prompt: the
  // chunked forward and the argmax of its last row. The logits stay on the device either way.
  int32_t greedy_step(SequenceState& state, std::span<const int32_t> ids, int limit) override;

  void generate_greedy(SequenceState& state, std::span<const int32_t> prompt, int n,
                       const std::function<bool(int32_t)>& on_token) override;

  // Sampling on the device (bf16/sampler.cu), each request with its own DeviceSampler (pooled).
  std::unique_ptr<TokenSampler> make_sampler(const SamplerSpec& spec) override;
  // The argmax on the device (greedy_step alone; the fused head's argmax of its row in a batch).
  std::unique_ptr<TokenSampler> make_greedy_sampler(int limit) override;

  // ---- continuous batching (bf16/batch.cu) ----
  // Sequences per step: kMaxBatch when one-token steps run the persistent step (the real model's
  // shapes), whose per-op kernels batch; else 1.
  int max_batch() const override { return batch_ok_ ? kMaxBatch : 1; }
  // One entry: fed alone. Several: prompt pieces one after another (as alone), then every
  // one-token entry in one batched decode step (run_decode_batch), each entry's logits in its
  // own row of batch_logits() for its sampler (the plan's, or a host sampler).
  void feed_batch(std::span<const FeedEntry> entries) override;
  // A FeedEntry's cut computed in the piece's one pass (the GDN delta rule run in two segments
  // split at the cut, the conv windows, GDN states, keys and values there copied into a scratch
  // state that on_cut is shown) instead of Model::feed_batch's two passes; on by default
  // (Golden.CutInOnePass, tests/gpu/test_model.cu). The scratch state (one of the fed state's
  // capacity, made on first use) is counted by scratch_states, so the engine's pool leaves room
  // for it. Off: the two passes (the tests' reference).
  int scratch_states() const override { return cut_in_one_pass_ ? 1 : 0; }
  void set_cut_in_one_pass(bool on) { cut_in_one_pass_ = on; }
  const float* batch_logits(int row) const { return d_logits_.get() + size_t(row) * cfg_.vocab_size; }
  // The greedy token of batch row `row` once the stream is done with the step.
  int32_t batch_token(int row);
  // StageProfiler-style stages of one batched decode step (a token per state), kernels launched
  // eagerly with an event between stages (tests/gpu/test_batch.cu's Batch.Profile).
  std::vector<StageTime> profile_decode_batch(std::span<SequenceState* const> states,
                                              std::span<const int32_t> tokens);
  // Device samplers are reused across requests (their buffers and pinned output stay allocated).
  std::unique_ptr<DeviceSampler> take_device_sampler();
  void return_device_sampler(std::unique_ptr<DeviceSampler> ds);
  // Feeds ids, leaving the logits after the last in device_logits() (one token: the decode
  // graph); enqueued on stream(), not waited for. token_on_device: ids is one token that the
  // stream has already written to device_token() (the device sampler's choice): no copy.
  void feed_device(CudaState& st, std::span<const int32_t> ids, bool token_on_device = false);
  const float* device_logits() const { return d_logits_.get(); }
  int32_t* device_token() { return d_tok_.get(); }  // the decode graph's input id
  cudaStream_t stream() const { return stream_; }

 private:
  void validate_config();

  void check_ids(const CudaState& st, std::span<const int32_t> ids);

  void upload(const ModelWeights& w);

  void allocate_scratch();

  // One eager decode step on a throwaway state: loads every decode kernel and sets its
  // attributes outside of any graph capture (lazy module loading must not happen mid-capture).
  void warm_up();

  int32_t fetch_token();

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

  void capture_decode_graph(CudaState& st);
  // Enqueues the copy of the keys and values of a's first n tokens into b (copy_state, cuts).
  void copy_keys(const CudaState& a, CudaState& b, int n);

  // Feeds the m ids in d_ids_ (host state advanced here); with cut_ set and its position in
  // this chunk, also writes the state there into cut_.dst.
  void run_chunk(CudaState& st, int m);
  // Feeds e's ids whole through `feed` with its cut computed in that pass (set_cut_in_one_pass),
  // then shows the state at the cut to e.on_cut.
  void feed_cut_in_one_pass(const FeedEntry& e, const std::function<void(std::span<const int32_t>)>& feed);

  // Feeds `ids` in chunks, then lm_head and the argmax over [0, limit) of the last row only,
  // the id moved to the host (d_tok_ holds it for a decode step that feeds it).
  int32_t prefill_argmax(CudaState& st, std::span<const int32_t> ids, int limit);

  // One decode step on the token id in d_tok_ (the decode graph's body): the layers, the final
  // norm, lm_head, the argmax over [0, limit) into d_tok_ and the position advance. The host's
  // st.n is the caller's to advance.
  void decode_step(CudaState& st, int limit);

  void lm_head(int row0, int rows);

  void trace_row(const std::string& name, const bf16* rows, int n, int dim);
  struct Mark {
    std::string name;  // "" ends the last stage
    cudaEvent_t ev = nullptr;
    double bytes = 0, flops = 0;
    int launches = 0;
  };
  // Starts stage `name` (ending the previous one) when profiling; otherwise nothing.
  void mark(std::string name, double bytes = 0, double flops = 0, int launches = 1);
  std::vector<StageTime> collect(std::vector<Mark>& marks);
  // Replaces the "step.launch" stages of a profiled step by its products' times (summed by kind),
  // the grid barriers between them, and the launches' remainder.
  std::vector<StageTime> fold_step_profile(std::vector<StageTime> stages);
  // Bytes a product must read: codes (or bf16 values) plus scales and biases.
  static double wbytes(const DevLinear& W);
  static double wflops(const DevLinear& W, int m) { return 2.0 * W.out * W.in * m; }

  // set_route_override: the m tokens just routed (stride ids per token) take the experts it gives,
  // weighted by this layer's own router logits (softmax renormalised over them, as the CPU
  // reference does); set_route_trace: the experts they use then.
  void report_routes(int layer, int m, int stride);
  // A test hook is set (trace, route trace or route override): such runs go eagerly, through the
  // per-op kernels for one token, where the host can see and change each layer's routing.
  bool hooked() const { return trace_ || route_trace_ || route_override_; }

  void trace_row(const std::string& name, const float* rows, int n, int dim);

  // The whole stack for m tokens whose ids are at `ids` (device); leaves final-normed rows in xn_
  // and advances the device position. Graph-capturable when tc is false.
  // cut (0 < cut < m; 0: none): also copies each layer's conv window and GDN state after the
  // chunk's first `cut` tokens, and the position there, into cut_.dst (run_chunk copies the keys).
  void run_layers(CudaState& st, const int* ids, int m, bool tc, int cut = 0);

  // One token, each norm / routing / GDN step fused into its neighbour (see the file comment).
  // The products that end a block add into the f32 residual row h_ in place and leave the partial
  // sums of its squares (ss_parts_, one row of kNormParts per norm point) for the next norm.
  // head == false leaves the final norm and the position to the fused head (decode_step).
  void run_decode_fused(CudaState& st, const int* ids, bool head = true);
  // The same step with the GDN layers and every MoE block in persistent launches (cuda/step/),
  // when step_ok_: the attention mixers between them stay per-op kernels.
  void run_decode_persistent(CudaState& st, const int* ids);
  void run_decode_per_op(CudaState& st, const int* ids);
  // One decode token of each state (ids in d_ids_, one per state), the per-op kernels with each
  // state's row in a grid row, ending with each row's fused head (logits in row t of d_logits_,
  // its argmax over [0, limits[t]) in d_rows_tok_[t], the state's position advanced).
  void run_decode_batch(std::span<CudaState* const> sts, std::span<const int> limits);
  // Elements between the rows of the norm partials (ss_parts_) of a batched step.
  int64_t ss_row_ld() const { return int64_t(2 * cfg_.num_layers + 1) * kNormParts; }
  // Attention layer i's mixer for one token: in_proj (+ norm), the fused attention, o_proj (+ residual).
  void attention_mixer_decode(CudaState& st, int i);  // in_proj, core, o_proj
  // q/k norm, RoPE, cache write, attention; with merge_counters (n_kv, zero) in one launch
  void attention_core_decode(CudaState& st, int i, unsigned* merge_counters = nullptr);
  // Decides step_ok_ from the uploaded shapes (after upload).
  void plan_decode_step(const CudaPlanOptions& opt);
  // The model's dimensions and the plan's scratch for the persistent step (no layers).
  StepArgs step_args();

  // Projection: GEMV for decode, tensor-core GEMM for prefill.
  void project(const DevLinear& W, const bf16* X, int64_t ldx, int m, void* Y, bool f32, int64_t ldy,
               bool tc);

  // at_cut: the state after the first `cut` of the m tokens goes there (run_layers' cut).
  void gdn(DevLayer& L, CudaState::Layer& S, int m, bool tc, int cut = 0, CudaState::Layer* at_cut = nullptr);

  void attention(DevLayer& L, CudaState& st, CudaState::Layer& S, int m, bool tc);

  // true: it also ran the next RMSNorm (h += the MoE output, xn = norm(h) · next_norm) in its
  // combine; false: the MoE output is in r_ and the caller runs add_rmsnorm.
  bool moe(int layer, DevLayer& L, int m, bool tc, const float* next_norm);

  ModelConfig cfg_;
  cudaStream_t stream_ = nullptr;
  // Prefill's shared expert runs on side_ beside the routed experts (moe(), tensor-core path):
  // fork_ orders it after the router's input, join_ orders the combine after it.
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  bool tc_prefill_ = true;  // prefill on the tensor-core kernels (else the GEMV ones: tests)
  // A cut computed in one pass (set_cut_in_one_pass): the state after `at` tokens (counted from
  // the start of the sequence) is written into dst while the piece is fed.
  struct Cut {
    CudaState* dst = nullptr;
    int at = 0;
  };
  Cut cut_;
  std::unique_ptr<CudaState> cut_state_;  // cut_.dst: made on first use, at the fed state's capacity
  bool cut_in_one_pass_ = true;
  bool head_fused_ = true;  // decode ends with lm_head_argmax (4-bit lm_heads)
  bool step_ok_ = false;    // decode runs the persistent step (plan_decode_step)
  std::string step_why_;    // why not, when it does not
  DevMatrix embed_, lm_head_;
  DeviceBuffer<float> final_norm_;
  std::vector<DevLayer> layers_;

  // Scratch, sized for kChunk tokens (m = tokens in flight).
  int64_t proj_ld_ = 0, router_ld_ = 0;
  DeviceBuffer<int> d_ids_;  // [kChunk] input ids
  DeviceBuffer<int> d_tok_;  // [1] the decode step's input id, overwritten by its argmax
  DeviceBuffer<float> h_;    // [m, H] residual stream (f32)
  DeviceBuffer<float>
      ss_parts_;  // decode: [kMaxBatch][2 * layers + 1, kNormParts] partial sums of h² per norm point
  DeviceBuffer<bf16> xn_, r_;     // [m, H] normed input, mixer/MoE output
  DeviceBuffer<float> conv_f32_;  // decode: [kMaxBatch, conv_dim] GDN conv output
  // last-block counters of fused decode kernels: [kMaxBatch, n_v_heads], [kMaxBatch]
  DeviceBuffer<unsigned> gdn_counters_, route_counter_;
  // persistent step: one grid counter per launch of a step, then n_kv counters per attention
  // layer (the splits' merge in the attention kernel), zeroed together at the step's start
  DeviceBuffer<unsigned> step_barriers_;
  int step_launches_ = 0;
  DeviceBuffer<int> route_log_;  // persistent step: [layers, K + 1] routed experts
  // `tansy bench --stages` of the persistent step: its in-kernel time stamps (StepArgs::prof) per
  // launch, and the launches they belong to.
  DeviceBuffer<unsigned long long> step_prof_;
  std::vector<StepArgs> prof_launches_;
  bool profile_step_ = false;
  DeviceBuffer<bf16> proj_;            // [m, proj_ld] fused input projections
  DeviceBuffer<bf16> conv_y_;          // [m, conv_dim] conv output, q/k normalised
  DeviceBuffer<float> beta_, g_;       // [m, n_v_heads]
  DeviceBuffer<float> o_;              // [m, value_dim] GDN output before the gated norm
  DeviceBuffer<bf16> mix_;             // [m, max(value_dim, q_dim)] input of out_proj / o_proj
  DeviceBuffer<float> router_logits_;  // [m, router_ld]
  DeviceBuffer<int> topk_idx_;         // [m, k]
  DeviceBuffer<float> topk_w_;         // [m, k]
  DeviceBuffer<bf16> act_;             // [m*k, I] routed experts' SwiGLU activations
  DeviceBuffer<bf16> sh_act_;          // [m, S]
  DeviceBuffer<bf16> sh_out_;          // [m, H] shared expert output (prefill)
  DeviceBuffer<float> attn_scratch_;   // split-attention partials
  DeviceBuffer<float> d_logits_;       // [max(kLogitRows, kMaxBatch), vocab]
  DeviceBuffer<unsigned long long> d_argmax_;
  DeviceBuffer<unsigned long long> d_head_scratch_;  // fused head: one argmax candidate per block (and row)
  DeviceBuffer<unsigned> head_counter_;
  DeviceBuffer<int> expert_offsets_, tile_offsets_, sorted_slot_, slot_row_;  // prefill MoE routing
  DeviceBuffer<int> route_work_;  // [2E + 1] moe_route_sort's counters (left zero by every sort)
  DeviceBuffer<bf16> yd_;         // [m*k, H] routed experts' down outputs in sorted order
  std::vector<std::unique_ptr<DeviceSampler>> sampler_pool_;  // device samplers no request holds
  bool batch_ok_ = false;                                     // max_batch() > 1
  // The batched step's experts gate|up, expert by expert (matvec_swiglu_experts_grouped): each
  // expert's tiles read once for its up to 8 slots of the step. Set when its tiles exist.
  bool batch_gu_grouped_ = false;
  DeviceBuffer<int> group_sorted_;      // [kMaxBatch*(k+1)] slots by expert
  DeviceBuffer<int4> group_items_;      // [expert_group_items_max(kMaxBatch*(k+1), E+1)]
  DeviceBuffer<int> group_count_;       // [1] items written
  DeviceBuffer<int> d_rows_tok_;        // [kMaxBatch] a batched step's greedy tokens
  int32_t* h_rows_tok_ = nullptr;       // pinned [kMaxBatch]
  int32_t* h_rows_ids_ = nullptr;       // pinned [kMaxBatch] a batched step's input ids
  int32_t* h_tok_ = nullptr;            // pinned
  int greedy_limit_ = 0;                // argmax range captured into new decode graphs
  std::vector<Mark>* marks_ = nullptr;  // set while a StageProfiler call runs
};

}  // namespace tansy::cuda
