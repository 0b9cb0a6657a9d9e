#include "text/detokenizer.h"

namespace tansy {

std::string StreamDecoder::push(int32_t id) {
  std::string bytes = tok_.token_bytes(id);  // validates id even when it is skipped
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += bytes;
  // Invalid bytes before a still-completable tail decode the same now as they would later, because
  // the tail starts at a lead byte that no earlier sequence can absorb.
  size_t keep = utf8_incomplete_tail(pending_);
  std::string out = utf8_lossy(std::string_view(pending_).substr(0, keep));
  pending_.erase(0, keep);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace tansy
