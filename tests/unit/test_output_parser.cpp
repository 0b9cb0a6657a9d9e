// Output parsing: reasoning / content / XML tool calls on complete text, agreement with the
// chat template (a rendered call parses back to the same arguments), and the streaming
// property: for every way of splitting the text into chunks, the deltas add up to the complete
// parse, and nothing that could still become a tag is emitted early.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/output_parser.h"

using tansy::text::Delta;
using tansy::text::Json;
using tansy::text::parse_output;
using tansy::text::ParsedOutput;
using tansy::text::StreamingOutputParser;

namespace {

const Json kTools = Json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "location": {"type": "string"}, "days": {"type": "integer"}, "note": {"type": ["string", "null"]},
    "options": {"type": "object"}}}}},
  {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
])");

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    auto b = static_cast<unsigned char>(s[i]);
    size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    i += len;
  }
  return true;
}

// Collects deltas the way an API client would, checking their order as it goes.
struct Collected {
  ParsedOutput out;
  bool utf8_chunks = false;  // chunks were whole characters, so every delta must be too
  void add(const std::vector<Delta>& deltas) {
    for (const Delta& d : deltas) {
      if (utf8_chunks) {
        EXPECT_TRUE(valid_utf8(d.text)) << d.text;
      }
      switch (d.kind) {
        case Delta::Kind::Reasoning:
          EXPECT_FALSE(d.text.empty());
          out.reasoning += d.text;
          break;
        case Delta::Kind::Content:
          EXPECT_FALSE(d.text.empty());
          out.content += d.text;
          break;
        case Delta::Kind::ToolCallStart:
          EXPECT_EQ(d.index, static_cast<int>(out.tool_calls.size()));
          out.tool_calls.push_back({d.id, d.name, ""});
          break;
        case Delta::Kind::ToolCallArguments:
          ASSERT_EQ(d.index + 1, static_cast<int>(out.tool_calls.size()))
              << "arguments for a call not started last";
          out.tool_calls.back().arguments += d.text;
          break;
      }
    }
  }
};

ParsedOutput stream(const std::string& text, const std::vector<size_t>& cuts, bool in_reasoning) {
  StreamingOutputParser parser(in_reasoning, kTools);
  Collected c;
  c.utf8_chunks = true;
  for (size_t cut : cuts)
    c.utf8_chunks =
        c.utf8_chunks && (cut >= text.size() || (static_cast<unsigned char>(text[cut]) >> 6) != 2);
  size_t prev = 0;
  for (size_t cut : cuts) {
    c.add(parser.push(std::string_view(text).substr(prev, cut - prev)));
    prev = cut;
  }
  c.add(parser.push(std::string_view(text).substr(prev)));
  c.add(parser.finish());
  return c.out;
}

void expect_same(const ParsedOutput& a, const ParsedOutput& b, const std::string& text) {
  EXPECT_EQ(a.reasoning, b.reasoning) << text;
  EXPECT_EQ(a.content, b.content) << text;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << text;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].id, b.tool_calls[i].id);
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name);
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << text;
  }
}

}  // namespace

TEST(OutputParser, ReasoningThenAnswer) {
  auto r = parse_output("Let me think.\nStep 2.\n\n</think>\n\nThe answer is 4.", true, nullptr);
  EXPECT_EQ(r.reasoning, "Let me think.\nStep 2.");
  EXPECT_EQ(r.content, "The answer is 4.");
  EXPECT_TRUE(r.tool_calls.empty());

  // Thinking disabled: the prompt already closed the think block.
  r = parse_output("Just the answer </think> literally", false, nullptr);
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "Just the answer </think> literally");

  // A think block the model opens itself at the very start.
  r = parse_output("<think>\nhmm\n</think>\n\nok", false, nullptr);
  EXPECT_EQ(r.reasoning, "hmm");
  EXPECT_EQ(r.content, "ok");

  // Cut off while reasoning: everything is reasoning, a dangling partial tag included.
  r = parse_output("still thinking\n</thi", true, nullptr);
  EXPECT_EQ(r.reasoning, "still thinking\n</thi");
  EXPECT_EQ(r.content, "");
}

TEST(OutputParser, ToolCallsWithSchemaTypes) {
  std::string text =
      "thinking\n</think>\n\nI'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\n"
      "Paris, \"FR\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
      "<parameter=options>\n{\"unit\": \"celsius\", \"x\": [1, "
      "2.50]}\n</parameter>\n</function>\n</tool_call>\n"
      "<tool_call>\n<function=noop>\n</function>\n</tool_call>";
  auto r = parse_output(text, true, kTools, "call_abc_");
  EXPECT_EQ(r.reasoning, "thinking");
  EXPECT_EQ(r.content, "I'll check.\n\n");
  ASSERT_EQ(r.tool_calls.size(), 2u);
  EXPECT_EQ(r.tool_calls[0].id, "call_abc_0");
  EXPECT_EQ(r.tool_calls[0].name, "get_weather");
  // "note" is typed string (or null), so "42" stays a string; "days" becomes an integer.
  EXPECT_EQ(
      r.tool_calls[0].arguments,
      R"({"location": "Paris, \"FR\"", "days": 3, "note": "42", "options": {"unit": "celsius", "x": [1, 2.5]}})");
  EXPECT_EQ(r.tool_calls[1].name, "noop");
  EXPECT_EQ(r.tool_calls[1].arguments, "{}");
  Json calls = r.tool_calls_json();
  EXPECT_EQ(calls[1]["type"], "function");
  EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
}

TEST(OutputParser, ValuesWithoutSchema) {
  std::string text =
      "<tool_call>\n<function=unknown>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\nhello "
      "world\n</parameter>\n"
      "<parameter=c>\ntrue\n</parameter>\n<parameter=d>\n\nline1\nline2\n\n</"
      "parameter>\n<parameter=e>\nnull\n</parameter>\n"
      "</function>\n</tool_call>";
  auto r = parse_output(text, false, nullptr);
  ASSERT_EQ(r.tool_calls.size(), 1u);
  // One newline is removed on each side of a value, no more.
  EXPECT_EQ(r.tool_calls[0].arguments,
            R"({"a": 12, "b": "hello world", "c": true, "d": "\nline1\nline2\n", "e": null})");
  EXPECT_EQ(r.content, "");
}

TEST(OutputParser, MalformedAndTruncatedCalls) {
  // Not a call after all: the text is content.
  auto r = parse_output("use <tool_call> tags like <tool_call>this", false, nullptr);
  EXPECT_EQ(r.content, "use <tool_call> tags like <tool_call>this");
  EXPECT_TRUE(r.tool_calls.empty());
  r = parse_output("a partial <tool_ca", false, nullptr);
  EXPECT_EQ(r.content, "a partial <tool_ca");

  // Truncated inside a value: the call survives with the finished parameters.
  r = parse_output("<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\nunfini", false,
                   nullptr);
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"x": 1})");

  // Missing </parameter> and </tool_call>; stray text in the body is skipped; content after calls kept.
  r = parse_output("<tool_call>\n<function=f>\njunk<parameter=x>\nv\n<parameter=y>\nw\n</function>\n\nDone.",
                   false, nullptr);
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"x": "v", "y": "w"})");
  EXPECT_EQ(r.content, "Done.");
}

// The template renders a call; the parser must read it back to the same arguments.
TEST(OutputParser, ReadsBackWhatTheTemplateRenders) {
  Json args = Json::parse(
      R"({"location": "Zürich\n\"quoted\"", "days": 7, "note": "true", "options": {"f": 1e-05, "g": [1.0, null]}})");
  Json messages = Json::array(
      {Json{{"role", "user"}, {"content", "q"}},
       Json{{"role", "assistant"},
            {"content", "Sure."},
            {"reasoning_content", "r"},
            {"tool_calls",
             Json::array({Json{{"function", {{"name", "get_weather"}, {"arguments", args}}}},
                          Json{{"function", {{"name", "noop"}, {"arguments", Json::object()}}}}})}}});
  tansy::text::TemplateOptions options;
  options.add_generation_prompt = false;
  std::string prompt = tansy::text::render_chat(messages, kTools, options);
  std::string head = "<|im_start|>assistant\n<think>\n";
  size_t begin = prompt.find(head) + head.size();
  std::string generated = prompt.substr(begin, prompt.rfind("<|im_end|>") - begin);
  auto r = parse_output(generated, true, kTools);
  EXPECT_EQ(r.reasoning, "r");
  EXPECT_EQ(r.content, "Sure.\n\n");
  ASSERT_EQ(r.tool_calls.size(), 2u);
  EXPECT_EQ(Json::parse(r.tool_calls[0].arguments), args);
  EXPECT_EQ(r.tool_calls[0].arguments, tansy::text::python_json_dumps(args));
  EXPECT_EQ(r.tool_calls[1].arguments, "{}");
}

TEST(OutputParser, StreamingEqualsCompleteForEverySplit) {
  const std::vector<std::string> pieces = {"<think>",
                                           "</think>",
                                           "<tool_call>",
                                           "</tool_call>",
                                           "<function=get_weather>",
                                           "<function=noop>",
                                           "<function=",
                                           "</function>",
                                           "<parameter=days>",
                                           "<parameter=location>",
                                           "<parameter=",
                                           "</parameter>",
                                           "<",
                                           "</",
                                           "<tool",
                                           "</thi",
                                           "<para",
                                           "\n",
                                           "\n\n",
                                           " ",
                                           "\t",
                                           "7",
                                           "{\"a\": [1, 2.5]}",
                                           "true",
                                           "hello",
                                           "é",
                                           "日本",
                                           "👨‍👩‍👧",
                                           "x<y",
                                           ">",
                                           "=",
                                           "\"q\""};
  std::mt19937 rng(1234);
  constexpr int kTexts = 1200;
  int texts = 0, splits = 0, calls = 0;
  for (int t = 0; t < kTexts; ++t) {
    std::string text;
    // Bias toward well-formed calls so the structured paths are exercised, not only garbage.
    if (rng() % 3 == 0) text += "reason\n";
    if (rng() % 3 == 0) text += "\n</think>\n\n";
    if (rng() % 2 == 0)
      text += "Answer\n\n<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n";
    int n = static_cast<int>(rng() % 14);
    for (int k = 0; k < n; ++k) text += pieces[rng() % pieces.size()];
    if (rng() % 2 == 0) text += "</function>\n</tool_call>";
    for (bool in_reasoning : {false, true}) {
      ParsedOutput whole = parse_output(text, in_reasoning, kTools);
      calls += static_cast<int>(whole.tool_calls.size());
      for (const auto& call : whole.tool_calls) {
        Json parsed = Json::parse(call.arguments, nullptr, false);
        EXPECT_TRUE(parsed.is_object()) << text;
      }
      // Byte by byte, then random chunkings (split points may fall inside a UTF-8 sequence).
      std::vector<size_t> every;
      for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
      expect_same(whole, stream(text, every, in_reasoning), text);
      ++splits;
      for (int s = 0; s < 6; ++s) {
        // Half of the chunkings cut only between characters, as the streaming detokenizer does.
        bool whole_chars = s % 2 == 0;
        std::vector<size_t> cuts;
        for (size_t i = 1; i < text.size(); ++i)
          if (rng() % 4 == 0 && (!whole_chars || (static_cast<unsigned char>(text[i]) >> 6) != 2))
            cuts.push_back(i);
        expect_same(whole, stream(text, cuts, in_reasoning), text);
        ++splits;
      }
      if (HasFailure()) return;
    }
    ++texts;
  }
  EXPECT_EQ(texts, kTexts);
  EXPECT_GT(calls, kTexts / 2);  // the generator really produces tool calls
  RecordProperty("splits", splits);
  RecordProperty("tool_calls", calls);
}

TEST(OutputParser, NeverEmitsAPartialTagEarly) {
  StreamingOutputParser p(false, nullptr);
  auto d = p.push("Hello <tool");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].text, "Hello ");
  d = p.push("_ca");
  EXPECT_TRUE(d.empty());
  d = p.push("ll>\n<function=f>");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].kind, Delta::Kind::ToolCallStart);
  EXPECT_EQ(d[0].name, "f");

  StreamingOutputParser r(true, nullptr);
  d = r.push("abc\n\n</th");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].text, "abc");  // the newlines wait: they vanish if "</think>" follows
  d = r.push("ink>\n\nok");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].kind, Delta::Kind::Content);
  EXPECT_EQ(d[0].text, "ok");
  r.finish();
  EXPECT_THROW(r.push("x"), tansy::Error);
}
