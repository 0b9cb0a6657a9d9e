#include "engine/prefix_cache.h"

#include <algorithm>

namespace tansy {

PrefixCache::Hit PrefixCache::lookup(Model& model, std::span<const int32_t> tokens, size_t max_len) {
  auto best = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    const auto& k = it->tokens;
    if (k.empty() || k.size() > max_len || k.size() > tokens.size()) continue;
    if (best != entries_.end() && k.size() <= best->tokens.size()) continue;
    if (std::equal(k.begin(), k.end(), tokens.begin())) best = it;
  }
  if (best == entries_.end()) {
    ++misses_;
    return {};
  }
  ++hits_;
  entries_.splice(entries_.begin(), entries_, best);
  return {model.clone_state(*best->state), int(best->tokens.size())};
}

void PrefixCache::insert(std::vector<int32_t> tokens, std::unique_ptr<SequenceState> state, bool cold) {
  if (capacity_ == 0 || tokens.empty()) return;
  // A hot entry supersedes the entries it extends: the conversation they belonged to has moved on,
  // and keeping them would evict other conversations' states.
  entries_.remove_if([&](const Entry& e) {
    return e.tokens.size() <= tokens.size() && (!cold || e.tokens.size() == tokens.size()) &&
           std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin());
  });
  if (cold) entries_.push_back({std::move(tokens), std::move(state)});
  else entries_.push_front({std::move(tokens), std::move(state)});
  while (entries_.size() > capacity_) entries_.pop_back();
}

}  // namespace tansy
