// Lexer and parser of the Jinja subset (text/jinja.h). Whitespace handling follows jinja2's lexer
// with trim_blocks and lstrip_blocks on: `-` strips all whitespace on its side, `+` keeps it, a
// block or comment tag drops one newline after it and the spaces before it on its own line.
#include <charconv>
#include <cstring>

#include "core/error.h"
#include "text/jinja_internal.h"

namespace tansy::text::jinja {

size_t utf8_decode(std::string_view s, size_t i, char32_t& cp) {
  auto b = static_cast<unsigned char>(s[i]);
  size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
  if (len == 0 || i + len > s.size()) return 0;
  cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < len; ++k) {
    auto c = static_cast<unsigned char>(s[i + k]);
    if ((c >> 6) != 2) return 0;
    cp = (cp << 6) | (c & 0x3F);
  }
  return len;
}

void utf8_encode(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

namespace {

constexpr int kMaxNesting = 200;  // expression and block nesting; deeper input is refused

// Length of the Python-whitespace code point at s[i], 0 if none.
size_t space_at(std::string_view s, size_t i) {
  char32_t cp = 0;
  size_t n = utf8_decode(s, i, cp);
  return n && py_isspace(cp) ? n : 0;
}

size_t skip_space(std::string_view s, size_t i) {
  while (i < s.size()) {
    size_t n = space_at(s, i);
    if (!n) break;
    i += n;
  }
  return i;
}

std::string_view rstrip_space(std::string_view s) {
  size_t e = s.size();
  while (e > 0) {
    size_t start = e - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) >> 6) == 2) --start;
    char32_t cp = 0;
    if (utf8_decode(s, start, cp) != e - start || !py_isspace(cp)) break;
    e = start;
  }
  return s.substr(0, e);
}

enum class Tok : uint8_t { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok type;
  int line;
  std::string text;  // data, name, operator, decoded string
  __int128 ival = 0;
  double fval = 0;
};

[[noreturn]] void syntax(int line, std::string_view what) { fail("chat template line {}: {}", line, what); }

// Python's unicode-escape decoding of a string literal's body (what jinja2 applies).
std::string decode_string(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\') {
      out += c;
      continue;
    }
    if (++i >= body.size()) syntax(line, "string literal ends with a backslash");
    char e = body[i];
    auto hex = [&](size_t n) {
      uint32_t v = 0;
      for (size_t k = 1; k <= n; ++k) {
        if (i + k >= body.size()) syntax(line, "truncated escape in string literal");
        char h = body[i + k];
        int d = h >= '0' && h <= '9'   ? h - '0'
                : h >= 'a' && h <= 'f' ? h - 'a' + 10
                : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                       : -1;
        if (d < 0) syntax(line, "truncated escape in string literal");
        v = v * 16 + uint32_t(d);
      }
      i += n;
      if (v > 0x10FFFF) syntax(line, "escape beyond U+10FFFF in string literal");
      utf8_encode(out, v);
    };
    switch (e) {
      case '\n':
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        hex(2);
        break;
      case 'u':
        hex(4);
        break;
      case 'U':
        hex(8);
        break;
      case 'N':
        syntax(line, "\\N{...} escapes are not supported");
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = uint32_t(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
            v = v * 8 + uint32_t(body[++i] - '0');
          utf8_encode(out, v);
        } else if (static_cast<unsigned char>(e) >= 0x80) {
          // jinja2 first writes non-ASCII as \xNN / \uNNNN / \UNNNNNNNN, so the backslash before it
          // stays and the escape's text follows.
          char32_t cp = 0;
          size_t n = utf8_decode(body, i, cp);
          if (!n) syntax(line, "invalid UTF-8 in string literal");
          i += n - 1;
          out += '\\';
          out += cp < 0x100     ? fmt::format("x{:02x}", uint32_t(cp))
                 : cp < 0x10000 ? fmt::format("u{:04x}", uint32_t(cp))
                                : fmt::format("U{:08x}", uint32_t(cp));
        } else {
          out += '\\';  // Python keeps unknown escapes
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view src) {
    // jinja2 normalises \r\n and \r to \n and drops one trailing newline.
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\r') {
        src_ += '\n';
        if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
      } else {
        src_ += src[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    std::string_view s = src_;
    size_t pos = 0;
    bool line_starting = true;
    while (pos < s.size()) {
      size_t start = find_tag(s, pos);
      std::string_view text = s.substr(pos, start - pos);
      if (start == s.size()) {
        emit_data(text);
        break;
      }
      char kind = s[start + 1];  // '{', '%' or '#'
      size_t after = start + 2;
      char sign = after < s.size() && (s[after] == '-' || s[after] == '+') ? s[after] : 0;
      if (sign) ++after;
      // raw blocks are handled here: their body is data
      bool is_raw = kind == '%' && raw_keyword(s, after, "raw") != std::string_view::npos;
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+' && kind != '{') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string_view::npos ? 0 : l_pos + 1;
        if (l_pos > 0 || line_starting) {
          std::string_view tail = text.substr(l_pos);
          if (!tail.empty() && skip_space(tail, 0) == tail.size()) text = text.substr(0, l_pos);
        }
      }
      emit_data(text);
      line_ += count_nl(s.substr(pos, start - pos));
      if (is_raw) {
        pos = lex_raw(s, raw_keyword(s, after, "raw"), line_starting);
      } else if (kind == '#') {
        size_t end = s.find("#}", after);
        if (end == std::string_view::npos) syntax(line_, "missing end of comment tag");
        line_ += count_nl(s.substr(after, end - after));
        pos = tag_end(s, end, '#', line_starting);
      } else {
        toks_.push_back({kind == '{' ? Tok::VarBegin : Tok::BlockBegin, line_, ""});
        pos = lex_inside(s, after, kind == '{' ? '}' : '%', line_starting);
      }
    }
    toks_.push_back({Tok::Eof, line_, ""});
    return std::move(toks_);
  }

 private:
  static size_t count_nl(std::string_view t) { return size_t(std::count(t.begin(), t.end(), '\n')); }

  void emit_data(std::string_view text) {
    if (!text.empty()) toks_.push_back({Tok::Data, line_, std::string(text)});
  }

  static size_t find_tag(std::string_view s, size_t pos) {
    for (size_t i = s.find('{', pos); i != std::string_view::npos; i = s.find('{', i + 1))
      if (i + 1 < s.size() && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#')) return i;
    return s.size();
  }

  // If s[at..] is `\s*WORD\s*` followed by `-%}` or `%}` (or `+%}`), where the tag's closing
  // starts; else npos.
  static size_t raw_keyword(std::string_view s, size_t at, std::string_view word) {
    size_t i = skip_space(s, at);
    if (s.substr(i, word.size()) != word) return std::string_view::npos;
    i = skip_space(s, i + word.size());
    if (s.substr(i, 2) == "%}" || s.substr(i, 3) == "-%}" || s.substr(i, 3) == "+%}") return i;
    return std::string_view::npos;
  }

  // After the closing delimiter at s[close] (with its sign before it), applying `-` and
  // trim_blocks; returns the position of the next data and updates line_starting.
  size_t tag_end(std::string_view s, size_t close, char kind, bool& line_starting) {
    char sign = close > 0 && (s[close - 1] == '-' || s[close - 1] == '+') ? s[close - 1] : 0;
    size_t pos = close + 2;
    if (sign == '-') {
      size_t e = skip_space(s, pos);
      line_ += count_nl(s.substr(pos, e - pos));
      line_starting = e > pos && s[e - 1] == '\n';
      return e;
    }
    if (sign != '+' && kind != '}' && pos < s.size() && s[pos] == '\n') {
      ++line_;
      line_starting = true;
      return pos + 1;
    }
    line_starting = false;
    return pos;
  }

  size_t lex_raw(std::string_view s, size_t close, bool& line_starting) {
    // {% raw %} has no trim_blocks; `-%}` strips what follows.
    size_t pos = close + (s[close] == '%' ? 2 : 3);
    if (s[close] == '-') pos = skip_space(s, pos);
    for (size_t i = s.find("{%", pos); i != std::string_view::npos; i = s.find("{%", i + 1)) {
      size_t after = i + 2;
      char sign = after < s.size() && (s[after] == '-' || s[after] == '+') ? s[after] : 0;
      if (sign) ++after;
      size_t end = raw_keyword(s, after, "endraw");
      if (end == std::string_view::npos) continue;
      std::string_view text = s.substr(pos, i - pos);
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string_view::npos ? 0 : l_pos + 1;
        if (l_pos > 0) {
          std::string_view tail = text.substr(l_pos);
          if (!tail.empty() && skip_space(tail, 0) == tail.size()) text = text.substr(0, l_pos);
        }
      }
      emit_data(text);
      line_ += count_nl(s.substr(pos, i - pos));
      size_t close2 = end + (s[end] == '%' ? 0 : 1);
      return tag_end(s, close2, '%', line_starting);
    }
    syntax(line_, "missing end of raw directive");
  }

  size_t lex_inside(std::string_view s, size_t i, char end_char, bool& line_starting) {
    int depth = 0;
    for (;;) {
      while (i < s.size()) {
        size_t n = space_at(s, i);
        if (!n) break;
        if (s[i] == '\n') ++line_;
        i += n;
      }
      if (i >= s.size())
        syntax(line_, end_char == '}' ? "unexpected end of template, expected '}}'"
                                      : "unexpected end of template, expected '%}'");
      if (depth == 0) {
        bool minus = s[i] == '-' && i + 2 < s.size() + 0 && s.substr(i + 1, 2) == std::string{end_char, '}'};
        bool plus = end_char == '%' && s[i] == '+' && s.substr(i + 1, 2) == "%}";
        if (minus || plus || s.substr(i, 2) == std::string{end_char, '}'}) {
          toks_.push_back({end_char == '}' ? Tok::VarEnd : Tok::BlockEnd, line_, ""});
          return tag_end(s, i + (minus || plus ? 1 : 0), end_char, line_starting);
        }
      }
      char c = s[i];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t j = i;
        while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
        toks_.push_back({Tok::Name, line_, std::string(s.substr(i, j - i))});
        i = j;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        i = lex_number(s, i);
      } else if (c == '\'' || c == '"') {
        size_t j = i + 1;
        while (j < s.size() && s[j] != c) j += s[j] == '\\' ? 2 : 1;
        if (j >= s.size()) syntax(line_, "unterminated string literal");
        std::string_view body = s.substr(i + 1, j - i - 1);
        toks_.push_back({Tok::String, line_, decode_string(body, line_)});
        line_ += count_nl(body);
        i = j + 1;
      } else {
        static const char* ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
                                    "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};
        std::string op;
        for (const char* o : ops)
          if (s.substr(i, std::strlen(o)) == o) {
            op = o;
            break;
          }
        if (op.empty()) syntax(line_, fmt::format("unexpected character '{}'", std::string(1, c)));
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") {
          if (depth == 0) syntax(line_, fmt::format("unexpected '{}'", op));
          --depth;
        }
        toks_.push_back({Tok::Op, line_, op});
        i += op.size();
      }
    }
  }

  size_t lex_number(std::string_view s, size_t i) {
    size_t j = i;
    auto digits = [&] {
      while (j < s.size() &&
             (std::isdigit(static_cast<unsigned char>(s[j])) ||
              (s[j] == '_' && j + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[j + 1])))))
        ++j;
    };
    digits();
    bool is_float = false;
    if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
      ++j;
      digits();
      is_float = true;
    }
    if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
      size_t k = j + 1;
      if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
      if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
        j = k;
        digits();
        is_float = true;
      }
    }
    std::string text;
    for (char ch : s.substr(i, j - i))
      if (ch != '_') text += ch;
    Token t{is_float ? Tok::Float : Tok::Int, line_, text};
    if (is_float) {
      t.fval = std::strtod(text.c_str(), nullptr);
    } else {
      if (text.size() > 1 && text[0] == '0' && text.find_first_not_of('0') != std::string::npos)
        syntax(line_, "integers with leading zeros (or base prefixes) are not supported");
      if (text.size() > 30) syntax(line_, "integer literal too large");
      for (char ch : text) t.ival = t.ival * 10 + (ch - '0');
    }
    toks_.push_back(std::move(t));
    return j;
  }

  std::string src_;
  std::vector<Token> toks_;
  int line_ = 1;
};

const std::pair<const char*, int> kFilters[] = {
    {"tojson", kFTojson}, {"items", kFItems},    {"length", kFLength}, {"count", kFLength},
    {"trim", kFTrim},     {"lower", kFLower},    {"upper", kFUpper},   {"replace", kFReplace},
    {"join", kFJoin},     {"first", kFFirst},    {"last", kFLast},     {"default", kFDefault},
    {"d", kFDefault},     {"list", kFList},      {"string", kFString}, {"int", kFInt},
    {"float", kFFloat},   {"safe", kFSafe},      {"abs", kFAbs},       {"capitalize", kFCapitalize},
    {"title", kFTitle},   {"reverse", kFReverse}};

const std::pair<const char*, int> kTests[] = {{"defined", kTDefined},
                                              {"undefined", kTUndefined},
                                              {"none", kTNone},
                                              {"string", kTString},
                                              {"number", kTNumber},
                                              {"mapping", kTMapping},
                                              {"iterable", kTIterable},
                                              {"sequence", kTSequence},
                                              {"true", kTTrue},
                                              {"false", kTFalse},
                                              {"boolean", kTBoolean},
                                              {"integer", kTInteger},
                                              {"float", kTFloat},
                                              {"eq", kTEq},
                                              {"equalto", kTEq},
                                              {"==", kTEq},
                                              {"ne", kTNe},
                                              {"!=", kTNe},
                                              {"in", kTIn},
                                              {"odd", kTOdd},
                                              {"even", kTEven},
                                              {"divisibleby", kTDivisibleby},
                                              {"callable", kTCallable},
                                              {"sameas", kTSameas},
                                              {"lower", kTLower},
                                              {"upper", kTUpper}};

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  std::unique_ptr<Program> run() {
    auto p = std::make_unique<Program>();
    std::string_view stop;
    p->body = parse_body({}, stop);
    return p;
  }

 private:
  const Token& cur() const { return t_[pos_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(pos_ + k, t_.size() - 1)]; }
  void next() {
    if (pos_ + 1 < t_.size()) ++pos_;
  }
  bool is_op(std::string_view op) const { return cur().type == Tok::Op && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == Tok::Name && cur().text == n; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  [[noreturn]] void unexpected() const {
    const Token& t = cur();
    std::string what = t.type == Tok::Eof        ? "end of template"
                       : t.type == Tok::BlockEnd ? "end of statement block"
                       : t.type == Tok::VarEnd   ? "end of print statement"
                       : t.type == Tok::String   ? "string literal"
                       : t.type == Tok::Data     ? "template data"
                                                 : "'" + t.text + "'";
    syntax(t.line, "unexpected " + what);
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) unexpected();
  }
  std::string expect_name() {
    if (cur().type != Tok::Name) unexpected();
    std::string n = cur().text;
    next();
    return n;
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd) unexpected();
    next();
  }
  struct Depth {
    Parser& p;
    explicit Depth(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxNesting)
        syntax(p.cur().line, fmt::format("nesting deeper than {} levels", kMaxNesting));
    }
    ~Depth() { --p.depth_; }
  };

  ExprP make(Expr::K k) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = cur().line;
    return e;
  }

  // Statements until one of `ends` (a block tag name) is reached; its name is returned in stop
  // with the parser positioned after the name.
  Body parse_body(std::initializer_list<std::string_view> ends, std::string_view& stop) {
    Depth d(*this);
    Body body;
    for (;;) {
      const Token& t = cur();
      if (t.type == Tok::Eof) {
        if (ends.size())
          syntax(t.line, fmt::format("unexpected end of template, expected '{}'", *ends.begin()));
        return body;
      }
      if (t.type == Tok::Data) {
        auto n = std::make_unique<Node>();
        n->k = Node::K::Text;
        n->text = t.text;
        body.push_back(std::move(n));
        next();
      } else if (t.type == Tok::VarBegin) {
        next();
        auto n = std::make_unique<Node>();
        n->k = Node::K::Output;
        n->line = t.line;
        n->expr = parse_tuple(true);
        if (cur().type != Tok::VarEnd) unexpected();
        next();
        body.push_back(std::move(n));
      } else if (t.type == Tok::BlockBegin) {
        next();
        if (cur().type != Tok::Name) unexpected();
        std::string name = cur().text;
        for (std::string_view e : ends)
          if (name == e) {
            next();
            stop = e;
            return body;
          }
        body.push_back(parse_statement());
      } else {
        unexpected();
      }
    }
  }

  NodeP parse_statement() {
    auto n = std::make_unique<Node>();
    n->line = cur().line;
    std::string kw = cur().text;
    next();
    std::string_view stop;
    if (kw == "if") {
      n->k = Node::K::If;
      ExprP c = parse_tuple(false);
      expect_block_end();
      for (;;) {
        Body b = parse_body({"elif", "else", "endif"}, stop);
        n->branches.emplace_back(std::move(c), std::move(b));
        if (stop == "elif") {
          c = parse_tuple(false);
          expect_block_end();
        } else if (stop == "else") {
          expect_block_end();
          n->branches.emplace_back(nullptr, parse_body({"endif"}, stop));
          expect_block_end();
          break;
        } else {
          expect_block_end();
          break;
        }
      }
    } else if (kw == "for") {
      n->k = Node::K::For;
      n->targets = parse_targets();
      if (!skip_name("in")) unexpected();
      n->expr = parse_tuple(false);
      if (skip_name("if")) n->cond = parse_expression(true);
      if (is_name("recursive")) syntax(cur().line, "unsupported construct: recursive for loops");
      expect_block_end();
      ++loop_depth_;
      n->body = parse_body({"else", "endfor"}, stop);
      --loop_depth_;
      if (stop == "else") {
        expect_block_end();
        n->else_body = parse_body({"endfor"}, stop);
      }
      expect_block_end();
    } else if (kw == "set") {
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == ".") {
        n->k = Node::K::Set;
        n->ns_attr = true;
        n->targets.push_back(expect_name());
        next();
        n->targets.push_back(expect_name());
        expect_op("=");
        n->expr = parse_tuple(true);
        expect_block_end();
      } else {
        n->targets = parse_targets();
        if (skip_op("=")) {
          n->k = Node::K::Set;
          n->expr = parse_tuple(true);
          expect_block_end();
        } else {
          n->k = Node::K::SetBlock;
          if (n->targets.size() != 1) syntax(n->line, "a block set takes one name");
          while (skip_op("|")) n->filters.push_back(filter_id(expect_name(), false));
          expect_block_end();
          n->body = parse_body({"endset"}, stop);
          expect_block_end();
        }
      }
    } else if (kw == "macro") {
      n->k = Node::K::Macro;
      n->name = expect_name();
      parse_signature(n->params);
      expect_block_end();
      n->body = parse_body({"endmacro"}, stop);
      if (cur().type == Tok::Name) next();  // {% endmacro name %}
      expect_block_end();
    } else if (kw == "call") {
      n->k = Node::K::CallBlock;
      if (is_op("(")) parse_signature(n->params);
      n->expr = parse_expression(true);
      if (n->expr->k != Expr::K::Call) syntax(n->line, "expected a call after 'call'");
      expect_block_end();
      n->body = parse_body({"endcall"}, stop);
      expect_block_end();
    } else if (kw == "break" || kw == "continue") {
      if (loop_depth_ == 0) syntax(n->line, fmt::format("'{}' outside of a loop", kw));
      n->k = kw == "break" ? Node::K::Break : Node::K::Continue;
      expect_block_end();
    } else if (kw == "generation") {
      // transformers' AssistantTracker tag: renders its body, only marks assistant spans.
      n->k = Node::K::Generation;
      expect_block_end();
      n->body = parse_body({"endgeneration"}, stop);
      expect_block_end();
    } else {
      static const char* known[] = {"elif",   "else",     "endif",   "endfor",
                                    "endset", "endmacro", "endcall", "endgeneration"};
      for (const char* k : known)
        if (kw == k) syntax(n->line, fmt::format("unexpected '{}'", kw));
      syntax(n->line, fmt::format("unsupported construct: the '{}' tag", kw));
    }
    return n;
  }

  void parse_signature(std::vector<std::pair<std::string, ExprP>>& params) {
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string name = expect_name();
      ExprP def;
      if (skip_op("=")) def = parse_expression(true);
      params.emplace_back(std::move(name), std::move(def));
    }
    next();
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    bool paren = skip_op("(");
    do {
      if (cur().type != Tok::Name) unexpected();
      names.push_back(expect_name());
    } while (skip_op(",") && cur().type == Tok::Name);
    if (paren) expect_op(")");
    return names;
  }

  // parse_tuple: a comma-separated list is a tuple (`{{ a, b }}`, `set x = 1, 2`).
  ExprP parse_tuple(bool with_condexpr) {
    ExprP first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = make(Expr::K::Tuple);
    t->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || is_op(")") || is_op("=")) break;
      t->args.push_back(parse_expression(with_condexpr));
    }
    return t;
  }

  ExprP parse_expression(bool with_condexpr) {
    Depth d(*this);
    if (!with_condexpr) return parse_or();
    ExprP e = parse_or();
    while (is_name("if")) {
      auto c = make(Expr::K::Cond);
      next();
      ExprP cond = parse_or();
      ExprP other;
      if (skip_name("else")) other = parse_expression(true);
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprP parse_or() {
    ExprP l = parse_and();
    while (is_name("or")) {
      auto n = make(Expr::K::Or);
      next();
      n->args.push_back(std::move(l));
      n->args.push_back(parse_and());
      l = std::move(n);
    }
    return l;
  }

  ExprP parse_and() {
    ExprP l = parse_not();
    while (is_name("and")) {
      auto n = make(Expr::K::And);
      next();
      n->args.push_back(std::move(l));
      n->args.push_back(parse_not());
      l = std::move(n);
    }
    return l;
  }

  ExprP parse_not() {
    if (is_name("not")) {
      Depth d(*this);
      auto n = make(Expr::K::Not);
      next();
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprP parse_compare() {
    ExprP e = parse_math1();
    ExprP cmp;
    for (;;) {
      int op = -1;
      if (cur().type == Tok::Op) {
        const std::string& o = cur().text;
        op = o == "=="   ? kEq
             : o == "!=" ? kNe
             : o == "<"  ? kLt
             : o == "<=" ? kLe
             : o == ">"  ? kGt
             : o == ">=" ? kGe
                         : -1;
        if (op >= 0) next();
      } else if (is_name("in")) {
        op = kIn;
        next();
      } else if (is_name("not") && peek().type == Tok::Name && peek().text == "in") {
        op = kNotIn;
        next();
        next();
      }
      if (op < 0) break;
      if (!cmp) {
        cmp = make(Expr::K::Compare);
        cmp->args.push_back(std::move(e));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(e);
  }

  ExprP binary(int op, ExprP l, ExprP r) {
    auto n = make(Expr::K::Binary);
    n->id = op;
    n->args.push_back(std::move(l));
    n->args.push_back(std::move(r));
    return n;
  }

  ExprP parse_math1() {
    ExprP l = parse_concat();
    while (is_op("+") || is_op("-")) {
      int op = is_op("+") ? kAdd : kSub;
      next();
      l = binary(op, std::move(l), parse_concat());
    }
    return l;
  }

  ExprP parse_concat() {
    ExprP l = parse_math2();
    if (!is_op("~")) return l;
    auto n = make(Expr::K::Concat);
    n->args.push_back(std::move(l));
    while (skip_op("~")) n->args.push_back(parse_math2());
    return n;
  }

  ExprP parse_math2() {
    ExprP l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      int op = is_op("*") ? kMul : is_op("/") ? kDiv : is_op("//") ? kFloorDiv : kMod;
      next();
      if (op == kMod && l->k == Expr::K::Const && l->value.is_str())
        syntax(l->line, "unsupported construct: printf-style string formatting with %");
      l = binary(op, std::move(l), parse_pow());
    }
    return l;
  }

  ExprP parse_pow() {
    ExprP l = parse_unary(true);
    while (skip_op("**")) l = binary(kPow, std::move(l), parse_unary(true));
    return l;
  }

  ExprP parse_unary(bool with_filter) {
    Depth d(*this);
    ExprP node;
    if (is_op("-") || is_op("+")) {
      node = make(is_op("-") ? Expr::K::Neg : Expr::K::Pos);
      next();
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprP parse_primary() {
    const Token& t = cur();
    if (t.type == Tok::Name) {
      auto n = make(Expr::K::Const);
      if (t.text == "true" || t.text == "True") {
        n->value = Value::boolean(true);
      } else if (t.text == "false" || t.text == "False") {
        n->value = Value::boolean(false);
      } else if (t.text == "none" || t.text == "None") {
        n->value = Value::none();
      } else {
        n->k = Expr::K::Name;
        n->name = t.text;
      }
      next();
      return n;
    }
    if (t.type == Tok::String) {
      auto n = make(Expr::K::Const);
      std::string s;
      while (cur().type == Tok::String) {  // adjacent literals concatenate
        s += cur().text;
        next();
      }
      n->value = Value::literal(s);
      return n;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      auto n = make(Expr::K::Const);
      n->value = t.type == Tok::Int ? Value::integer(t.ival) : Value::real(t.fval);
      next();
      return n;
    }
    if (is_op("(")) {
      Depth d(*this);
      next();
      if (skip_op(")")) return make(Expr::K::Tuple);
      ExprP first = parse_expression(true);
      if (skip_op(")")) return first;
      auto tup = make(Expr::K::Tuple);
      tup->args.push_back(std::move(first));
      while (skip_op(",")) {
        if (is_op(")")) break;
        tup->args.push_back(parse_expression(true));
      }
      expect_op(")");
      return tup;
    }
    if (is_op("[")) {
      Depth d(*this);
      auto n = make(Expr::K::List);
      next();
      while (!is_op("]")) {
        if (!n->args.empty()) expect_op(",");
        if (is_op("]")) break;
        n->args.push_back(parse_expression(true));
      }
      next();
      return n;
    }
    if (is_op("{")) {
      Depth d(*this);
      auto n = make(Expr::K::Dict);
      next();
      while (!is_op("}")) {
        if (!n->args.empty()) expect_op(",");
        if (is_op("}")) break;
        n->args.push_back(parse_expression(true));
        expect_op(":");
        n->args.push_back(parse_expression(true));
      }
      next();
      return n;
    }
    unexpected();
  }

  ExprP parse_postfix(ExprP node) {
    for (;;) {
      if (is_op(".")) {
        next();
        if (cur().type == Tok::Name) {
          auto a = make(Expr::K::Attr);
          a->name = cur().text;
          a->args.push_back(std::move(node));
          next();
          node = std::move(a);
        } else if (cur().type == Tok::Int) {
          auto a = make(Expr::K::Item);
          auto k = make(Expr::K::Const);
          k->value = Value::integer(cur().ival);
          a->args.push_back(std::move(node));
          a->args.push_back(std::move(k));
          next();
          node = std::move(a);
        } else {
          unexpected();
        }
      } else if (is_op("[")) {
        Depth d(*this);
        next();
        std::vector<ExprP> subs;
        while (!is_op("]")) {
          if (!subs.empty()) expect_op(",");
          subs.push_back(parse_subscribed());
        }
        next();
        if (subs.empty()) unexpected();
        auto a = make(Expr::K::Item);
        a->args.push_back(std::move(node));
        if (subs.size() == 1) {
          a->args.push_back(std::move(subs[0]));
        } else {
          auto tup = make(Expr::K::Tuple);
          tup->args = std::move(subs);
          a->args.push_back(std::move(tup));
        }
        node = std::move(a);
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprP parse_subscribed() {
    ExprP start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
    }
    next();
    auto s = make(Expr::K::Slice);
    ExprP stop, step;
    if (!is_op("]") && !is_op(",") && !is_op(":")) stop = parse_expression(true);
    if (skip_op(":"))
      if (!is_op("]") && !is_op(",")) step = parse_expression(true);
    s->args.push_back(std::move(start));
    s->args.push_back(std::move(stop));
    s->args.push_back(std::move(step));
    return s;
  }

  void parse_call_args(Expr& call) {
    Depth d(*this);
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      if (is_op(")")) break;
      first = false;
      if (is_op("*") || is_op("**")) syntax(cur().line, "unsupported construct: *args / **kwargs in a call");
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == "=") {
        std::string key = cur().text;
        next();
        next();
        call.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!call.kwargs.empty()) syntax(cur().line, "positional argument after keyword argument");
        call.args.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprP parse_call(ExprP callee) {
    auto c = make(Expr::K::Call);
    c->args.push_back(std::move(callee));
    parse_call_args(*c);
    return c;
  }

  // jinja2 reads `|a.b` as a filter named "a.b" (likewise tests).
  std::string dotted_name() {
    std::string name = expect_name();
    while (is_op(".")) {
      next();
      name += "." + expect_name();
    }
    return name;
  }

  int filter_id(const std::string& name, bool test) {
    if (test) {
      for (auto& [n, id] : kTests)
        if (name == n) return id;
      syntax(cur().line, fmt::format("unsupported construct: the test '{}'", name));
    }
    for (auto& [n, id] : kFilters)
      if (name == n) return id;
    syntax(cur().line, fmt::format("unsupported construct: the filter '{}'", name));
  }

  ExprP parse_filter_expr(ExprP node) {
    for (;;) {
      if (is_op("|")) {
        next();
        auto f = make(Expr::K::Filter);
        f->name = dotted_name();
        f->id = filter_id(f->name, false);
        f->args.push_back(std::move(node));
        if (is_op("(")) parse_call_args(*f);
        node = std::move(f);
      } else if (is_name("is")) {
        next();
        bool negated = skip_name("not");
        auto t = make(Expr::K::Test);
        t->negated = negated;
        t->name = dotted_name();
        t->id = filter_id(t->name, true);
        t->args.push_back(std::move(node));
        if (is_op("(")) {
          parse_call_args(*t);
        } else if ((cur().type == Tok::Name || cur().type == Tok::String || cur().type == Tok::Int ||
                    cur().type == Tok::Float || is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) syntax(cur().line, "you cannot chain multiple tests with is");
          t->args.push_back(parse_postfix(parse_primary()));
        }
        node = std::move(t);
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  friend struct Depth;
  std::vector<Token> t_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

std::unique_ptr<Program> parse_program(std::string_view source) {
  Lexer lex(source);
  Parser p(lex.run());
  return p.run();
}

}  // namespace tansy::text::jinja
