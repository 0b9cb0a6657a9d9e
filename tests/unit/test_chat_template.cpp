// The Qwen3.6 chat template: every fixture render byte-identical, every fixture error with the
// same message, Python-compatible value formatting, request parsing and the checkpoint check.
// tests/python/test_render_vs_jinja.py compares against jinja2 on hundreds of generated cases.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/error.h"
#include "text/chat_template.h"

namespace fs = std::filesystem;
using tansy::text::Json;
using tansy::text::TemplateOptions;

namespace {

fs::path fixture_dir() {
  const char* env = std::getenv("TANSY_SOURCE_DIR");
  return fs::path(env ? env : TANSY_SOURCE_DIR) / "tests" / "fixtures" / "qwen3.6";
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  EXPECT_TRUE(f) << "cannot read " << p;
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The fixture JSON as render_fixtures.py passed it to jinja2: absent switches stay undefined.
TemplateOptions fixture_options(const Json& j) {
  TemplateOptions o;
  o.add_generation_prompt = j.at("add_generation_prompt").get<bool>();
  if (j.contains("enable_thinking")) o.enable_thinking = j["enable_thinking"].get<bool>();
  if (j.contains("preserve_thinking")) o.preserve_thinking = j["preserve_thinking"].get<bool>();
  return o;
}

std::string render_error(const Json& messages, const Json& tools, const TemplateOptions& o = {}) {
  try {
    tansy::text::render_chat(messages, tools, o);
  } catch (const tansy::Error& e) {
    return e.what();
  }
  return "(no error)";
}

Json user(const std::string& text) { return Json{{"role", "user"}, {"content", text}}; }

}  // namespace

TEST(ChatTemplate, EmbeddedTemplateIsTheFixtureFile) {
  std::string file = read_bytes(fixture_dir() / "chat_template.jinja");
  ASSERT_EQ(file.size(), 7764u);
  EXPECT_TRUE(file == tansy::text::implemented_template());
}

TEST(ChatTemplate, FixtureRendersAreByteIdentical) {
  int renders = 0;
  for (auto& entry : fs::directory_iterator(fixture_dir() / "renders")) {
    if (entry.path().extension() != ".json") continue;
    Json j = Json::parse(read_bytes(entry.path()));
    if (j.contains("error")) continue;
    fs::path txt = entry.path();
    txt.replace_extension(".txt");
    std::string got = tansy::text::render_chat(j["messages"], j["tools"], fixture_options(j));
    EXPECT_EQ(got, read_bytes(txt)) << entry.path().filename();
    // The server path (request parsing first) must give the same prompt.
    EXPECT_EQ(tansy::text::render_request(j), got) << entry.path().filename();
    ++renders;
  }
  EXPECT_EQ(renders, 10);
}

TEST(ChatTemplate, FixtureErrorsHaveTheTemplatesMessages) {
  int errors = 0;
  for (auto& entry : fs::directory_iterator(fixture_dir() / "renders")) {
    if (entry.path().extension() != ".json") continue;
    Json j = Json::parse(read_bytes(entry.path()));
    if (!j.contains("error")) continue;
    EXPECT_EQ(render_error(j["messages"], j["tools"], fixture_options(j)), j["error"].get<std::string>())
        << entry.path().filename();
    ++errors;
  }
  EXPECT_EQ(errors, 6);
}

TEST(ChatTemplate, WireFormatArgumentsAreParsedBeforeRendering) {
  Json j = Json::parse(read_bytes(fixture_dir() / "renders" / "err_tool_arguments_json_string.json"));
  std::string got = tansy::text::render_request(j);
  Json as_dict = j;
  as_dict["messages"][1]["tool_calls"][0]["function"]["arguments"] = Json{{"location", "Paris"}};
  EXPECT_EQ(got, tansy::text::render_chat(as_dict["messages"], as_dict["tools"], fixture_options(j)));
  EXPECT_NE(got.find("<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</"
                     "function>\n</tool_call>"),
            std::string::npos);

  Json bad = j;
  bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{\"location\": ";
  EXPECT_THROW(tansy::text::render_request(bad), tansy::Error);
  bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]";
  EXPECT_THROW(tansy::text::render_request(bad), tansy::Error);
}

TEST(ChatTemplate, PythonFloatRepr) {
  using tansy::text::python_float_repr;
  EXPECT_EQ(python_float_repr(2.5), "2.5");
  EXPECT_EQ(python_float_repr(1.0), "1.0");
  EXPECT_EQ(python_float_repr(-0.0), "-0.0");
  EXPECT_EQ(python_float_repr(1e-05), "1e-05");
  EXPECT_EQ(python_float_repr(0.0001), "0.0001");
  EXPECT_EQ(python_float_repr(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(python_float_repr(1e15), "1000000000000000.0");
  EXPECT_EQ(python_float_repr(1e16), "1e+16");
  EXPECT_EQ(python_float_repr(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(python_float_repr(1.5e-7), "1.5e-07");
  EXPECT_EQ(python_float_repr(1e100), "1e+100");
  EXPECT_EQ(python_float_repr(5e-324), "5e-324");
  EXPECT_EQ(python_float_repr(1.7976931348623157e308), "1.7976931348623157e+308");
  EXPECT_EQ(python_float_repr(123.456), "123.456");
}

TEST(ChatTemplate, PythonJsonDumps) {
  Json v =
      Json::parse(R"({"z": 1, "a": [true, null, 2.0, -3], "s": "q\"b\\n\n\t\u0001\u001f\u007f/\u2028é"})");
  EXPECT_EQ(
      tansy::text::python_json_dumps(v),
      "{\"z\": 1, \"a\": [true, null, 2.0, -3], \"s\": \"q\\\"b\\\\n\\n\\t\\u0001\\u001f\x7f/\u2028é\"}");
  EXPECT_EQ(tansy::text::python_json_dumps(Json::object()), "{}");
  EXPECT_EQ(tansy::text::python_json_dumps(Json::array()), "[]");
}

TEST(ChatTemplate, PythonStripUsesStrIsspace) {
  using tansy::text::python_strip;
  EXPECT_EQ(python_strip(
                " \t\n\v\f\r\x1c\x1d\x1e\x1fx y\u0085\u00a0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000"),
            "x y");
  // Zero-width space, LRM, RLM and BOM are not whitespace to Python.
  EXPECT_EQ(python_strip("\u200bx\u200e"), "\u200bx\u200e");
  EXPECT_EQ(python_strip("\ufeff x \u200f"), "\ufeff x \u200f");
  EXPECT_EQ(python_strip(" \u3000 "), "");
}

TEST(ChatTemplate, RequestSwitches) {
  Json body = {{"messages", Json::array({user("hi")})}};
  auto req = tansy::text::parse_render_request(body);
  EXPECT_TRUE(req.options.add_generation_prompt);
  EXPECT_FALSE(req.options.enable_thinking.has_value());
  EXPECT_TRUE(req.tools.is_null());

  body["enable_thinking"] = true;
  body["chat_template_kwargs"] = {{"enable_thinking", false}, {"preserve_thinking", true}};
  req = tansy::text::parse_render_request(body);
  EXPECT_EQ(req.options.enable_thinking, false);  // chat_template_kwargs wins
  EXPECT_EQ(req.options.preserve_thinking, true);
  EXPECT_TRUE(tansy::text::render_request(body).ends_with("<think>\n\n</think>\n\n"));

  // `is false` is an identity test: 0, "false" and null leave thinking on.
  for (Json v : {Json(0), Json("false"), Json(nullptr)}) {
    body["chat_template_kwargs"]["enable_thinking"] = v;
    EXPECT_TRUE(tansy::text::render_request(body).ends_with("assistant\n<think>\n")) << v.dump();
  }

  body["add_generation_prompt"] = false;
  EXPECT_EQ(tansy::text::render_request(body), "<|im_start|>user\nhi<|im_end|>\n");
  body["add_generation_prompt"] = "no";
  EXPECT_THROW(tansy::text::parse_render_request(body), tansy::Error);
  EXPECT_THROW(tansy::text::parse_render_request(Json{{"messages", "hi"}}), tansy::Error);
  EXPECT_THROW(tansy::text::parse_render_request(Json{{"messages", Json::array()}, {"tools", "x"}}),
               tansy::Error);
  EXPECT_THROW(tansy::text::parse_render_request(Json::array()), tansy::Error);
}

TEST(ChatTemplate, PythonExceptionsOnOddValues) {
  Json none = nullptr;
  EXPECT_EQ(render_error(Json::array({Json{{"role", "user"}, {"content", 5}}}), none),
            "Unexpected content type.");
  EXPECT_EQ(render_error(Json::array({Json{{"role", "user"}, {"content", Json::array({7})}}}), none),
            "argument of type 'int' is not iterable");
  EXPECT_EQ(
      render_error(Json::array({Json{{"role", "user"}, {"content", Json::array({Json{{"x", 1}}})}}}), none),
      "Unexpected item type in content.");
  Json assistant = {{"role", "assistant"},
                    {"content", "x"},
                    {"tool_calls", Json::array({Json{{"function", {{"arguments", Json::object()}}}}})}};
  EXPECT_EQ(render_error(Json::array({user("q"), assistant}), none), "'dict object' has no attribute 'name'");
  assistant["tool_calls"][0]["function"]["name"] = 3;
  EXPECT_EQ(render_error(Json::array({user("q"), assistant}), none),
            "can only concatenate str (not \"int\") to str");
  // A content part's non-string text prints as Python's str().
  Json parts = {{"role", "user"},
                {"content", Json::array({Json{{"text", Json::array({1.0, "a'b", nullptr, true})}}})}};
  EXPECT_EQ(tansy::text::render_chat(Json::array({parts}), none, {}),
            "<|im_start|>user\n[1.0, \"a'b\", None, True]<|im_end|>\n<|im_start|>assistant\n<think>\n");
}

TEST(ChatTemplate, CheckpointTemplateLoading) {
  using tansy::text::ChatTemplate;
  fs::path dir = fs::temp_directory_path() / ("tansy_tmpl_check_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::string tmpl(tansy::text::implemented_template());
  Json body = {{"messages", Json::array({user("Hello")})}};
  const std::string hello = read_bytes(fixture_dir() / "renders" / "a_user_hello.txt");

  try {
    ChatTemplate::load(dir);
    ADD_FAILURE() << "a directory without a template loaded";
  } catch (const tansy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no chat template"), std::string::npos) << e.what();
  }

  std::ofstream(dir / "tokenizer_config.json")
      << Json{{"chat_template", tmpl}, {"eos_token", "<|im_end|>"}}.dump();
  ChatTemplate t = ChatTemplate::load(dir);
  EXPECT_TRUE(t.is_qwen36()) << t.describe();
  EXPECT_EQ(t.sha256(), "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259");
  EXPECT_NE(t.describe().find("sha256 e84f32a23fdd"), std::string::npos) << t.describe();
  EXPECT_EQ(t.render_text(tansy::text::parse_render_request(body)), hello);

  // The named-list form takes "default".
  std::ofstream(dir / "tokenizer_config.json") << Json{
      {"chat_template", Json::array({Json{{"name", "tool_use"}, {"template", "x"}},
                                     Json{{"name", "default"}, {"template", "{{ eos_token }}!"}}})},
      {"eos_token", "<|im_end|>"}}.dump();
  EXPECT_EQ(ChatTemplate::load(dir).render_text(tansy::text::parse_render_request(body)), "<|im_end|>!");

  // chat_template.jinja wins; one final newline is dropped as jinja2 does.
  std::ofstream(dir / "chat_template.jinja", std::ios::binary) << tmpl << "\n";
  t = ChatTemplate::load(dir);
  EXPECT_TRUE(t.is_qwen36()) << t.describe();

  // An edited template is rendered as written, not refused.
  std::ofstream(dir / "chat_template.jinja", std::ios::binary) << "{# edited #}\n" << tmpl;
  t = ChatTemplate::load(dir);
  EXPECT_FALSE(t.is_qwen36());
  EXPECT_NE(t.describe().find("not the known Qwen3.6 template"), std::string::npos) << t.describe();
  EXPECT_EQ(t.render_text(tansy::text::parse_render_request(body)), hello);

  // A construct outside the subset is a load-time error naming it.
  std::ofstream(dir / "chat_template.jinja", std::ios::binary) << "line one\n{% include 'x.jinja' %}";
  try {
    ChatTemplate::load(dir);
    ADD_FAILURE() << "include was accepted";
  } catch (const tansy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2: unsupported construct: the 'include' tag"),
              std::string::npos)
        << e.what();
  }
  std::ofstream(dir / "chat_template.jinja", std::ios::binary) << "{{ messages | map(attribute='x') }}";
  EXPECT_THROW(ChatTemplate::load(dir), tansy::Error);
  fs::remove_all(dir);

  // Qwen3's tokenizer_config.json carries the original Qwen3 template: loaded and rendered.
  t = ChatTemplate::load(fixture_dir() / ".." / "qwen3-tokenizer");
  EXPECT_FALSE(t.is_qwen36());
  EXPECT_EQ(t.render_text(tansy::text::parse_render_request(body)),
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, ExactJsonParsing) {
  using tansy::text::parse_json_exact;
  Json v = parse_json_exact(R"({"z": 18446744073709551615, "a": -9223372036854775808, "f": 1e5})", "t");
  EXPECT_EQ(tansy::text::python_json_dumps(v),
            R"({"z": 18446744073709551615, "a": -9223372036854775808, "f": 100000.0})");
  // Python would keep these exact; rounding them to floats would change the prompt.
  EXPECT_THROW(parse_json_exact(R"({"a": 18446744073709551616})", "t"), tansy::Error);
  EXPECT_THROW(parse_json_exact(R"([-9223372036854775809])", "t"), tansy::Error);
  EXPECT_THROW(parse_json_exact(R"({"a": )", "t"), tansy::Error);
  EXPECT_THROW(parse_json_exact(R"({} x)", "t"), tansy::Error);
}
