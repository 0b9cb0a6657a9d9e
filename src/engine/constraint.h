// What the decode loop needs from structured output: which tokens may come next. The loop calls
// fill_mask() before sampling a step while active(), and accept() after every emitted token
// (sampled or forced). The mask can be computed while the model runs the step's forward: it
// depends only on the tokens accepted so far.
#pragma once
#include <cstdint>
#include <span>

namespace tansy {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // False while the constraint does not apply yet (the reasoning before "</think>"): the step is
  // sampled freely.
  virtual bool active() const = 0;
  // The allowed next tokens as a bitmask (bit i % 32 of word i / 32 set: id i allowed); words past
  // the vocabulary are cleared. Never empty.
  virtual void fill_mask(std::span<uint32_t> bits) = 0;
  virtual void accept(int32_t token) = 0;
  // The document is complete: the end-of-turn token is allowed.
  virtual bool can_end() const = 0;
  // The document is complete and nothing may follow: generation ends here (finish "stop").
  virtual bool complete() const = 0;
};

}  // namespace tansy
