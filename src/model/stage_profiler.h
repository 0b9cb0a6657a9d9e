// Per-stage breakdown hook for `tansy bench --stages` (docs/PERFORMANCE.md). A backend's Model that
// also derives from StageProfiler gets its stages timed and reported next to the floors; the bench
// says plainly when the backend does not. The backend places the marks (it alone knows its stages);
// the bench drives the calls and reports.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/model.h"

namespace tansy {

struct StageTime {
  std::string name;  // e.g. "gdn.in_proj", "moe.experts", "lm_head"; repeated layers summed
  double ms = 0;     // device time summed over the step (or prefill)
  double bytes = 0;  // minimum bytes the stage must move (0: not counted)
  double flops = 0;  // floating-point operations (0: not counted)
  int launches = 0;  // kernel launches summed into ms
};

class StageProfiler {
 public:
  virtual ~StageProfiler() = default;
  // Feeds `token` as one decode step after what `state` holds, timing each stage (advances it).
  virtual std::vector<StageTime> profile_decode_step(SequenceState& state, int32_t token) = 0;
  // Feeds `ids` after what `state` holds, timing each stage (advances it).
  virtual std::vector<StageTime> profile_prefill(SequenceState& state, std::span<const int32_t> ids) = 0;
};

}  // namespace tansy
