// Sampling on the device: penalties, logit bias, the allowed-token mask, temperature, top_k,
// min_p, top_p, the seeded draw, and logprobs with top alternatives, in one cooperative launch
// after the decode step, with only the chosen token (and the logprobs asked for) copied back.
//
// CPU reference: tansy::Sampler / tansy::sample_adjusted (engine/sampler.cpp), which follows the
// rule of engine/sample_math.h bit for bit: given the same logits, parameters and draw, both pick
// the same token. Logprobs: tansy::logprobs_of (the same ids; values to float rounding).
// GPU tests: tests/gpu/test_sample.cu.
//
// How (sample.cu): one block per multiprocessor, each owning a contiguous slice of the vocabulary
// in registers; the blocks meet at grid barriers (counters in global memory) between phases:
//   1. penalised logits, their maximum (the greedy choice) and the count of finite ones;
//   2. when top_k or min_p cut the candidates: the n-th best by a 4-pass radix select over the
//      logits' order-preserving keys (8 bits a pass, histograms in global memory);
//   3. at most kSampleGather candidates: gathered, sorted and finished by one block (top_p over
//      the sorted masses, the draw over the kept ids); more: top_p by a radix select weighted by
//      the integer masses, then the draw by block prefix sums of the kept masses.
//   Ties at a selected key are broken by id with one more barrier, only when they matter.
//   The deciding block writes the output into mapped host memory (no copy on the stream) and,
//   when asked, the chosen token into the decode graph's input (no upload on the next feed).
#pragma once
#include <cstdint>
#include <span>

#include "cuda/common/cuda_util.h"
#include "engine/sampler.h"

namespace tansy::cuda {

constexpr int kMaxTopLogprobs = 20;  // OpenAI's limit for top_logprobs
constexpr int kSampleGather = 1024;  // candidates finished by one block

struct SampleOutput {
  int32_t token = -1;
  float logprob = 0;  // of `token` under the raw logits (when logprobs were asked for)
  int32_t n_top = 0;
  int32_t top_id[kMaxTopLogprobs] = {};
  float top_logprob[kMaxTopLogprobs] = {};
};

// One sequence's sampler: its penalty state (counts of generated ids, the repetition penalty's
// set of seen ids, the logit bias) lives on the device and is updated by the launch that picks a
// token, so a step needs no upload unless a mask is given.
class DeviceSampler {
 public:
  explicit DeviceSampler(int vocab);
  ~DeviceSampler();
  DeviceSampler(const DeviceSampler&) = delete;
  DeviceSampler& operator=(const DeviceSampler&) = delete;

  // Starts a request: parameters, penalty state from the prompt (repetition) and nothing generated.
  void begin(const SamplingParams& p, std::span<const int32_t> prompt, cudaStream_t stream);

  // Enqueues the choice of a token from logits[0, limit) (device, f32) with the draw R
  // (sample_math::draw_bits(seed, position)). allowed: a host bitmask over the vocabulary (bit i % 32
  // of word i / 32), or null; copied with the launch. forced >= 0: that token is taken without a
  // draw (only its logprobs and the penalty counts are computed). n_logprobs: -1 none, else the
  // chosen token's logprob and that many alternatives (<= kMaxTopLogprobs). token_out: null, or a
  // device int the chosen token is also written to (the decode graph's input).
  void enqueue(const float* logits, int limit, uint64_t R, const uint32_t* allowed, int32_t forced,
               int n_logprobs, cudaStream_t stream, int32_t* token_out = nullptr);

  // The result of the last enqueue, once the stream has synchronised (written by the kernel
  // into mapped host memory).
  const SampleOutput& output() const { return *out_host_; }

 private:
  int vocab_ = 0, blocks_ = 0;
  SamplingParams p_;
  bool has_bias_ = false;
  int parity_ = 0;
  DeviceBuffer<int> counts_;        // [vocab] times each id was generated
  DeviceBuffer<uint32_t> seen_;     // [vocab / 32] repetition penalty: prompt and generated ids
  DeviceBuffer<float> bias_;        // [vocab] logit_bias (only read when there is one)
  DeviceBuffer<uint32_t> allowed_;  // [vocab / 32] the step's mask
  DeviceBuffer<unsigned char> scratch_;
  SampleOutput* out_host_ = nullptr;  // pinned, mapped
  SampleOutput* out_dev_ = nullptr;   // its device address
  uint32_t* mask_host_ = nullptr;     // pinned staging for the mask
};

}  // namespace tansy::cuda
