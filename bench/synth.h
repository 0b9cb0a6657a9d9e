// Synthetic checkpoints: the exact tensor names, shapes, dtypes and quantization layout of
// mlx-community/Qwen3.6-35B-A3B-4bit (docs/MODEL.md §8.2-8.3), filled with deterministic random
// values at scales that keep hidden states of order 1, so that benchmarks and full-size tests
// run the real code paths without the real weights (docs/BENCHMARK.md "The weights").
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tansy {

// config.json of the real checkpoint as MODEL.md §1 and §8.3 describe it (VLM wrapper,
// text_config, quantization with 8-bit router and shared-expert-gate overrides).
nlohmann::json real_model_config_json();

// Completes a user-supplied config into the MLX wrapper form synth writes: a flat text config
// is wrapped under text_config; a missing `quantization` block gets the real model's
// (4-bit, group 64, 8-bit mlp.gate and mlp.shared_expert_gate for every layer), mirrored in
// quantization_config.
nlohmann::json complete_synth_config(nlohmann::json config);

struct SynthOptions {
  uint64_t seed = 0;
  int threads = 0;                        // 0: hardware concurrency
  size_t shard_bytes = size_t(5) << 30;   // start a new shard past this many data bytes
  size_t chunk_bytes = size_t(32) << 20;  // unit of work per thread and per write
  bool tokenizer = false;                 // also write_synthetic_tokenizer (before config.json)
  // Router skew alpha (0: off, the routers' rows all alike, near-uniform expert load). With
  // alpha > 0 each layer's router rows get per-expert multipliers such that, for router inputs
  // uncorrelated with the router rows, the expert of popularity rank r (1-based; a per-layer
  // permutation of the experts) is chosen by a fraction of tokens proportional to r^-alpha
  // (router_skew_rates). docs/BENCHMARK.md "Skewed routing".
  double router_skew = 0;
};

// Fraction of tokens choosing the expert of popularity rank r (0-based) among E with top-k
// routing under router skew alpha: k·(r+1)^-alpha / sum_j (j+1)^-alpha (sums to k). Throws Error
// when alpha is negative or so large that the most popular expert would need a rate above
// kMaxRouterSkewRate (scaling a router row cannot push its rate much past 1/2).
constexpr double kMaxRouterSkewRate = 0.4;
std::vector<double> router_skew_rates(int E, int k, double alpha);

// Per-rank multipliers of the router rows (RMS 1 over the experts) that give router_skew_rates:
// fitted once per (E, k, alpha) on a fixed sample of Gaussian logits (deterministic).
std::vector<float> router_skew_multipliers(int E, int k, double alpha);

struct SynthResult {
  size_t data_bytes = 0;  // tensor bytes over all shards
  int tensors = 0;
  int shards = 0;
  int tokenizer_ids = 0;   // with SynthOptions::tokenizer: the tokenizer's vocab_size()
  double tokenizer_s = 0;  // time spent writing it
};

// Writes DIR/config.json, DIR/model-0000k-of-0000N.safetensors and
// DIR/model.safetensors.index.json, plus the tokenizer files with SynthOptions::tokenizer. DIR
// must be absent or empty. Output depends only on (config, seed), never on the thread count.
// Throws Error.
SynthResult write_synthetic_checkpoint(const nlohmann::json& config, const std::filesystem::path& dir,
                                       const SynthOptions& opt);

struct ModelConfig;

// Synthetic tokenizers: a deterministic byte-level BPE vocabulary (256 byte tokens, then merges
// into ASCII pairs, two-byte UTF-8 characters and ASCII triples, every merged token complete
// UTF-8) plus added tokens, in the Hugging Face tokenizer.json format Tokenizer::load reads.
// It round-trips any text; it is not the real model's vocabulary.
struct SynthToken {
  std::string content;
  int32_t id = 0;
  bool special = false;
};
struct SynthTokenizerLayout {
  int n_ordinary = 0;             // ids [0, n_ordinary): byte tokens and merges
  std::vector<SynthToken> added;  // ids at or above n_ordinary
  int vocab_size() const;         // highest id + 1
};
// For the real configuration (ModelConfig::is_qwen36_35b_a3b): the real special-token ids
// (MODEL.md §9; see the source for which are UNVERIFIED) and 248070 ids in all, below the
// embedding's 248320 rows. Otherwise <|endoftext|>, <|im_start|>, <|im_end|>, <think>, </think>
// take the top five ids of vocab_size. Throws Error when the vocabulary is too small (< 261).
SynthTokenizerLayout synth_tokenizer_layout(const ModelConfig& cfg);
std::string synthetic_tokenizer_json(const SynthTokenizerLayout& layout);
// Writes DIR/tokenizer.json, DIR/tokenizer_config.json and DIR/chat_template.jinja (the Qwen3.6
// template tansy implements). Throws Error.
void write_synthetic_tokenizer(const ModelConfig& cfg, const std::filesystem::path& dir);

}  // namespace tansy
