#include "engine/stop.h"

#include <algorithm>

#include "core/error.h"

namespace tansy {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (auto& s : stops_) TANSY_CHECK(!s.empty(), "stop strings must not be empty");
}

const std::string& StopMatcher::matched() const {
  TANSY_CHECK(matched_ >= 0, "StopMatcher::matched() before a match");
  return stops_[size_t(matched_)];
}

std::string StopMatcher::push(std::string_view text) {
  if (stopped()) return {};
  held_.append(text);
  // Earliest match wins; at equal positions, the longer string (it contains the shorter one's start).
  size_t best = std::string::npos;
  for (size_t i = 0; i < stops_.size(); ++i) {
    size_t p = held_.find(stops_[i]);
    if (p != std::string::npos &&
        (p < best || (p == best && stops_[i].size() > stops_[size_t(matched_)].size()))) {
      best = p;
      matched_ = int(i);
    }
  }
  if (best != std::string::npos) {
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t keep = 0;
  for (auto& s : stops_) {
    for (size_t len = std::min(s.size() - 1, held_.size()); len > keep; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace tansy
