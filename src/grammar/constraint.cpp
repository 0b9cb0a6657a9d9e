#include "grammar/constraint.h"

#include <algorithm>
#include <list>
#include <mutex>

#include "core/error.h"

namespace tansy::grammar {

std::shared_ptr<const Vocabulary> Vocabulary::of(const Tokenizer& tok) {
  auto v = std::make_shared<Vocabulary>();
  v->bytes.resize(size_t(tok.vocab_size()));
  for (int32_t id = 0; id < tok.vocab_size(); ++id)
    if (tok.is_valid(id) && !tok.is_special(id)) v->bytes[size_t(id)] = tok.token_bytes(id);
  v->trie = std::make_shared<VocabTrie>(v->bytes);
  return v;
}

GrammarConstraint::GrammarConstraint(std::shared_ptr<Runtime> rt, std::shared_ptr<const Vocabulary> vocab,
                                     ConstraintOptions opt)
    : rt_(std::move(rt)), vocab_(std::move(vocab)), opt_(std::move(opt)), active_(!opt_.start_after) {
  state_ = rt_->initial();
}

void GrammarConstraint::fill_mask(std::span<uint32_t> bits) {
  TANSY_CHECK(active_, "structured output: mask asked for before the document starts");
  if (ended_) {
    // Past the end of turn (ignore_eos): the document is over, only end-of-turn tokens follow.
    std::fill(bits.begin(), bits.end(), 0u);
    for (int32_t e : opt_.end_tokens)
      if (size_t(e) < bits.size() * 32) bits[size_t(e) >> 5] |= 1u << (e & 31);
    return;
  }
  // Tokens left after this one; a document is kept closable within them where possible.
  const int budget = opt_.max_tokens >= 0 ? opt_.max_tokens - accepted_ - 1 : -1;
  const bool can_end = rt_->accepting(state_);
  // No token leaves room to finish: end here if the document is complete, else (it will be cut
  // anyway) continue without the budget.
  if (!rt_->mask(state_, bits, budget) && !can_end) rt_->mask(state_, bits, -1);
  bool any = false;
  for (uint32_t w : bits) any = any || w != 0;
  if (can_end || !any)
    for (int32_t e : opt_.end_tokens)
      if (size_t(e) < bits.size() * 32) bits[size_t(e) >> 5] |= 1u << (e & 31);
}

void GrammarConstraint::accept(int32_t token) {
  ++accepted_;
  if (!active_) {
    if (opt_.start_after && token == *opt_.start_after) active_ = true;
    return;
  }
  if (ended_) return;
  if (std::find(opt_.end_tokens.begin(), opt_.end_tokens.end(), token) != opt_.end_tokens.end()) {
    ended_ = true;
    return;
  }
  TANSY_CHECK(token >= 0 && size_t(token) < vocab_->bytes.size() && !vocab_->bytes[size_t(token)].empty(),
              "structured output: token {} has no text", token);
  int32_t next = rt_->advance(state_, vocab_->bytes[size_t(token)]);
  TANSY_CHECK(next != Runtime::kDead, "structured output: token {} does not continue the document", token);
  state_ = next;
}

bool GrammarConstraint::can_end() const { return active_ && rt_->accepting(state_); }

bool GrammarConstraint::complete() const { return active_ && !ended_ && rt_->finished(state_); }

std::shared_ptr<Runtime> cached_runtime(const std::string& key, std::shared_ptr<const Vocabulary> vocab,
                                        const std::function<std::shared_ptr<Grammar>()>& build) {
  struct Entry {
    std::string key;
    std::shared_ptr<const Vocabulary> vocab;  // held: its address identifies it
    std::shared_ptr<Runtime> rt;
  };
  static std::mutex mu;
  static std::list<Entry> lru;  // most recent first
  constexpr size_t kEntries = 32;
  {
    std::lock_guard lk(mu);
    for (auto it = lru.begin(); it != lru.end(); ++it)
      if (it->key == key && it->vocab == vocab) {
        lru.splice(lru.begin(), lru, it);
        return lru.front().rt;
      }
  }
  auto rt = std::make_shared<Runtime>(build(), vocab->trie);
  std::lock_guard lk(mu);
  lru.push_front({key, vocab, rt});
  if (lru.size() > kEntries) lru.pop_back();
  return rt;
}

}  // namespace tansy::grammar
