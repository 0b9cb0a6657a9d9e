// Prefix cache: sequence states (KV cache, GDN conv and recurrent state) saved at cut points
// and keyed by the exact token prefix they hold, so that the next turn of a conversation
// resumes from the longest stored prefix instead of prefilling it again. Least recently used
// entries are evicted. Not thread-safe: only the engine's thread uses it.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <vector>

#include "model/model.h"

namespace tansy {

class PrefixCache {
 public:
  explicit PrefixCache(size_t capacity) : capacity_(capacity) {}

  struct Hit {
    std::unique_ptr<SequenceState> state;  // a private copy, holding exactly n_tokens tokens
    int n_tokens = 0;
  };
  // The longest stored prefix of `tokens` no longer than max_len tokens; state is null on a miss.
  // A hit's copy goes into the state `into` holds when there is one and the backend can copy into
  // it (Model::copy_state: no allocation on the request's path), the hit then owning it; else it
  // is a clone, and `into` is left as it was.
  Hit lookup(Model& model, std::span<const int32_t> tokens, size_t max_len,
             std::unique_ptr<SequenceState>* into = nullptr);
  // Stores `state`, which holds exactly `tokens`, as the most recently used entry (or, when
  // `cold`, as the least recently used one: kept only while there is room). Replaces an entry
  // with the same key; a hot entry also replaces the entries whose tokens it extends. Returns one
  // state the cache let go of (not stored, replaced or evicted) for the caller to reuse, or null.
  // A `shared` entry holds a prefix that several conversations begin with (a system prompt):
  // no entry supersedes it; it leaves only as the least recently used.
  std::unique_ptr<SequenceState> insert(std::vector<int32_t> tokens, std::unique_ptr<SequenceState> state,
                                        bool cold = false, bool shared = false);
  // The longest prefix `tokens` has in common with the tokens of an entry stored hot (whether or
  // not the entry is a prefix of `tokens`). Cold entries (a generation's end state) do not count:
  // the next turn of their conversation re-renders the answer they end with.
  size_t longest_common_prefix(std::span<const int32_t> tokens) const;

  // Lets go of the least recently used entry (the caller needs its room); null when empty.
  std::unique_ptr<SequenceState> pop_lru();

  size_t capacity() const { return capacity_; }
  // Before the first insert (the engine sizes the cache once it knows its pool).
  void set_capacity(size_t capacity) { capacity_ = capacity; }
  size_t size() const { return entries_.size(); }
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  // Entries let go of for room (over capacity, or pop_lru), not those replaced by a newer state.
  uint64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::unique_ptr<SequenceState> state;
    bool shared = false;
    bool cold = false;  // stored cold
  };
  size_t capacity_;
  std::list<Entry> entries_;  // most recently used first
  uint64_t hits_ = 0, misses_ = 0, evictions_ = 0;
};

}  // namespace tansy
