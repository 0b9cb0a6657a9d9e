#include "model/model.h"

#include <vector>

#include "core/error.h"
#include "cpu/backend.h"
#include "model/backend_choice.h"
#ifdef TANSY_HAVE_CUDA_BACKEND
#include "cuda/backend.h"
#endif

namespace tansy {

int32_t argmax(std::span<const float> v) {
  if (v.empty()) fail("argmax of an empty vector");
  size_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[best]) best = i;
  return int32_t(best);
}

void Model::generate_greedy(SequenceState& state, std::span<const int32_t> prompt, int n,
                            const std::function<bool(int32_t)>& on_token) {
  std::vector<float> logits(size_t(config().vocab_size));
  forward(state, prompt, logits, false);
  for (int i = 0; i < n; ++i) {
    int32_t next = argmax(logits);
    if (!on_token(next) || i + 1 == n) return;
    forward(state, std::span<const int32_t>(&next, 1), logits, false);
  }
}

int32_t Model::greedy_step(SequenceState& state, std::span<const int32_t> ids, int limit) {
  const int V = config().vocab_size;
  if (limit < 1 || limit > V) fail("greedy_step: limit {} outside 1..{}", limit, V);
  if (ids.empty()) fail("greedy_step: no ids to feed");
  std::vector<float> logits(static_cast<size_t>(V));
  forward(state, ids, logits, false);
  return argmax(std::span<const float>(logits.data(), size_t(limit)));
}

std::unique_ptr<Model> open_model(const std::filesystem::path& dir, const ModelOptions& opt) {
  if (opt.backend == "cpu") return make_cpu_model(dir, opt);
  if (opt.backend == "cuda") {
    [[maybe_unused]] const PrecisionChoice pc = choose_cuda_precision(
        opt.cuda_precision, opt.cuda_precision == "auto" ? checkpoint_bytes(dir.string()) : 0);
#ifdef TANSY_HAVE_CUDA_BACKEND
    return pc.precision == "f32" ? make_cuda_f32_model(dir) : make_cuda_model(dir);
#else
    fail("this build of tansy has no CUDA backend (built without nvcc)");
#endif
  }
  fail("unknown backend '{}' (expected cpu or cuda)", opt.backend);
}

}  // namespace tansy
