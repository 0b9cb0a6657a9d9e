#include "engine/prefix_cache.h"

#include <algorithm>
#include <iterator>

namespace tansy {

PrefixCache::Hit PrefixCache::lookup(Model& model, std::span<const int32_t> tokens, size_t max_len,
                                     std::unique_ptr<SequenceState>* into) {
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
  const int n = int(best->tokens.size());
  if (into && *into && model.copy_state(*best->state, **into)) return {std::move(*into), n};
  return {model.clone_state(*best->state), n};
}

std::unique_ptr<SequenceState> PrefixCache::insert(std::vector<int32_t> tokens,
                                                   std::unique_ptr<SequenceState> state, bool cold,
                                                   bool shared) {
  if (capacity_ == 0 || tokens.empty()) return state;
  std::unique_ptr<SequenceState> freed;
  auto drop = [&](std::list<Entry>::iterator it) {
    if (!freed) freed = std::move(it->state);
    return entries_.erase(it);
  };
  // A hot entry supersedes the entries it extends: the conversation they belonged to has moved on,
  // and keeping them would evict other conversations' states.
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& e = *it;
    const bool superseded = e.tokens.size() == tokens.size() || (!cold && !e.shared);
    if (e.tokens.size() <= tokens.size() && superseded &&
        std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin()))
      it = drop(it);
    else
      ++it;
  }
  if (cold)
    entries_.push_back({std::move(tokens), std::move(state), shared, true});
  else
    entries_.push_front({std::move(tokens), std::move(state), shared, false});
  while (entries_.size() > capacity_) {
    drop(std::prev(entries_.end()));
    ++evictions_;
  }
  return freed;
}

size_t PrefixCache::longest_common_prefix(std::span<const int32_t> tokens) const {
  size_t best = 0;
  for (const Entry& e : entries_) {
    if (e.cold) continue;
    const size_t n = std::min(e.tokens.size(), tokens.size());
    size_t i = 0;
    while (i < n && e.tokens[i] == tokens[i]) ++i;
    best = std::max(best, i);
  }
  return best;
}

std::unique_ptr<SequenceState> PrefixCache::pop_lru() {
  if (entries_.empty()) return nullptr;
  std::unique_ptr<SequenceState> s = std::move(entries_.back().state);
  entries_.pop_back();
  ++evictions_;
  return s;
}

}  // namespace tansy
