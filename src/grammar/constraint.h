// The grammar-backed TokenConstraint, and the per-tokenizer vocabulary it masks over.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/constraint.h"
#include "grammar/grammar.h"
#include "text/tokenizer.h"

namespace tansy::grammar {

// The vocabulary as byte strings and its trie (special tokens excluded); build once per tokenizer
// (some 100 ms for 150k tokens) and share.
struct Vocabulary {
  std::vector<std::string> bytes;  // per id; empty for special tokens
  std::shared_ptr<const VocabTrie> trie;
  static std::shared_ptr<const Vocabulary> of(const Tokenizer& tok);
};

struct ConstraintOptions {
  std::vector<int32_t> end_tokens;     // end-of-turn ids: allowed only where the document is complete
  std::optional<int32_t> start_after;  // inactive until this token is emitted ("</think>")
  int max_tokens = -1;  // the request's budget: the document is closed within it when it can be
};

class GrammarConstraint : public TokenConstraint {
 public:
  GrammarConstraint(std::shared_ptr<Runtime> rt, std::shared_ptr<const Vocabulary> vocab,
                    ConstraintOptions opt);
  bool active() const override { return active_; }
  void fill_mask(std::span<uint32_t> bits) override;
  void accept(int32_t token) override;
  bool can_end() const override;
  bool complete() const override;

 private:
  std::shared_ptr<Runtime> rt_;
  std::shared_ptr<const Vocabulary> vocab_;
  ConstraintOptions opt_;
  bool active_;
  bool ended_ = false;  // an end-of-turn token was accepted
  int32_t state_;
  int accepted_ = 0;
};

// Runtimes by grammar key (the schema text and framing), so that requests repeating a schema
// reuse its compiled grammar and mask cache. `build` makes the grammar on a miss.
std::shared_ptr<Runtime> cached_runtime(const std::string& key, std::shared_ptr<const Vocabulary> vocab,
                                        const std::function<std::shared_ptr<Grammar>()>& build);

}  // namespace tansy::grammar
