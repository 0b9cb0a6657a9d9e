// Structured output's grammar engine: JSON Schema and regex compilation, the matcher and the
// token masks, checked against independent references (an enumeration of each schema's
// documents, std::regex) on a small vocabulary, and on the Qwen3 tokenizer of the fixtures.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <regex>
#include <set>

#include "grammar/constraint.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace tansy::grammar {
namespace {

using J = Json;

// All single bytes, all pairs over JSON's punctuation and a few letters, and some longer tokens
// that cross structure boundaries; the last id is an end-of-turn token with no text.
std::shared_ptr<Vocabulary> small_vocab() {
  auto v = std::make_shared<Vocabulary>();
  for (int b = 0; b < 256; ++b) v->bytes.push_back(std::string(1, char(b)));
  const std::string alpha = "{}[]\":,01-.tfaelnrubx\\ ";
  for (char a : alpha)
    for (char b : alpha) v->bytes.push_back(std::string{a, b});
  for (const char* t : {"true",
                        "false",
                        "null",
                        "\"a\"",
                        "\":",
                        "},{",
                        "\":\"",
                        "12",
                        "-1",
                        "\"b\":",
                        "[1,",
                        "\"x\":[",
                        "]}",
                        "\"}",
                        "0.5",
                        "1e",
                        "\\u00",
                        "\\\"",
                        "é",
                        "\xc3",
                        "\xa9\"",
                        "abc",
                        "\"abc\"",
                        "],[",
                        "\"ok\",\"",
                        "10",
                        "99",
                        "-0",
                        "00",
                        "ab\n",
                        "\n<",
                        "<tool_call>",
                        "\n<function=f>\n",
                        "</parameter>\n",
                        "<parameter=a>\n",
                        "\n</parameter>\n"})
    v->bytes.push_back(t);
  v->bytes.push_back("");  // end of turn
  v->trie = std::make_shared<VocabTrie>(v->bytes);
  return v;
}

int32_t eot(const Vocabulary& v) { return int32_t(v.bytes.size()) - 1; }

// ---- an independent enumeration of a finite schema's documents (compact JSON) ----

std::vector<std::string> enumerate(const J& s, const J& root);

std::vector<std::string> enumerate_ref(const J& s, const J& root) {
  std::string p = s["$ref"].get<std::string>().substr(1);
  return enumerate(root.at(J::json_pointer(p)), root);
}

std::vector<std::string> enumerate(const J& s, const J& root) {
  std::vector<std::string> out;
  if (s.contains("$ref")) return enumerate_ref(s, root);
  if (s.contains("anyOf")) {
    for (auto& x : s["anyOf"])
      for (auto& d : enumerate(x, root)) out.push_back(d);
    return out;
  }
  if (s.contains("enum")) {
    for (auto& x : s["enum"]) out.push_back(x.dump());
    return out;
  }
  if (s.contains("const")) return {s["const"].dump()};
  std::string t = s["type"];
  if (t == "boolean") return {"true", "false"};
  if (t == "null") return {"null"};
  if (t == "integer") {
    for (int64_t i = s["minimum"].get<int64_t>(); i <= s["maximum"].get<int64_t>(); ++i)
      out.push_back(std::to_string(i));
    return out;
  }
  if (t == "array") {
    auto items = enumerate(s["items"], root);
    int mn = s.value("minItems", 0), mx = s["maxItems"];
    std::vector<std::string> cur = {""};
    for (int n = 0; n <= mx; ++n) {
      if (n >= mn)
        for (auto& c : cur) out.push_back("[" + c + "]");
      std::vector<std::string> next;
      for (auto& c : cur)
        for (auto& i : items) next.push_back(c.empty() ? i : c + "," + i);
      cur = next;
    }
    return out;
  }
  // object: declared properties in order, each required or optional
  std::set<std::string> req;
  if (s.contains("required"))
    for (auto& r : s["required"]) req.insert(r);
  std::vector<std::string> cur = {""};
  for (auto& [k, v] : s["properties"].items()) {
    std::vector<std::string> next;
    auto vals = enumerate(v, root);
    for (auto& c : cur) {
      if (!req.count(k)) next.push_back(c);
      for (auto& x : vals) next.push_back((c.empty() ? "" : c + ",") + J(k).dump() + ":" + x);
    }
    cur = next;
  }
  for (auto& c : cur) out.push_back("{" + c + "}");
  return out;
}

struct Reference {
  std::vector<std::string> docs;  // sorted
  bool extends(const std::string& prefix) const {
    auto it = std::lower_bound(docs.begin(), docs.end(), prefix);
    return it != docs.end() && it->compare(0, prefix.size(), prefix) == 0;
  }
  bool contains(const std::string& d) const { return std::binary_search(docs.begin(), docs.end(), d); }
  // Tokens needed at most to finish from a valid prefix: 0 if it is a document nothing extends, 1
  // (end of turn) if it is a document, else the fewest bytes to a document plus one.
  int cost(const std::string& p) const {
    bool doc = false, extended = false;
    size_t best = SIZE_MAX;
    for (auto it = std::lower_bound(docs.begin(), docs.end(), p);
         it != docs.end() && it->compare(0, p.size(), p) == 0; ++it) {
      if (it->size() == p.size())
        doc = true;
      else
        extended = true, best = std::min(best, it->size() - p.size());
    }
    return doc ? (extended ? 1 : 0) : int(best) + 1;
  }
};

bool bit(const std::vector<uint32_t>& m, int32_t id) { return (m[size_t(id) >> 5] >> (id & 31)) & 1; }

// Random walks through the documents: at every step the mask must be exactly the tokens that
// keep the text a prefix of some document, plus end-of-turn where the text is one.
void check_exact(const J& schema, int walks, uint64_t seed) {
  auto vocab = small_vocab();
  Reference ref;
  ref.docs = enumerate(schema, schema);
  std::sort(ref.docs.begin(), ref.docs.end());
  ref.docs.erase(std::unique(ref.docs.begin(), ref.docs.end()), ref.docs.end());
  ASSERT_FALSE(ref.docs.empty());
  auto rt = std::make_shared<Runtime>(json_schema_grammar(schema), vocab->trie);
  std::mt19937_64 rng(seed);
  const int n = int(vocab->bytes.size());
  std::vector<uint32_t> mask(size_t((n + 31) / 32));
  std::set<std::string> seen_docs;
  for (int w = 0; w < walks; ++w) {
    // Every other walk has a token budget: then only tokens after which the document can still
    // be finished within it are allowed (all valid ones when none can).
    const int max_tokens = w % 2 ? int(rng() % 12) + 1 : -1;
    GrammarConstraint c(rt, vocab, {{eot(*vocab)}, std::nullopt, max_tokens});
    std::string text;
    for (int step = 0; step < (max_tokens < 0 ? 200 : max_tokens); ++step) {
      c.fill_mask(mask);
      const int budget = max_tokens - step - 1;
      auto valid = [&](int32_t id) {
        return id == eot(*vocab) ? ref.contains(text) : ref.extends(text + vocab->bytes[size_t(id)]);
      };
      auto fits = [&](int32_t id) {
        return id == eot(*vocab) || max_tokens < 0 || ref.cost(text + vocab->bytes[size_t(id)]) <= budget;
      };
      bool any_fits = false;
      for (int32_t id = 0; id < eot(*vocab); ++id) any_fits = any_fits || (valid(id) && fits(id));
      const bool use_budget = any_fits || ref.contains(text);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < n; ++id) {
        bool want = valid(id) && (!use_budget || fits(id));
        ASSERT_EQ(bit(mask, id), want) << "schema " << schema.dump() << " after '" << text << "' token '"
                                       << vocab->bytes[size_t(id)] << "' budget " << budget;
        if (want) allowed.push_back(id);
      }
      ASSERT_FALSE(allowed.empty());
      ASSERT_EQ(c.can_end(), ref.contains(text));
      int32_t t = allowed[rng() % allowed.size()];
      c.accept(t);
      if (t == eot(*vocab)) break;
      text += vocab->bytes[size_t(t)];
      if (c.complete()) {
        // Nothing may follow: no document extends this one.
        ASSERT_TRUE(ref.contains(text));
        for (auto& d : ref.docs) ASSERT_FALSE(d.size() > text.size() && d.compare(0, text.size(), text) == 0);
        break;
      }
    }
    seen_docs.insert(text);
  }
  EXPECT_GT(seen_docs.size(), 1u);
}

TEST(GrammarMask, ExactAgainstEnumeratedDocuments) {
  const std::vector<J> schemas = {
      J::parse(R"({"type":"boolean"})"),
      J::parse(R"({"enum":["a","ab","abc",1,null,true,[1,2],{"x":1}]})"),
      J::parse(R"({"type":"integer","minimum":-12,"maximum":130})"),
      J::parse(R"({"type":"integer","minimum":95,"maximum":1003})"),
      J::parse(R"({"type":"array","items":{"enum":[0,1,"a"]},"minItems":1,"maxItems":3})"),
      J::parse(R"({"type":"object","properties":{"a":{"type":"boolean"},"b":{"enum":["x","y"]},
                 "c":{"type":"null"}},"required":["b"]})"),
      J::parse(R"({"type":"object","properties":{"a":{"type":"boolean"},"b":{"type":"boolean"}}})"),
      J::parse(R"({"anyOf":[{"type":"integer","minimum":0,"maximum":20},{"const":"ok"},
                 {"type":"array","items":{"type":"boolean"},"maxItems":2}]})"),
      J::parse(R"({"$defs":{"p":{"type":"object","properties":{"x":{"$ref":"#/$defs/v"}},"required":["x"]},
                 "v":{"enum":[1,2,3]}},"type":"array","items":{"$ref":"#/$defs/p"},"maxItems":2})"),
  };
  uint64_t seed = 1;
  for (auto& s : schemas) check_exact(s, 60, seed++);
}

// The masks only admit text that stays completable and every document's own tokens are
// admitted, on schemas whose languages are infinite (checked by parsing what comes out).
TEST(GrammarMask, RandomDocumentsParseAndMatch) {
  auto vocab = small_vocab();
  const J schema = J::parse(R"({"type":"object","properties":{
      "s":{"type":"string","maxLength":5},"n":{"type":"number"},"i":{"type":"integer","minimum":-5},
      "tags":{"type":"array","items":{"type":"string"}},"any":{}},"required":["s","n","i"]})");
  auto rt = std::make_shared<Runtime>(json_schema_grammar(schema), vocab->trie);
  std::mt19937_64 rng(7);
  const int n = int(vocab->bytes.size());
  std::vector<uint32_t> mask(size_t((n + 31) / 32));
  int finished = 0;
  for (int w = 0; w < 300; ++w) {
    // A budget keeps the walks short: the document must close within it.
    GrammarConstraint c(rt, vocab, {{eot(*vocab)}, std::nullopt, 120});
    std::string text;
    int steps = 0;
    for (; steps < 120; ++steps) {
      c.fill_mask(mask);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < n; ++id)
        if (bit(mask, id)) allowed.push_back(id);
      ASSERT_FALSE(allowed.empty());
      int32_t t = allowed[rng() % allowed.size()];
      c.accept(t);
      if (t == eot(*vocab)) break;
      text += vocab->bytes[size_t(t)];
      if (c.complete()) break;
    }
    ASSERT_LT(steps, 120) << "the budget did not close the document: " << text;
    J doc = J::parse(text);  // throws on invalid JSON
    ASSERT_TRUE(doc.is_object()) << text;
    ASSERT_TRUE(doc["s"].is_string() && doc["n"].is_number() && doc["i"].is_number_integer()) << text;
    std::string s = doc["s"];
    size_t chars = 0;
    for (unsigned char ch : s) chars += (ch & 0xC0) != 0x80;
    ASSERT_LE(chars, 5u) << text;
    ASSERT_GE(doc["i"].get<int64_t>(), -5) << text;
    for (auto& [k, v] : doc.items())
      ASSERT_TRUE(k == "s" || k == "n" || k == "i" || k == "tags" || k == "any");
    ++finished;
  }
  EXPECT_EQ(finished, 300);
  // Known documents: every token that spells a prefix of the rest is allowed at every point.
  for (const char* d : {R"({"s":"a\"\u00e9é","n":-0.5e10,"i":-5})",
                        R"({"s":"","n":0,"i":12,"tags":["x",""],"any":{"k":[null,true,1.5]}})"}) {
    GrammarConstraint c(rt, vocab, {{eot(*vocab)}, std::nullopt, -1});
    std::string rest = d;
    while (!rest.empty()) {
      c.fill_mask(mask);
      int32_t longest = -1;
      for (int32_t id = 0; id < n - 1; ++id) {
        const std::string& b = vocab->bytes[size_t(id)];
        if (rest.compare(0, b.size(), b) != 0) continue;
        ASSERT_TRUE(bit(mask, id)) << d << ": token '" << b << "' excluded before '" << rest << "'";
        if (longest < 0 || b.size() > vocab->bytes[size_t(longest)].size()) longest = id;
      }
      c.accept(longest);
      rest = rest.substr(vocab->bytes[size_t(longest)].size());
    }
    EXPECT_TRUE(c.can_end()) << d;
  }
}

bool accepts(Runtime& rt, const std::string& s) {
  int32_t st = rt.advance(rt.initial(), s);
  return st != Runtime::kDead && rt.accepting(st);
}

TEST(GrammarRegex, AgreesWithStdRegex) {
  auto vocab = small_vocab();
  const std::vector<std::string> patterns = {
      "^a(b|c)*d$",       "^[a-c]{2,4}$",     "^x?y+z*$",   "^(ab|a)(bc|c)?$",
      "^\\d{3}-\\d{2}$",  "^[^ab]+$",         "b",          "^a.c$",
      "^(a|b){0,3}c{1}$", "^[\\w-]+$",        "^(a?){3}b$", "^((a*)*b?)*$",
      "^(a|b?c?){2,3}$",  "^(ab?|c*){0,2}d*$"};
  const std::string alphabet = "abcdxyz-01 _";
  std::mt19937_64 rng(3);
  for (auto& p : patterns) {
    Runtime rt(regex_grammar(p), vocab->trie);
    std::regex re(p);
    for (int k = 0; k < 3000; ++k) {
      std::string s;
      size_t len = rng() % 7;
      for (size_t i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
      // JSON Schema patterns match anywhere, as std::regex_search does.
      ASSERT_EQ(accepts(rt, s), std::regex_search(s, re)) << "pattern " << p << " on '" << s << "'";
    }
  }
}

TEST(GrammarSchema, FormatsAndPatternsInsideJson) {
  auto vocab = small_vocab();
  auto check = [&](const char* schema, std::vector<std::string> good, std::vector<std::string> bad) {
    Runtime rt(json_schema_grammar(J::parse(schema)), vocab->trie);
    for (auto& g : good) EXPECT_TRUE(accepts(rt, g)) << schema << " should accept " << g;
    for (auto& b : bad) EXPECT_FALSE(accepts(rt, b)) << schema << " should refuse " << b;
  };
  check(R"({"type":"string","format":"date"})", {R"("2024-02-28")", R"("1999-12-31")"},
        {R"("2024-02-30")", R"("2024-13-01")", R"("24-01-01")"});
  check(R"({"type":"string","format":"uuid"})", {R"("123e4567-e89b-12d3-a456-426614174000")"}, {R"("123")"});
  check(R"({"type":"string","format":"date-time"})",
        {R"("2024-01-05T10:20:30Z")", R"("2024-01-05T10:20:30.5+02:00")"}, {R"("2024-01-05 10:20:30")"});
  check(R"({"type":"string","format":"email"})", {R"("a.b@example.com")"}, {R"("a@b")", R"("@x.com")"});
  check(R"({"type":"string","pattern":"^\"[a-z]+\\\\$"})", {R"("\"ab\\")"}, {R"(""ab\")"});
  check(R"({"type":"string","minLength":2,"maxLength":3})", {R"("ab")", R"("a\nb")", R"("\u00e9éx")"},
        {R"("a")", R"("abcd")", R"("\ud83d\ude00")"});
  check(R"({"type":"number","minimum":0,"maximum":1})", {"0", "0.25", "1", "1.000"},
        {"-0.5", "1.5", "1.01", "2"});
  check(R"({"type":"number","exclusiveMinimum":-2,"exclusiveMaximum":3})", {"-1.999", "0", "2.5", "-1"},
        {"-2", "3", "3.0", "-2.0", "-3"});
  check(R"({"type":"number","minimum":-1e300,"maximum":1e300})", {"0", "-2.5e3"}, {"x"});
  check(R"({"type":"integer","minimum":-1e300,"maximum":3})", {"-99", "3"}, {"4"});
  check(R"({"type":"integer","exclusiveMinimum":0,"maximum":10})", {"1", "10"}, {"0", "11", "01", "-1"});
  check(R"({"type":["string","null"]})", {"null", R"("x")"}, {"1"});
  check(R"({"type":"string","nullable":true,"maxLength":1})", {"null", R"("x")"}, {R"("xy")"});
  check(
      R"({"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":{"type":"boolean"}})",
      {R"({"a":1,"b":true})", R"({"ab":false})", "{}"},
      {R"({"a":true})", R"({"b":1})", R"({"a":1,"a":true})"});
  check(R"({"type":"array","prefixItems":[{"type":"integer"},{"type":"string"}],"items":false})",
        {"[]", "[1]", R"([1,"a"])"}, {R"([1,"a",2])", R"(["a"])"});
  check(
      R"({"$ref":"#/$defs/t","$defs":{"t":{"type":"object","properties":{"c":{"type":"array","items":{"$ref":"#/$defs/t"}}}}}})",
      {"{}", R"({"c":[]})", R"({"c":[{"c":[{}]}]})"}, {R"({"c":[1]})"});
}

TEST(GrammarSchema, UnsupportedKeywordsAreNamed) {
  auto err = [](const char* schema) {
    try {
      json_schema_grammar(J::parse(schema));
    } catch (const SchemaError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(err(R"({"type":"array","uniqueItems":true})").find("'uniqueItems'"), std::string::npos);
  EXPECT_NE(err(R"({"type":"object","properties":{"a":{"type":"integer","multipleOf":3}}})")
                .find("'multipleOf' at '/properties/a'"),
            std::string::npos);
  EXPECT_NE(err(R"({"type":"string","pattern":"(?=a)b"})").find("lookaround"), std::string::npos);
  EXPECT_NE(err(R"({"type":"string","format":"hostname"})").find("'hostname'"), std::string::npos);
  EXPECT_NE(err(R"({"type":"string","pattern":"a???"})").find("multiple repeat"), std::string::npos);
  EXPECT_NE(err(R"({"type":"string","pattern":"a{2}{3}"})").find("multiple repeat"), std::string::npos);
  EXPECT_EQ(err(R"({"type":"string","pattern":"^a*?b+?c??$"})"), "(accepted)");
  EXPECT_NE(err(R"({"$ref":"#/$defs/missing"})").find("does not resolve"), std::string::npos);
  EXPECT_NE(err(R"({"$defs":{"a":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"})").find("cannot be generated"),
            std::string::npos);
  EXPECT_NE(err(R"({"type":"object","properties":{"a":{"$ref":"#"}},"required":["a"]})")
                .find("cannot be generated"),
            std::string::npos);
  EXPECT_EQ(err(R"({"type":"object","properties":{"a":{"$ref":"#"}}})"), "(accepted)");
}

TEST(GrammarTools, CallsFollowTheParameterSchema) {
  auto vocab = small_vocab();
  J params = J::parse(
      R"({"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer","minimum":1,"maximum":7},
      "unit":{"type":"string","enum":["c","f"]}},"required":["city","days"]})");
  auto g = tool_call_grammar({{"f", params, true}, {"g", J(), true}}, ToolMode::kRequired, {true});
  Runtime rt(g, vocab->trie);
  EXPECT_TRUE(
      accepts(rt,
              "\n\n<tool_call>\n<function=f>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
              "</parameter>\n</function>\n</tool_call>"));
  EXPECT_TRUE(accepts(
      rt,
      "<tool_call>\n<function=g>\n</function>\n</tool_call>\n<tool_call>\n<function=f>\n<parameter=city>\n"
      "a b\nc\n</parameter>\n<parameter=days>\n7\n</parameter>\n<parameter=unit>\nf\n</parameter>\n"
      "</function>\n</tool_call>"));
  EXPECT_FALSE(accepts(
      rt, "<tool_call>\n<function=f>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"));
  // The output parser ends a value at "</parameter>", "<parameter=" or "</function>" anywhere:
  // raw values never hold '<' before '/' or 'p', JSON values write '<' as \u003c.
  auto call = [](const std::string& city) {
    return "<tool_call>\n<function=f>\n<parameter=city>\n" + city +
           "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
  };
  EXPECT_TRUE(accepts(rt, call("a < b\n<y")));
  EXPECT_FALSE(accepts(rt, call("x</y")));
  EXPECT_FALSE(accepts(rt, call("x<parameter=y")));
  EXPECT_FALSE(accepts(rt, call("x</function>")));
  J obj = J::parse(R"({"type":"object","properties":{"o":{"type":"object","properties":{"s":{"type":"string"},
      "e":{"enum":["<a>"]}}}}})");
  Runtime ort(tool_call_grammar({{"h", obj, true}}, ToolMode::kRequired), vocab->trie);
  auto hcall = [](const std::string& json) {
    return "<tool_call>\n<function=h>\n<parameter=o>\n" + json + "\n</parameter>\n</function>\n</tool_call>";
  };
  EXPECT_TRUE(accepts(ort, hcall(R"({"s":"\u003c/function>","e":"\u003ca>"})")));
  EXPECT_FALSE(accepts(ort, hcall(R"({"s":"</function>"})")));
  EXPECT_FALSE(accepts(ort, hcall(R"({"e":"<a>"})")));
  EXPECT_FALSE(accepts(rt, "hello"));
  Runtime autort(tool_call_grammar({{"f", params, true}}, ToolMode::kAuto), vocab->trie);
  EXPECT_TRUE(accepts(autort, "just text < tool"));
  EXPECT_TRUE(accepts(autort,
                      "I'll call it.\n\n<tool_call>\n<function=f>\n<parameter=city>\nx\n</parameter>\n"
                      "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>"));
  EXPECT_FALSE(accepts(autort, "x<tool_call>\n<function=f>\n</function>\n</tool_call>"));
}

TEST(GrammarConstraint, StartsAfterTheReasoningAndHonoursTheBudget) {
  auto vocab = small_vocab();
  auto rt = std::make_shared<Runtime>(
      json_schema_grammar(J::parse(R"({"type":"array","items":{"type":"string"}})"), {true}), vocab->trie);
  const int32_t think_end = int32_t('T');  // stands for "</think>"
  GrammarConstraint c(rt, vocab, {{eot(*vocab)}, think_end, 10});
  EXPECT_FALSE(c.active());
  c.accept('x');
  c.accept(think_end);
  ASSERT_TRUE(c.active());
  std::vector<uint32_t> mask((vocab->bytes.size() + 31) / 32);
  std::string text;
  for (int i = 2; i < 10; ++i) {
    c.fill_mask(mask);
    // Prefer the longest allowed token: that is what would overrun the budget.
    int32_t pick = -1;
    for (int32_t id = 0; id < eot(*vocab); ++id)
      if (bit(mask, id) && (pick < 0 || vocab->bytes[size_t(id)].size() >= vocab->bytes[size_t(pick)].size()))
        pick = id;
    if (pick < 0) break;
    c.accept(pick);
    text += vocab->bytes[size_t(pick)];
    if (c.complete()) break;
  }
  EXPECT_TRUE(c.complete()) << text;
  size_t p = text.find_first_not_of('\n');
  EXPECT_LE(p, 2u);
  EXPECT_TRUE(J::parse(text.substr(p)).is_array()) << text;
}

TEST(GrammarConstraint, QwenTokenizerMasks) {
  Tokenizer tok = Tokenizer::load(test::source_dir() / "tests" / "fixtures" / "qwen3-tokenizer");
  auto vocab = Vocabulary::of(tok);
  auto rt = std::make_shared<Runtime>(
      json_schema_grammar(J::parse(
          R"({"type":"object","properties":{"name":{"type":"string"},"n":{"type":"integer"}},"required":["name","n"]})")),
      vocab->trie);
  auto im_end = *tok.token_id("<|im_end|>");
  GrammarConstraint c(rt, vocab, {{im_end}, std::nullopt, -1});
  std::vector<uint32_t> mask((size_t(tok.vocab_size()) + 31) / 32);
  c.fill_mask(mask);
  auto allowed = [&](const std::string& text) {
    auto ids = tok.encode(text, false);
    return ids.size() == 1 && bit(mask, ids[0]);
  };
  EXPECT_TRUE(allowed("{\""));
  EXPECT_TRUE(allowed("{"));
  EXPECT_FALSE(allowed("["));
  EXPECT_FALSE(bit(mask, im_end));
  for (int32_t id : tok.encode("{\"name\":\"Tansy", false)) c.accept(id);
  c.fill_mask(mask);
  EXPECT_TRUE(allowed(" is"));
  EXPECT_TRUE(allowed("\","));
  EXPECT_FALSE(allowed("\"}"));
  EXPECT_FALSE(bit(mask, *tok.token_id("<|im_start|>")));
  for (int32_t id : tok.encode("\",\"n\":12}", false)) c.accept(id);
  EXPECT_TRUE(c.complete());
  EXPECT_TRUE(c.can_end());
}

}  // namespace
}  // namespace tansy::grammar

namespace tansy::grammar {
namespace {

// The plain-token shortcut (where every plain byte leads to one same state, plain tokens are
// decided by their length) gives the masks of a full walk, on the Qwen3 vocabulary: free and
// bounded strings, patterns, tool-call raw values.
TEST(GrammarMask, PlainShortcutEqualsTheFullWalk) {
  Tokenizer tok = Tokenizer::load(test::source_dir() / "tests" / "fixtures" / "qwen3-tokenizer");
  auto split = Vocabulary::of(tok);
  ASSERT_GT(split->trie->plain_ids_.size(), 50000u);
  auto whole = std::make_shared<VocabTrie>(split->bytes, false);
  ASSERT_FALSE(whole->rest_);
  const J schema =
      J::parse(R"({"type":"object","properties":{"a":{"type":"string"},"m":{"type":"string","maxLength":9},
      "b":{"type":"array","items":{"type":["string","number"]}},"c":{"type":"string","pattern":"^x.*$"},"d":{}},
      "required":["a","m","b","c","d"]})");
  const J params =
      J::parse(R"({"type":"object","properties":{"q":{"type":"string"},"n":{"type":"string","maxLength":5},
      "o":{"type":"object","properties":{"s":{"type":"string"}}}},"required":["q","n","o"]})");
  const std::vector<std::pair<std::shared_ptr<Grammar>, std::string>> cases = {
      {json_schema_grammar(schema),
       R"({"a":"hello wörld \"q\" \\ ok","m":"abc defgh","b":["x y",-1.5e3,""],"c":"xyz abc","d":{"k":[true,"s t"]}})"},
      {tool_call_grammar({{"f", params, true}}, ToolMode::kRequired),
       "<tool_call>\n<function=f>\n<parameter=q>\nsome text < here\nand "
       "more\n</parameter>\n<parameter=n>\nab c\n"
       "</parameter>\n<parameter=o>\n{\"s\":\"x \\u003c y\"}\n</parameter>\n</function>\n</tool_call>"}};
  std::vector<uint32_t> ma((size_t(tok.vocab_size()) + 31) / 32), mb(ma.size());
  int plain_states = 0;
  for (auto& [g, d] : cases) {
    auto ra = std::make_shared<Runtime>(g, split->trie), rb = std::make_shared<Runtime>(g, whole);
    int32_t sa = ra->initial(), sb = rb->initial();
    for (int32_t id : tok.encode(d, true)) {
      for (int budget : {-1, 3, 40}) {
        bool a = ra->mask(sa, ma, budget), b = rb->mask(sb, mb, budget);
        ASSERT_EQ(a, b);
        ASSERT_EQ(ma, mb) << "after a prefix of " << d << " budget " << budget;
      }
      plain_states +=
          (ma[size_t(split->trie->plain_ids_.back()) >> 5] >> (split->trie->plain_ids_.back() & 31)) & 1;
      sa = ra->advance(sa, tok.token_bytes(id));
      sb = rb->advance(sb, tok.token_bytes(id));
      ASSERT_NE(sa, Runtime::kDead) << d;
    }
  }
  EXPECT_GT(plain_states, 5);  // the longest plain token was allowed: free-text states were met
}

}  // namespace
}  // namespace tansy::grammar
