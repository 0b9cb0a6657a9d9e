// MoE routing on the device (docs/MODEL.md §6 steps 1-2). CPU reference: cpu::route_topk.
#pragma once
#include <cstdint>

#include "cuda/cuda_util.h"

namespace tansy::cuda {

constexpr int kRouteMaxExperts = 1024;
constexpr int kRouteMaxTopK = 16;

// For each token t < n: softmax (f32) over logits[t*ld .. t*ld+E), top-k (ties to the lower
// index), renormalised. idx int32 [n, k], w f32 [n, k], in descending weight order.
void route_topk(const float* logits, int64_t ld, int n, int E, int k, int* idx, float* w,
                cudaStream_t stream);

}  // namespace tansy::cuda
