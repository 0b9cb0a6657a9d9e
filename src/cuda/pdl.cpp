#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_set>

#include "cuda/pdl.cuh"

namespace tansy::cuda {

int smem_carveout() {
  static const int pct = [] {
    const char* v = std::getenv("TANSY_SMEM_CARVEOUT");
    if (!v || !*v) return -1;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end != '\0' || n < 0 || n > 100) fail("TANSY_SMEM_CARVEOUT must be a percentage 0..100, not '{}'", v);
    return int(n);
  }();
  return pct;
}

void prefer_carveout(const void* kern) {
  static std::mutex mu;
  static std::unordered_set<const void*> done;
  std::lock_guard lk(mu);
  if (!done.insert(kern).second) return;
  CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, smem_carveout()));
}

}  // namespace tansy::cuda
