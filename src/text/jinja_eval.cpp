// Evaluation of the Jinja subset with Python's value semantics, as jinja2 runs a chat template in
// transformers' sandboxed environment. Error messages are the str() of the exception jinja2 or
// Python would raise, so comparison tests can hold errors to the same standard as output.
#include <unicode/locid.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <cmath>
#include <ctime>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/jinja_internal.h"

namespace tansy::text::jinja {

struct Scope;
using ScopeP = std::shared_ptr<Scope>;
class Interp;
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

struct Callable {
  std::string name;
  const Node* macro = nullptr;  // a macro or a call block's caller
  // Weak: the scope holds the macro, and a macro that outlives its scope sees only globals.
  std::weak_ptr<Scope> closure;
  std::function<Value(Interp&, Args&, Kwargs&)> builtin;
};

struct LoopState {
  std::shared_ptr<const List> items;
  size_t index0 = 0;
};

struct Scope {
  ScopeP parent;
  std::vector<std::pair<std::string, Value>> vars;
  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (auto it = s->vars.rbegin(); it != s->vars.rend(); ++it)
        if (it->first == name) return &it->second;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, x] : vars)
      if (k == name) {
        x = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};

uint32_t Value::check_depth(uint32_t d) {
  if (d > kMaxDepth) fail("chat template value nested deeper than {} levels", kMaxDepth);
  return d;
}

namespace {

using T = Value::T;

std::string int_str(__int128 v) {
  if (v == 0) return "0";
  bool neg = v < 0;
  unsigned __int128 u =
      neg ? static_cast<unsigned __int128>(-(v + 1)) + 1 : static_cast<unsigned __int128>(v);
  std::string s;
  while (u) {
    s += char('0' + int(u % 10));
    u /= 10;
  }
  if (neg) s += '-';
  return {s.rbegin(), s.rend()};
}

const char* type_name(const Value& v) {
  switch (v.t) {
    case T::Undef:
      return "Undefined";
    case T::None:
      return "NoneType";
    case T::Bool:
      return "bool";
    case T::Int:
      return "int";
    case T::Float:
      return "float";
    case T::Str:
      return "str";
    case T::List:
      return "list";
    case T::Tuple:
      return "tuple";
    case T::Dict:
      return "dict";
    case T::Ns:
      return "Namespace";
    case T::Fn:
      return v.fn->macro ? "Macro" : "builtin_function_or_method";
    case T::Loop:
      return "LoopContext";
  }
  return "object";
}

// jinja2's object_type_repr, used in undefined messages.
std::string object_type_repr(const Value& v) {
  if (v.t == T::None) return "None";
  if (v.t == T::Ns) return "jinja2.utils.Namespace object";
  if (v.t == T::Loop) return "jinja2.runtime.LoopContext object";
  if (v.t == T::Fn && v.fn->macro) return "jinja2.runtime.Macro object";
  return std::string(type_name(v)) + " object";
}

[[noreturn]] void raise_undefined(const Value& v) { throw Error(*v.undef); }

std::string repr(const Value& v);

std::string str(const Value& v) {
  switch (v.t) {
    case T::Undef:
      return "";
    case T::Str:
      return v.sv();
    default:
      return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.t) {
    case T::Undef:
      return "Undefined";
    case T::None:
      return "None";
    case T::Bool:
      return v.b ? "True" : "False";
    case T::Int:
      return int_str(v.i);
    case T::Float:
      return python_float_repr(v.f);
    case T::Str:
      return python_str_repr(v.sv());
    case T::List:
    case T::Tuple: {
      std::string out = v.t == T::List ? "[" : "(";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      if (v.t == T::Tuple && v.list->size() == 1) out += ",";
      return out + (v.t == T::List ? "]" : ")");
    }
    case T::Dict:
    case T::Ns: {
      const Dict& d = v.t == T::Dict ? *v.dict : *v.ns;
      std::string out = v.t == T::Ns ? "<Namespace {" : "{";
      for (size_t k = 0; k < d.size(); ++k)
        out += (k ? ", " : "") + python_str_repr(d[k].first) + ": " + repr(d[k].second);
      return out + (v.t == T::Ns ? "}>" : "}");
    }
    case T::Fn:
      return "<" + std::string(type_name(v)) + " '" + v.fn->name + "'>";
    case T::Loop:
      return fmt::format("<LoopContext {}/{}>", v.loop->index0 + 1, v.loop->items->size());
  }
  return "";
}

bool has_data(const Value& v) {
  if (v.data) return true;
  if (v.t == T::Str) return v.s->has_data();
  if (v.is_seq()) {
    for (const Value& x : *v.list)
      if (has_data(x)) return true;
  } else if (v.t == T::Dict) {
    for (const auto& kv : *v.dict)
      if (has_data(kv.second)) return true;
  }
  return false;
}

Text to_text(const Value& v) {
  if (v.t == T::Str) return *v.s;
  Text t;
  t.append_data(str(v), has_data(v));
  return t;
}

bool truthy(const Value& v) {
  switch (v.t) {
    case T::Undef:
    case T::None:
      return false;
    case T::Bool:
      return v.b;
    case T::Int:
      return v.i != 0;
    case T::Float:
      return v.f != 0;
    case T::Str:
      return !v.sv().empty();
    case T::List:
    case T::Tuple:
      return !v.list->empty();
    case T::Dict:
      return !v.dict->empty();
    default:
      return true;
  }
}

__int128 as_int(const Value& v) { return v.t == T::Bool ? __int128(v.b) : v.i; }
bool is_intlike(const Value& v) { return v.t == T::Int || v.t == T::Bool; }
long double as_ld(const Value& v) { return v.t == T::Float ? (long double)v.f : (long double)as_int(v); }

size_t cp_count(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c >> 6) != 2;
  return n;
}

// Byte offsets of each code point start, plus s.size().
std::vector<size_t> cp_offsets(std::string_view s) {
  std::vector<size_t> o;
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) >> 6) != 2) o.push_back(i);
  o.push_back(s.size());
  return o;
}

bool py_eq(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.t == T::Float || b.t == T::Float) return as_ld(a) == as_ld(b);
    return as_int(a) == as_int(b);
  }
  if (a.t != b.t) return false;
  switch (a.t) {
    case T::Undef:
    case T::None:
      return true;
    case T::Str:
      return a.sv() == b.sv();
    case T::List:
    case T::Tuple:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!py_eq((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case T::Dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, x] : *a.dict) {
        bool found = false;
        for (const auto& [k2, y] : *b.dict)
          if (k == k2) {
            if (!py_eq(x, y)) return false;
            found = true;
            break;
          }
        if (!found) return false;
      }
      return true;
    case T::Ns:
      return a.ns == b.ns;
    case T::Fn:
      return a.fn == b.fn;
    case T::Loop:
      return a.loop == b.loop;
    default:
      return false;
  }
}

const char* cmp_symbol(int op) {
  switch (op) {
    case kLt:
      return "<";
    case kLe:
      return "<=";
    case kGt:
      return ">";
    default:
      return ">=";
  }
}

// -1, 0, 1 for a < b, ==, >; raises Python's TypeError for unordered types.
int py_order(const Value& a, const Value& b, int op) {
  if (a.is_undef()) raise_undefined(a);
  if (b.is_undef()) raise_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.t == T::Float || b.t == T::Float) {
      long double x = as_ld(a), y = as_ld(b);
      if (std::isnan(x) || std::isnan(y)) return 2;  // every comparison false
      return x < y ? -1 : x > y ? 1 : 0;
    }
    __int128 x = as_int(a), y = as_int(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.t == T::Str && b.t == T::Str) {
    int c = a.sv().compare(b.sv());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_seq() && a.t == b.t) {
    const List &x = *a.list, &y = *b.list;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k)
      if (!py_eq(x[k], y[k])) return py_order(x[k], y[k], op);
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  fail("'{}' not supported between instances of '{}' and '{}'", cmp_symbol(op), type_name(a), type_name(b));
}

bool py_in(const Value& needle, const Value& hay) {
  switch (hay.t) {
    case T::Undef:
      return false;
    case T::Str:
      if (needle.t != T::Str)
        fail("'in <string>' requires string as left operand, not {}", type_name(needle));
      return hay.sv().find(needle.sv()) != std::string::npos;
    case T::List:
    case T::Tuple:
      for (const Value& x : *hay.list)
        if (py_eq(needle, x)) return true;
      return false;
    case T::Dict:
      if (needle.t == T::List || needle.t == T::Dict) fail("unhashable type: '{}'", type_name(needle));
      if (needle.t != T::Str) return false;
      for (const auto& kv : *hay.dict)
        if (kv.first == needle.sv()) return true;
      return false;
    default:
      fail("argument of type '{}' is not iterable", type_name(hay));
  }
}

Value key_value(const std::string& k, bool data) {
  Text t;
  t.append_data(k, data);
  return Value::str(std::move(t));
}

List iterate(const Value& v) {
  switch (v.t) {
    case T::Undef:
      return {};
    case T::List:
    case T::Tuple:
      return *v.list;
    case T::Dict: {
      List out;
      for (const auto& kv : *v.dict) out.push_back(key_value(kv.first, v.data));
      return out;
    }
    case T::Str: {
      List out;
      auto off = cp_offsets(v.sv());
      for (size_t k = 0; k + 1 < off.size(); ++k) out.push_back(Value::str(v.s->sub(off[k], off[k + 1])));
      return out;
    }
    case T::Loop:
      return *v.loop->items;
    default:
      fail("'{}' object is not iterable", type_name(v));
  }
}

Value undef_attr(const Value& obj, const std::string& name) {
  return Value::undefined(
      fmt::format("{} has no attribute {}", python_str_repr(object_type_repr(obj)), python_str_repr(name)));
}

Value undef_item(const Value& obj, const Value& key) {
  if (key.t == T::Str) return undef_attr(obj, key.sv());
  return Value::undefined(fmt::format("{} has no element {}", object_type_repr(obj), repr(key)));
}

// ------------------------------------------------------------------------------------------------
// Strings
// ------------------------------------------------------------------------------------------------
bool in_chars(char32_t cp, const std::vector<char32_t>* chars) {
  if (!chars) return py_isspace(cp);
  for (char32_t c : *chars)
    if (c == cp) return true;
  return false;
}

std::vector<char32_t> code_points(std::string_view s) {
  std::vector<char32_t> out;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    size_t n = utf8_decode(s, i, cp);
    if (!n) fail("string is not valid UTF-8");
    out.push_back(cp);
    i += n;
  }
  return out;
}

Text strip_text(const Text& t, bool left, bool right, const std::vector<char32_t>* chars) {
  std::string_view s = t.s;
  size_t b = 0, e = s.size();
  if (left)
    while (b < e) {
      char32_t cp = 0;
      size_t n = utf8_decode(s, b, cp);
      if (!n || !in_chars(cp, chars)) break;
      b += n;
    }
  if (right)
    while (e > b) {
      size_t start = e - 1;
      while (start > b && (static_cast<unsigned char>(s[start]) >> 6) == 2) --start;
      char32_t cp = 0;
      if (utf8_decode(s, start, cp) != e - start || !in_chars(cp, chars)) break;
      e = start;
    }
  return t.sub(b, e);
}

// Python's str.upper/lower/capitalize/title, with Unicode's full case mappings (ICU's root locale:
// 'ß'.upper() is 'SS', a final sigma lowers to 'ς', 'ǆ' titles to 'ǅ'), and jinja2's own `title`
// filter, which is not str.title(): it splits at runs of '-', whitespace and opening brackets and
// upper-cases the first character of each piece, lower-casing the rest.
enum class Case { Upper, Lower, Capitalize, Title, TitleFilter };

std::string icu_case(std::string_view s, Case how) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), int32_t(s.size())));
  const icu::Locale& root = icu::Locale::getRoot();
  if (how == Case::Upper) u.toUpper(root);
  if (how == Case::Lower) u.toLower(root);
  if (how == Case::Capitalize)  // the first code point title-cased, the rest lower-cased
    u.toTitle(nullptr, root, U_TITLECASE_WHOLE_STRING | U_TITLECASE_NO_BREAK_ADJUSTMENT);
  std::string out;
  u.toUTF8String(out);
  return out;
}

// str.title(): a cased character after an uncased one is title-cased, every other one lower-cased.
std::string python_title(std::string_view s) {
  std::string out;
  bool prev_cased = false;
  size_t i = 0;
  while (i < s.size()) {
    char32_t cp = 0;
    const size_t n = utf8_decode(s, i, cp);
    if (!n) fail("string is not valid UTF-8");
    std::string one;
    utf8_encode(one, cp);
    out += prev_cased ? icu_case(one, Case::Lower) : icu_case(one, Case::Capitalize);
    prev_cased = u_hasBinaryProperty(UChar32(cp), UCHAR_CASED);
    i += n;
  }
  return out;
}

std::string jinja_title_filter(std::string_view s) {
  auto separator = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
  };
  std::string out;
  size_t i = 0;
  bool word_start = true;
  while (i < s.size()) {
    char32_t cp = 0;
    const size_t n = utf8_decode(s, i, cp);
    if (!n) fail("string is not valid UTF-8");
    std::string one;
    utf8_encode(one, cp);
    if (separator(cp)) {
      out += one;
      word_start = true;
    } else {
      out += icu_case(one, word_start ? Case::Upper : Case::Lower);
      word_start = false;
    }
    i += n;
  }
  return out;
}

Text change_case(const Text& t, Case how) {
  std::string out = how == Case::Title         ? python_title(t.s)
                    : how == Case::TitleFilter ? jinja_title_filter(t.s)
                                               : icu_case(t.s, how);
  Text r;
  r.append_data(out, t.has_data());
  return r;
}

Text replace_text(const Text& t, const Text& old, const Text& repl, long long count) {
  Text out;
  std::string_view s = t.s;
  if (old.s.empty()) {
    auto off = cp_offsets(s);
    long long done = 0;
    for (size_t k = 0; k + 1 < off.size(); ++k) {
      if (count < 0 || done < count) {
        out.append(repl);
        ++done;
      }
      out.append(t.sub(off[k], off[k + 1]));
    }
    if (count < 0 || done < count) out.append(repl);
    return out;
  }
  size_t pos = 0;
  long long done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(old.s, pos);
    if (f == std::string_view::npos) break;
    out.append(t.sub(pos, f));
    out.append(repl);
    pos = f + old.s.size();
    ++done;
  }
  out.append(t.sub(pos, s.size()));
  return out;
}

List split_text(const Text& t, const Text* sep, long long maxsplit, bool from_right) {
  List parts;
  std::string_view s = t.s;
  if (sep) {
    if (sep->s.empty()) fail("empty separator");
    std::vector<std::pair<size_t, size_t>> pieces;
    if (!from_right) {
      size_t pos = 0;
      long long n = 0;
      for (;;) {
        size_t f = (maxsplit < 0 || n < maxsplit) ? s.find(sep->s, pos) : std::string_view::npos;
        if (f == std::string_view::npos) {
          pieces.emplace_back(pos, s.size());
          break;
        }
        pieces.emplace_back(pos, f);
        pos = f + sep->s.size();
        ++n;
      }
    } else {
      size_t end = s.size();
      long long n = 0;
      for (;;) {
        size_t f = std::string_view::npos;
        if ((maxsplit < 0 || n < maxsplit) && end >= sep->s.size()) f = s.substr(0, end).rfind(sep->s);
        if (f == std::string_view::npos) {
          pieces.emplace_back(0, end);
          break;
        }
        pieces.emplace_back(f + sep->s.size(), end);
        end = f;
        ++n;
      }
      std::reverse(pieces.begin(), pieces.end());
    }
    for (auto [b, e] : pieces) parts.push_back(Value::str(t.sub(b, e)));
    return parts;
  }
  // Runs of whitespace, no empty strings.
  std::vector<std::pair<size_t, size_t>> words;
  size_t i = 0;
  while (i < s.size()) {
    char32_t cp = 0;
    size_t n = utf8_decode(s, i, cp);
    if (!n) fail("string is not valid UTF-8");
    if (py_isspace(cp)) {
      i += n;
      continue;
    }
    size_t b = i;
    while (i < s.size()) {
      n = utf8_decode(s, i, cp);
      if (!n || py_isspace(cp)) break;
      i += n;
    }
    words.emplace_back(b, i);
  }
  if (maxsplit >= 0 && (long long)words.size() > maxsplit + 1) {
    if (!from_right) {
      size_t rest = words[size_t(maxsplit)].first;
      words.resize(size_t(maxsplit));
      Text tail = strip_text(t.sub(rest, s.size()), false, true, nullptr);
      for (auto [b, e] : words) parts.push_back(Value::str(t.sub(b, e)));
      parts.push_back(Value::str(tail));
      return parts;
    }
    size_t keep_from = words.size() - size_t(maxsplit);
    size_t head_end = words[keep_from - 1].second;
    parts.push_back(Value::str(strip_text(t.sub(0, head_end), true, false, nullptr)));
    for (size_t k = keep_from; k < words.size(); ++k)
      parts.push_back(Value::str(t.sub(words[k].first, words[k].second)));
    return parts;
  }
  for (auto [b, e] : words) parts.push_back(Value::str(t.sub(b, e)));
  return parts;
}

// ------------------------------------------------------------------------------------------------
// JSON (transformers' tojson: json.dumps with ensure_ascii=False by default)
// ------------------------------------------------------------------------------------------------
struct JsonStyle {
  bool ensure_ascii = false;
  long long indent = -1;  // -1: None
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    size_t n = utf8_decode(s, i, cp);
    if (!n) fail("string is not valid UTF-8");
    switch (cp) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (cp < 0x20 || (ensure_ascii && cp >= 0x7F)) {
          if (cp >= 0x10000) {
            char32_t v = cp - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", unsigned(0xD800 + (v >> 10)),
                               unsigned(0xDC00 + (v & 0x3FF)));
          } else {
            out += fmt::format("\\u{:04x}", unsigned(cp));
          }
        } else {
          out += s.substr(i, n);
        }
    }
    i += n;
  }
  out += '"';
}

void json_dump(std::string& out, const Value& v, const JsonStyle& st, int level, size_t max_out) {
  if (out.size() > max_out) fail("tojson output exceeds {} bytes", max_out);
  if (level > 200) fail("tojson: nesting too deep");
  auto newline = [&](int lvl) {
    out += '\n';
    out.append(size_t(st.indent) * size_t(lvl), ' ');
  };
  switch (v.t) {
    case T::None:
      out += "null";
      return;
    case T::Bool:
      out += v.b ? "true" : "false";
      return;
    case T::Int:
      out += int_str(v.i);
      return;
    case T::Float:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f > 0 ? "Infinity" : "-Infinity";
      else
        out += python_float_repr(v.f);
      return;
    case T::Str:
      json_string(out, v.sv(), st.ensure_ascii);
      return;
    case T::List:
    case T::Tuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += st.item_sep;
        if (st.indent >= 0) newline(level + 1);
        json_dump(out, (*v.list)[k], st, level + 1, max_out);
      }
      if (st.indent >= 0) newline(level);
      out += ']';
      return;
    }
    case T::Dict: {
      if (v.dict->empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : *v.dict) items.push_back(&kv);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += st.item_sep;
        if (st.indent >= 0) newline(level + 1);
        json_string(out, items[k]->first, st.ensure_ascii);
        out += st.key_sep;
        json_dump(out, items[k]->second, st, level + 1, max_out);
      }
      if (st.indent >= 0) newline(level);
      out += '}';
      return;
    }
    default:
      fail("Object of type {} is not JSON serializable", type_name(v));
  }
}

Value from_json(const Json& j, uint32_t depth = 0) {
  if (depth > Value::kMaxDepth) fail("request value nested deeper than {} levels", Value::kMaxDepth);
  Value v;
  switch (j.type()) {
    case Json::value_t::null:
      v = Value::none();
      break;
    case Json::value_t::boolean:
      v = Value::boolean(j.get<bool>());
      break;
    case Json::value_t::number_integer:
      v = Value::integer(j.get<int64_t>());
      break;
    case Json::value_t::number_unsigned:
      v = Value::integer(j.get<uint64_t>());
      break;
    case Json::value_t::number_float:
      v = Value::real(j.get<double>());
      break;
    case Json::value_t::string: {
      Text t;
      t.append_data(j.get_ref<const std::string&>(), true);
      v = Value::str(std::move(t));
      break;
    }
    case Json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const Json& x : j) l.push_back(from_json(x, depth + 1));
      v = Value::make_list(std::move(l));
      break;
    }
    case Json::value_t::object: {
      Dict d;
      d.reserve(j.size());
      for (auto& [k, x] : j.items()) d.emplace_back(k, from_json(x, depth + 1));
      v = Value::make_dict(std::move(d));
      break;
    }
    default:
      fail("binary JSON values are not supported");
  }
  v.data = true;
  return v;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The interpreter
// ------------------------------------------------------------------------------------------------
class Interp {
 public:
  explicit Interp(const Limits& lim) : lim_(lim) {}

  enum class Flow { Normal, Break, Continue };

  void step() {
    if (++steps_ > lim_.max_steps) fail("chat template exceeded {} evaluation steps", lim_.max_steps);
  }
  void check_size(size_t n) const {
    if (n > lim_.max_output) fail("chat template output exceeds {} bytes", lim_.max_output);
  }

  Flow exec(const Body& body, const ScopeP& sc, Text& out) {
    for (const NodeP& n : body) {
      Flow f = exec_node(*n, sc, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Value call(const Value& callee, Args& args, Kwargs& kwargs) {
    if (callee.is_undef()) raise_undefined(callee);
    if (callee.t != T::Fn) fail("'{}' object is not callable", type_name(callee));
    step();
    const Callable& c = *callee.fn;
    if (c.builtin) return c.builtin(*this, args, kwargs);
    return call_macro(c, args, kwargs);
  }

  Value eval(const Expr& e, const ScopeP& sc);

 private:
  Flow exec_node(const Node& n, const ScopeP& sc, Text& out);
  Value call_macro(const Callable& c, Args& args, Kwargs& kwargs);
  Value get_attr(const Value& obj, const std::string& name);
  Value get_item(const Value& obj, const Value& key);
  Value method(const Value& self, const std::string& name);
  Value apply_filter(const Expr& e, const ScopeP& sc);
  bool apply_test(const Expr& e, const ScopeP& sc);
  Value binary(int op, const Value& a, const Value& b);
  void assign(const std::vector<std::string>& targets, const Value& v, Scope& sc);

  const Limits& lim_;
  uint64_t steps_ = 0;
  int depth_ = 0;
};

namespace {

// A namespace holding a namespace could hold itself: printing it would never end.
void check_no_namespace(const Value& v) {
  if (v.t == T::Ns) fail("unsupported: a namespace stored inside a namespace");
  if (v.is_seq())
    for (const Value& x : *v.list) check_no_namespace(x);
  if (v.t == T::Dict)
    for (const auto& kv : *v.dict) check_no_namespace(kv.second);
}

Value make_fn(std::string name, std::function<Value(Interp&, Args&, Kwargs&)> f) {
  Value v;
  v.t = T::Fn;
  auto c = std::make_shared<Callable>();
  c->name = std::move(name);
  c->builtin = std::move(f);
  v.fn = std::move(c);
  return v;
}

// Positional-or-keyword argument binding for builtins.
struct Bind {
  Args& a;
  Kwargs& k;
  const char* fname;
  Value get(size_t i, const char* name, Value def) {
    if (i < a.size()) return a[i];
    for (auto& [kn, kv] : k)
      if (kn == name) return kv;
    return def;
  }
  void check(size_t max_pos, std::initializer_list<const char*> names) {
    if (a.size() > max_pos) fail("{}() takes at most {} arguments ({} given)", fname, max_pos, a.size());
    for (auto& [kn, kv] : k) {
      bool ok = false;
      for (const char* n : names) ok |= kn == n;
      if (!ok) fail("{}() got an unexpected keyword argument '{}'", fname, kn);
    }
  }
};

const Text& need_str(const Value& v, const char* what) {
  if (v.is_undef()) raise_undefined(v);
  if (v.t != T::Str) fail("{}{}must be str, not {}", what, *what ? " " : "", type_name(v));
  return *v.s;
}

long long need_int(const Value& v, const char* what) {
  if (v.is_undef()) raise_undefined(v);
  if (!is_intlike(v)) fail("'{}' object cannot be interpreted as an integer ({})", type_name(v), what);
  __int128 x = as_int(v);
  if (x > (__int128)INT64_MAX || x < (__int128)INT64_MIN)
    fail("Python int too large to convert to C ssize_t");
  return (long long)x;
}

std::vector<char32_t> strip_chars(const Value& v, const char* what) {
  if (v.t == T::None) return {};
  return code_points(need_str(v, what).s);
}

Value slice_value(const Value& obj, const Value& start, const Value& stop, const Value& stepv) {
  auto opt = [](const Value& v) -> std::optional<long long> {
    if (v.t == T::None || v.is_undef()) return std::nullopt;
    if (!is_intlike(v)) fail("slice indices must be integers or None or have an __index__ method");
    return (long long)as_int(v);
  };
  long long step = opt(stepv).value_or(1);
  if (step == 0) fail("slice step cannot be zero");
  std::vector<size_t> off;
  long long len;
  if (obj.t == T::Str) {
    off = cp_offsets(obj.sv());
    len = (long long)off.size() - 1;
  } else if (obj.is_seq()) {
    len = (long long)obj.list->size();
  } else {
    return Value::undefined("");  // unreachable: caller checks
  }
  auto adjust = [&](std::optional<long long> x, long long def) {
    if (!x) return def;
    long long v = *x;
    if (v < 0) v += len;
    if (step > 0) return std::clamp(v, 0LL, len);
    return std::clamp(v, -1LL, len - 1);
  };
  long long b = adjust(opt(start), step > 0 ? 0 : len - 1);
  long long e = adjust(opt(stop), step > 0 ? len : -1);
  std::vector<long long> idx;
  if (step > 0)
    for (long long k = b; k < e; k += step) idx.push_back(k);
  else
    for (long long k = b; k > e; k += step) idx.push_back(k);
  if (obj.t == T::Str) {
    if (step == 1) return Value::str(obj.s->sub(off[size_t(b)], off[size_t(std::max(b, e))]));
    Text t;
    for (long long k : idx) t.append(obj.s->sub(off[size_t(k)], off[size_t(k) + 1]));
    return Value::str(std::move(t));
  }
  List l;
  for (long long k : idx) l.push_back((*obj.list)[size_t(k)]);
  return Value::make_list(std::move(l), obj.t == T::Tuple);
}

std::string strftime_now(const std::string& format) {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::string buf(256 + format.size() * 4, '\0');
  size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &tm);
  buf.resize(n);
  return buf;
}

const Scope& globals() {
  static const Scope g = [] {
    Scope s;
    s.set("raise_exception", make_fn("raise_exception", [](Interp&, Args& a, Kwargs& k) -> Value {
            Bind b{a, k, "raise_exception"};
            throw Error(str(b.get(0, "message", Value::literal(""))));
          }));
    s.set("strftime_now", make_fn("strftime_now", [](Interp&, Args& a, Kwargs& k) -> Value {
            Bind b{a, k, "strftime_now"};
            b.check(1, {"format"});
            return Value::literal(strftime_now(need_str(b.get(0, "format", Value()), "format").s));
          }));
    s.set("namespace", make_fn("namespace", [](Interp&, Args& a, Kwargs& k) -> Value {
            Value v;
            v.t = T::Ns;
            v.ns = std::make_shared<Dict>();
            if (a.size() > 1) fail("Namespace expected at most 1 argument, got {}", a.size());
            if (a.size() == 1) {
              if (a[0].t != T::Dict) fail("'{}' object is not iterable", type_name(a[0]));
              check_no_namespace(a[0]);
              *v.ns = *a[0].dict;
            }
            for (auto& [kn, kv] : k) {
              check_no_namespace(kv);
              bool set = false;
              for (auto& [n2, v2] : *v.ns)
                if (n2 == kn) v2 = kv, set = true;
              if (!set) v.ns->emplace_back(kn, kv);
            }
            return v;
          }));
    s.set("dict", make_fn("dict", [](Interp&, Args& a, Kwargs& k) -> Value {
            Dict d;
            if (a.size() > 1) fail("dict expected at most 1 argument, got {}", a.size());
            if (a.size() == 1) {
              if (a[0].t != T::Dict) fail("unsupported: dict() from a {}", type_name(a[0]));
              d = *a[0].dict;
            }
            for (auto& [kn, kv] : k) {
              bool set = false;
              for (auto& [n2, v2] : d)
                if (n2 == kn) v2 = kv, set = true;
              if (!set) d.emplace_back(kn, kv);
            }
            return Value::make_dict(std::move(d));
          }));
    s.set("range", make_fn("range", [](Interp&, Args& a, Kwargs& k) -> Value {
            if (!k.empty()) fail("range() takes no keyword arguments");
            if (a.empty() || a.size() > 3) fail("range expected at most 3 arguments, got {}", a.size());
            long long start = 0, stop, step = 1;
            if (a.size() == 1) {
              stop = need_int(a[0], "range");
            } else {
              start = need_int(a[0], "range");
              stop = need_int(a[1], "range");
              if (a.size() == 3) step = need_int(a[2], "range");
            }
            if (step == 0) fail("range() arg 3 must not be zero");
            long double count = step > 0 ? std::ceil((long double)(stop - start) / step)
                                         : std::ceil((long double)(start - stop) / -step);
            if (count > 100000)
              fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
            List l;
            for (long long x = start; step > 0 ? x < stop : x > stop; x += step)
              l.push_back(Value::integer(x));
            return Value::make_list(std::move(l));
          }));
    return s;
  }();
  return g;
}

}  // namespace

Value Interp::call_macro(const Callable& c, Args& args, Kwargs& kwargs) {
  const Node& m = *c.macro;
  if (depth_ >= lim_.max_call_depth)
    fail("chat template exceeded {} nested macro calls", lim_.max_call_depth);
  auto sc = std::make_shared<Scope>();
  sc->parent = c.closure.lock();
  if (args.size() > m.params.size())
    fail("macro '{}' takes not more than {} argument(s)", c.name, m.params.size());
  std::vector<bool> used(kwargs.size(), false);
  Value caller;
  for (size_t k = 0; k < kwargs.size(); ++k)
    if (kwargs[k].first == "caller") {
      caller = kwargs[k].second;
      used[k] = true;
    }
  for (size_t p = 0; p < m.params.size(); ++p) {
    const std::string& name = m.params[p].first;
    if (p < args.size()) {
      sc->set(name, args[p]);
      continue;
    }
    bool found = false;
    for (size_t k = 0; k < kwargs.size(); ++k)
      if (!used[k] && kwargs[k].first == name) {
        sc->set(name, kwargs[k].second);
        used[k] = found = true;
        break;
      }
    if (found) continue;
    if (m.params[p].second)
      sc->set(name, eval(*m.params[p].second, sc));
    else
      sc->set(name, Value::undefined(fmt::format("parameter {} was not provided", python_str_repr(name))));
  }
  for (size_t k = 0; k < kwargs.size(); ++k)
    if (!used[k]) fail("macro '{}' takes no keyword argument {}", c.name, python_str_repr(kwargs[k].first));
  if (!caller.is_undef()) sc->set("caller", caller);
  Text out;
  ++depth_;
  try {
    exec(m.body, sc, out);
  } catch (...) {
    --depth_;
    throw;
  }
  --depth_;
  return Value::str(std::move(out));
}

Value Interp::method(const Value& self, const std::string& name) {
  auto bind = [&](auto f) {
    Value s = self;
    return make_fn(name,
                   [s, f, name](Interp& in, Args& a, Kwargs& k) -> Value { return f(in, s, a, k, name); });
  };
  if (self.t == T::Str) {
    static const char* kStr[] = {"startswith", "endswith", "split", "rsplit", "strip", "lstrip",
                                 "rstrip",     "replace",  "upper", "lower",  "title", "capitalize",
                                 "find",       "index",    "count", "join"};
    bool known = false;
    for (const char* n : kStr) known |= name == n;
    if (!known) return Value();
    return bind([](Interp& in, const Value& s, Args& a, Kwargs& k, const std::string& nm) -> Value {
      Bind b{a, k, nm.c_str()};
      const Text& t = *s.s;
      if (nm == "startswith" || nm == "endswith") {
        b.check(1, {});
        Value p = b.get(0, "prefix", Value());
        if (p.is_undef() && a.empty()) fail("{}() takes at least 1 argument (0 given)", nm);
        List options;
        if (p.t == T::Tuple)
          options = *p.list;
        else
          options.push_back(p);
        for (const Value& o : options) {
          if (o.t != T::Str)
            fail("{} first arg must be str or a tuple of str, not {}", nm,
                 type_name(p.t == T::Tuple ? o : p));
          if (nm == "startswith" ? t.s.starts_with(o.sv()) : t.s.ends_with(o.sv()))
            return Value::boolean(true);
        }
        return Value::boolean(false);
      }
      if (nm == "split" || nm == "rsplit") {
        b.check(2, {"sep", "maxsplit"});
        Value sep = b.get(0, "sep", Value::none());
        long long maxsplit = need_int(b.get(1, "maxsplit", Value::integer(-1)), "maxsplit");
        if (sep.t != T::None && sep.t != T::Str) fail("must be str or None, not {}", type_name(sep));
        return Value::make_list(
            split_text(t, sep.t == T::Str ? sep.s.get() : nullptr, maxsplit, nm == "rsplit"));
      }
      if (nm == "strip" || nm == "lstrip" || nm == "rstrip") {
        b.check(1, {});
        Value chars = b.get(0, "chars", Value::none());
        if (chars.t != T::None && chars.t != T::Str) fail("{} arg must be None or str", nm);
        auto set = strip_chars(chars, "chars");
        return Value::str(strip_text(t, nm != "rstrip", nm != "lstrip", chars.t == T::None ? nullptr : &set));
      }
      if (nm == "replace") {
        b.check(3, {"count"});
        if (a.size() < 2) fail("replace expected at least 2 arguments, got {}", a.size());
        Text r =
            replace_text(t, need_str(a[0], "replace() argument 1"), need_str(a[1], "replace() argument 2"),
                         need_int(b.get(2, "count", Value::integer(-1)), "count"));
        in.check_size(r.s.size());
        return Value::str(std::move(r));
      }
      if (nm == "upper" || nm == "lower" || nm == "title" || nm == "capitalize") {
        b.check(0, {});
        return Value::str(change_case(t, nm == "upper"   ? Case::Upper
                                         : nm == "lower" ? Case::Lower
                                         : nm == "title" ? Case::Title
                                                         : Case::Capitalize));
      }
      if (nm == "find" || nm == "index" || nm == "count") {
        b.check(1, {});
        if (a.empty()) fail("{}() takes at least 1 argument (0 given)", nm);
        const std::string& sub = need_str(a[0], "").s;
        if (nm != "count") {
          size_t f = t.s.find(sub);
          if (f == std::string::npos && nm == "index") fail("substring not found");
          return Value::integer(f == std::string::npos ? -1 : (long long)cp_count(t.s.substr(0, f)));
        }
        if (sub.empty()) return Value::integer((long long)cp_count(t.s) + 1);
        long long n = 0;
        for (size_t f = t.s.find(sub); f != std::string::npos; f = t.s.find(sub, f + sub.size())) ++n;
        return Value::integer(n);
      }
      // join
      b.check(1, {});
      if (a.empty()) fail("join() takes exactly one argument (0 given)");
      Text out;
      List items = iterate(a[0]);
      for (size_t k = 0; k < items.size(); ++k) {
        if (items[k].t != T::Str)
          fail("sequence item {}: expected str instance, {} found", k, type_name(items[k]));
        if (k) out.append(t);
        out.append(*items[k].s);
        in.check_size(out.s.size());
      }
      return Value::str(std::move(out));
    });
  }
  if (self.t == T::Dict) {
    if (name == "keys" || name == "values" || name == "items" || name == "get")
      return bind([](Interp&, const Value& s, Args& a, Kwargs& k, const std::string& nm) -> Value {
        Bind b{a, k, nm.c_str()};
        if (nm == "get") {
          if (!k.empty()) fail("get() takes no keyword arguments");
          if (a.empty() || a.size() > 2) fail("get expected at most 2 arguments, got {}", a.size());
          if (a[0].t == T::Str)
            for (const auto& kv : *s.dict)
              if (kv.first == a[0].sv()) return kv.second;
          return a.size() > 1 ? a[1] : Value::none();
        }
        b.check(0, {});
        List l;
        for (const auto& kv : *s.dict) {
          if (nm == "keys")
            l.push_back(key_value(kv.first, s.data));
          else if (nm == "values")
            l.push_back(kv.second);
          else
            l.push_back(Value::make_list({key_value(kv.first, s.data), kv.second}, true));
        }
        return Value::make_list(std::move(l));
      });
    static const char* kUnsafe[] = {"pop", "popitem", "setdefault", "update", "clear"};
    for (const char* n : kUnsafe)
      if (name == n)
        return Value::undefined(fmt::format("access to attribute '{}' of 'dict' object is unsafe.", name));
  }
  if (self.is_seq()) {
    static const char* kUnsafe[] = {"append", "extend",  "insert", "pop",
                                    "remove", "reverse", "sort",   "clear"};
    if (self.t == T::List)
      for (const char* n : kUnsafe)
        if (name == n)
          return Value::undefined(fmt::format("access to attribute '{}' of 'list' object is unsafe.", name));
    if (name == "index" || name == "count")
      return bind([](Interp&, const Value& s, Args& a, Kwargs&, const std::string& nm) -> Value {
        if (a.size() != 1) fail("{}() takes exactly one argument ({} given)", nm, a.size());
        long long n = 0;
        for (size_t k = 0; k < s.list->size(); ++k)
          if (py_eq((*s.list)[k], a[0])) {
            if (nm == "index") return Value::integer((long long)k);
            ++n;
          }
        if (nm == "index") fail("{} is not in {}", repr(a[0]), s.t == T::List ? "list" : "tuple");
        return Value::integer(n);
      });
  }
  return Value();
}

Value Interp::get_attr(const Value& obj, const std::string& name) {
  switch (obj.t) {
    case T::Undef:
      raise_undefined(obj);
    case T::Dict: {
      Value m = method(obj, name);
      if (m.t != T::Undef || m.undef) return m;
      for (const auto& kv : *obj.dict)
        if (kv.first == name) return kv.second;
      return undef_attr(obj, name);
    }
    case T::Ns:
      for (const auto& kv : *obj.ns)
        if (kv.first == name) return kv.second;
      return undef_attr(obj, name);
    case T::Loop: {
      const LoopState& l = *obj.loop;
      long long i = (long long)l.index0, n = (long long)l.items->size();
      if (name == "index0") return Value::integer(i);
      if (name == "index") return Value::integer(i + 1);
      if (name == "revindex") return Value::integer(n - i);
      if (name == "revindex0") return Value::integer(n - i - 1);
      if (name == "first") return Value::boolean(i == 0);
      if (name == "last") return Value::boolean(i == n - 1);
      if (name == "length") return Value::integer(n);
      if (name == "depth") return Value::integer(1);
      if (name == "depth0") return Value::integer(0);
      if (name == "previtem")
        return i > 0 ? (*l.items)[size_t(i - 1)] : Value::undefined("there is no previous item");
      if (name == "nextitem")
        return i + 1 < n ? (*l.items)[size_t(i + 1)] : Value::undefined("there is no next item");
      if (name == "cycle") {
        size_t idx = l.index0;
        return make_fn("cycle", [idx](Interp&, Args& a, Kwargs&) -> Value {
          if (a.empty()) fail("no items for cycling given");
          return a[idx % a.size()];
        });
      }
      return undef_attr(obj, name);
    }
    default: {
      Value m = method(obj, name);
      if (m.t != T::Undef || m.undef) return m;
      return undef_attr(obj, name);
    }
  }
}

Value Interp::get_item(const Value& obj, const Value& key) {
  if (obj.is_undef()) raise_undefined(obj);
  switch (obj.t) {
    case T::Dict:
      if (key.t == T::Str) {
        for (const auto& kv : *obj.dict)
          if (kv.first == key.sv()) return kv.second;
        return get_attr(obj, key.sv());
      }
      return undef_item(obj, key);
    case T::List:
    case T::Tuple:
    case T::Str: {
      if (is_intlike(key)) {
        __int128 i = as_int(key);
        if (obj.t == T::Str) {
          auto off = cp_offsets(obj.sv());
          __int128 n = (__int128)off.size() - 1;
          if (i < 0) i += n;
          if (i < 0 || i >= n) return undef_item(obj, key);
          return Value::str(obj.s->sub(off[size_t(i)], off[size_t(i) + 1]));
        }
        __int128 n = (__int128)obj.list->size();
        if (i < 0) i += n;
        if (i < 0 || i >= n) return undef_item(obj, key);
        return (*obj.list)[size_t(i)];
      }
      if (key.t == T::Str) return get_attr(obj, key.sv());
      return undef_item(obj, key);
    }
    case T::Ns:
    case T::Loop:
      if (key.t == T::Str) return get_attr(obj, key.sv());
      return undef_item(obj, key);
    default:
      return undef_item(obj, key);
  }
}

Value Interp::binary(int op, const Value& a, const Value& b) {
  if (a.is_undef()) raise_undefined(a);
  if (b.is_undef()) raise_undefined(b);
  static const char* sym[] = {"+", "-", "*", "/", "//", "%", "**"};
  auto unsupported = [&]() -> Value {
    fail("unsupported operand type(s) for {}: '{}' and '{}'", sym[op], type_name(a), type_name(b));
  };
  if (a.is_number() && b.is_number()) {
    bool fl = a.t == T::Float || b.t == T::Float;
    if (!fl && op != kDiv) {
      __int128 x = as_int(a), y = as_int(b), r = 0;
      bool of = false;
      switch (op) {
        case kAdd:
          of = __builtin_add_overflow(x, y, &r);
          break;
        case kSub:
          of = __builtin_sub_overflow(x, y, &r);
          break;
        case kMul:
          of = __builtin_mul_overflow(x, y, &r);
          break;
        case kFloorDiv:
        case kMod: {
          if (y == 0)
            fail("{}", op == kMod ? "integer modulo by zero" : "integer division or modulo by zero");
          __int128 q = x / y, m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) {
            --q;
            m += y;
          }
          r = op == kFloorDiv ? q : m;
          break;
        }
        case kPow: {
          if (y < 0) return Value::real(std::pow(double(x), double(y)));
          // Bases 0, 1 and -1 never overflow, so the loop would run y times (y may be 10^24):
          // their powers directly; any other base overflows within 127 multiplications.
          if (x == 0 || x == 1 || x == -1) {
            r = x == 0 ? (y == 0 ? 1 : 0) : (x == 1 || y % 2 == 0) ? 1 : -1;
            break;
          }
          r = 1;
          for (__int128 k = 0; k < y && !of; ++k) of = __builtin_mul_overflow(r, x, &r);
          break;
        }
      }
      if (of) fail("integer result out of the supported range");
      return Value::integer(r);
    }
    double x = double(as_ld(a)), y = double(as_ld(b));
    switch (op) {
      case kAdd:
        return Value::real(x + y);
      case kSub:
        return Value::real(x - y);
      case kMul:
        return Value::real(x * y);
      case kDiv:
        if (y == 0) fail("{}", fl ? "float division by zero" : "division by zero");
        return Value::real(x / y);
      case kFloorDiv:
        if (y == 0) fail("float floor division by zero");
        return Value::real(std::floor(x / y));
      case kMod: {
        if (y == 0) fail("float modulo");
        double m = std::fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        return Value::real(m);
      }
      default:
        return Value::real(std::pow(x, y));
    }
  }
  if (op == kAdd) {
    if (a.t == T::Str) {
      if (b.t != T::Str) fail("can only concatenate str (not \"{}\") to str", type_name(b));
      Text t = *a.s;
      t.append(*b.s);
      check_size(t.s.size());
      return Value::str(std::move(t));
    }
    if (a.is_seq()) {
      if (b.t != a.t)
        fail("can only concatenate {} (not \"{}\") to {}", type_name(a), type_name(b), type_name(a));
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::make_list(std::move(l), a.t == T::Tuple);
    }
    return unsupported();
  }
  if (op == kMul) {
    const bool a_seq = a.t == T::Str || a.is_seq();
    const Value* seq = a_seq ? &a : &b;
    const Value* n = a_seq ? &b : &a;
    if (seq->t == T::Str || seq->is_seq()) {
      if (!is_intlike(*n)) fail("can't multiply sequence by non-int of type '{}'", type_name(*n));
      __int128 times = std::max<__int128>(0, as_int(*n));
      size_t unit = seq->t == T::Str ? seq->sv().size() : seq->list->size() * 16;
      if (unit && times > (__int128)(lim_.max_output / unit)) check_size(lim_.max_output + 1);
      if (unit == 0) times = 0;  // an empty sequence repeated is empty however many times: no loop
      if (seq->t == T::Str) {
        Text t;
        for (__int128 k = 0; k < times; ++k) t.append(*seq->s);
        return Value::str(std::move(t));
      }
      List l;
      for (__int128 k = 0; k < times; ++k) l.insert(l.end(), seq->list->begin(), seq->list->end());
      return Value::make_list(std::move(l), seq->t == T::Tuple);
    }
  }
  if (op == kMod && a.t == T::Str) fail("unsupported construct: printf-style string formatting with %");
  return unsupported();
}

void Interp::assign(const std::vector<std::string>& targets, const Value& v, Scope& sc) {
  if (targets.size() == 1) {
    sc.set(targets[0], v);
    return;
  }
  if (v.is_undef()) raise_undefined(v);
  if (v.t != T::Str && !v.is_seq() && v.t != T::Dict)
    fail("cannot unpack non-iterable {} object", type_name(v));
  List items = iterate(v);
  if (items.size() < targets.size())
    fail("not enough values to unpack (expected {}, got {})", targets.size(), items.size());
  if (items.size() > targets.size()) fail("too many values to unpack (expected {})", targets.size());
  for (size_t k = 0; k < targets.size(); ++k) sc.set(targets[k], items[k]);
}

Value Interp::eval(const Expr& e, const ScopeP& sc) {
  switch (e.k) {
    case Expr::K::Const:
      return e.value;
    case Expr::K::Name: {
      if (const Value* v = sc->find(e.name)) return *v;
      if (const Value* v = globals().find(e.name)) return *v;
      return Value::undefined(fmt::format("{} is undefined", python_str_repr(e.name)));
    }
    case Expr::K::List:
    case Expr::K::Tuple: {
      List l;
      for (const ExprP& x : e.args) l.push_back(eval(*x, sc));
      return Value::make_list(std::move(l), e.k == Expr::K::Tuple);
    }
    case Expr::K::Dict: {
      Dict d;
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
        Value key = eval(*e.args[k], sc);
        if (key.t != T::Str) fail("unsupported: a dict literal key of type {}", type_name(key));
        Value val = eval(*e.args[k + 1], sc);
        bool set = false;
        for (auto& [kn, kv] : d)
          if (kn == key.sv()) kv = val, set = true;
        if (!set) d.emplace_back(key.sv(), std::move(val));
      }
      return Value::make_dict(std::move(d));
    }
    case Expr::K::Attr:
      return get_attr(eval(*e.args[0], sc), e.name);
    case Expr::K::Item: {
      Value obj = eval(*e.args[0], sc);
      const Expr& k = *e.args[1];
      if (k.k == Expr::K::Slice) {
        if (obj.is_undef()) raise_undefined(obj);
        auto part = [&](size_t i) { return k.args[i] ? eval(*k.args[i], sc) : Value::none(); };
        Value a = part(0), b = part(1), c = part(2);
        // jinja2 compiles slices to plain Python subscripts, bypassing its undefined-returning getitem.
        if (obj.t != T::Str && !obj.is_seq()) {
          if (obj.t == T::Dict) fail("unhashable type: 'slice'");
          fail("'{}' object is not subscriptable", type_name(obj));
        }
        return slice_value(obj, a, b, c);
      }
      return get_item(obj, eval(k, sc));
    }
    case Expr::K::Slice:
      fail("unsupported: a slice outside a subscript");
    case Expr::K::Call: {
      Value callee = eval(*e.args[0], sc);
      Args args;
      for (size_t k = 1; k < e.args.size(); ++k) args.push_back(eval(*e.args[k], sc));
      Kwargs kwargs;
      for (const auto& [n, x] : e.kwargs) kwargs.emplace_back(n, eval(*x, sc));
      return call(callee, args, kwargs);
    }
    case Expr::K::Filter:
      return apply_filter(e, sc);
    case Expr::K::Test:
      return Value::boolean(apply_test(e, sc) != e.negated);
    case Expr::K::Not:
      return Value::boolean(!truthy(eval(*e.args[0], sc)));
    case Expr::K::Neg:
    case Expr::K::Pos: {
      Value v = eval(*e.args[0], sc);
      if (v.is_undef()) raise_undefined(v);
      if (!v.is_number())
        fail("bad operand type for unary {}: '{}'", e.k == Expr::K::Neg ? "-" : "+", type_name(v));
      if (e.k == Expr::K::Pos) return v.t == T::Bool ? Value::integer(v.b) : v;
      return v.t == T::Float ? Value::real(-v.f) : Value::integer(-as_int(v));
    }
    case Expr::K::Binary: {
      Value a = eval(*e.args[0], sc);
      Value b = eval(*e.args[1], sc);
      return binary(e.id, a, b);
    }
    case Expr::K::Compare: {
      Value left = eval(*e.args[0], sc);
      for (size_t k = 0; k < e.ops.size(); ++k) {
        Value right = eval(*e.args[k + 1], sc);
        bool r;
        switch (e.ops[k]) {
          case kEq:
            r = py_eq(left, right);
            break;
          case kNe:
            r = !py_eq(left, right);
            break;
          case kIn:
            r = py_in(left, right);
            break;
          case kNotIn:
            r = !py_in(left, right);
            break;
          default: {
            int c = py_order(left, right, e.ops[k]);
            r = c == 2            ? false
                : e.ops[k] == kLt ? c < 0
                : e.ops[k] == kLe ? c <= 0
                : e.ops[k] == kGt ? c > 0
                                  : c >= 0;
          }
        }
        if (!r) return Value::boolean(false);
        left = std::move(right);
      }
      return Value::boolean(true);
    }
    case Expr::K::And: {
      Value a = eval(*e.args[0], sc);
      return truthy(a) ? eval(*e.args[1], sc) : a;
    }
    case Expr::K::Or: {
      Value a = eval(*e.args[0], sc);
      return truthy(a) ? a : eval(*e.args[1], sc);
    }
    case Expr::K::Cond: {
      if (truthy(eval(*e.args[0], sc))) return eval(*e.args[1], sc);
      if (e.args[2]) return eval(*e.args[2], sc);
      return Value::undefined(fmt::format(
          "the inline if-expression on line {} evaluated to false and no else section was defined.", e.line));
    }
    case Expr::K::Concat: {
      Text t;
      for (const ExprP& x : e.args) {
        t.append(to_text(eval(*x, sc)));
        check_size(t.s.size());
      }
      return Value::str(std::move(t));
    }
  }
  return Value();
}

Value Interp::apply_filter(const Expr& e, const ScopeP& sc) {
  Value v = eval(*e.args[0], sc);
  Args a;
  for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k], sc));
  Kwargs kw;
  for (const auto& [n, x] : e.kwargs) kw.emplace_back(n, eval(*x, sc));
  Bind b{a, kw, e.name.c_str()};
  auto soft_str = [&](const Value& x) { return to_text(x); };
  switch (e.id) {
    case kFTojson: {
      b.check(4, {"ensure_ascii", "indent", "separators", "sort_keys"});
      JsonStyle st;
      st.ensure_ascii = truthy(b.get(0, "ensure_ascii", Value::boolean(false)));
      Value indent = b.get(1, "indent", Value::none());
      if (indent.t != T::None) {
        if (indent.t == T::Str) fail("unsupported: tojson with a string indent");
        st.indent = std::clamp<long long>(need_int(indent, "indent"), 0, 64);
        st.item_sep = ",";
      }
      Value seps = b.get(2, "separators", Value::none());
      if (seps.t != T::None) {
        if (!seps.is_seq() || seps.list->size() != 2 || (*seps.list)[0].t != T::Str ||
            (*seps.list)[1].t != T::Str)
          fail("tojson: separators must be a pair of strings");
        st.item_sep = (*seps.list)[0].sv();
        st.key_sep = (*seps.list)[1].sv();
      }
      st.sort_keys = truthy(b.get(3, "sort_keys", Value::boolean(false)));
      std::string out;
      json_dump(out, v, st, 0, lim_.max_output);
      check_size(out.size());
      Text t;
      t.append_data(out, has_data(v));
      return Value::str(std::move(t));
    }
    case kFItems: {
      b.check(0, {});
      if (v.is_undef()) return Value::make_list({});
      if (v.t != T::Dict) fail("Can only get item pairs from a mapping.");
      List l;
      for (const auto& kv : *v.dict)
        l.push_back(Value::make_list({key_value(kv.first, v.data), kv.second}, true));
      return Value::make_list(std::move(l));
    }
    case kFLength:
      b.check(0, {});
      switch (v.t) {
        case T::Undef:
          return Value::integer(0);
        case T::Str:
          return Value::integer((long long)cp_count(v.sv()));
        case T::List:
        case T::Tuple:
          return Value::integer((long long)v.list->size());
        case T::Dict:
          return Value::integer((long long)v.dict->size());
        case T::Loop:
          return Value::integer((long long)v.loop->items->size());
        default:
          fail("object of type '{}' has no len()", type_name(v));
      }
    case kFTrim: {
      b.check(1, {"chars"});
      Value chars = b.get(0, "chars", Value::none());
      auto set = strip_chars(chars, "chars");
      return Value::str(strip_text(soft_str(v), true, true, chars.t == T::None ? nullptr : &set));
    }
    case kFLower:
    case kFUpper:
    case kFCapitalize:
    case kFTitle:
      b.check(0, {});
      return Value::str(change_case(soft_str(v), e.id == kFLower   ? Case::Lower
                                                 : e.id == kFUpper ? Case::Upper
                                                 : e.id == kFTitle ? Case::TitleFilter
                                                                   : Case::Capitalize));
    case kFReplace: {
      b.check(3, {"old", "new", "count"});
      Value cnt = b.get(2, "count", Value::none());
      Text r =
          replace_text(soft_str(v), soft_str(b.get(0, "old", Value())), soft_str(b.get(1, "new", Value())),
                       cnt.t == T::None ? -1 : need_int(cnt, "count"));
      check_size(r.s.size());
      return Value::str(std::move(r));
    }
    case kFJoin: {
      b.check(2, {"d", "attribute"});
      if (b.get(1, "attribute", Value::none()).t != T::None) fail("unsupported: join with attribute=");
      Text sep = soft_str(b.get(0, "d", Value::literal("")));
      Text out;
      List items = iterate(v);
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out.append(sep);
        out.append(soft_str(items[k]));
        check_size(out.s.size());
      }
      return Value::str(std::move(out));
    }
    case kFFirst: {
      b.check(0, {});
      List items = iterate(v);
      if (items.empty()) return Value::undefined("No first item, sequence was empty.");
      return items.front();
    }
    case kFLast: {
      b.check(0, {});
      if (!v.is_undef() && v.t != T::Str && !v.is_seq() && v.t != T::Dict)
        fail("'{}' object is not reversible", type_name(v));
      List items = iterate(v);
      if (items.empty()) return Value::undefined("No last item, sequence was empty.");
      return items.back();
    }
    case kFDefault: {
      b.check(2, {"default_value", "boolean"});
      Value def = b.get(0, "default_value", Value::literal(""));
      bool boolean = truthy(b.get(1, "boolean", Value::boolean(false)));
      if (v.is_undef() || (boolean && !truthy(v))) return def;
      return v;
    }
    case kFList:
      b.check(0, {});
      return Value::make_list(iterate(v));
    case kFString:
    case kFSafe:
      b.check(0, {});
      return v.t == T::Str ? v : Value::str(soft_str(v));
    case kFInt:
    case kFFloat: {
      b.check(e.id == kFInt ? 2 : 1, {"default", "base"});
      Value def = b.get(0, "default", e.id == kFInt ? Value::integer(0) : Value::real(0.0));
      if (v.is_undef()) raise_undefined(v);
      if (v.is_number()) {
        if (e.id == kFFloat) return Value::real(double(as_ld(v)));
        if (v.t != T::Float) return Value::integer(as_int(v));
        if (!std::isfinite(v.f)) return def;
        return Value::integer((__int128)std::trunc(v.f));
      }
      if (v.t != T::Str) return def;
      std::string s(strip_text(*v.s, true, true, nullptr).s);
      std::string digits;
      for (size_t k = 0; k < s.size(); ++k)
        if (s[k] != '_' || (k > 0 && k + 1 < s.size() && std::isdigit((unsigned char)s[k - 1]) &&
                            std::isdigit((unsigned char)s[k + 1])))
          digits += s[k];
      if (e.id == kFInt && b.get(1, "base", Value::integer(10)).t == T::Int &&
          as_int(b.get(1, "base", Value::integer(10))) != 10)
        fail("unsupported: int filter with a base other than 10");
      char* end = nullptr;
      if (e.id == kFInt) {
        bool ok = !digits.empty();
        size_t k = (digits[0] == '+' || digits[0] == '-') ? 1 : 0;
        ok = ok && k < digits.size();
        for (size_t q = k; ok && q < digits.size(); ++q) ok = std::isdigit((unsigned char)digits[q]);
        if (ok && digits.size() < 38) {
          __int128 r = 0;
          for (size_t q = k; q < digits.size(); ++q) r = r * 10 + (digits[q] - '0');
          return Value::integer(digits[0] == '-' ? -r : r);
        }
      }
      if (s.empty() || s.find_first_of("xXpP") != std::string::npos) return def;
      double d = std::strtod(s.c_str(), &end);
      if (end != s.c_str() + s.size()) return def;
      if (e.id == kFFloat) return Value::real(d);
      if (!std::isfinite(d)) return def;
      return Value::integer((__int128)std::trunc(d));
    }
    case kFAbs:
      b.check(0, {});
      if (!v.is_number()) fail("bad operand type for abs(): '{}'", type_name(v));
      return v.t == T::Float ? Value::real(std::fabs(v.f))
                             : Value::integer(as_int(v) < 0 ? -as_int(v) : as_int(v));
    case kFReverse: {
      b.check(0, {});
      if (v.t == T::Str) {
        Text t;
        auto off = cp_offsets(v.sv());
        for (size_t k = off.size() - 1; k > 0; --k) t.append(v.s->sub(off[k - 1], off[k]));
        return Value::str(std::move(t));
      }
      if (v.t != T::Undef && !v.is_seq() && v.t != T::Dict && v.t != T::Loop)
        fail("argument must be iterable");
      List items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::make_list(std::move(items));
    }
  }
  fail("unsupported filter '{}'", e.name);
}

bool Interp::apply_test(const Expr& e, const ScopeP& sc) {
  Value v = eval(*e.args[0], sc);
  Args a;
  for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k], sc));
  auto arg = [&]() -> const Value& {
    if (a.empty()) fail("test '{}' takes one argument", e.name);
    return a[0];
  };
  switch (e.id) {
    case kTDefined:
      return !v.is_undef();
    case kTUndefined:
      return v.is_undef();
    case kTNone:
      return v.t == T::None;
    case kTString:
      return v.t == T::Str;
    case kTNumber:
      return v.is_number();
    case kTMapping:
      return v.t == T::Dict;
    case kTIterable:
    case kTSequence:
      return v.is_undef() || v.t == T::Str || v.is_seq() || v.t == T::Dict ||
             (e.id == kTIterable && v.t == T::Loop);
    case kTTrue:
      return v.t == T::Bool && v.b;
    case kTFalse:
      return v.t == T::Bool && !v.b;
    case kTBoolean:
      return v.t == T::Bool;
    case kTInteger:
      return v.t == T::Int;
    case kTFloat:
      return v.t == T::Float;
    case kTEq:
      return py_eq(v, arg());
    case kTNe:
      return !py_eq(v, arg());
    case kTIn:
      return py_in(v, arg());
    case kTOdd:
    case kTEven:
    case kTDivisibleby: {
      Value m = binary(kMod, v, e.id == kTDivisibleby ? arg() : Value::integer(2));
      bool zero = !truthy(m);
      return e.id == kTOdd ? !zero : zero;
    }
    case kTCallable:
      return v.t == T::Fn || v.is_undef();
    case kTSameas: {
      const Value& o = arg();
      if (v.t != o.t) return false;
      switch (v.t) {
        case T::None:
        case T::Undef:
          return v.t == T::None || v.undef == o.undef;
        case T::Bool:
          return v.b == o.b;
        case T::Str:
          return v.s == o.s;
        case T::List:
        case T::Tuple:
          return v.list == o.list;
        case T::Dict:
          return v.dict == o.dict;
        case T::Ns:
          return v.ns == o.ns;
        default:
          return py_eq(v, o) && v.t != T::Float;
      }
    }
    case kTLower:
    case kTUpper: {
      // Python's str.islower() / str.isupper(): no character of the other case (title case counts
      // as neither), and at least one of this case.
      Text t = to_text(v);
      bool cased = false;
      for (char32_t cp : code_points(t.s)) {
        const UChar32 c = UChar32(cp);
        const bool mine = e.id == kTLower ? u_isULowercase(c) : u_isUUppercase(c);
        const bool other = (e.id == kTLower ? u_isUUppercase(c) : u_isULowercase(c)) || u_istitle(c);
        if (other) return false;
        cased = cased || mine;
      }
      return cased;
    }
  }
  fail("unsupported test '{}'", e.name);
}

Interp::Flow Interp::exec_node(const Node& n, const ScopeP& sc, Text& out) {
  switch (n.k) {
    case Node::K::Text:
      out.append_literal(n.text);
      check_size(out.s.size());
      return Flow::Normal;
    case Node::K::Output:
      step();
      out.append(to_text(eval(*n.expr, sc)));
      check_size(out.s.size());
      return Flow::Normal;
    case Node::K::If:
      for (const auto& [cond, body] : n.branches)
        if (!cond || truthy(eval(*cond, sc))) return exec(body, sc, out);
      return Flow::Normal;
    case Node::K::For: {
      Value it = eval(*n.expr, sc);
      if (it.is_undef()) {
        // iterates as empty
      } else if (it.t != T::Str && !it.is_seq() && it.t != T::Dict && it.t != T::Loop) {
        fail("'{}' object is not iterable", type_name(it));
      }
      std::shared_ptr<const List> items = it.is_seq() ? it.list : std::make_shared<const List>(iterate(it));
      if (n.cond) {
        List kept;
        for (const Value& x : *items) {
          step();
          auto fs = std::make_shared<Scope>();
          fs->parent = sc;
          assign(n.targets, x, *fs);
          if (truthy(eval(*n.cond, fs))) kept.push_back(x);
        }
        items = std::make_shared<const List>(std::move(kept));
      }
      if (items->empty()) return exec(n.else_body, sc, out);
      Value loop;
      loop.t = T::Loop;
      loop.loop = std::make_shared<LoopState>();
      loop.loop->items = std::move(items);
      // One scope object, emptied for each iteration: what one iteration sets is gone in the next.
      auto is = std::make_shared<Scope>();
      is->parent = sc;
      for (size_t k = 0; k < loop.loop->items->size(); ++k) {
        step();
        loop.loop->index0 = k;
        is->vars.clear();
        is->vars.emplace_back("loop", loop);
        assign(n.targets, (*loop.loop->items)[k], *is);
        Flow f = exec(n.body, is, out);
        if (f == Flow::Break) break;
      }
      return Flow::Normal;
    }
    case Node::K::Set: {
      Value v = eval(*n.expr, sc);
      if (n.ns_attr) {
        const Value* target = sc->find(n.targets[0]);
        if (!target) target = globals().find(n.targets[0]);
        if (!target || target->t != T::Ns) fail("cannot assign attribute on non-namespace object");
        check_no_namespace(v);
        for (auto& kv : *target->ns)
          if (kv.first == n.targets[1]) {
            kv.second = std::move(v);
            return Flow::Normal;
          }
        target->ns->emplace_back(n.targets[1], std::move(v));
        return Flow::Normal;
      }
      assign(n.targets, v, *sc);
      return Flow::Normal;
    }
    case Node::K::SetBlock: {
      Text t;
      exec(n.body, sc, t);
      Value v = Value::str(std::move(t));
      for (int f : n.filters) {
        Expr fe;
        fe.k = Expr::K::Filter;
        fe.id = f;
        auto c = std::make_unique<Expr>();
        c->value = v;
        fe.args.push_back(std::move(c));
        v = apply_filter(fe, sc);
      }
      sc->set(n.targets[0], std::move(v));
      return Flow::Normal;
    }
    case Node::K::Macro: {
      Value v;
      v.t = T::Fn;
      auto c = std::make_shared<Callable>();
      c->name = n.name;
      c->macro = &n;
      c->closure = sc;
      v.fn = std::move(c);
      sc->set(n.name, std::move(v));
      return Flow::Normal;
    }
    case Node::K::CallBlock: {
      const Expr& call_e = *n.expr;
      Value callee = eval(*call_e.args[0], sc);
      Args args;
      for (size_t k = 1; k < call_e.args.size(); ++k) args.push_back(eval(*call_e.args[k], sc));
      Kwargs kwargs;
      for (const auto& [nm, x] : call_e.kwargs) kwargs.emplace_back(nm, eval(*x, sc));
      Value caller;
      caller.t = T::Fn;
      auto c = std::make_shared<Callable>();
      c->name = "caller";
      c->macro = &n;
      c->closure = sc;
      caller.fn = std::move(c);
      kwargs.emplace_back("caller", std::move(caller));
      step();
      out.append(to_text(call(callee, args, kwargs)));
      check_size(out.s.size());
      return Flow::Normal;
    }
    case Node::K::Break:
      return Flow::Break;
    case Node::K::Continue:
      return Flow::Continue;
    case Node::K::Generation:
      return exec(n.body, sc, out);
  }
  return Flow::Normal;
}

Template Template::parse(std::string_view source) {
  Template t;
  t.program_ = parse_program(source);
  return t;
}

Rendered Template::render(const Json& context, const Limits& limits) const {
  if (!context.is_object()) fail("template context must be a JSON object");
  Interp in(limits);
  auto root = std::make_shared<Scope>();
  for (auto& [k, v] : context.items()) root->set(k, from_json(v));
  Text out;
  try {
    in.exec(program_->body, root, out);
  } catch (...) {
    // Macros hold their defining scope; break the cycle root -> macro -> root.
    root->vars.clear();
    throw;
  }
  root->vars.clear();
  return {std::move(out.s), std::move(out.data)};
}

}  // namespace tansy::text::jinja
