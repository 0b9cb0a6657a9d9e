// Internals of the Jinja interpreter (text/jinja.h): values with Python semantics, the syntax
// tree, and the parser's entry point. Only jinja_parse.cpp and jinja_eval.cpp include this.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja.h"

namespace tansy::text::jinja {

// A string with the byte ranges that came from the render context.
struct Text {
  std::string s;
  std::vector<std::pair<size_t, size_t>> data;

  void add_range(size_t b, size_t e) {
    if (b >= e) return;
    if (!data.empty() && data.back().second == b)
      data.back().second = e;
    else
      data.emplace_back(b, e);
  }
  void append(const Text& o) {
    size_t base = s.size();
    s += o.s;
    for (auto [b, e] : o.data) add_range(base + b, base + e);
  }
  void append_literal(std::string_view t) { s += t; }
  void append_data(std::string_view t, bool is_data) {
    size_t base = s.size();
    s += t;
    if (is_data) add_range(base, s.size());
  }
  // The bytes [b, e) with their provenance.
  Text sub(size_t b, size_t e) const {
    Text t;
    t.s = s.substr(b, e - b);
    for (auto [rb, re] : data) {
      size_t lo = std::max(rb, b), hi = std::min(re, e);
      if (lo < hi) t.add_range(lo - b, hi - b);
    }
    return t;
  }
  bool has_data() const { return !data.empty(); }
};

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion-ordered, like Python's dict
struct Callable;
struct LoopState;

struct Value {
  enum class T : uint8_t { Undef, None, Bool, Int, Float, Str, List, Tuple, Dict, Ns, Fn, Loop };
  T t = T::Undef;
  bool data = false;   // a non-string value taken from the render context
  uint32_t depth = 0;  // container nesting, bounded so that printing and comparing cannot overflow the stack
  bool b = false;
  __int128 i = 0;
  double f = 0;
  std::shared_ptr<const Text> s;
  std::shared_ptr<const List> list;
  std::shared_ptr<const Dict> dict;
  std::shared_ptr<Dict> ns;  // a namespace() object is mutable
  std::shared_ptr<const Callable> fn;
  std::shared_ptr<LoopState> loop;
  std::shared_ptr<const std::string> undef;  // what using this Undefined raises

  static Value undefined(std::string message) {
    Value v;
    v.undef = std::make_shared<const std::string>(std::move(message));
    return v;
  }
  static Value none() {
    Value v;
    v.t = T::None;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.t = T::Bool;
    v.b = x;
    return v;
  }
  static Value integer(__int128 x) {
    Value v;
    v.t = T::Int;
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v;
    v.t = T::Float;
    v.f = x;
    return v;
  }
  static Value str(Text t) {
    Value v;
    v.t = T::Str;
    v.s = std::make_shared<const Text>(std::move(t));
    return v;
  }
  static Value literal(std::string_view x) {
    Text t;
    t.s = x;
    return str(std::move(t));
  }
  static constexpr uint32_t kMaxDepth = 512;
  static uint32_t nested_depth(const List& l) {
    uint32_t d = 0;
    for (const Value& x : l) d = std::max(d, x.depth);
    return check_depth(d + 1);
  }
  static uint32_t check_depth(uint32_t d);  // throws past kMaxDepth
  static Value make_list(List l, bool tuple = false) {
    Value v;
    v.depth = nested_depth(l);
    v.t = tuple ? T::Tuple : T::List;
    v.list = std::make_shared<const List>(std::move(l));
    return v;
  }
  static Value make_dict(Dict d) {
    Value v;
    uint32_t depth = 0;
    for (const auto& kv : d) depth = std::max(depth, kv.second.depth);
    v.depth = check_depth(depth + 1);
    v.t = T::Dict;
    v.dict = std::make_shared<const Dict>(std::move(d));
    return v;
  }
  bool is_undef() const { return t == T::Undef; }
  bool is_str() const { return t == T::Str; }
  bool is_seq() const { return t == T::List || t == T::Tuple; }
  bool is_number() const { return t == T::Int || t == T::Float || t == T::Bool; }
  const std::string& sv() const { return s->s; }
};

// ------------------------------------------------------------------------------------------------
// Syntax tree
// ------------------------------------------------------------------------------------------------
struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum class K : uint8_t {
    Const,
    Name,
    List,
    Tuple,
    Dict,
    Attr,
    Item,
    Slice,
    Call,
    Filter,
    Test,
    Not,
    Neg,
    Pos,
    Binary,
    Compare,
    And,
    Or,
    Cond,
    Concat
  };
  K k = K::Const;
  int line = 0;
  bool negated = false;     // `is not`
  int id = 0;               // filter/test id, binary operator
  Value value;              // Const
  std::string name;         // Name, Attr, Filter, Test
  std::vector<ExprP> args;  // operands; for Call/Filter/Test: [callee/subject, positional...]
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<int> ops;  // Compare: one operator per following operand
};

struct Node;
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

struct Node {
  enum class K : uint8_t {
    Text,
    Output,
    If,
    For,
    Set,
    SetBlock,
    Macro,
    CallBlock,
    Break,
    Continue,
    Generation
  };
  K k = K::Text;
  int line = 0;
  std::string text;                              // Text
  ExprP expr;                                    // Output, Set value, For iterable, CallBlock call
  ExprP cond;                                    // For's `if` filter
  std::vector<std::string> targets;              // Set / For names; Set on a namespace: {ns, attr}
  bool ns_attr = false;                          // Set targets[0].targets[1]
  std::vector<std::pair<ExprP, Body>> branches;  // If: (condition or null for else, body)
  Body body, else_body;
  std::string name;                                   // Macro name
  std::vector<std::pair<std::string, ExprP>> params;  // Macro / CallBlock parameters with defaults
  std::vector<int> filters;                           // SetBlock's filters (ids), applied in order
};

struct Program {
  Body body;
};

// Filter and test ids, resolved when the template is parsed.
enum Filter : int {
  kFTojson,
  kFItems,
  kFLength,
  kFTrim,
  kFLower,
  kFUpper,
  kFReplace,
  kFJoin,
  kFFirst,
  kFLast,
  kFDefault,
  kFList,
  kFString,
  kFInt,
  kFFloat,
  kFSafe,
  kFAbs,
  kFCapitalize,
  kFTitle,
  kFReverse
};
enum TestId : int {
  kTDefined,
  kTUndefined,
  kTNone,
  kTString,
  kTNumber,
  kTMapping,
  kTIterable,
  kTSequence,
  kTTrue,
  kTFalse,
  kTBoolean,
  kTInteger,
  kTFloat,
  kTEq,
  kTNe,
  kTIn,
  kTOdd,
  kTEven,
  kTDivisibleby,
  kTCallable,
  kTSameas,
  kTLower,
  kTUpper
};
enum BinOp : int { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum CmpOp : int { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

std::unique_ptr<Program> parse_program(std::string_view source);

// UTF-8 helpers shared by the two halves.
size_t utf8_decode(std::string_view s, size_t i, char32_t& cp);  // bytes consumed, 0 if malformed
void utf8_encode(std::string& out, char32_t cp);
bool py_isspace(char32_t c);

}  // namespace tansy::text::jinja
