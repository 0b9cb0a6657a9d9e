#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.h"

namespace tansy {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// UTF-8

namespace {

enum class U8 { ok, invalid, truncated };

// One step of a UTF-8 decoder following Unicode's "maximal subpart" rule (Table 3-7): `len` is the
// length of the character, or of the invalid / truncated prefix that one U+FFFD replaces.
U8 utf8_step(const uint8_t* p, size_t n, size_t& len) {
  uint8_t b = p[0];
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b < 0x80) {
    len = 1;
    return U8::ok;
  }
  if (b >= 0xC2 && b <= 0xDF)
    need = 2;
  else if (b >= 0xE0 && b <= 0xEF) {
    need = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    len = 1;
    return U8::invalid;
  }
  for (size_t i = 1; i < need; ++i) {
    if (i >= n) {
      len = i;
      return U8::truncated;
    }
    uint8_t c = p[i];
    if (c < (i == 1 ? lo : 0x80) || c > (i == 1 ? hi : 0xBF)) {
      len = i;
      return U8::invalid;
    }
  }
  len = need;
  return U8::ok;
}

// Byte offset of the first invalid byte, or npos.
size_t first_invalid_utf8(std::string_view s) {
  auto p = reinterpret_cast<const uint8_t*>(s.data());
  size_t i = 0, n = s.size(), len;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    if (utf8_step(p + i, n - i, len) != U8::ok) return i;
    i += len;
  }
  return std::string_view::npos;
}

bool is_ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

// Decodes the (valid) code point starting at s[i].
UChar32 cp_at(std::string_view s, size_t i, size_t* len = nullptr) {
  auto p = reinterpret_cast<const uint8_t*>(s.data()) + i;
  size_t l = *p < 0x80 ? 1 : *p < 0xE0 ? 2 : *p < 0xF0 ? 3 : 4;
  UChar32 c = l == 1 ? p[0] : l == 2 ? p[0] & 0x1F : l == 3 ? p[0] & 0x0F : p[0] & 0x07;
  for (size_t k = 1; k < l; ++k) c = (c << 6) | (p[k] & 0x3F);
  if (len) *len = l;
  return c;
}

// Start of the code point that ends at s[end) (s valid UTF-8, end > 0).
size_t prev_cp_start(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

void append_cp(std::string& out, uint32_t c) {
  if (c < 0x80)
    out += char(c);
  else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

// HF checks lstrip/rstrip/single_word with the Rust regex crate's Unicode \s and \w.
bool rust_whitespace(UChar32 c) { return u_isUWhiteSpace(c); }
bool rust_word(UChar32 c) {
  if (u_isUAlphabetic(c) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL)) return true;
  int8_t t = u_charType(c);
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION || t == U_NON_SPACING_MARK ||
         t == U_COMBINING_SPACING_MARK || t == U_ENCLOSING_MARK;
}

}  // namespace

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  auto p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t i = 0, n = bytes.size(), len;
  while (i < n) {
    if (p[i] < 0x80) {
      out += char(p[i++]);
      continue;
    }
    if (utf8_step(p + i, n - i, len) == U8::ok)
      out.append(bytes.substr(i, len));
    else
      out += "\xEF\xBF\xBD";
    i += len;
  }
  return out;
}

// Exposed to the stream decoder: where a trailing, still-completable UTF-8 prefix begins.
size_t utf8_incomplete_tail(std::string_view bytes) {
  auto p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t n = bytes.size(), len;
  for (size_t start = n > 3 ? n - 3 : 0; start < n; ++start)
    if (utf8_step(p + start, n - start, len) == U8::truncated && start + len == n) return start;
  return n;
}

// ---------------------------------------------------------------------------------------------
// Byte-level mapping (GPT-2): every byte is spelled as one printable code point in the vocab.

namespace {

std::array<uint32_t, 256> byte_to_cp() {
  std::array<uint32_t, 256> m{};
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    m[b] = printable ? b : next++;
  }
  return m;
}

// HF's ByteLevel decoder maps a token's characters back to bytes; a token with any character
// outside the mapping (e.g. an added token containing a space) is emitted as its raw UTF-8.
std::string byte_level_decode(std::string_view token) {
  static const auto table = [] {
    std::unordered_map<uint32_t, uint8_t> t;
    auto m = byte_to_cp();
    for (int b = 0; b < 256; ++b) t[m[b]] = uint8_t(b);
    return t;
  }();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    size_t len;
    auto it = table.find(uint32_t(cp_at(token, i, &len)));
    if (it == table.end()) return std::string(token);
    out += char(it->second);
    i += len;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Regex: HF compiles the Split pattern with Oniguruma; PCRE2 (UTF + UCP) agrees on everything the
// Qwen patterns use except \s, which in Oniguruma is the White_Space property (it includes U+0085,
// which PCRE2's \s lacks). Constructs whose meaning differs between the two are refused.

std::string onig_to_pcre2(std::string_view pat) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pat.size(); ++i) {
    char c = pat[i];
    if (c == '\\') {
      if (i + 1 >= pat.size()) fail("tokenizer.json: pre-tokenizer regex ends with a lone backslash");
      char e = pat[++i];
      if (e == 's')
        out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      else if (e == 'S') {
        if (in_class)
          fail("tokenizer.json: pre-tokenizer regex: \\S inside a character class is not supported");
        out += "[^\\s\\x{85}]";
      } else if (e == 'h' || e == 'H' || e == 'A' || e == 'z' || e == 'Z' || e == 'G' || e == 'K' ||
                 e == 'R' || e == 'X') {
        fail("tokenizer.json: pre-tokenizer regex: \\{} is not supported (Oniguruma and PCRE2 differ)", e);
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == '[') fail("tokenizer.json: pre-tokenizer regex: nested character classes are not supported");
      if (c == ']') in_class = false;
      out += c;
      continue;
    }
    if (c == '^' || c == '$')
      fail(
          "tokenizer.json: pre-tokenizer regex: anchors ^ and $ are not supported (Oniguruma treats them as "
          "line anchors)");
    if (c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < pat.size() && pat[i + 1] == '^') out += pat[++i];
      if (i + 1 < pat.size() && pat[i + 1] == ']') out += pat[++i];  // a leading ']' is literal
      continue;
    }
    out += c;
  }
  if (in_class) fail("tokenizer.json: pre-tokenizer regex has an unterminated character class");
  return out;
}

class Regex {
 public:
  Regex(std::string_view onig_pattern, bool literal) {
    std::string pat = literal ? std::string(onig_pattern) : onig_to_pcre2(onig_pattern);
    int err;
    PCRE2_SIZE off;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), opts, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail("tokenizer.json: pre-tokenizer regex does not compile at offset {}: {}", off,
           reinterpret_cast<char*>(msg));
    }
    // JIT is the fast path the speed target depends on: refuse to run without it.
    int rc = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
    if (rc != 0) {
      pcre2_code_free(code_);
      fail("PCRE2 JIT compilation of the pre-tokenizer regex failed (error {})", rc);
    }
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }
  const pcre2_code* code() const { return code_; }

 private:
  pcre2_code* code_ = nullptr;
};

// Per-call PCRE2 match state with a JIT stack large enough for long whitespace runs.
class Matcher {
 public:
  Matcher() {
    data_ = pcre2_match_data_create(4, nullptr);
    mctx_ = pcre2_match_context_create(nullptr);
    stack_ = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (!data_ || !mctx_ || !stack_) fail("out of memory creating PCRE2 match state");
    pcre2_jit_stack_assign(mctx_, nullptr, stack_);
  }
  ~Matcher() {
    pcre2_jit_stack_free(stack_);
    pcre2_match_context_free(mctx_);
    pcre2_match_data_free(data_);
  }
  // Next match at or after `from`; false when none.
  bool find(const Regex& re, std::string_view s, size_t from, size_t& b, size_t& e) {
    int rc =
        pcre2_jit_match(re.code(), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), from, 0, data_, mctx_);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail("pre-tokenizer regex failed on the input: {}", reinterpret_cast<char*>(msg));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data_);
    b = ov[0];
    e = ov[1];
    return true;
  }

 private:
  pcre2_match_data* data_ = nullptr;
  pcre2_match_context* mctx_ = nullptr;
  pcre2_jit_stack* stack_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Normalizer: a chain of ICU Unicode normalization forms (the only HF normalizers supported).

class Normalizer {
 public:
  void add(const json& n) {
    std::string type = n.value("type", "");
    UErrorCode st = U_ZERO_ERROR;
    const icu::Normalizer2* f = nullptr;
    if (type == "NFC")
      f = icu::Normalizer2::getNFCInstance(st);
    else if (type == "NFD")
      f = icu::Normalizer2::getNFDInstance(st);
    else if (type == "NFKC")
      f = icu::Normalizer2::getNFKCInstance(st);
    else if (type == "NFKD")
      f = icu::Normalizer2::getNFKDInstance(st);
    else if (type == "Sequence") {
      for (auto& sub : n.at("normalizers")) add(sub);
      return;
    } else
      fail("tokenizer.json: normalizer '{}' is not supported", type);
    if (U_FAILURE(st)) fail("ICU: cannot load the {} normalizer: {}", type, u_errorName(st));
    forms_.push_back(f);
  }
  bool empty() const { return forms_.empty(); }
  std::string apply(std::string_view s) const {
    std::string cur(s);
    if (is_ascii(s)) return cur;  // ASCII is invariant under every normalization form
    for (auto* f : forms_) {
      std::string next;
      icu::StringByteSink<std::string> sink(&next);
      UErrorCode st = U_ZERO_ERROR;
      f->normalizeUTF8(0, icu::StringPiece(cur.data(), int32_t(cur.size())), sink, nullptr, st);
      if (U_FAILURE(st)) fail("ICU normalization failed: {}", u_errorName(st));
      cur = std::move(next);
    }
    return cur;
  }

 private:
  std::vector<const icu::Normalizer2*> forms_;
};

struct AddedToken {
  std::string content;  // as matched (normalized when the token is flagged normalized)
  int32_t id;
  bool single_word, lstrip, rstrip, special;
};

// Leftmost-longest matching of added tokens (HF's aho-corasick with MatchKind::LeftmostLongest).
class AddedMatcher {
 public:
  void add(AddedToken t) {
    if (t.content.empty()) fail("tokenizer.json: added token {} has empty content", t.id);
    first_.set(uint8_t(t.content[0]));
    toks_.push_back(std::move(t));
  }
  void finish() {
    std::stable_sort(toks_.begin(), toks_.end(),
                     [](auto& a, auto& b) { return a.content.size() > b.content.size(); });
  }
  bool empty() const { return toks_.empty(); }
  const AddedToken* find(std::string_view s, size_t from, size_t& at) const {
    for (size_t i = from; i < s.size(); ++i) {
      if (!first_.test(uint8_t(s[i]))) continue;
      for (auto& t : toks_)
        if (s.compare(i, t.content.size(), t.content) == 0) {
          at = i;
          return &t;
        }
    }
    return nullptr;
  }

 private:
  std::bitset<256> first_;
  std::vector<AddedToken> toks_;  // longest first
};

struct PairHash {
  size_t operator()(uint64_t k) const { return size_t(k * 0x9E3779B97F4A7C15ull >> 17) ^ size_t(k); }
};
struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  Normalizer normalizer;
  std::vector<std::unique_ptr<Regex>> splits;  // applied in order, each on the previous pieces
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> vocab;  // tokenizer.json spelling
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> added_by_content;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>, PairHash> merges;  // (a,b) -> (rank, merged)
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> whole_vocab_bytes;  // raw bytes -> id
  std::array<int32_t, 256> byte_id{};
  bool ignore_merges = false;
  AddedMatcher raw_added, normalized_added;
  std::vector<std::string> id_bytes;  // decode bytes per id
  std::vector<uint8_t> id_kind;       // 0 undefined, 1 vocab, 2 added, 3 added special

  static constexpr size_t kCacheMax = 1 << 16, kCacheMaxPiece = 128;
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> cache;

  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  void model_encode(std::string_view piece, std::vector<int32_t>& out) const;
  void pretokenize(std::string_view s, size_t stage, Matcher& m, std::vector<int32_t>& out) const;
  void split_added(std::string_view s, const AddedMatcher& am, bool parse_special,
                   const std::function<void(std::string_view)>& text, std::vector<int32_t>& out,
                   std::span<const std::pair<size_t, size_t>> plain = {}) const;
  std::vector<int32_t> encode(std::string_view text, bool parse_special,
                              std::span<const std::pair<size_t, size_t>> plain) const;
};

namespace {

// Whether [b, e) overlaps one of the sorted, disjoint ranges.
bool overlaps(std::span<const std::pair<size_t, size_t>> ranges, size_t b, size_t e) {
  auto it = std::lower_bound(ranges.begin(), ranges.end(), b,
                             [](const std::pair<size_t, size_t>& r, size_t x) { return r.second <= x; });
  return it != ranges.end() && it->first < e;
}

}  // namespace

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  // HF's Word::merge_all: a heap of candidate merges by (rank, position), skipping stale ones.
  struct Sym {
    int32_t id;
    int32_t prev, next;
    uint32_t len;
  };
  struct Cand {
    int32_t rank;
    int32_t pos;
    int32_t merged;
  };
  auto worse = [](const Cand& a, const Cand& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::vector<Sym> sym(piece.size());
  for (size_t i = 0; i < piece.size(); ++i)
    sym[i] = {byte_id[uint8_t(piece[i])], int32_t(i) - 1, i + 1 < piece.size() ? int32_t(i + 1) : -1, 1};
  std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
  auto push = [&](int32_t pos) {
    int32_t nx = sym[pos].next;
    if (nx < 0) return;
    auto it = merges.find(uint64_t(uint32_t(sym[pos].id)) << 32 | uint32_t(sym[nx].id));
    if (it != merges.end()) heap.push({it->second.first, pos, it->second.second});
  };
  for (int32_t i = 0; i + 1 < int32_t(piece.size()); ++i) push(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& s = sym[c.pos];
    if (s.len == 0 || s.next < 0) continue;
    auto it = merges.find(uint64_t(uint32_t(s.id)) << 32 | uint32_t(sym[s.next].id));
    if (it == merges.end() || it->second.second != c.merged) continue;
    Sym& r = sym[s.next];
    s.id = c.merged;
    s.len += r.len;
    r.len = 0;
    s.next = r.next;
    if (s.next >= 0) sym[s.next].prev = c.pos;
    if (s.prev >= 0) push(s.prev);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0 && i < int32_t(sym.size()); i = sym[i].next) out.push_back(sym[i].id);
}

void Tokenizer::Impl::model_encode(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_id[uint8_t(piece[0])]);
    return;
  }
  if (ignore_merges) {
    auto it = whole_vocab_bytes.find(piece);
    if (it != whole_vocab_bytes.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (piece.size() > kCacheMaxPiece) {
    bpe(piece, out);
    return;
  }
  {
    std::lock_guard lk(cache_mu);
    auto it = cache.find(piece);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t start = out.size();
  bpe(piece, out);
  std::lock_guard lk(cache_mu);
  if (cache.size() >= kCacheMax) cache.clear();  // bounded: a crude reset keeps memory flat
  cache.emplace(std::string(piece), std::vector<int32_t>(out.begin() + start, out.end()));
}

void Tokenizer::Impl::pretokenize(std::string_view s, size_t stage, Matcher& m,
                                  std::vector<int32_t>& out) const {
  if (s.empty()) return;
  if (stage == splits.size()) {
    model_encode(s, out);
    return;
  }
  // Split with behavior Isolated: matches and the gaps between them are all pieces.
  size_t pos = 0, b, e;
  while (pos < s.size() && m.find(*splits[stage], s, pos, b, e)) {
    if (e == b) {  // an empty match splits nothing; step over one character
      size_t len;
      cp_at(s, b, &len);
      if (b + len > s.size()) break;
      pretokenize(s.substr(pos, b + len - pos), stage + 1, m, out);
      pos = b + len;
      continue;
    }
    if (b > pos) pretokenize(s.substr(pos, b - pos), stage + 1, m, out);
    pretokenize(s.substr(b, e - b), stage + 1, m, out);
    pos = e;
  }
  if (pos < s.size()) pretokenize(s.substr(pos), stage + 1, m, out);
}

// HF AddedVocabulary::find_matches, including its lstrip/rstrip/single_word rules.
void Tokenizer::Impl::split_added(std::string_view s, const AddedMatcher& am, bool parse_special,
                                  const std::function<void(std::string_view)>& text,
                                  std::vector<int32_t>& out,
                                  std::span<const std::pair<size_t, size_t>> plain) const {
  if (am.empty()) {
    text(s);
    return;
  }
  size_t start_offset = 0, search = 0, at;
  while (const AddedToken* t = am.find(s, search, at)) {
    size_t start = at, stop = at + t->content.size();
    search = stop;
    if (t->special && (!parse_special || overlaps(plain, start, stop))) continue;
    if (t->single_word) {
      bool start_ok = start == 0 || !rust_word(cp_at(s, prev_cp_start(s, start)));
      bool stop_ok = stop == s.size() || !rust_word(cp_at(s, stop));
      if (!start_ok || !stop_ok) continue;
    }
    if (t->lstrip) {
      size_t ns = start;
      while (ns > 0) {
        size_t p = prev_cp_start(s, ns);
        if (!rust_whitespace(cp_at(s, p))) break;
        ns = p;
      }
      start = std::max(ns, start_offset);
    }
    if (t->rstrip) {
      while (stop < s.size()) {
        size_t len;
        if (!rust_whitespace(cp_at(s, stop, &len))) break;
        stop += len;
      }
    }
    if (start_offset < start) text(s.substr(start_offset, start - start_offset));
    out.push_back(t->id);
    start_offset = stop;
  }
  if (start_offset < s.size()) text(s.substr(start_offset));
}

// ---------------------------------------------------------------------------------------------
// Loading

namespace {

void check_only(const json& obj, std::string_view what, std::initializer_list<std::string_view> known) {
  for (auto& [k, v] : obj.items())
    if (std::find(known.begin(), known.end(), k) == known.end())
      fail("tokenizer.json: {} field '{}' is not supported", what, k);
}

bool flag(const json& obj, const char* key, bool fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail("tokenizer.json: '{}' must be a boolean", key);
  return it->get<bool>();
}

bool null_or_empty_string(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty());
}

void check_byte_level(const json& b, const char* where) {
  if (flag(b, "add_prefix_space", false))
    fail("tokenizer.json: {} ByteLevel with add_prefix_space=true is not supported", where);
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::filesystem::path& model_dir) {
  auto path = model_dir / "tokenizer.json";
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open {}", path.string());
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return from_json(ss.str());
  } catch (const Error& e) {
    fail("{}: {}", path.string(), e.what());
  }
}

Tokenizer Tokenizer::from_json(std::string_view text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("tokenizer.json is not valid JSON: {}", e.what());
  }
  if (!j.is_object()) fail("tokenizer.json: top level is not an object");
  auto impl = std::make_unique<Impl>();
  try {
    for (const char* k : {"truncation", "padding"})
      if (j.contains(k) && !j[k].is_null()) fail("tokenizer.json: '{}' is set, which is not supported", k);

    if (j.contains("normalizer") && !j["normalizer"].is_null()) impl->normalizer.add(j["normalizer"]);

    // Pre-tokenizer: Split (Isolated) regexes and exactly one ByteLevel.
    const json& pt = j.at("pre_tokenizer");
    std::vector<json> pts;
    if (pt.is_null()) fail("tokenizer.json: no pre_tokenizer; a ByteLevel pre-tokenizer is required");
    if (pt.at("type") == "Sequence")
      for (auto& p : pt.at("pretokenizers")) pts.push_back(p);
    else
      pts.push_back(pt);
    int byte_levels = 0;
    for (auto& p : pts) {
      std::string type = p.at("type");
      if (type == "Split") {
        check_only(p, "Split pre-tokenizer", {"type", "pattern", "behavior", "invert"});
        if (p.at("behavior") != "Isolated")
          fail("tokenizer.json: Split behavior '{}' is not supported", p.at("behavior").get<std::string>());
        if (flag(p, "invert", false)) fail("tokenizer.json: Split with invert=true is not supported");
        const json& pat = p.at("pattern");
        if (pat.contains("Regex"))
          impl->splits.push_back(std::make_unique<Regex>(pat["Regex"].get<std::string>(), false));
        else if (pat.contains("String"))
          impl->splits.push_back(std::make_unique<Regex>(pat["String"].get<std::string>(), true));
        else
          fail("tokenizer.json: Split pattern must be Regex or String");
      } else if (type == "ByteLevel") {
        if (byte_levels++ || &p != &pts.back())
          fail("tokenizer.json: ByteLevel must be the last pre-tokenizer, once");
        check_byte_level(p, "pre-tokenizer");
        if (flag(p, "use_regex", true))  // HF's built-in GPT-2 split
          impl->splits.push_back(std::make_unique<Regex>(
              "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+", false));
      } else {
        fail("tokenizer.json: pre-tokenizer '{}' is not supported", type);
      }
    }
    if (!byte_levels)
      fail("tokenizer.json: the pre-tokenizer has no ByteLevel step; only byte-level BPE is supported");

    const json& dec = j.at("decoder");
    if (dec.is_null() || dec.at("type") != "ByteLevel")
      fail("tokenizer.json: decoder '{}' is not supported (ByteLevel only)",
           dec.is_null() ? "null" : dec.at("type").get<std::string>());
    if (j.contains("post_processor") && !j["post_processor"].is_null()) {
      const json& pp = j["post_processor"];
      if (pp.at("type") != "ByteLevel")
        fail("tokenizer.json: post_processor '{}' is not supported", pp.at("type").get<std::string>());
    }

    // Model.
    const json& m = j.at("model");
    if (m.value("type", "BPE") != "BPE")
      fail("tokenizer.json: model type '{}' is not supported (BPE only)", m.value("type", ""));
    if (m.contains("dropout") && !m["dropout"].is_null())
      fail("tokenizer.json: BPE dropout is not supported");
    if (!null_or_empty_string(m, "continuing_subword_prefix"))
      fail("tokenizer.json: BPE continuing_subword_prefix is not supported");
    if (!null_or_empty_string(m, "end_of_word_suffix"))
      fail("tokenizer.json: BPE end_of_word_suffix is not supported");
    if (flag(m, "byte_fallback", false)) fail("tokenizer.json: BPE byte_fallback is not supported");
    impl->ignore_merges = flag(m, "ignore_merges", false);

    int32_t max_id = -1;
    for (auto& [tok, idj] : m.at("vocab").items()) {
      int64_t id = idj.get<int64_t>();
      if (id < 0 || id > INT32_MAX / 2) fail("tokenizer.json: vocab id {} out of range", id);
      impl->vocab.emplace(tok, int32_t(id));
      max_id = std::max(max_id, int32_t(id));
    }
    struct Added {
      std::string content;
      int32_t id;
      bool special;
    };
    std::vector<Added> added;
    for (auto& a : j.at("added_tokens")) {
      check_only(a, "added token",
                 {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
      int64_t id = a.at("id").get<int64_t>();
      std::string content = a.at("content");
      if (id < 0 || id > INT32_MAX / 2) fail("tokenizer.json: added token id {} out of range", id);
      auto v = impl->vocab.find(content);
      if (v != impl->vocab.end() && v->second != id)
        fail("tokenizer.json: added token '{}' has id {} but the vocab gives it {}", content, id, v->second);
      bool special = flag(a, "special", false), normalized = flag(a, "normalized", !special);
      AddedToken t{content,
                   int32_t(id),
                   flag(a, "single_word", false),
                   flag(a, "lstrip", false),
                   flag(a, "rstrip", false),
                   special};
      if (normalized && !impl->normalizer.empty()) t.content = impl->normalizer.apply(content);
      (normalized ? impl->normalized_added : impl->raw_added).add(std::move(t));
      impl->added_by_content[content] = int32_t(id);
      added.push_back({content, int32_t(id), special});
      max_id = std::max(max_id, int32_t(id));
    }
    impl->raw_added.finish();
    impl->normalized_added.finish();

    impl->id_bytes.resize(size_t(max_id) + 1);
    impl->id_kind.assign(size_t(max_id) + 1, 0);
    for (auto& [tok, id] : impl->vocab) {
      impl->id_bytes[id] = byte_level_decode(tok);
      impl->id_kind[id] = 1;
      if (impl->ignore_merges) impl->whole_vocab_bytes[byte_level_decode(tok)] = id;
    }
    for (auto& a : added) {
      impl->id_bytes[a.id] = byte_level_decode(a.content);
      impl->id_kind[a.id] = a.special ? 3 : 2;
    }
    auto cps = byte_to_cp();
    for (int b = 0; b < 256; ++b) {
      std::string s;
      append_cp(s, cps[b]);
      auto it = impl->vocab.find(s);
      if (it == impl->vocab.end())
        fail("tokenizer.json: the vocab lacks the byte-level token for byte 0x{:02X}", b);
      impl->byte_id[b] = it->second;
    }

    const json& merges = m.at("merges");
    impl->merges.reserve(merges.size());
    int32_t rank = 0;
    for (auto& mg : merges) {
      std::string a, b;
      if (mg.is_string()) {
        std::string s = mg;
        auto sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail("tokenizer.json: malformed merge '{}'", s);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (mg.is_array() && mg.size() == 2) {
        a = mg[0];
        b = mg[1];
      } else {
        fail("tokenizer.json: malformed merge {}", mg.dump());
      }
      auto ia = impl->vocab.find(a), ib = impl->vocab.find(b), im = impl->vocab.find(a + b);
      if (ia == impl->vocab.end() || ib == impl->vocab.end() || im == impl->vocab.end())
        fail("tokenizer.json: merge '{} {}' refers to a token missing from the vocab", a, b);
      impl->merges[uint64_t(uint32_t(ia->second)) << 32 | uint32_t(ib->second)] = {rank++, im->second};
    }
  } catch (const json::exception& e) {
    fail("tokenizer.json: unexpected structure: {}", e.what());
  }
  return Tokenizer(std::move(impl));
}

// ---------------------------------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  return impl_->encode(text, parse_special, {});
}

std::vector<int32_t> Tokenizer::encode_plain_ranges(std::string_view text,
                                                    std::span<const std::pair<size_t, size_t>> plain) const {
  return impl_->encode(text, true, plain);
}

std::vector<int32_t> Tokenizer::Impl::encode(std::string_view text, bool parse_special,
                                             std::span<const std::pair<size_t, size_t>> plain) const {
  size_t bad = first_invalid_utf8(text);
  if (bad != std::string_view::npos) fail("input is not valid UTF-8 (byte offset {})", bad);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  Matcher m;
  const Impl& im = *this;
  auto pretok = [&](std::string_view s) { im.pretokenize(s, 0, m, out); };
  auto normalize_then_split = [&](std::string_view s) {
    // Normalization moves offsets, so a piece touching a plain range matches no special token.
    const size_t off = size_t(s.data() - text.data());
    const bool special = parse_special && !overlaps(plain, off, off + s.size());
    if (im.normalizer.empty()) {
      im.split_added(s, im.normalized_added, special, pretok, out);
      return;
    }
    std::string n = im.normalizer.apply(s);
    im.split_added(n, im.normalized_added, special, pretok, out);
  };
  im.split_added(text, im.raw_added, parse_special, normalize_then_split, out, plain);
  return out;
}

bool Tokenizer::is_valid(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->id_kind.size() && impl_->id_kind[id] != 0;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  if (!is_valid(id)) fail("token id {} is not in the vocabulary", id);
  return impl_->id_bytes[id];
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (!is_valid(id)) fail("token id {} is not in the vocabulary", id);
    if (skip_special && impl_->id_kind[id] == 3) continue;
    bytes += impl_->id_bytes[id];
  }
  return utf8_lossy(bytes);
}

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

int Tokenizer::vocab_size() const { return int(impl_->id_kind.size()); }

bool Tokenizer::is_special(int32_t id) const { return is_valid(id) && impl_->id_kind[id] == 3; }

}  // namespace tansy
