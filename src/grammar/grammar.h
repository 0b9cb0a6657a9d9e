// A context-free grammar over bytes and the machinery that turns it into token masks.
//
// Grammar: rules with alternatives, each a sequence of byte sets and rule references (no left
// recursion; compile() refuses it). The parser state is a set of stacks of grammar positions (a
// nondeterministic pushdown automaton, as in llama.cpp's GBNF matcher): the top of every stack
// is a byte set, the frames below are return positions. Stacks are hash-consed into a tree, and
// whole states (a sorted set of stacks plus "the input may end here") are interned too, so that
// advancing a state by a byte is a table lookup once it has been seen.
//
// The mask of a state comes from one walk of a trie of the vocabulary's byte strings, pruned
// where the state dies; its result is cached per state, since the same state recurs (inside a
// string, between array items). Tokens that are not text (special tokens) are never in the trie.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tansy::grammar {

struct ByteSet {
  uint64_t w[4] = {0, 0, 0, 0};
  bool has(uint8_t b) const { return (w[b >> 6] >> (b & 63)) & 1; }
  void add(uint8_t b) { w[b >> 6] |= uint64_t(1) << (b & 63); }
  void add_range(int lo, int hi) {
    for (int b = lo; b <= hi; ++b) add(uint8_t(b));
  }
  bool empty() const { return !(w[0] | w[1] | w[2] | w[3]); }
  bool operator==(const ByteSet&) const = default;
};

class Grammar {
 public:
  // A symbol: >= 0 is a rule id, < 0 is byte set number -(s + 1).
  using Sym = int32_t;

  // Limits that keep a hostile schema's grammar (and its compile time) bounded.
  static constexpr size_t kMaxRules = 1'000'000, kMaxSymbols = 4'000'000;
  int add_rule(std::string name);  // an empty rule; give it alternatives with add_alt
  void add_alt(int rule, std::vector<Sym> seq);
  Sym bytes(const ByteSet& s);
  Sym byte(uint8_t b);
  // A rule matching exactly `text` (shared between equal texts).
  int literal(std::string_view text);
  int rule_count() const { return int(rules_.size()); }
  const std::string& rule_name(int r) const { return rules_[size_t(r)].name; }
  void set_root(int r) { root_ = r; }

  // Flattens the rules; fails (tansy::Error) on left recursion, an undefined rule or a root that
  // derives no finite string.
  void compile();
  bool compiled() const { return !elems_.empty(); }

  // --- compiled form, read by the matcher ---
  enum class Kind : uint8_t { kBytes, kRef, kEnd };
  struct Elem {
    Kind kind;
    int32_t arg;  // kBytes: set index; kRef: rule id
  };
  std::vector<Elem> elems_;
  std::vector<std::vector<int32_t>> alt_starts_;  // per rule: positions in elems_
  std::vector<int32_t> rest_;                     // per position: fewest bytes to the end of its alternative
  std::vector<int32_t> min_len_;                  // per rule: fewest bytes it derives
  std::vector<ByteSet> sets_;
  int root_ = -1;

 private:
  struct Rule {
    std::string name;
    std::vector<std::vector<Sym>> alts;
  };
  std::vector<Rule> rules_;
  std::unordered_map<std::string, int> literals_;
  size_t symbols_ = 0;
};

// The byte strings of a vocabulary, as a trie in preorder (children after their parent, a
// subtree contiguous), so that a walk is a forward scan that skips dead subtrees.
class VocabTrie {
 public:
  // token_bytes[id]: the bytes of token id; ids with empty bytes (special tokens) are left out.
  explicit VocabTrie(const std::vector<std::string>& token_bytes, bool split_plain = true);
  int vocab_size() const { return vocab_; }
  size_t nodes() const { return byte_.size(); }

  std::vector<uint8_t> byte_;       // the byte leading into the node (node 0: the root, unused)
  std::vector<uint16_t> depth_;     // root 0
  std::vector<int32_t> end_;        // one past the node's subtree
  std::vector<int32_t> tok_begin_;  // tokens spelling exactly this node: ids_[tok_begin_[n], tok_begin_[n+1])
  std::vector<int32_t> ids_;
  int max_depth_ = 0;
  // Plain tokens: printable ASCII without '"', '\\' or '<'. Inside a string every plain byte
  // takes a state to one and the same next state (itself in a free string, the next count in a
  // bounded one), so a token's fate depends only on its length; where that holds the plain tokens
  // are decided by length and only the others (rest_, a trie of its own) need a walk.
  std::vector<int32_t> plain_ids_;     // by length
  std::vector<int32_t> plain_by_len_;  // plain_ids_[plain_by_len_[L], plain_by_len_[L+1]): length L
  ByteSet plain_bytes_;
  std::unique_ptr<VocabTrie> rest_;

 private:
  int vocab_ = 0;
};

// A compiled grammar's shared runtime: stack and state tables, the per-state advance tables and
// the mask cache. Shared by every request with the same grammar; internally locked.
class Runtime {
 public:
  Runtime(std::shared_ptr<const Grammar> g, std::shared_ptr<const VocabTrie> trie);

  static constexpr int32_t kDead = -2;
  int32_t initial();
  // The state after byte b, or kDead.
  int32_t advance(int32_t state, uint8_t b);
  int32_t advance(int32_t state, std::string_view bytes);
  bool accepting(int32_t state);  // the input may end here
  bool finished(int32_t state);   // accepting and nothing may follow
  // Tokens (ids < bits.size() * 32) whose bytes keep the input valid. With budget >= 0, only
  // those after which the document can still be finished in `budget` more tokens (see cost());
  // returns false when no token qualifies (the caller then falls back to no budget).
  bool mask(int32_t state, std::span<uint32_t> bits, int budget = -1);
  // Tokens needed, at most, to finish from `state`: 0 when finished, else the fewest bytes to an
  // accepting state plus one (an end-of-turn token); each byte is one token in a byte-level vocabulary.
  int32_t cost(int32_t state);
  const VocabTrie& trie() const { return *trie_; }
  size_t states() const;

 private:
  struct State {
    std::vector<int32_t> stacks;  // sorted stack node ids
    bool accept = false;
    int32_t cost = 0;
    int32_t plain_next = -1;  // the state every plain byte leads to (kDead too); kMixed; -1 unknown
  };
  struct StackNode {
    int32_t pos, parent, dist;
  };
  struct MaskEntry {
    std::vector<uint32_t> bits;
    int32_t max_cost = 0;  // the largest cost() after an allowed token
  };
  int32_t intern_stack(int32_t pos, int32_t parent);
  void expand(int32_t pos, int32_t parent, std::vector<int32_t>& out, bool& accept, int depth);
  int32_t intern_state(std::vector<int32_t>& stacks, bool accept);
  int32_t step(int32_t state, uint8_t b);  // locked by the caller
  static constexpr int32_t kMixed = -3;
  int32_t plain_next(int32_t state);
  int32_t walk(int32_t state, std::span<uint32_t> bits, int budget, bool& any);

  std::shared_ptr<const Grammar> g_;
  std::shared_ptr<const VocabTrie> trie_;
  std::mutex mu_;
  std::vector<StackNode> stack_nodes_;
  std::unordered_map<uint64_t, int32_t> stack_ids_;
  std::vector<State> states_;
  // Per state: 256 successors (-1 unknown, kDead) and the cost, flat for the trie walk's inner loop.
  std::vector<int32_t> next_;
  std::vector<int32_t> costs_;
  std::unordered_map<std::string, int32_t> state_ids_;
  std::unordered_map<int32_t, MaskEntry> masks_;
  size_t mask_bytes_ = 0;
  int32_t initial_ = -1;
  std::vector<int32_t> walk_states_;  // per trie depth
  std::vector<int32_t> scratch_;
};

}  // namespace tansy::grammar
