// libFuzzer target: structured output's schema and regex compilers and the matcher. Input byte 0
// picks the mode (JSON Schema or a pattern), the rest is the schema text or the pattern. What
// compiles is walked: random tokens from each step's mask (under a closing budget) until the
// document is complete; a completed JSON document must parse.
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>

#include "core/error.h"
#include "grammar/constraint.h"
#include "grammar/json_schema.h"

namespace g = tansy::grammar;

static std::shared_ptr<const g::Vocabulary> vocab() {
  static std::shared_ptr<const g::Vocabulary> v = [] {
    auto x = std::make_shared<g::Vocabulary>();
    for (int b = 0; b < 256; ++b) x->bytes.push_back(std::string(1, char(b)));
    for (const char* t :
         {"{\"", "\":", "\",\"", "\"}", "true", "null", "12", "-0.5", "],[", "\\u00", "é", "ab"})
      x->bytes.push_back(t);
    x->bytes.push_back("");  // end of turn
    x->trie = std::make_shared<g::VocabTrie>(x->bytes);
    return x;
  }();
  return v;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > 4096) return 0;
  const bool regex = data[0] & 1;
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  std::shared_ptr<g::Grammar> grammar;
  try {
    if (regex) {
      grammar = g::regex_grammar(text);
    } else {
      g::Json schema = g::Json::parse(text, nullptr, false);
      if (schema.is_discarded()) return 0;
      grammar = g::json_schema_grammar(schema);
    }
  } catch (const tansy::Error&) {
    return 0;  // refused (SchemaError) or not generable: fine
  }
  auto v = vocab();
  const int32_t eot = int32_t(v->bytes.size()) - 1;
  auto rt = std::make_shared<g::Runtime>(grammar, v->trie);
  std::mt19937_64 rng(size * 1315423911u + data[0]);
  g::GrammarConstraint c(rt, v, {{eot}, std::nullopt, 64});
  std::vector<uint32_t> mask((v->bytes.size() + 31) / 32);
  std::string out;
  bool done = false;
  for (int step = 0; step < 64 && !done; ++step) {
    c.fill_mask(mask);
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id <= eot; ++id)
      if ((mask[size_t(id) >> 5] >> (id & 31)) & 1) allowed.push_back(id);
    if (allowed.empty()) __builtin_trap();  // a mask is never empty
    int32_t t = allowed[rng() % allowed.size()];
    if (t == eot && !c.can_end()) __builtin_trap();
    c.accept(t);
    if (t == eot) break;
    out += v->bytes[size_t(t)];
    done = c.complete();
  }
  if (!regex && (done || c.can_end()) && g::Json::parse(out, nullptr, false).is_discarded()) __builtin_trap();
  return 0;
}
