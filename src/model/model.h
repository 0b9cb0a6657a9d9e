// The backend-neutral model interface: one loaded checkpoint on one backend, and the
// per-sequence state (KV cache, conv windows, GDN recurrent state) it extends.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/config.h"

namespace tansy {

// State of one sequence: every token fed so far. Backend-specific.
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  virtual int n_tokens() const = 0;
};

// What a request asks of the sampler: its parameters, the prompt (the repetition penalty's set;
// the first sampled token sits at position prompt.size()), the ids it may choose from [0, limit)
// and how many logprob alternatives it wants (-1: no logprobs).
struct SamplerSpec {
  SamplingParams params;
  std::span<const int32_t> prompt;
  int limit = 0;
  int logprobs = -1;
};

struct SampleChoice {
  int32_t token = -1;
  std::optional<LogprobInfo> logprobs;  // when the spec asked for them
};

// Feeds one request's tokens and chooses its next ones, on the backend that holds the logits
// (Model::make_sampler). Every choice follows the reference Sampler's rule (engine/sample_math.h).
class TokenSampler {
 public:
  virtual ~TokenSampler() = default;
  // Feeds ids after what `state` holds. May return before the backend is done (the CUDA plan
  // enqueues the step), so that the caller can prepare the next mask meanwhile.
  virtual void feed(SequenceState& state, std::span<const int32_t> ids) = 0;
  // The next token after what was fed: drawn among the ids `allowed` permits (a bitmask over
  // [0, limit), bit i % 32 of word i / 32; null: all), or `forced` when >= 0. Either way it counts
  // for the penalties from now on, and the next choice is at the next position.
  virtual SampleChoice next(const uint32_t* allowed, int32_t forced) = 0;
  // True when feed() only enqueues the step (CUDA): work between feed() and next() (the engine
  // computes the constraint's mask there) overlaps the step.
  virtual bool feed_is_async() const { return false; }
};

// One sequence's part of an engine step (Model::feed_batch): `ids` fed after what `state` holds;
// `sampler`, when set, is the sequence's sampler, which chooses the token after the last of them
// (TokenSampler::next) once the step has run. Null: no choice is wanted (a piece of prompt that
// does not end it, or a step whose next token is forced).
// `cut` (0 < cut < ids.size(); 0: none) marks a state the prefix cache keeps: during the feed,
// on_cut is called once with a state that holds what `state` held plus ids [0, cut), which it
// may copy but not keep. Model::feed_batch feeds such a piece in two parts and shows `state`
// itself between them, so the piece costs two passes over the weights; a backend that computes
// the piece in one pass and shows a copy of its state at the cut overrides that.
struct FeedEntry {
  SequenceState* state = nullptr;
  std::span<const int32_t> ids;
  TokenSampler* sampler = nullptr;
  size_t cut = 0;
  std::function<void(const SequenceState&)> on_cut = {};
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string backend_name() const = 0;
  // The backend and, where it has several, its plan: "cpu", "cuda-bf16", "cuda-f32".
  virtual std::string backend_plan() const { return backend_name(); }

  // Fresh state able to hold up to max_tokens tokens.
  virtual std::unique_ptr<SequenceState> new_state(int max_tokens) = 0;
  // Empties `state` for reuse as a fresh state of the same capacity, keeping its buffers (on
  // CUDA also its captured decode graph, so a reused state costs no allocation or capture).
  // Returns false when the backend cannot (the caller then makes a new state).
  virtual bool reset_state(SequenceState& state) {
    (void)state;
    return false;
  }
  // Deep copy (prefix cache).
  virtual std::unique_ptr<SequenceState> clone_state(const SequenceState& s) = 0;
  // Makes `dst` hold exactly the tokens `src` holds, in dst's own buffers (on CUDA dst also keeps
  // its captured decode graph, which points at them): a copy into a state made beforehand costs
  // no allocation or capture, which clone_state's new state does. dst must have src's capacity
  // (new_state's max_tokens); otherwise it is an error. The CUDA plan only enqueues the copies on
  // its stream, which every later use of either state follows. Returns false when the backend
  // cannot (the caller then clones).
  virtual bool copy_state(const SequenceState& src, SequenceState& dst) {
    (void)src;
    (void)dst;
    return false;
  }
  // copy_state's precondition, one error for every backend: dst and src hold up to as many tokens.
  static void check_copy_capacity(int dst_max_tokens, int src_max_tokens);

  // Feeds `ids` after what `state` holds. Writes logits [n, vocab] when all_positions, else
  // [vocab] for the last position only. Results do not depend on how a prompt is split.
  virtual void forward(SequenceState& state, std::span<const int32_t> ids, std::span<float> logits,
                       bool all_positions) = 0;

  // Greedy continuation: feeds `prompt`, then generates n tokens by argmax, calling on_token
  // for each as soon as it is on the host (on_token returns false to stop early).
  // Backends override this with a path that keeps the token on the device.
  virtual void generate_greedy(SequenceState& state, std::span<const int32_t> prompt, int n,
                               const std::function<bool(int32_t)>& on_token);

  // Greedy step: feeds `ids` (one decode token, or a piece of prompt) after what `state` holds
  // and returns the argmax of the logits after the last of them over ids [0, limit)
  // (1 <= limit <= vocab_size; ties to the lower id). The default runs forward() and an argmax
  // on the host; the CUDA backend keeps the logits on the device (one token: its decode graph)
  // and moves only the token id.
  virtual int32_t greedy_step(SequenceState& state, std::span<const int32_t> ids, int limit);

  // How many sequences feed_batch runs as one batch, each layer's weights read once for all of
  // them. 1: the backend feeds sequences one at a time (the engine then runs one at a time).
  virtual int max_batch() const { return 1; }
  // Feeds every entry in one step (at most max_batch() of them, each state at most once);
  // afterwards each entry's sampler may choose. Every entry's result is bit for bit what feeding
  // it alone gives: a sequence's tokens do not depend on what else is in the batch. One entry is
  // fed alone (its sampler's feed). Several: the default (forward_batch) needs host samplers
  // (make_host_sampler, or make_greedy_sampler's), which take their rows of the batch's logits;
  // a backend with its own batched step overrides this and takes its own samplers.
  virtual void feed_batch(std::span<const FeedEntry> entries);

  // Bytes one state able to hold max_tokens tokens takes at most, and the memory free for states
  // now (nullopt: the backend does not know). The engine sizes its pool of states from them.
  virtual size_t state_bytes(int max_tokens) const = 0;
  virtual std::optional<size_t> free_state_memory() const { return std::nullopt; }
  // States the backend makes for itself beside the ones it is given (each at most state_bytes of
  // the fed states' capacity), which the engine keeps room for in its pool: the bf16 plan's
  // scratch state for a cut computed in the piece's one pass.
  virtual int scratch_states() const { return 0; }
  // True when the states live in memory of their own (a GPU's), which the prefix cache may then
  // fill by default (EngineOptions::prefix_cache_entries); host memory is shared with the rest of
  // the machine.
  virtual bool states_on_device() const { return false; }

  // A sampler choosing the argmax over [0, limit) (ties to the lower id), the reference Sampler's
  // greedy rule: through greedy_step for a backend that feeds one sequence at a time (on CUDA the
  // logits stay on the device), else a host sampler, so that greedy sequences batch with the rest.
  virtual std::unique_ptr<TokenSampler> make_greedy_sampler(int limit);

  // A sampler for one request. The default computes logits with forward() and chooses on the
  // host with Sampler; the CUDA plan chooses on the device and moves only the choice.
  virtual std::unique_ptr<TokenSampler> make_sampler(const SamplerSpec& spec);
  // The host sampler, whatever the backend (tests compare the two).
  std::unique_ptr<TokenSampler> make_host_sampler(const SamplerSpec& spec);

  // Debugging and layer-by-layer tests: when set, forward() reports named intermediates of the
  // last position fed ("layer.{i}.mixer_out", "layer.{i}.moe_out", "layer.{i}.hidden", "final_norm"),
  // each as f32 values. Slow; off by default.
  using TraceFn = std::function<void(const std::string& name, std::span<const float> values)>;
  virtual void set_trace(TraceFn fn) { trace_ = std::move(fn); }

  // Tests: when set, every MoE layer reports the routed experts it used (after a route override),
  // idx [n, k] for the n tokens of the call (slow: the CUDA backend synchronises per layer; its
  // decode stays in the persistent step unless a route override is set too).
  using RouteTraceFn = std::function<void(int layer, std::span<const int32_t> idx)>;
  void set_route_trace(RouteTraceFn fn) { route_trace_ = std::move(fn); }
  // Tests: when set, MoE layer `layer` hands the override its own top-k in idx [n, k]; if the
  // override returns true, the layer routes its n tokens to the experts it wrote there instead,
  // weighted by its own softmax renormalised over them. Lets one path follow another's experts
  // where two experts' probabilities are within rounding of each other, so the two can be compared
  // tightly. The CPU reference and the CUDA bf16 plan honour it (the bf16 plan's one-token steps
  // then run its per-op kernels, eagerly); the CUDA f32 plan refuses it.
  using RouteOverrideFn = std::function<bool(int layer, int n, std::span<int32_t> idx)>;
  void set_route_override(RouteOverrideFn fn) { route_override_ = std::move(fn); }
  // A route override's weights for one token: its router logits [E] softmax-renormalised over the
  // experts `forced` names, into w[j * w_stride]; an expert outside 0..E-1 is an error.
  static void override_weights(const float* logits, int E, std::span<const int32_t> forced, float* w,
                               int w_stride = 1);

 protected:
  // feed_batch's batched form, for backends with max_batch() > 1: feeds each piece after its
  // state and writes logits [n, vocab_size], one row per piece with want_logits, in order.
  struct BatchPiece {
    SequenceState* state = nullptr;
    std::span<const int32_t> ids;
    bool want_logits = false;
  };
  virtual void forward_batch(std::span<const BatchPiece> pieces, std::span<float> logits);
  // feed_batch's checks: at most max_batch() entries, each with a state and ids, no state twice,
  // a cut inside its ids with someone to show it to.
  void check_batch(std::span<const FeedEntry> entries) const;
  // The default treatment of a cut: feeds ids [0, cut) alone (no logits wanted) and shows the
  // state to on_cut; returns the ids still to feed (all of them when the entry has no cut).
  std::span<const int32_t> feed_to_cut(const FeedEntry& e);
  // Hands a host sampler (make_host_sampler's) its row of a batch's logits; false for another kind.
  bool give_host_logits(TokenSampler* sampler, std::span<const float> row) const;

  TraceFn trace_;
  RouteTraceFn route_trace_;
  std::vector<float> scratch_logits_;  // feed_batch: logits nobody reads, or the batch's rows
  RouteOverrideFn route_override_;
};

struct ModelOptions {
  std::string backend = "cpu";  // "cpu" or "cuda"
  int threads = 0;              // CPU backend: 0 = all cores
  // CUDA backend: "bf16" (the fast plan), "f32" (the CPU reference's arithmetic on the device) or
  // "auto" (f32 for checkpoints of at most 1 GiB); see model/backend_choice.h.
  std::string cuda_precision = "bf16";
};

// Loads DIR (config.json + safetensors) onto the chosen backend. Throws Error.
std::unique_ptr<Model> open_model(const std::filesystem::path& dir, const ModelOptions& opt);

int32_t argmax(std::span<const float> v);

// Bytes of one sequence's state able to hold max_tokens tokens, given each part's element size:
// keys and values per attention layer, the conv window and the recurrent state per GDN layer.
size_t state_bytes_of(const ModelConfig& c, int max_tokens, size_t kv_elem, size_t window_elem,
                      size_t recurrent_elem);

}  // namespace tansy
