#include "grammar/json_schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>

namespace tansy::grammar {

namespace {

using Sym = Grammar::Sym;
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;  // code point ranges, inclusive
constexpr uint32_t kMaxCp = 0x10FFFF;
// Digits of an unbounded integer part and of a fraction: a document must stay finite, and these
// are more than a double holds.
constexpr int kMaxIntDigits = 16;
constexpr int kMaxFracDigits = 15;
constexpr int kMaxRepeat = 10000;  // the largest count a repetition bound may ask for

[[noreturn]] void schema_fail(const std::string& msg) { throw SchemaError(msg); }

Ranges normalize(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (auto [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1)
      out.back().second = std::max(out.back().second, hi);
    else
      out.push_back({lo, hi});
  }
  return out;
}

Ranges complement(const Ranges& r, uint32_t top = kMaxCp) {
  Ranges out;
  uint32_t next = 0;
  for (auto [lo, hi] : normalize(r)) {
    if (lo > top) break;
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= top) out.push_back({next, top});
  return out;
}

Ranges subtract(const Ranges& a, const Ranges& b) {
  Ranges nb = complement(b);
  Ranges out;
  for (auto [lo, hi] : normalize(a))
    for (auto [l2, h2] : nb) {
      uint32_t l = std::max(lo, l2), h = std::min(hi, h2);
      if (l <= h) out.push_back({l, h});
    }
  return normalize(out);
}

std::string utf8_encode(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// A code point range as sequences of byte ranges (the usual UTF-8 range split).
void utf8_split(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  for (uint32_t b : {0x7Fu, 0x7FFu, 0xFFFFu})
    if (lo <= b && hi > b) {
      utf8_split(lo, b, out);
      utf8_split(b + 1, hi, out);
      return;
    }
  if (hi < 0x80) {
    out.push_back({{uint8_t(lo), uint8_t(hi)}});
    return;
  }
  int n = hi <= 0x7FF ? 2 : hi <= 0xFFFF ? 3 : 4;
  for (int i = 1; i < n; ++i) {
    uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_split(lo, lo | m, out);
        utf8_split((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_split(lo, (hi & ~m) - 1, out);
        utf8_split(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a = utf8_encode(lo), b = utf8_encode(hi);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (size_t k = 0; k < a.size(); ++k) seq.push_back({uint8_t(a[k]), uint8_t(b[k])});
  out.push_back(seq);
}

const Ranges kSurrogates = {{0xD800, 0xDFFF}};

// How the characters of a string are written: inside a JSON string literal (escaped where JSON
// requires it) or as raw text (a tool-call parameter).
enum class Mode { kJson, kRaw };

class Builder {
 public:
  // no_lt: for tool-call grammars. The output parser ends a parameter value at "</parameter>",
  // "<parameter=" or "</function>" wherever they occur, so JSON there writes '<' as \u003c (same
  // value) and raw text never has '<' before '/' or 'p'.
  Builder(Grammar& g, bool no_lt = false) : g(g), no_lt(no_lt) {}
  Grammar& g;
  const bool no_lt;

  Sym lit(std::string_view s) { return g.literal(s); }
  // A JSON text (a literal value or key) as written into the output.
  Sym json_lit(const std::string& json) {
    if (!no_lt) return lit(json);
    std::string out;
    for (char c : json) out += c == '<' ? std::string("\\u003c") : std::string(1, c);
    return lit(out);
  }
  Sym rule(const std::string& name, std::vector<std::vector<Sym>> alts) {
    int r = g.add_rule(name);
    for (auto& a : alts) g.add_alt(r, std::move(a));
    return r;
  }
  Sym seq(const std::string& name, std::vector<Sym> s) { return rule(name, {std::move(s)}); }
  Sym opt(Sym s) { return rule("opt", {{}, {s}}); }
  Sym star(Sym s) {
    int r = g.add_rule("star");
    g.add_alt(r, {});
    g.add_alt(r, {s, r});
    return r;
  }
  Sym byte_range(int lo, int hi) {
    ByteSet b;
    b.add_range(lo, hi);
    return g.bytes(b);
  }
  // s{min,max}; max < 0: unbounded.
  Sym repeat(Sym s, int min, int max, const std::string& what) {
    if (min > kMaxRepeat || max > kMaxRepeat)
      schema_fail(fmt::format("{} above {} is not supported", what, kMaxRepeat));
    std::vector<Sym> body(size_t(min), s);
    if (max < 0) {
      body.push_back(star(s));
    } else if (max > min) {
      Sym tail = rule("rep", {{}, {s}});
      for (int k = min + 1; k < max; ++k) tail = rule("rep", {{}, {s, tail}});
      body.push_back(tail);
    }
    return seq("repeat", body);
  }

  // A set of code points, each written as `mode` requires.
  Sym chars(const Ranges& cps_in, Mode mode) {
    Ranges cps = subtract(cps_in, kSurrogates);
    std::vector<std::vector<Sym>> alts;
    if (mode == Mode::kJson) {
      for (auto [lo, hi] : cps)
        for (uint32_t c = lo; c <= std::min(hi, 0x1Fu); ++c) alts.push_back({lit(json_escape(c))});
      for (uint32_t c : {uint32_t('"'), uint32_t('\\'), uint32_t('<')})
        for (auto [lo, hi] : cps)
          if (c >= lo && c <= hi && (c != '<' || no_lt)) alts.push_back({lit(json_escape(c))});
      cps = subtract(cps, {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});
      if (no_lt) cps = subtract(cps, {{'<', '<'}});
    }
    std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
    for (auto [lo, hi] : cps) utf8_split(lo, hi, seqs);
    for (auto& s : seqs) {
      std::vector<Sym> a;
      for (auto [l, h] : s) a.push_back(byte_range(l, h));
      alts.push_back(a);
    }
    if (alts.empty()) schema_fail("a character class of the pattern matches no character");
    return rule("chars", alts);
  }

  static std::string json_escape(uint32_t c) {
    switch (c) {
      case '"':
        return "\\\"";
      case '\\':
        return "\\\\";
      case '\b':
        return "\\b";
      case '\f':
        return "\\f";
      case '\n':
        return "\\n";
      case '\r':
        return "\\r";
      case '\t':
        return "\\t";
      default:
        return fmt::format("\\u{:04x}", c);
    }
  }

  // Any character of a JSON string, escapes included (surrogate escapes excluded: a pair would
  // count as two characters here and one for the validator).
  Sym json_char() {
    if (json_char_ >= 0) return json_char_;
    std::vector<std::vector<Sym>> alts;
    ByteSet plain;
    plain.add_range(0x20, 0x7F);
    ByteSet quote_bs;
    for (uint8_t b : {uint8_t('"'), uint8_t('\\')}) quote_bs.add(b);
    if (no_lt) quote_bs.add('<');
    for (int i = 0; i < 4; ++i) plain.w[i] &= ~quote_bs.w[i];
    alts.push_back({g.bytes(plain)});
    std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
    for (auto [lo, hi] : subtract({{0x80, kMaxCp}}, kSurrogates)) utf8_split(lo, hi, seqs);
    for (auto& s : seqs) {
      std::vector<Sym> a;
      for (auto [l, h] : s) a.push_back(byte_range(l, h));
      alts.push_back(a);
    }
    ByteSet esc;
    for (char c : std::string("\"\\/bfnrt")) esc.add(uint8_t(c));
    alts.push_back({g.byte('\\'), g.bytes(esc)});
    ByteSet hex, hex_no_d;
    hex.add_range('0', '9');
    hex.add_range('a', 'f');
    hex.add_range('A', 'F');
    hex_no_d = hex;
    ByteSet d;
    d.add('d');
    d.add('D');
    for (int i = 0; i < 4; ++i) hex_no_d.w[i] &= ~d.w[i];
    Sym h = g.bytes(hex);
    alts.push_back({g.byte('\\'), g.byte('u'), g.bytes(hex_no_d), h, h, h});
    alts.push_back({g.byte('\\'), g.byte('u'), g.bytes(d), byte_range('0', '7'), h, h});
    json_char_ = rule("json_char", alts);
    return json_char_;
  }

  Sym any_string() {
    if (any_string_ < 0) any_string_ = seq("string", {g.byte('"'), star(json_char()), g.byte('"')});
    return any_string_;
  }

  Sym digits(int min, int max) { return repeat(byte_range('0', '9'), min, max, "digits"); }

  Sym any_number() {
    if (any_number_ >= 0) return any_number_;
    Sym int_part = rule("int", {{lit("0")}, {byte_range('1', '9'), digits(0, kMaxIntDigits - 1)}});
    Sym frac = opt(seq("frac", {g.byte('.'), digits(1, kMaxFracDigits)}));
    ByteSet e, sign;
    e.add('e');
    e.add('E');
    sign.add('+');
    sign.add('-');
    Sym exp = opt(seq("exp", {g.bytes(e), opt(g.bytes(sign)), digits(1, 2)}));
    any_number_ = seq("number", {opt(g.byte('-')), int_part, frac, exp});
    return any_number_;
  }

  Sym any_value() {
    if (any_value_ >= 0) return any_value_;
    any_value_ = g.add_rule("value");
    Sym member = seq("member", {any_string(), g.byte(':'), any_value_});
    Sym members = seq("members", {member, star(seq("more", {g.byte(','), member}))});
    any_object_ = seq("object", {g.byte('{'), opt(members), g.byte('}')});
    Sym elems = seq("elems", {any_value_, star(seq("more", {g.byte(','), any_value_}))});
    Sym array = seq("array", {g.byte('['), opt(elems), g.byte(']')});
    for (Sym s : {any_object_, array, any_string(), any_number(), lit("true"), lit("false"), lit("null")})
      g.add_alt(any_value_, {s});
    return any_value_;
  }
  Sym any_object() {
    any_value();
    return any_object_;
  }

  // Raw text that cannot end a parameter value early: no '<' before '/' or 'p' (the parser ends
  // a value at "</parameter>", "<parameter=" or "</function>").
  Sym raw_free() {
    if (raw_free_ >= 0) return raw_free_;
    Ranges all = subtract({{0, kMaxCp}}, kSurrogates);
    Sym not_lt = chars(subtract(all, {{'<', '<'}}), Mode::kRaw);
    Sym after_lt = chars(subtract(all, {{'<', '<'}, {'/', '/'}, {'p', 'p'}}), Mode::kRaw);
    int a = g.add_rule("raw_a"), l = g.add_rule("raw_lt");
    // a: the last character was not '<'; l: it was.
    g.add_alt(a, {});
    g.add_alt(a, {not_lt, a});
    g.add_alt(a, {g.byte('<'), l});
    g.add_alt(l, {});
    g.add_alt(l, {g.byte('<'), l});
    g.add_alt(l, {after_lt, a});
    raw_free_ = a;
    return raw_free_;
  }

  // Integers in [lo, hi], written without leading zeros.
  Sym int_range(int64_t lo, int64_t hi) {
    std::vector<std::vector<Sym>> alts;
    if (lo < 0) {
      int64_t a = std::max<int64_t>(1, hi >= 0 ? 1 : -hi), b = -lo;
      alts.push_back({g.byte('-'), nonneg_range(a, b)});
    }
    if (hi >= 0) alts.push_back({nonneg_range(std::max<int64_t>(lo, 0), hi)});
    return rule("int_range", alts);
  }

  Sym nonneg_range(int64_t a, int64_t b) {
    std::vector<std::vector<Sym>> alts;
    std::string sa = std::to_string(a), sb = std::to_string(b);
    for (size_t nd = sa.size(); nd <= sb.size(); ++nd) {
      int64_t lo_nd = nd == 1 ? 0 : pow10(int(nd) - 1), hi_nd = pow10(int(nd)) - 1;
      int64_t l = std::max(a, lo_nd), h = std::min(b, hi_nd);
      if (l > h) continue;
      alts.push_back({fixed_range(std::to_string(l), std::to_string(h))});
    }
    return rule("nonneg_range", alts);
  }

  static int64_t pow10(int n) {
    int64_t p = 1;
    while (n-- > 0) p *= 10;
    return p;
  }

  // Digit strings of one length between x and y (leading zeros allowed inside).
  Sym fixed_range(const std::string& x, const std::string& y) {
    auto key = x + "-" + y;
    auto it = fixed_.find(key);
    if (it != fixed_.end()) return it->second;
    Sym r;
    size_t n = x.size();
    if (x == y) {
      r = lit(x);
    } else if (n == 1) {
      r = byte_range(x[0], y[0]);
    } else if (x[0] == y[0]) {
      r = seq("digits", {g.byte(uint8_t(x[0])), fixed_range(x.substr(1), y.substr(1))});
    } else {
      std::vector<std::vector<Sym>> alts;
      std::string nines(n - 1, '9'), zeros(n - 1, '0');
      alts.push_back({g.byte(uint8_t(x[0])), fixed_range(x.substr(1), nines)});
      if (x[0] + 1 <= y[0] - 1)
        alts.push_back({byte_range(x[0] + 1, y[0] - 1), digits(int(n - 1), int(n - 1))});
      alts.push_back({g.byte(uint8_t(y[0])), fixed_range(zeros, y.substr(1))});
      r = rule("digits", alts);
    }
    fixed_[key] = r;
    return r;
  }

 private:
  Sym json_char_ = -1, any_string_ = -1, any_number_ = -1, any_value_ = -1, any_object_ = -1, raw_free_ = -1;
  std::map<std::string, Sym> fixed_;
};

// ---- regular expressions --------------------------------------------------------------------

struct Re {
  enum class Kind { kChars, kSeq, kAlt, kRepeat };
  Kind kind = Kind::kSeq;
  Ranges cps;
  std::vector<Re> kids;
  int min = 0, max = 0;
};

class RegexParser {
 public:
  RegexParser(const std::string& pattern, Mode mode) : pat_(pattern), mode_(mode) {
    size_t i = 0;
    while (i < pattern.size()) cps_.push_back(decode(pattern, i));
  }

  // The pattern as a whole-string language: unanchored ends become "any text".
  Re parse() {
    bool start = !cps_.empty() && cps_[0] == '^';
    if (start) pos_ = 1;
    Re body = alt();
    bool end = false;
    if (pos_ < cps_.size() && cps_[pos_] == '$') {
      end = true;
      ++pos_;
    }
    if (pos_ != cps_.size()) error(fmt::format("unexpected '{}'", utf8_encode(cps_[pos_])));
    Re any_text;
    any_text.kind = Re::Kind::kRepeat;
    any_text.min = 0;
    any_text.max = -1;
    Re any_char;
    any_char.kind = Re::Kind::kChars;
    any_char.cps = mode_ == Mode::kRaw ? complement({{'\n', '\n'}}) : Ranges{{0, kMaxCp}};
    any_text.kids.push_back(any_char);
    Re out;
    out.kind = Re::Kind::kSeq;
    if (!start) out.kids.push_back(any_text);
    out.kids.push_back(body);
    if (!end) out.kids.push_back(any_text);
    return out;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    schema_fail(
        fmt::format("pattern '{}': {} (docs/API.md lists the supported regular expressions)", pat_, what));
  }

  static uint32_t decode(const std::string& s, size_t& i) {
    unsigned char c = uint8_t(s[i]);
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n && i + size_t(k) < s.size(); ++k)
      cp = (cp << 6) | (uint8_t(s[i + size_t(k)]) & 0x3F);
    i += size_t(n);
    return cp;
  }

  bool more() const { return pos_ < cps_.size(); }
  uint32_t peek() const { return cps_[pos_]; }

  Re alt() {
    Re a;
    a.kind = Re::Kind::kAlt;
    a.kids.push_back(concat());
    while (more() && peek() == '|') {
      ++pos_;
      a.kids.push_back(concat());
    }
    return a.kids.size() == 1 ? a.kids[0] : a;
  }

  Re concat() {
    Re s;
    s.kind = Re::Kind::kSeq;
    while (more() && peek() != '|' && peek() != ')') {
      if (peek() == '$' && pos_ + 1 == cps_.size()) break;
      s.kids.push_back(repeat());
    }
    return s;
  }

  int number() {
    if (!more() || peek() < '0' || peek() > '9') error("a repetition count must be a number");
    int v = 0;
    while (more() && peek() >= '0' && peek() <= '9') {
      v = v * 10 + int(peek() - '0');
      if (v > kMaxRepeat) error(fmt::format("repetition counts above {} are not supported", kMaxRepeat));
      ++pos_;
    }
    return v;
  }

  Re repeat() {
    Re atom_ = atom();
    for (;;) {
      if (!more()) return atom_;
      uint32_t c = peek();
      int mn, mx;
      if (c == '*') {
        mn = 0, mx = -1, ++pos_;
      } else if (c == '+') {
        mn = 1, mx = -1, ++pos_;
      } else if (c == '?') {
        mn = 0, mx = 1, ++pos_;
      } else if (c == '{') {
        ++pos_;
        mn = number();
        mx = mn;
        if (more() && peek() == ',') {
          ++pos_;
          mx = more() && peek() == '}' ? -1 : number();
        }
        if (!more() || peek() != '}') error("'{' must close with '}'");
        ++pos_;
        if (mx >= 0 && mx < mn) error("a repetition's maximum is below its minimum");
      } else {
        return atom_;
      }
      // A lazy quantifier matches the same whole strings.
      if (more() && peek() == '?') ++pos_;
      if (more() && peek() == '+') error("possessive quantifiers are not supported");
      Re r;
      r.kind = Re::Kind::kRepeat;
      r.min = mn;
      r.max = mx;
      r.kids.push_back(std::move(atom_));
      // As in ECMAScript and Python: a quantifier cannot follow another ("a**", "a{2}{3}").
      if (more() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{'))
        error("a quantifier cannot follow another (multiple repeat)");
      return r;
    }
  }

  static Re chars(Ranges r) {
    Re c;
    c.kind = Re::Kind::kChars;
    c.cps = normalize(std::move(r));
    return c;
  }

  // \d \w \s and their negations (ASCII: what every regex dialect agrees on), or -1.
  bool shorthand(uint32_t c, Ranges& out, bool& negated) const {
    negated = c == 'D' || c == 'W' || c == 'S';
    switch (c) {
      case 'd':
      case 'D':
        out = {{'0', '9'}};
        return true;
      case 'w':
      case 'W':
        out = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
        return true;
      case 's':
      case 'S':
        out = {{'\t', '\r'}, {' ', ' '}};
        return true;
      default:
        return false;
    }
  }

  uint32_t hex(int n) {
    uint32_t v = 0;
    for (int k = 0; k < n; ++k) {
      if (!more()) error("a hexadecimal escape is cut short");
      uint32_t c = peek();
      ++pos_;
      int d = c >= '0' && c <= '9'   ? int(c - '0')
              : c >= 'a' && c <= 'f' ? int(c - 'a' + 10)
              : c >= 'A' && c <= 'F' ? int(c - 'A' + 10)
                                     : -1;
      if (d < 0) error("bad hexadecimal escape");
      v = v * 16 + uint32_t(d);
    }
    return v;
  }

  // An escaped single character (after the backslash).
  uint32_t escaped_char(uint32_t c) {
    switch (c) {
      case 'n':
        return '\n';
      case 'r':
        return '\r';
      case 't':
        return '\t';
      case 'f':
        return '\f';
      case 'v':
        return '\v';
      case '0':
        return 0;
      case 'x':
        return hex(2);
      case 'u':
        return hex(4);
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '1' && c <= '9'))
          error(fmt::format("the escape '\\{}' is not supported", utf8_encode(c)));
        return c;
    }
  }

  // Negated ASCII shorthands (\D) stay within ASCII, where every dialect agrees.
  static Ranges ascii_complement(const Ranges& r) { return complement(r, 0x7F); }

  Re atom() {
    uint32_t c = peek();
    ++pos_;
    switch (c) {
      case '(': {
        if (more() && peek() == '?') {
          ++pos_;
          if (more() && peek() == ':') {
            ++pos_;
          } else if (more() && peek() == '<' && pos_ + 1 < cps_.size() && cps_[pos_ + 1] != '=' &&
                     cps_[pos_ + 1] != '!') {
            while (more() && peek() != '>') ++pos_;
            if (!more()) error("a group name must close with '>'");
            ++pos_;
          } else {
            error("lookaround and other (?...) groups are not supported");
          }
        }
        Re inner = alt();
        if (!more() || peek() != ')') error("'(' must close with ')'");
        ++pos_;
        return inner;
      }
      case ')':
        error("unbalanced ')'");
      case '[':
        return char_class();
      case '.':
        return chars(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
      case '^':
        error("'^' is supported only at the start of the pattern");
      case '$':
        error("'$' is supported only at the end of the pattern");
      case '*':
      case '+':
      case '?':
      case '{':
        error(fmt::format("'{}' has nothing to repeat", char(c)));
      case '\\': {
        if (!more()) error("the pattern ends with '\\'");
        uint32_t e = peek();
        ++pos_;
        Ranges r;
        bool neg;
        if (shorthand(e, r, neg)) return chars(neg ? ascii_complement(r) : r);
        if (e == 'b' || e == 'B') error("word boundaries (\\b, \\B) are not supported");
        uint32_t ch = escaped_char(e);
        return chars({{ch, ch}});
      }
      default:
        return chars({{c, c}});
    }
  }

  Re char_class() {
    bool negated = false;
    if (more() && peek() == '^') {
      negated = true;
      ++pos_;
    }
    Ranges r;
    bool shorthand_used = false, first = true;
    for (;;) {
      if (!more()) error("'[' must close with ']'");
      uint32_t c = peek();
      if (c == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      ++pos_;
      uint32_t lo;
      if (c == '\\') {
        if (!more()) error("the pattern ends with '\\'");
        uint32_t e = peek();
        ++pos_;
        Ranges s;
        bool neg;
        if (shorthand(e, s, neg)) {
          shorthand_used = true;
          for (auto x : neg ? ascii_complement(s) : s) r.push_back(x);
          continue;
        }
        lo = e == 'b' ? '\b' : escaped_char(e);
      } else {
        lo = c;
      }
      uint32_t hi = lo;
      if (more() && peek() == '-' && pos_ + 1 < cps_.size() && cps_[pos_ + 1] != ']') {
        ++pos_;
        uint32_t d = peek();
        ++pos_;
        if (d == '\\') {
          if (!more()) error("the pattern ends with '\\'");
          uint32_t e = peek();
          ++pos_;
          d = escaped_char(e);
        }
        hi = d;
        if (hi < lo) error("a character range is reversed");
      }
      r.push_back({lo, hi});
    }
    if (negated) r = shorthand_used ? ascii_complement(r) : complement(r);
    return chars(r);
  }

  std::string pat_;
  Mode mode_;
  std::vector<uint32_t> cps_;
  size_t pos_ = 0;
};

bool nullable(const Re& re) {
  switch (re.kind) {
    case Re::Kind::kChars:
      return false;
    case Re::Kind::kSeq:
      for (auto& k : re.kids)
        if (!nullable(k)) return false;
      return true;
    case Re::Kind::kAlt:
      for (auto& k : re.kids)
        if (nullable(k)) return true;
      return false;
    case Re::Kind::kRepeat:
      return re.min == 0 || nullable(re.kids[0]);
  }
  return true;
}

// The same language without the empty string (nullopt: it held only the empty string). A
// repetition of something nullable is emitted as one of its non-empty form ((a?){n} as a{0,n},
// (a*)* as (a+)*): the matcher would otherwise meet an empty loop or thousands of equal stacks.
std::optional<Re> nonempty(const Re& re) {
  if (!nullable(re)) return re;
  Re a;
  a.kind = Re::Kind::kAlt;
  switch (re.kind) {
    case Re::Kind::kChars:
      return re;
    case Re::Kind::kAlt:
      for (auto& k : re.kids)
        if (auto n = nonempty(k)) a.kids.push_back(*n);
      break;
    case Re::Kind::kSeq:
      // Every part is nullable: some part is the first non-empty one, the rest may follow.
      for (size_t i = 0; i < re.kids.size(); ++i) {
        auto n = nonempty(re.kids[i]);
        if (!n) continue;
        Re s;
        s.kind = Re::Kind::kSeq;
        s.kids.push_back(*n);
        for (size_t j = i + 1; j < re.kids.size(); ++j) s.kids.push_back(re.kids[j]);
        a.kids.push_back(s);
      }
      break;
    case Re::Kind::kRepeat: {
      auto inner = nonempty(re.kids[0]);
      if (!inner || re.max == 0) return std::nullopt;
      // x{m,n} with x nullable (or m = 0) is (x+){0,n}; without the empty string: (x+){1,n}.
      Re r;
      r.kind = Re::Kind::kRepeat;
      r.min = 1;
      r.max = re.max;
      r.kids.push_back(std::move(*inner));
      return r;
    }
  }
  if (a.kids.empty()) return std::nullopt;
  return a;
}

Sym emit_regex(Builder& b, const Re& re, Mode mode) {
  switch (re.kind) {
    case Re::Kind::kChars: {
      Ranges cps = re.cps;
      // A raw parameter value stays on one line unless the pattern spells a newline itself.
      // A raw parameter value keeps to one line and has no '<' unless the pattern spells one.
      if (mode == Mode::kRaw && cps.size() > 1) cps = subtract(cps, {{'\n', '\n'}, {'<', '<'}});
      return b.chars(cps, mode);
    }
    case Re::Kind::kSeq: {
      std::vector<Sym> s;
      for (auto& k : re.kids) s.push_back(emit_regex(b, k, mode));
      return b.seq("re_seq", s);
    }
    case Re::Kind::kAlt: {
      std::vector<std::vector<Sym>> alts;
      for (auto& k : re.kids) alts.push_back({emit_regex(b, k, mode)});
      return b.rule("re_alt", alts);
    }
    case Re::Kind::kRepeat: {
      if (nullable(re.kids[0])) {
        auto inner = nonempty(re.kids[0]);
        if (!inner || re.max == 0) return b.seq("re_empty", {});
        return b.repeat(emit_regex(b, *inner, mode), 0, re.max, "a regular expression repetition count");
      }
      return b.repeat(emit_regex(b, re.kids[0], mode), re.min, re.max,
                      "a regular expression repetition count");
    }
  }
  return b.seq("re_empty", {});
}

Sym regex_rule(Builder& b, const std::string& pattern, Mode mode) {
  RegexParser p(pattern, mode);
  return emit_regex(b, p.parse(), mode);
}

// Formats as anchored patterns (leap days left out: every generated date exists).
const std::map<std::string, std::string>& formats() {
  static const std::map<std::string, std::string> f = [] {
    std::string date =
        "[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1["
        "0-9]|2[0-8]))";
    std::string time =
        "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
    return std::map<std::string, std::string>{
        {"date", "^" + date + "$"},
        {"time", "^" + time + "$"},
        {"date-time", "^" + date + "T" + time + "$"},
        {"uuid", "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"},
        {"email", "^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\\.[A-Za-z0-9-]{1,63})*\\.[A-Za-z]{2,24}$"},
    };
  }();
  return f;
}

// ---- schemas --------------------------------------------------------------------------------

const std::set<std::string> kAnnotations = {
    "title",     "description", "default", "examples",      "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema",     "$id",     "discriminator", "$defs",    "definitions"};
const std::set<std::string> kKeywords = {"type",
                                         "properties",
                                         "required",
                                         "additionalProperties",
                                         "enum",
                                         "const",
                                         "anyOf",
                                         "oneOf",
                                         "allOf",
                                         "items",
                                         "prefixItems",
                                         "minItems",
                                         "maxItems",
                                         "minLength",
                                         "maxLength",
                                         "pattern",
                                         "format",
                                         "minimum",
                                         "maximum",
                                         "exclusiveMinimum",
                                         "exclusiveMaximum",
                                         "$ref",
                                         "nullable"};

std::string at(const std::string& path) { return path.empty() ? "the schema root" : "'" + path + "'"; }

class SchemaCompiler {
 public:
  SchemaCompiler(Builder& b, const Json& root) : b_(b), root_(root) {}

  Sym value(const Json& s, const std::string& path) { return value_impl(s, path, true); }

  // A tool parameter whose schema says "string": raw text.
  Sym raw_string(const Json& s, const std::string& path) {
    check_keywords(s, path);
    if (s.contains("enum") || s.contains("const")) {
      std::vector<std::vector<Sym>> alts;
      for (const Json& v : enum_values(s, path)) {
        if (!v.is_string()) continue;
        alts.push_back({b_.lit(v.get<std::string>())});
      }
      if (alts.empty()) schema_fail(fmt::format("'enum' at {} has no string value", at(path)));
      return b_.rule("enum", alts);
    }
    return string_body(s, path, Mode::kRaw);
  }

 private:
  Builder& b_;
  const Json& root_;
  std::map<const Json*, Sym> refs_;

  void check_keywords(const Json& s, const std::string& path) {
    for (auto& [k, v] : s.items()) {
      if (kAnnotations.count(k) || kKeywords.count(k)) continue;
      schema_fail(fmt::format("unsupported JSON Schema keyword '{}' at {}", k, at(path)));
    }
  }

  std::vector<std::string> validation_keys(const Json& s, std::initializer_list<const char*> allowed) {
    std::vector<std::string> out;
    for (auto& [k, v] : s.items()) {
      if (kAnnotations.count(k)) continue;
      bool ok = false;
      for (const char* a : allowed) ok = ok || k == a;
      if (!ok) out.push_back(k);
    }
    return out;
  }

  static bool is_integral(const Json& v) {
    if (v.is_number_integer()) return true;
    if (!v.is_number_float()) return false;
    double d = v.get<double>();
    return std::isfinite(d) && d == std::floor(d);
  }

  static std::string json_type_of(const Json& v) {
    if (v.is_null()) return "null";
    if (v.is_boolean()) return "boolean";
    if (v.is_number()) return "number";
    if (v.is_string()) return "string";
    if (v.is_array()) return "array";
    return "object";
  }

  std::vector<Json> enum_values(const Json& s, const std::string& path) {
    std::vector<Json> vals;
    if (s.contains("const")) vals.push_back(s["const"]);
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty())
        schema_fail(fmt::format("'enum' at {} must be a non-empty array", at(path)));
      if (s.contains("const"))
        schema_fail(fmt::format("'enum' with 'const' at {} is not supported", at(path)));
      for (auto& v : s["enum"]) vals.push_back(v);
    }
    return vals;
  }

  std::vector<std::string> types_of(const Json& s, const std::string& path) {
    std::vector<std::string> types;
    if (s.contains("type")) {
      const Json& t = s["type"];
      static const std::set<std::string> known = {"null",   "boolean", "object", "array",
                                                  "number", "integer", "string"};
      auto add = [&](const Json& x) {
        if (!x.is_string() || !known.count(x.get<std::string>()))
          schema_fail(fmt::format("'type' at {} must be a JSON type name or an array of them", at(path)));
        types.push_back(x.get<std::string>());
      };
      if (t.is_array()) {
        if (t.empty()) schema_fail(fmt::format("'type' at {} must not be empty", at(path)));
        for (auto& x : t) add(x);
      } else {
        add(t);
      }
    }
    return types;
  }

  Sym value_impl(const Json& s, const std::string& path, bool allow_null_flag) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return b_.any_value();
      schema_fail(fmt::format("the schema at {} is false: it allows no value", at(path)));
    }
    if (!s.is_object()) schema_fail(fmt::format("the schema at {} must be an object or a boolean", at(path)));
    check_keywords(s, path);
    if (allow_null_flag && s.contains("nullable")) {
      if (!s["nullable"].is_boolean())
        schema_fail(fmt::format("'nullable' at {} must be a boolean", at(path)));
      if (s["nullable"].get<bool>())
        return b_.rule("nullable", {{value_impl(s, path, false)}, {b_.lit("null")}});
    }
    if (s.contains("$ref")) {
      auto extra = validation_keys(s, {"$ref", "nullable"});
      if (!extra.empty())
        schema_fail(
            fmt::format("'$ref' with the sibling keyword '{}' at {} is not supported", extra[0], at(path)));
      return ref(s["$ref"], path);
    }
    if (s.contains("allOf")) {
      const Json& a = s["allOf"];
      auto extra = validation_keys(s, {"allOf", "nullable"});
      if (!a.is_array() || a.size() != 1 || !extra.empty())
        schema_fail(fmt::format("'allOf' at {} is supported only as a single schema with no sibling keywords",
                                at(path)));
      return value(a[0], path + "/allOf/0");
    }
    for (const char* comb : {"anyOf", "oneOf"}) {
      if (!s.contains(comb)) continue;
      const Json& a = s[comb];
      if (!a.is_array() || a.empty())
        schema_fail(fmt::format("'{}' at {} must be a non-empty array", comb, at(path)));
      auto extra = validation_keys(s, {comb, "nullable"});
      if (!extra.empty())
        schema_fail(fmt::format("'{}' with the sibling keyword '{}' at {} is not supported", comb, extra[0],
                                at(path)));
      std::vector<std::vector<Sym>> alts;
      for (size_t i = 0; i < a.size(); ++i)
        alts.push_back({value(a[i], fmt::format("{}/{}/{}", path, comb, i))});
      return b_.rule(comb, alts);
    }
    std::vector<std::string> types = types_of(s, path);
    if (s.contains("enum") || s.contains("const")) {
      auto extra = validation_keys(s, {"enum", "const", "type", "nullable"});
      if (!extra.empty())
        schema_fail(fmt::format("'enum'/'const' with the sibling keyword '{}' at {} is not supported",
                                extra[0], at(path)));
      std::vector<std::vector<Sym>> alts;
      for (const Json& v : enum_values(s, path)) {
        std::string t = json_type_of(v);
        bool ok = types.empty();
        for (auto& want : types)
          ok =
              ok || want == t || (want == "integer" && is_integral(v)) || (want == "number" && t == "number");
        if (ok) alts.push_back({b_.json_lit(v.dump(-1, ' ', false, Json::error_handler_t::strict))});
      }
      if (alts.empty())
        schema_fail(fmt::format("no 'enum'/'const' value at {} has the schema's type", at(path)));
      return b_.rule("enum", alts);
    }
    if (types.empty()) {
      // No type: the keywords present say which kind of value they constrain.
      for (const char* k : {"properties", "required", "additionalProperties"})
        if (s.contains(k)) types = {"object"};
      for (const char* k : {"items", "prefixItems", "minItems", "maxItems"})
        if (s.contains(k) && types.empty()) types = {"array"};
      for (const char* k : {"minLength", "maxLength", "pattern", "format"})
        if (s.contains(k) && types.empty()) types = {"string"};
      for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
        if (s.contains(k) && types.empty()) types = {"number"};
      if (types.empty()) return b_.any_value();
    }
    std::vector<std::vector<Sym>> alts;
    for (auto& t : types) alts.push_back({typed(s, t, path)});
    return alts.size() == 1 ? alts[0][0] : b_.rule("types", alts);
  }

  Sym ref(const Json& r, const std::string& path) {
    if (!r.is_string()) schema_fail(fmt::format("'$ref' at {} must be a string", at(path)));
    std::string p = r.get<std::string>();
    if (p.empty() || p[0] != '#')
      schema_fail(fmt::format("'$ref' '{}' at {}: only references within the schema (#...) are supported", p,
                              at(path)));
    const Json* target = &root_;
    std::string ptr = p.substr(1);
    if (!ptr.empty()) {
      try {
        target = &root_.at(Json::json_pointer(ptr));
      } catch (const std::exception&) {
        schema_fail(fmt::format("'$ref' '{}' at {} does not resolve", p, at(path)));
      }
    }
    auto it = refs_.find(target);
    if (it != refs_.end()) return it->second;
    int rule = b_.g.add_rule(p);
    refs_[target] = rule;
    b_.g.add_alt(rule, {value(*target, ptr)});
    return rule;
  }

  int64_t count(const Json& s, const char* k, const std::string& path, int64_t fallback) {
    if (!s.contains(k)) return fallback;
    const Json& v = s[k];
    if (!is_integral(v) || v.get<double>() < 0)
      schema_fail(fmt::format("'{}' at {} must be a non-negative integer", k, at(path)));
    double d = v.get<double>();
    if (d > kMaxRepeat)
      schema_fail(fmt::format("'{}' above {} at {} is not supported", k, kMaxRepeat, at(path)));
    return int64_t(d);
  }

  Sym typed(const Json& s, const std::string& t, const std::string& path) {
    if (t == "null") return b_.lit("null");
    if (t == "boolean") return b_.rule("boolean", {{b_.lit("true")}, {b_.lit("false")}});
    if (t == "string")
      return b_.seq("string", {b_.g.byte('"'), string_body(s, path, Mode::kJson), b_.g.byte('"')});
    if (t == "integer") return integer(s, path);
    if (t == "number") return number(s, path);
    if (t == "object") return object(s, path);
    return array(s, path);
  }

  Sym string_body(const Json& s, const std::string& path, Mode mode) {
    const bool has_len = s.contains("minLength") || s.contains("maxLength");
    std::string pattern;
    if (s.contains("format")) {
      if (!s["format"].is_string()) schema_fail(fmt::format("'format' at {} must be a string", at(path)));
      auto it = formats().find(s["format"].get<std::string>());
      if (it == formats().end())
        schema_fail(fmt::format("unsupported 'format' '{}' at {} (date, time, date-time, uuid, email)",
                                s["format"].get<std::string>(), at(path)));
      if (s.contains("pattern") || has_len)
        schema_fail(fmt::format("'format' with 'pattern' or a length at {} is not supported", at(path)));
      pattern = it->second;
    } else if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) schema_fail(fmt::format("'pattern' at {} must be a string", at(path)));
      if (has_len)
        schema_fail(fmt::format("'pattern' with 'minLength'/'maxLength' at {} is not supported", at(path)));
      pattern = s["pattern"].get<std::string>();
    }
    if (s.contains("format") || s.contains("pattern")) return regex_rule(b_, pattern, mode);
    int64_t mn = count(s, "minLength", path, 0), mx = count(s, "maxLength", path, -1);
    if (mx >= 0 && mx < mn) schema_fail(fmt::format("'maxLength' is below 'minLength' at {}", at(path)));
    if (mode == Mode::kRaw) {
      if (!has_len) return b_.raw_free();
      Sym c = b_.chars(subtract({{0, kMaxCp}}, {{'\n', '\n'}, {'<', '<'}}), Mode::kRaw);
      return b_.repeat(c, int(mn), int(mx), "a string length");
    }
    if (!has_len) return b_.star(b_.json_char());
    return b_.repeat(b_.json_char(), int(mn), int(mx), "a string length");
  }

  struct Bound {
    std::optional<double> v;
    bool exclusive = false;
  };

  void bounds(const Json& s, const std::string& path, Bound& lo, Bound& hi) {
    auto num = [&](const char* k) -> std::optional<double> {
      if (!s.contains(k)) return std::nullopt;
      if (!s[k].is_number()) schema_fail(fmt::format("'{}' at {} must be a number", k, at(path)));
      return s[k].get<double>();
    };
    auto mn = num("minimum"), emn = num("exclusiveMinimum"), mx = num("maximum"),
         emx = num("exclusiveMaximum");
    if (mn) lo = {mn, false};
    if (emn && (!lo.v || *emn >= *lo.v)) lo = {emn, true};
    if (mx) hi = {mx, false};
    if (emx && (!hi.v || *emx <= *hi.v)) hi = {emx, true};
  }

  static constexpr double kIntCap = 9999999999999999.0;  // kMaxIntDigits nines

  Sym integer(const Json& s, const std::string& path) {
    Bound lo, hi;
    bounds(s, path, lo, hi);
    if (!lo.v && !hi.v)
      return b_.seq(
          "integer",
          {b_.opt(b_.g.byte('-')),
           b_.rule("int", {{b_.lit("0")}, {b_.byte_range('1', '9'), b_.digits(0, kMaxIntDigits - 1)}})});
    double l = -kIntCap, h = kIntCap;
    if (lo.v) l = lo.exclusive ? std::floor(*lo.v) + 1 : std::ceil(*lo.v);
    if (hi.v) h = hi.exclusive ? std::ceil(*hi.v) - 1 : std::floor(*hi.v);
    l = std::max(l, -kIntCap);
    h = std::min(h, kIntCap);
    if (l > h) schema_fail(fmt::format("no integer lies within the bounds at {}", at(path)));
    return b_.int_range(int64_t(l), int64_t(h));
  }

  // Magnitudes m with a <(=) m <(=) b, written as an integer part and an optional fraction.
  void magnitudes(int64_t a, bool a_open, std::optional<int64_t> b, bool b_incl,
                  std::vector<std::vector<Sym>>& out) {
    Sym any_frac = b_.opt(b_.seq("frac", {b_.g.byte('.'), b_.digits(1, kMaxFracDigits)}));
    Sym nz_frac = b_.seq("frac", {b_.g.byte('.'), b_.digits(0, kMaxFracDigits - 1), b_.byte_range('1', '9')});
    Sym zero_frac =
        b_.opt(b_.seq("frac", {b_.g.byte('.'), b_.repeat(b_.g.byte('0'), 1, kMaxFracDigits, "digits")}));
    const int64_t top = b ? *b : int64_t(kIntCap);
    if (b && a == *b) {
      if (!a_open && b_incl) out.push_back({b_.nonneg_range(a, a), zero_frac});
      return;
    }
    out.push_back({b_.nonneg_range(a, a), a_open ? nz_frac : any_frac});
    if (b) {
      if (a + 1 <= top - 1) out.push_back({b_.nonneg_range(a + 1, top - 1), any_frac});
      if (b_incl) out.push_back({b_.nonneg_range(top, top), zero_frac});
    } else if (a + 1 <= top) {
      out.push_back({b_.nonneg_range(a + 1, top), any_frac});
    }
  }

  Sym number(const Json& s, const std::string& path) {
    Bound lo, hi;
    bounds(s, path, lo, hi);
    if (!lo.v && !hi.v) return b_.any_number();
    // Bounds beyond what is generated anyway (16 integer digits) change nothing.
    if (lo.v && *lo.v < -kIntCap) lo = {};
    if (hi.v && *hi.v > kIntCap) hi = {};
    if ((lo.v && *lo.v > kIntCap) || (hi.v && *hi.v < -kIntCap))
      schema_fail(fmt::format("the bounds at {} lie beyond the {}-digit numbers tansy generates", at(path),
                              kMaxIntDigits));
    if (!lo.v && !hi.v) return b_.any_number();
    for (auto* bd : {&lo, &hi})
      if (bd->v && *bd->v != std::floor(*bd->v))
        schema_fail(fmt::format(
            "bounds of a 'number' at {} must be integers (non-integer bounds are not supported)", at(path)));
    std::optional<int64_t> L, H;
    if (lo.v) L = int64_t(*lo.v);
    if (hi.v) H = int64_t(*hi.v);
    if (L && H && (*L > *H || (*L == *H && (lo.exclusive || hi.exclusive))))
      schema_fail(fmt::format("no number lies within the bounds at {}", at(path)));
    std::vector<std::vector<Sym>> alts;
    // x >= 0
    if (!H || *H > 0 || (*H == 0 && !hi.exclusive)) {
      int64_t a = (!L || *L < 0) ? 0 : *L;
      bool a_open = L && *L >= 0 && lo.exclusive;
      std::vector<std::vector<Sym>> m;
      magnitudes(a, a_open, H, !hi.exclusive, m);
      for (auto& x : m) alts.push_back(x);
    }
    // x < 0: "-" and a magnitude in (max(0, -H), -L]
    if (!L || *L < 0) {
      int64_t a = (!H || *H >= 0) ? 0 : -*H;
      bool a_open = a == 0 ? true : hi.exclusive;
      std::optional<int64_t> b;
      if (L) b = -*L;
      std::vector<std::vector<Sym>> m;
      magnitudes(a, a_open, b, !lo.exclusive, m);
      for (auto& x : m) {
        x.insert(x.begin(), b_.g.byte('-'));
        alts.push_back(x);
      }
    }
    return b_.rule("number", alts);
  }

  // An object key other than the declared ones: plain printable ASCII (no escapes, so no
  // spelling of a declared key slips through).
  Sym extra_key(const std::vector<std::string>& declared) {
    ByteSet key_chars;
    key_chars.add_range(0x20, 0x7E);
    ByteSet bad;
    bad.add('"');
    bad.add('\\');
    if (b_.no_lt) bad.add('<');
    for (int i = 0; i < 4; ++i) key_chars.w[i] &= ~bad.w[i];
    Sym free_rest = b_.seq("key_rest", {b_.star(b_.g.bytes(key_chars)), b_.g.byte('"')});
    // A trie of the declared keys' encodings; leaving it anywhere but at a key's end is fine.
    std::set<std::string> keys;
    for (auto& k : declared) keys.insert(Json(k).dump());  // with quotes
    std::function<Sym(const std::string&)> node = [&](const std::string& prefix) -> Sym {
      std::set<uint8_t> next;
      bool is_key = false;
      for (auto& k : keys) {
        std::string body = k.substr(1, k.size() - 2);
        if (body.compare(0, prefix.size(), prefix) != 0) continue;
        if (body.size() == prefix.size())
          is_key = true;
        else
          next.insert(uint8_t(body[prefix.size()]));
      }
      std::vector<std::vector<Sym>> alts;
      if (!is_key) alts.push_back({b_.g.byte('"')});
      ByteSet others = key_chars;
      for (uint8_t c : next) {
        if (!key_chars.has(c)) continue;
        others.w[c >> 6] &= ~(uint64_t(1) << (c & 63));
        alts.push_back({b_.g.byte(c), node(prefix + char(c))});
      }
      if (!others.empty()) alts.push_back({b_.g.bytes(others), free_rest});
      return b_.rule("key", alts);
    };
    return b_.seq("extra_key", {b_.g.byte('"'), node("")});
  }

  Sym object(const Json& s, const std::string& path) {
    std::vector<std::pair<std::string, const Json*>> props;
    static const Json kAny = true;
    if (s.contains("properties")) {
      if (!s["properties"].is_object())
        schema_fail(fmt::format("'properties' at {} must be an object", at(path)));
      for (auto& [k, v] : s["properties"].items()) props.push_back({k, &v});
    }
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array())
        schema_fail(fmt::format("'required' at {} must be an array of strings", at(path)));
      for (auto& r : s["required"]) {
        if (!r.is_string())
          schema_fail(fmt::format("'required' at {} must be an array of strings", at(path)));
        required.insert(r.get<std::string>());
      }
    }
    const Json* extra = nullptr;  // schema of additional properties, when they are generated
    if (s.contains("additionalProperties")) {
      const Json& ap = s["additionalProperties"];
      if (!ap.is_boolean() && !ap.is_object())
        schema_fail(fmt::format("'additionalProperties' at {} must be a boolean or a schema", at(path)));
      if (!(ap.is_boolean() && !ap.get<bool>())) extra = &ap;
    }
    for (auto& r : required) {
      bool declared = false;
      for (auto& p : props) declared = declared || p.first == r;
      if (declared) continue;
      if (s.contains("additionalProperties") && !extra)
        schema_fail(fmt::format("required property '{}' at {} is not allowed by 'additionalProperties'", r,
                                at(path)));
      props.push_back({r, extra ? extra : &kAny});
    }
    // rest[i][comma]: properties i.. given whether a comma must precede the next one.
    const size_t n = props.size();
    std::vector<std::array<Sym, 2>> rest(n + 1);
    std::vector<std::string> names;
    for (auto& p : props) names.push_back(p.first);
    Sym tail0, tail1;
    if (extra) {
      Sym val = value(*extra, path + "/additionalProperties");
      Sym member = b_.seq("member", {extra_key(names), b_.g.byte(':'), val});
      Sym more = b_.star(b_.seq("more", {b_.g.byte(','), member}));
      tail1 = more;
      tail0 = b_.opt(b_.seq("members", {member, more}));
    } else {
      tail0 = tail1 = b_.seq("none", {});
    }
    rest[n] = {tail0, tail1};
    for (size_t i = n; i-- > 0;) {
      const std::string key = Json(props[i].first).dump();
      Sym val = value(*props[i].second, path + "/properties/" + props[i].first);
      for (int comma = 0; comma < 2; ++comma) {
        std::vector<Sym> with;
        if (comma) with.push_back(b_.g.byte(','));
        with.push_back(b_.json_lit(key + ":"));
        with.push_back(val);
        with.push_back(rest[i + 1][1]);
        std::vector<std::vector<Sym>> alts = {with};
        if (!required.count(props[i].first)) alts.push_back({rest[i + 1][size_t(comma)]});
        rest[i][size_t(comma)] = b_.rule("props", alts);
      }
    }
    return b_.seq("object", {b_.g.byte('{'), rest[0][0], b_.g.byte('}')});
  }

  Sym array(const Json& s, const std::string& path) {
    std::vector<const Json*> prefix;
    if (s.contains("prefixItems")) {
      if (!s["prefixItems"].is_array())
        schema_fail(fmt::format("'prefixItems' at {} must be an array", at(path)));
      for (auto& x : s["prefixItems"]) prefix.push_back(&x);
    }
    int64_t mn = count(s, "minItems", path, 0), mx = count(s, "maxItems", path, -1);
    bool items_false = false;
    Sym item = -1;
    if (s.contains("items")) {
      const Json& it = s["items"];
      if (it.is_boolean() && !it.get<bool>())
        items_false = true;
      else
        item = value(it, path + "/items");
    } else {
      item = b_.any_value();
    }
    const int64_t P = int64_t(prefix.size());
    if (items_false) mx = mx < 0 ? P : std::min(mx, P);
    if (mx >= 0 && mn > mx) schema_fail(fmt::format("no array length satisfies the bounds at {}", at(path)));
    std::vector<Sym> prefix_syms;
    for (int64_t i = 0; i < P; ++i)
      prefix_syms.push_back(value(*prefix[size_t(i)], fmt::format("{}/prefixItems/{}", path, i)));
    auto elem = [&](int64_t i) { return i < P ? prefix_syms[size_t(i)] : item; };
    auto with_sep = [&](int64_t i, Sym e) {
      return i > 0 ? std::vector<Sym>{b_.g.byte(','), e} : std::vector<Sym>{e};
    };
    const int64_t K = mx >= 0 ? mx : std::max(P, mn);
    Sym next;
    if (mx >= 0) {
      next = b_.seq("end", {});
    } else {
      int t = b_.g.add_rule("items");
      b_.g.add_alt(t, {});
      std::vector<Sym> a = {b_.g.byte(','), item, t};
      b_.g.add_alt(t, a);
      next = K == 0 ? b_.rule("items", {{}, {item, t}}) : t;
    }
    for (int64_t i = K; i-- > 0;) {
      std::vector<std::vector<Sym>> alts;
      if (i >= mn) alts.push_back({});
      std::vector<Sym> a = with_sep(i, elem(i));
      a.push_back(next);
      alts.push_back(a);
      next = b_.rule("items", alts);
    }
    return b_.seq("array", {b_.g.byte('['), next, b_.g.byte(']')});
  }
};

Sym framed(Builder& b, Sym body, const Framing& f) {
  if (!f.leading_newlines) return body;
  return b.seq("root", {b.rule("newlines", {{}, {b.lit("\n")}, {b.lit("\n\n")}}), body});
}

std::shared_ptr<Grammar> finish(std::shared_ptr<Grammar> g, Sym root) {
  g->set_root(root);
  try {
    g->compile();
  } catch (const SchemaError&) {
    throw;
  } catch (const Error& e) {
    // A schema whose every instance would be infinite (a required recursive property).
    throw SchemaError(fmt::format("the schema cannot be generated: {}", e.what()));
  }
  return g;
}

bool is_string_parameter(const Json& prop) {
  if (!prop.is_object() || !prop.contains("type")) return false;
  const Json& t = prop["type"];
  if (t.is_string()) return t == "string";
  if (!t.is_array()) return false;
  bool has_string = false;
  for (const Json& x : t) {
    if (x == "string")
      has_string = true;
    else if (x != "null")
      return false;
  }
  return has_string;
}

}  // namespace

// Every failure while building (the grammar's size limits included) is the schema's: SchemaError.
template <typename F>
std::shared_ptr<Grammar> guarded(F&& build) {
  try {
    return build();
  } catch (const SchemaError&) {
    throw;
  } catch (const Error& e) {
    throw SchemaError(fmt::format("the schema cannot be generated: {}", e.what()));
  }
}

std::shared_ptr<Grammar> json_schema_grammar(const Json& schema, const Framing& f) {
  return guarded([&] {
    auto g = std::make_shared<Grammar>();
    Builder b(*g);
    SchemaCompiler c(b, schema);
    return finish(g, framed(b, c.value(schema, ""), f));
  });
}

std::shared_ptr<Grammar> json_object_grammar(const Framing& f) {
  auto g = std::make_shared<Grammar>();
  Builder b(*g);
  return finish(g, framed(b, b.any_object(), f));
}

std::shared_ptr<Grammar> regex_grammar(const std::string& pattern) {
  return guarded([&] {
    auto g = std::make_shared<Grammar>();
    Builder b(*g);
    return finish(g, regex_rule(b, pattern, Mode::kRaw));
  });
}

static std::shared_ptr<Grammar> tool_call_grammar_impl(const std::vector<ToolSpec>& tools, ToolMode mode,
                                                       const Framing& f, const ToolContent& content,
                                                       bool single_call) {
  if (tools.empty()) throw SchemaError("tool calls need at least one tool");
  auto g = std::make_shared<Grammar>();
  Builder b(*g, /*no_lt=*/true);
  // The call after "<tool_call>", per tool.
  std::vector<std::vector<Sym>> rests;
  for (size_t t = 0; t < tools.size(); ++t) {
    const ToolSpec& tool = tools[t];
    const std::string where = fmt::format("tools[{}].function.parameters", t);
    std::vector<Sym> body = {b.lit("\n<function=" + tool.name + ">\n")};
    if (!tool.constrained) {
      ByteSet name_chars;
      name_chars.add_range(0x20, 0xFF);
      for (uint8_t c : {uint8_t('<'), uint8_t('>')}) name_chars.w[c >> 6] &= ~(uint64_t(1) << (c & 63));
      Sym pname = b.repeat(g->bytes(name_chars), 1, -1, "a parameter name");
      Sym param = b.seq("param",
                        {b.lit("<parameter="), pname, b.lit(">\n"), b.raw_free(), b.lit("\n</parameter>\n")});
      body.push_back(b.star(param));
    } else if (tool.parameters.is_object()) {
      const Json& p = tool.parameters;
      SchemaCompiler c(b, p);
      // The parameters themselves are an object schema: only its members are generated.
      for (auto& [k, v] : p.items())
        if (!kAnnotations.count(k) && k != "type" && k != "properties" && k != "required" &&
            k != "additionalProperties")
          throw SchemaError(
              fmt::format("unsupported keyword '{}' at {} (parameters must be an object schema)", k, where));
      if (p.contains("type") && p["type"] != "object")
        throw SchemaError(fmt::format("'type' at {} must be \"object\"", where));
      std::set<std::string> required;
      if (p.contains("required")) {
        if (!p["required"].is_array())
          throw SchemaError(fmt::format("'required' at {} must be an array", where));
        for (auto& r : p["required"])
          if (r.is_string()) required.insert(r.get<std::string>());
      }
      if (p.contains("properties")) {
        if (!p["properties"].is_object())
          throw SchemaError(fmt::format("'properties' at {} must be an object", where));
        for (auto& [k, v] : p["properties"].items()) {
          std::string ppath = where + "/properties/" + k;
          Sym val = is_string_parameter(v) ? c.raw_string(v, ppath)
                                           : b.seq("json", {b.lit("\n"), c.value(v, ppath), b.lit("\n")});
          // A raw value is the text between "<parameter=K>\n" and "\n</parameter>".
          Sym param = is_string_parameter(v)
                          ? b.seq("param", {b.lit("<parameter=" + k + ">\n"), val, b.lit("\n</parameter>\n")})
                          : b.seq("param", {b.lit("<parameter=" + k + ">"), val, b.lit("</parameter>\n")});
          body.push_back(required.count(k) ? param : b.opt(param));
          required.erase(k);
        }
      }
      if (!required.empty())
        throw SchemaError(
            fmt::format("required parameter '{}' at {} is not in 'properties'", *required.begin(), where));
    }
    body.push_back(b.lit("</function>\n</tool_call>"));
    rests.push_back(body);
  }
  Sym rest = b.rule("call_rest", rests);
  Sym call = b.seq("call", {b.lit("<tool_call>"), rest});
  Sym more = single_call ? b.seq("none", {}) : b.star(b.seq("more", {b.lit("\n"), call}));
  if (mode == ToolMode::kRequired) return finish(g, framed(b, b.seq("calls", {call, more}), f));
  if (content.kind != ToolContent::Kind::kFree) {
    // A JSON answer or calls.
    Sym doc = content.kind == ToolContent::Kind::kJsonObject
                  ? b.any_object()
                  : SchemaCompiler(b, content.schema).value(content.schema, "");
    return finish(g, framed(b, b.rule("answer", {{doc}, {call, more}}), f));
  }
  // Free text up to the first "<tool_call>" (a KMP automaton over bytes), then calls only.
  const std::string w = "<tool_call>";
  const size_t n = w.size();
  std::vector<int> fail_(n + 1, 0);
  for (size_t i = 1, k = 0; i < n; ++i) {
    while (k > 0 && w[i] != w[k]) k = size_t(fail_[k]);
    if (w[i] == w[k]) ++k;
    fail_[i + 1] = int(k);
  }
  auto delta = [&](size_t k, uint8_t c) {
    while (k > 0 && uint8_t(w[k]) != c) k = size_t(fail_[k]);
    return uint8_t(w[k]) == c ? k + 1 : 0;
  };
  std::vector<int> text(n);
  for (size_t k = 0; k < n; ++k) text[k] = g->add_rule("text");
  Sym calls_after = b.seq("calls", {rest, more});
  for (size_t k = 0; k < n; ++k) {
    g->add_alt(text[k], {});
    std::map<size_t, ByteSet> by_target;
    for (int c = 0; c < 256; ++c) by_target[delta(k, uint8_t(c))].add(uint8_t(c));
    for (auto& [target, set] : by_target) {
      Sym s = g->bytes(set);
      if (target == n)
        g->add_alt(text[k], {s, calls_after});
      else
        g->add_alt(text[k], {s, text[target]});
    }
  }
  return finish(g, text[0]);
}

std::shared_ptr<Grammar> tool_call_grammar(const std::vector<ToolSpec>& tools, ToolMode mode,
                                           const Framing& f, const ToolContent& content, bool single_call) {
  return guarded([&] { return tool_call_grammar_impl(tools, mode, f, content, single_call); });
}

}  // namespace tansy::grammar
