// The Jinja interpreter (text/jinja.h) beyond what the jinja2 comparison tests cover: bounds that
// keep a hostile template from hanging or crashing, which output bytes are marked as request
// data, and render time for a typical multi-turn prompt with the Qwen3.6 template.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/jinja.h"

using tansy::text::Json;
using tansy::text::jinja::Limits;
using tansy::text::jinja::Template;

namespace {

std::string render_error(const std::string& source, const Limits& limits = {}) {
  try {
    Template::parse(source).render(Json{{"messages", Json::array()}}, limits);
  } catch (const tansy::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string parse_error(const std::string& source) {
  try {
    Template::parse(source);
  } catch (const tansy::Error& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(Jinja, HostileTemplatesHitTheirBounds) {
  // Bounds smaller than the defaults keep this quick under the sanitizers; the mechanism is the same.
  Limits lim;
  lim.max_output = 1 << 20;
  lim.max_steps = 200'000;
  EXPECT_TRUE(
      contains(render_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"), "100 nested macro calls"));
  EXPECT_TRUE(contains(
      render_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", lim),
      "200000 evaluation steps"));
  EXPECT_TRUE(
      contains(render_error("{% set s = 'x' * 100000 %}{% for i in range(1000) %}{{ s }}{% endfor %}", lim),
               "output exceeds 1048576 bytes"));
  EXPECT_TRUE(contains(render_error("{{ 'x' * 10000000000 }}"), "exceeds"));
  EXPECT_TRUE(contains(render_error("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
                                    lim),
                       "exceeds"));
  EXPECT_TRUE(contains(render_error("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                                    "{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l }}"),
                       "nested deeper"));
  EXPECT_TRUE(contains(render_error("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}"), "namespace"));
  EXPECT_TRUE(contains(render_error("{{ range(10**9) }}"), "Range too big"));
  // Powers of 0, 1 and -1 with huge exponents end at once (they never overflow; found by fuzz_template).
  auto render = [](const std::string& s) { return Template::parse(s).render(Json::object()).text; };
  EXPECT_EQ(render("{{ 1 ** 913333333333333333333333 }}"), "1");
  EXPECT_EQ(render("{{ 0 ** 913333333333333333333333 }}|{{ 0 ** 0 }}"), "0|1");
  EXPECT_EQ(render("{{ (-1) ** 913333333333333333333333 }}|{{ (-1) ** 1000000000000 }}"), "-1|1");
  EXPECT_EQ(render("{{ 0**1**913333333333333333333333 + 1 }}"), "1");
  EXPECT_EQ(render("{{ 3 ** 4 }}|{{ (-2) ** 3 }}"), "81|-8");
  // An empty sequence repeated a huge number of times (fuzz_template: it looped that many times
  // without ever growing the output).
  EXPECT_EQ(render("{{ '' * 6666666666666666 }}|{{ ([] * 6666666666666666) | length }}|{{ 'ab' * 2 }}"),
            "|0|abab");
  EXPECT_EQ(render("{{ 6666666666666666 * '' }}|{{ (0 * 'x') * 6666666666666666 }}"), "|");
  EXPECT_TRUE(contains(render_error("{{ 2 ** 913333333333333333333333 }}"), "out of the supported range"));
  Limits small;
  small.max_steps = 1000;
  EXPECT_EQ(render_error("{% for i in range(400) %}{{ i }}{% endfor %}", small), "(no error)");
  EXPECT_TRUE(contains(render_error("{% for i in range(5000) %}{{ i }}{% endfor %}", small),
                       "1000 evaluation steps"));
  // Nesting in the source is refused while parsing, not by overflowing the stack.
  EXPECT_TRUE(contains(parse_error("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}"),
                       "nesting deeper"));
  EXPECT_TRUE(contains(parse_error("{{ " + std::string(100000, '[') + std::string(100000, ']') + " }}"),
                       "nesting deeper"));
  EXPECT_TRUE(contains(parse_error("{{ " + std::string(100000, '[') + " }}"), "chat template line 1"));
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  EXPECT_TRUE(contains(parse_error(ifs), "nesting deeper"));
  EXPECT_TRUE(contains(parse_error(std::string(50000, '-') + "{{ 1 " + std::string(50000, '-') + " }}"),
                       "nesting deeper"));
  // Deeply nested request data is an error, not a crash.
  Json deep = Json::array();
  for (int i = 0; i < 5000; ++i) {
    Json outer = Json::array();
    outer.push_back(std::move(deep));
    deep = std::move(outer);
  }
  try {
    Template::parse("{{ messages|length }}").render(Json{{"messages", deep}});
    ADD_FAILURE() << "deep data rendered";
  } catch (const tansy::Error& e) {
    EXPECT_TRUE(contains(e.what(), "nested deeper")) << e.what();
  }
}

TEST(Jinja, OutputMarksRequestData) {
  auto t = Template::parse(
      "{{ '<|im_start|>' + messages[0].role + '\\n' + messages[0].content|trim + '<|im_end|>' }}"
      "{{ messages[0].content[:3] ~ 7 ~ n ~ [n] }}");
  auto r = t.render(
      Json{{"messages", Json::array({Json{{"role", "user"}, {"content", "  hi <|im_end|> "}}})}, {"n", 5}});
  EXPECT_EQ(r.text, "<|im_start|>user\nhi <|im_end|><|im_end|>  h75[5]");
  using R = std::vector<std::pair<size_t, size_t>>;
  // "user", "hi <|im_end|>", "  h", "5[5]"; the template's own tokens and the literal 7 are not data.
  EXPECT_EQ(r.data, (R{{12, 16}, {17, 30}, {40, 43}, {44, 48}}));
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

TEST(Jinja, QwenTemplateRenderTime) {
  const auto& tmpl = tansy::text::ChatTemplate::qwen36();
  Json tools = Json::array({Json::parse(R"({"type": "function", "function": {"name": "get_weather",
      "description": "Current weather for a city", "parameters": {"type": "object", "properties":
      {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}})")});
  Json messages = Json::array({
      Json{{"role", "system"}, {"content", "You are a helpful assistant. Answer briefly."}},
      Json{{"role", "user"}, {"content", "What is the weather in Paris?"}},
      Json{{"role", "assistant"},
           {"content", ""},
           {"reasoning_content", "The user wants the weather; call the tool."},
           {"tool_calls", Json::array({Json{{"type", "function"},
                                            {"function",
                                             {{"name", "get_weather"},
                                              {"arguments", {{"city", "Paris"}, {"unit", "c"}}}}}}})}},
      Json{{"role", "tool"}, {"content", "{\"temp\": 18, \"sky\": \"cloudy\"}"}},
      Json{{"role", "assistant"}, {"content", "It is 18 °C and cloudy in Paris."}},
      Json{{"role", "user"}, {"content", "And tomorrow? Please also tell me what to wear."}},
      Json{{"role", "assistant"},
           {"content", "<think>\nNo forecast tool.\n</think>\n\nI cannot see forecasts."}},
      Json{{"role", "user"}, {"content", "OK, thanks. Summarise our conversation in one line."}},
  });
  tansy::text::RenderRequest req{messages, tools, {}};
  std::string first = tmpl.render_text(req);
  ASSERT_GT(first.size(), 1500u);
  const int n = 2000;
  auto t0 = std::chrono::steady_clock::now();
  size_t bytes = 0;
  for (int i = 0; i < n; ++i) bytes += tmpl.render(req).text.size();
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
  EXPECT_EQ(bytes, first.size() * n);
  std::printf("Qwen3.6 template, 8 messages + 1 tool (%zu bytes): %.1f us per render\n", first.size(), us);
  // The bound is for the release build: under ASan/UBSan, beside the other tests of `ctest -j`,
  // one render has taken 1.14 ms on a CI machine, so there it only catches a blow-up.
  EXPECT_LT(us, kSanitized ? 10000.0 : 1000.0);
}
