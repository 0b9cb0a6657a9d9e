#include "grammar/grammar.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace tansy::grammar {

namespace {
constexpr int32_t kInf = std::numeric_limits<int32_t>::max() / 4;
int32_t add_sat(int32_t a, int32_t b) { return std::min(kInf, a + b); }
}  // namespace

int Grammar::add_rule(std::string name) {
  TANSY_CHECK(rules_.size() < kMaxRules, "the grammar would exceed {} rules", kMaxRules);
  rules_.push_back({std::move(name), {}});
  return int(rules_.size()) - 1;
}

void Grammar::add_alt(int rule, std::vector<Sym> seq) {
  symbols_ += seq.size() + 1;
  TANSY_CHECK(symbols_ <= kMaxSymbols, "the grammar would exceed {} symbols", kMaxSymbols);
  rules_[size_t(rule)].alts.push_back(std::move(seq));
}

Grammar::Sym Grammar::bytes(const ByteSet& s) {
  for (size_t i = 0; i < sets_.size(); ++i)
    if (sets_[i] == s) return -Sym(i) - 1;
  sets_.push_back(s);
  return -Sym(sets_.size());
}

Grammar::Sym Grammar::byte(uint8_t b) {
  ByteSet s;
  s.add(b);
  return bytes(s);
}

int Grammar::literal(std::string_view text) {
  auto it = literals_.find(std::string(text));
  if (it != literals_.end()) return it->second;
  std::vector<Sym> seq;
  for (char c : text) seq.push_back(byte(uint8_t(c)));
  std::string name = "'";
  name.append(text);
  name += '\'';
  int r = add_rule(std::move(name));
  add_alt(r, std::move(seq));
  literals_[std::string(text)] = r;
  return r;
}

void Grammar::compile() {
  TANSY_CHECK(root_ >= 0 && root_ < int(rules_.size()), "grammar: no root rule");
  const size_t n = rules_.size();
  for (auto& r : rules_)
    for (auto& alt : r.alts)
      for (Sym s : alt) TANSY_CHECK(s < int(n), "grammar: rule '{}' refers to an undefined rule", r.name);
  // Fewest bytes each rule derives (a fixed point from "infinite").
  min_len_.assign(n, kInf);
  auto seq_len = [&](const std::vector<Sym>& alt) {
    int32_t t = 0;
    for (Sym s : alt) t = add_sat(t, s < 0 ? 1 : min_len_[size_t(s)]);
    return t;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      int32_t best = min_len_[r];
      for (auto& alt : rules_[r].alts) best = std::min(best, seq_len(alt));
      if (best < min_len_[r]) min_len_[r] = best, changed = true;
    }
  }
  TANSY_CHECK(min_len_[size_t(root_)] < kInf, "grammar: rule '{}' derives no finite text",
              rules_[size_t(root_)].name);
  // Alternatives that can never finish are dropped: every state the matcher reaches can then be
  // completed, so a mask never admits a token that leads into a dead end.
  std::vector<std::vector<const std::vector<Sym>*>> live(n);
  for (size_t r = 0; r < n; ++r)
    for (auto& alt : rules_[r].alts)
      if (seq_len(alt) < kInf) live[r].push_back(&alt);
  // Left recursion (a rule reaching itself before consuming a byte) would make expansion loop.
  std::vector<int> color(n, 0);
  auto dfs = [&](auto& self, size_t r) -> void {
    color[r] = 1;
    for (auto* alt : live[r])
      for (Sym s : *alt) {
        if (s < 0) break;
        if (color[size_t(s)] == 1) fail("grammar: rule '{}' is left-recursive", rules_[size_t(s)].name);
        if (color[size_t(s)] == 0) self(self, size_t(s));
        if (min_len_[size_t(s)] > 0) break;
      }
    color[r] = 2;
  };
  for (size_t r = 0; r < n; ++r)
    if (color[r] == 0) dfs(dfs, r);

  elems_.clear();
  rest_.clear();
  alt_starts_.assign(n, {});
  for (size_t r = 0; r < n; ++r)
    for (auto* alt : live[r]) {
      alt_starts_[r].push_back(int32_t(elems_.size()));
      size_t first = elems_.size();
      for (Sym s : *alt) elems_.push_back(s < 0 ? Elem{Kind::kBytes, -s - 1} : Elem{Kind::kRef, s});
      elems_.push_back({Kind::kEnd, 0});
      rest_.resize(elems_.size(), 0);
      for (size_t p = elems_.size() - 1; p-- > first;) {
        const Elem& e = elems_[p];
        rest_[p] = add_sat(rest_[p + 1], e.kind == Kind::kBytes ? 1 : min_len_[size_t(e.arg)]);
      }
    }
}

// ---- vocabulary trie ----------------------------------------------------------------------

VocabTrie::VocabTrie(const std::vector<std::string>& token_bytes, bool split_plain)
    : vocab_(int(token_bytes.size())) {
  if (split_plain) {
    std::vector<std::string> rest = token_bytes;
    for (size_t i = 0; i < token_bytes.size(); ++i) {
      const std::string& s = token_bytes[i];
      bool plain = !s.empty();
      for (unsigned char c : s) plain = plain && c >= 0x20 && c <= 0x7E && c != '"' && c != '\\' && c != '<';
      if (!plain) continue;
      plain_ids_.push_back(int32_t(i));
      for (unsigned char c : s) plain_bytes_.add(c);
      rest[i].clear();
    }
    std::stable_sort(plain_ids_.begin(), plain_ids_.end(), [&](int32_t a, int32_t b) {
      return token_bytes[size_t(a)].size() < token_bytes[size_t(b)].size();
    });
    size_t longest = plain_ids_.empty() ? 0 : token_bytes[size_t(plain_ids_.back())].size();
    plain_by_len_.assign(longest + 2, 0);
    for (int32_t id : plain_ids_) ++plain_by_len_[token_bytes[size_t(id)].size() + 1];
    for (size_t l = 1; l < plain_by_len_.size(); ++l) plain_by_len_[l] += plain_by_len_[l - 1];
    rest_ = std::make_unique<VocabTrie>(rest, false);
  }
  std::vector<int32_t> order;
  for (size_t i = 0; i < token_bytes.size(); ++i)
    if (!token_bytes[i].empty()) order.push_back(int32_t(i));
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return token_bytes[size_t(a)] < token_bytes[size_t(b)]; });
  auto new_node = [&](uint8_t b, int d) {
    byte_.push_back(b);
    depth_.push_back(uint16_t(d));
    end_.push_back(0);
    tok_begin_.push_back(int32_t(ids_.size()));
    max_depth_ = std::max(max_depth_, d);
    return int32_t(byte_.size()) - 1;
  };
  std::vector<int32_t> path = {new_node(0, 0)};
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& s = token_bytes[size_t(id)];
    TANSY_CHECK(s.size() < 65535, "vocabulary: token {} is too long", id);
    size_t l = 0;
    if (prev)
      while (l < prev->size() && l < s.size() && (*prev)[l] == s[l]) ++l;
    while (path.size() > l + 1) {
      end_[size_t(path.back())] = int32_t(byte_.size());
      path.pop_back();
    }
    for (size_t k = l; k < s.size(); ++k) path.push_back(new_node(uint8_t(s[k]), int(k + 1)));
    ids_.push_back(id);  // the newest node is path.back(): its tokens stay contiguous
    prev = &s;
  }
  while (!path.empty()) {
    end_[size_t(path.back())] = int32_t(byte_.size());
    path.pop_back();
  }
  tok_begin_.push_back(int32_t(ids_.size()));
}

// ---- runtime ------------------------------------------------------------------------------

Runtime::Runtime(std::shared_ptr<const Grammar> g, std::shared_ptr<const VocabTrie> trie)
    : g_(std::move(g)), trie_(std::move(trie)) {
  TANSY_CHECK(g_->compiled(), "grammar: not compiled");
  walk_states_.resize(size_t(trie_->max_depth_) + 1);
}

int32_t Runtime::intern_stack(int32_t pos, int32_t parent) {
  uint64_t key = (uint64_t(uint32_t(pos)) << 32) | uint32_t(parent + 1);
  auto it = stack_ids_.find(key);
  if (it != stack_ids_.end()) return it->second;
  int32_t dist = add_sat(g_->rest_[size_t(pos)], parent >= 0 ? stack_nodes_[size_t(parent)].dist : 0);
  stack_nodes_.push_back({pos, parent, dist});
  int32_t id = int32_t(stack_nodes_.size()) - 1;
  stack_ids_.emplace(key, id);
  return id;
}

// Brings the stack (pos on top of parent) to positions where a byte is read: references are
// entered (their return position pushed unless it ends the alternative: tail calls keep
// repetitions flat) and ended alternatives return to their caller.
void Runtime::expand(int32_t pos, int32_t parent, std::vector<int32_t>& out, bool& accept, int depth) {
  TANSY_CHECK(depth < 100000, "grammar: expansion too deep");
  const auto& elems = g_->elems_;
  for (;;) {
    const Grammar::Elem& e = elems[size_t(pos)];
    if (e.kind == Grammar::Kind::kBytes) {
      out.push_back(intern_stack(pos, parent));
      return;
    }
    if (e.kind == Grammar::Kind::kEnd) {
      if (parent < 0) {
        accept = true;
        return;
      }
      const StackNode node = stack_nodes_[size_t(parent)];
      pos = node.pos;
      parent = node.parent;
      continue;
    }
    int32_t ret = pos + 1;
    int32_t caller = elems[size_t(ret)].kind == Grammar::Kind::kEnd ? parent : intern_stack(ret, parent);
    const auto& starts = g_->alt_starts_[size_t(e.arg)];
    for (int32_t a : starts) expand(a, caller, out, accept, depth + 1);
    return;
  }
}

int32_t Runtime::intern_state(std::vector<int32_t>& stacks, bool accept) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  if (stacks.empty() && !accept) return kDead;
  std::string key(1 + stacks.size() * 4, '\0');
  key[0] = accept ? 1 : 0;
  if (!stacks.empty()) std::memcpy(key.data() + 1, stacks.data(), stacks.size() * 4);
  auto it = state_ids_.find(key);
  if (it != state_ids_.end()) return it->second;
  State s;
  s.stacks = stacks;
  s.accept = accept;
  if (stacks.empty()) {
    s.cost = 0;
  } else if (accept) {
    s.cost = 1;
  } else {
    int32_t d = kInf;
    for (int32_t id : stacks) d = std::min(d, stack_nodes_[size_t(id)].dist);
    s.cost = add_sat(d, 1);
  }
  costs_.push_back(s.cost);
  next_.resize(next_.size() + 256, -1);
  states_.push_back(std::move(s));
  int32_t id = int32_t(states_.size()) - 1;
  state_ids_.emplace(std::move(key), id);
  return id;
}

int32_t Runtime::initial() {
  std::lock_guard lk(mu_);
  if (initial_ < 0) {
    std::vector<int32_t> out;
    bool accept = false;
    for (int32_t a : g_->alt_starts_[size_t(g_->root_)]) expand(a, -1, out, accept, 0);
    initial_ = intern_state(out, accept);
    TANSY_CHECK(initial_ != kDead, "grammar: the root matches nothing");
  }
  return initial_;
}

int32_t Runtime::step(int32_t state, uint8_t b) {
  const int32_t cached = next_[size_t(state) * 256 + b];
  if (cached != -1) return cached;
  const State& st = states_[size_t(state)];
  std::vector<int32_t> out;
  bool accept = false;
  const std::vector<int32_t> stacks = st.stacks;  // states_ may grow below
  for (int32_t sid : stacks) {
    const StackNode node = stack_nodes_[size_t(sid)];
    const Grammar::Elem& e = g_->elems_[size_t(node.pos)];
    if (g_->sets_[size_t(e.arg)].has(b)) expand(node.pos + 1, node.parent, out, accept, 0);
  }
  int32_t next = intern_state(out, accept);
  next_[size_t(state) * 256 + b] = next;
  return next;
}

int32_t Runtime::advance(int32_t state, uint8_t b) {
  if (state == kDead) return kDead;
  std::lock_guard lk(mu_);
  return step(state, b);
}

int32_t Runtime::advance(int32_t state, std::string_view bytes) {
  std::lock_guard lk(mu_);
  for (char c : bytes) {
    if (state == kDead) break;
    state = step(state, uint8_t(c));
  }
  return state;
}

bool Runtime::accepting(int32_t state) {
  std::lock_guard lk(mu_);
  return state != kDead && states_[size_t(state)].accept;
}

bool Runtime::finished(int32_t state) {
  std::lock_guard lk(mu_);
  return state != kDead && states_[size_t(state)].accept && states_[size_t(state)].stacks.empty();
}

int32_t Runtime::cost(int32_t state) {
  std::lock_guard lk(mu_);
  return state == kDead ? kInf : states_[size_t(state)].cost;
}

size_t Runtime::states() const { return states_.size(); }

int32_t Runtime::plain_next(int32_t state) {
  if (state == kDead) return kDead;
  if (states_[size_t(state)].plain_next == -1) {
    int32_t next = -1;
    // Stops at the first byte that disagrees: a state outside a string costs two steps here.
    for (int b = 0; b < 256 && next != kMixed; ++b) {
      if (!trie_->plain_bytes_.has(uint8_t(b))) continue;
      int32_t s = step(state, uint8_t(b));
      next = next == -1 || next == s ? s : kMixed;
    }
    states_[size_t(state)].plain_next = next;
  }
  return states_[size_t(state)].plain_next;
}

int32_t Runtime::walk(int32_t state, std::span<uint32_t> bits, int budget, bool& any) {
  std::fill(bits.begin(), bits.end(), 0u);
  const size_t nbits = bits.size() * 32;
  int32_t max_cost = 0;
  const VocabTrie* full = trie_.get();
  if (full->rest_ && !full->plain_ids_.empty()) {
    // Follow the plain bytes' common successor for as long as the longest plain token: a plain
    // token of length L ends in chain[L]. A state where they disagree needs the full walk.
    const size_t longest = full->plain_by_len_.size() - 2;
    std::vector<int32_t>& chain = scratch_;
    chain.assign(1, state);
    while (chain.size() <= longest && chain.back() != kDead && chain.back() != kMixed)
      chain.push_back(plain_next(chain.back()));
    if (chain.back() != kMixed) {
      for (size_t len = 1; len < chain.size() && chain[len] != kDead; ++len) {
        const int32_t c = costs_[size_t(chain[len])];
        if ((budget >= 0 && c > budget) || full->plain_by_len_[len] == full->plain_by_len_[len + 1]) continue;
        for (int32_t k = full->plain_by_len_[len]; k < full->plain_by_len_[len + 1]; ++k) {
          const uint32_t id = uint32_t(full->plain_ids_[size_t(k)]);
          if (id < nbits) bits[id >> 5] |= 1u << (id & 31), any = true;
        }
        max_cost = std::max(max_cost, c);
      }
      full = full->rest_.get();
    }
  }
  const VocabTrie& t = *full;
  const size_t n = t.nodes();
  walk_states_[0] = state;
  for (size_t i = 1; i < n;) {
    const uint8_t b = t.byte_[i];
    const int32_t parent = walk_states_[t.depth_[i] - 1];
    int32_t nx = next_[size_t(parent) * 256 + b];
    if (nx == -1) nx = step(parent, b);
    if (nx == kDead) {
      i = size_t(t.end_[i]);
      continue;
    }
    walk_states_[t.depth_[i]] = nx;
    const int32_t tb = t.tok_begin_[i], te = t.tok_begin_[i + 1];
    if (tb != te) {
      const int32_t c = costs_[size_t(nx)];
      if (budget < 0 || c <= budget) {
        for (int32_t k = tb; k < te; ++k) {
          const uint32_t id = uint32_t(t.ids_[size_t(k)]);
          if (id < nbits) bits[id >> 5] |= 1u << (id & 31), any = true;
        }
        max_cost = std::max(max_cost, c);
      }
    }
    ++i;
  }
  return max_cost;
}

bool Runtime::mask(int32_t state, std::span<uint32_t> bits, int budget) {
  std::lock_guard lk(mu_);
  TANSY_CHECK(state != kDead, "grammar: mask of a dead state");
  auto it = masks_.find(state);
  if (it == masks_.end() || it->second.bits.size() != bits.size()) {
    // Bound the cache: 32 MB of masks per grammar (some 1,000 states at 248k tokens; a document
    // meets a few hundred), times the 32 grammars kept.
    if (mask_bytes_ > (size_t(32) << 20)) {
      masks_.clear();
      mask_bytes_ = 0;
    }
    MaskEntry e;
    e.bits.resize(bits.size());
    bool any = false;
    e.max_cost = walk(state, e.bits, -1, any);
    mask_bytes_ += e.bits.size() * 4;
    it = masks_.insert_or_assign(state, std::move(e)).first;
  }
  if (budget < 0 || it->second.max_cost <= budget) {
    std::copy(it->second.bits.begin(), it->second.bits.end(), bits.begin());
    return true;
  }
  bool any = false;
  walk(state, bits, budget, any);
  return any;
}

}  // namespace tansy::grammar
