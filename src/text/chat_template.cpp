// Hand translation of the Qwen3.6 chat template. Each block below names the template lines it
// implements; where jinja2 would raise a Python exception on odd input (an `in` test on a number,
// `+` with a non-string name, `|items` on a non-mapping) the same message is raised here, so the
// Python comparison test can hold errors to the same standard as output.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/chat_template.h"

#include <pcre2.h>

#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace tansy::text {
namespace {

// Byte-for-byte copy of tests/fixtures/qwen3.6/chat_template.jinja (sha256 e84f32a2...4259);
// a unit test compares it with the fixture file.
constexpr std::string_view kQwen36Template = R"QWEN({%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or (loop.index0 > ns.last_query_index) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | string if args_value is string else args_value | tojson | safe %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %})QWEN";

}  // namespace

std::string_view implemented_template() { return kQwen36Template; }

// ---------------------------------------------------------------------------------------------
// Python value semantics
// ---------------------------------------------------------------------------------------------
namespace {

// Decodes one code point starting at s[i]; returns 0 bytes consumed on malformed input so that
// callers stop rather than misread (parsed JSON is valid UTF-8, hand-built JSON may not be).
size_t decode_utf8(std::string_view s, size_t i, char32_t& cp) {
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

bool python_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

const char* python_type_name(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "NoneType";
    case Json::value_t::boolean:
      return "bool";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "int";
    case Json::value_t::number_float:
      return "float";
    case Json::value_t::string:
      return "str";
    case Json::value_t::array:
      return "list";
    case Json::value_t::object:
      return "dict";
    default:
      return "bytes";
  }
}

// Python's str.isprintable() per code point: false for categories C* and Z* except U+0020.
// PCRE2 carries the Unicode tables so they are not duplicated here.
bool python_isprintable(std::string_view utf8_char) {
  static pcre2_code* re = [] {
    int err = 0;
    PCRE2_SIZE off = 0;
    auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(R"(^[\p{C}\p{Z}]$)"), PCRE2_ZERO_TERMINATED,
                               PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    if (!code) fail("internal: cannot compile the printable-character pattern");
    return code;
  }();
  if (utf8_char == " ") return true;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  int rc =
      pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(utf8_char.data()), utf8_char.size(), 0, 0, md, nullptr);
  pcre2_match_data_free(md);
  return rc < 0;
}

// Python's repr() of a str.
std::string python_str_repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    size_t len = decode_utf8(s, i, cp);
    if (len == 0) fail("string is not valid UTF-8");
    std::string_view ch = s.substr(i, len);
    i += len;
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x20 || cp == 0x7F) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(cp));
    } else if (cp < 0x80 || python_isprintable(ch)) {
      out += ch;
    } else if (cp < 0x100) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(cp));
    } else if (cp < 0x10000) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(cp));
    } else {
      out += fmt::format("\\U{:08x}", static_cast<unsigned>(cp));
    }
  }
  out += quote;
  return out;
}

std::string python_repr(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "None";
    case Json::value_t::boolean:
      return v.get<bool>() ? "True" : "False";
    case Json::value_t::number_integer:
      return std::to_string(v.get<int64_t>());
    case Json::value_t::number_unsigned:
      return std::to_string(v.get<uint64_t>());
    case Json::value_t::number_float:
      return python_float_repr(v.get<double>());
    case Json::value_t::string:
      return python_str_repr(v.get_ref<const std::string&>());
    case Json::value_t::array: {
      std::string out = "[";
      for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + python_repr(v[i]);
      return out + "]";
    }
    case Json::value_t::object: {
      std::string out = "{";
      bool first = true;
      for (auto& [k, x] : v.items()) {
        out += (first ? "" : ", ") + python_str_repr(k) + ": " + python_repr(x);
        first = false;
      }
      return out + "}";
    }
    default:
      fail("binary JSON values are not supported");
  }
}

// What `{{ value }}` prints: str(value), and nothing for an undefined value (nullptr).
std::string python_str(const Json* v) {
  if (!v) return "";
  if (v->is_string()) return v->get<std::string>();
  return python_repr(*v);
}

void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    switch (c) {
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
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        else
          out += c;
    }
  }
  out += '"';
}

void append_json(std::string& out, const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      out += "null";
      return;
    case Json::value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      return;
    case Json::value_t::number_integer:
      out += std::to_string(v.get<int64_t>());
      return;
    case Json::value_t::number_unsigned:
      out += std::to_string(v.get<uint64_t>());
      return;
    case Json::value_t::number_float: {
      double d = v.get<double>();
      // json.dumps writes non-finite floats as JavaScript literals, not repr's "inf".
      if (std::isnan(d))
        out += "NaN";
      else if (std::isinf(d))
        out += d > 0 ? "Infinity" : "-Infinity";
      else
        out += python_float_repr(d);
      return;
    }
    case Json::value_t::string:
      append_json_string(out, v.get_ref<const std::string&>());
      return;
    case Json::value_t::array: {
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ", ";
        append_json(out, v[i]);
      }
      out += ']';
      return;
    }
    case Json::value_t::object: {
      out += '{';
      bool first = true;
      for (auto& [k, x] : v.items()) {
        if (!first) out += ", ";
        first = false;
        append_json_string(out, k);
        out += ": ";
        append_json(out, x);
      }
      out += '}';
      return;
    }
    default:
      fail("binary JSON values are not supported");
  }
}

}  // namespace

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // Shortest round-trip digits, as Python's repr (David Gay's mode 0) chooses them.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  std::string out;
  if (sci[0] == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e))
    if (c != '.') digits += c;
  int exp10 = std::stoi(std::string(sci.substr(e + 1)));
  int decpt = exp10 + 1;  // value = 0.DIGITS * 10^decpt
  int nd = static_cast<int>(digits.size());
  // Python's float_repr_style 'short': fixed notation for 1e-4 <= |x| < 1e16.
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (nd > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp10 < 0 ? '-' : '+', std::abs(exp10));
  } else if (decpt <= 0) {
    out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  } else if (decpt >= nd) {
    out += digits + std::string(static_cast<size_t>(decpt - nd), '0') + ".0";
  } else {
    out += digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
  }
  return out;
}

std::string python_json_dumps(const Json& value) {
  std::string out;
  append_json(out, value);
  return out;
}

std::string_view python_strip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    char32_t cp = 0;
    size_t len = decode_utf8(s, b, cp);
    if (len == 0 || !python_isspace(cp)) break;
    b += len;
  }
  size_t e = s.size();
  while (e > b) {
    size_t start = e - 1;
    while (start > b && (static_cast<unsigned char>(s[start]) >> 6) == 2) --start;
    char32_t cp = 0;
    size_t len = decode_utf8(s, start, cp);
    if (len != e - start || !python_isspace(cp)) break;
    e = start;
  }
  return s.substr(b, e - b);
}

// ---------------------------------------------------------------------------------------------
// The template
// ---------------------------------------------------------------------------------------------
namespace {

constexpr std::string_view kToolsPreamble =
    "# Tools\n\nYou have access to the following functions:\n\n<tools>";
constexpr std::string_view kToolsInstructions =
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> "
    "block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be "
    "specified\n- You may provide optional reasoning for your function call in natural language "
    "BEFORE the function call, but NOT after\n- If there is no function call available, answer the "
    "question like normal with your current knowledge and do not tell the user about function "
    "calls\n</IMPORTANT>";

// Jinja's `obj.name`: an item of a dict, otherwise undefined (nullptr). None of the attribute
// names the template uses exist as Python attributes of dict, str or list.
const Json* attr(const Json* obj, const char* name) {
  if (!obj || !obj->is_object()) return nullptr;
  auto it = obj->find(name);
  return it == obj->end() ? nullptr : &*it;
}

bool is_str(const Json* v, std::string_view s) {
  return v && v->is_string() && v->get_ref<const std::string&>() == s;
}

bool role_is(const Json& message, std::string_view role) { return is_str(attr(&message, "role"), role); }

// Python's `key in item` for the content-part tests.
bool contains(const Json& item, const std::string& key) {
  if (item.is_object()) return item.contains(key);
  if (item.is_string()) return item.get_ref<const std::string&>().find(key) != std::string::npos;
  if (item.is_array()) {
    for (auto& x : item)
      if (x.is_string() && x.get_ref<const std::string&>() == key) return true;
    return false;
  }
  fail("argument of type '{}' is not iterable", python_type_name(item));
}

// Lines 3-41, macro render_content. Image/video counting only matters with add_vision_id, which
// the template never receives.
std::string render_content(const Json* content, bool is_system_content) {
  if (!content || content->is_null()) return "";  // undefined iterates as empty; none -> ''
  if (content->is_string()) return content->get<std::string>();
  if (!content->is_array()) fail("Unexpected content type.");
  std::string out;
  for (const Json& item : *content) {
    const Json* type = attr(&item, "type");
    if (contains(item, "image") || contains(item, "image_url") || is_str(type, "image")) {
      if (is_system_content) fail("System message cannot contain images.");
      out += "<|vision_start|><|image_pad|><|vision_end|>";
    } else if (contains(item, "video") || is_str(type, "video")) {
      if (is_system_content) fail("System message cannot contain videos.");
      out += "<|vision_start|><|video_pad|><|vision_end|>";
    } else if (contains(item, "text")) {
      out += python_str(attr(&item, "text"));
    } else {
      fail("Unexpected item type in content.");
    }
  }
  return out;
}

std::string trimmed_content(const Json& message, bool is_system_content) {
  return std::string(python_strip(render_content(attr(&message, "content"), is_system_content)));
}

// Jinja's `'literal' + obj.name`: str + str, or the exception Python/Jinja raise otherwise.
const std::string& concat_operand(const Json& obj, const char* name) {
  const Json* v = attr(&obj, name);
  if (!v) {
    std::string type = obj.is_null() ? "None" : std::string(python_type_name(obj)) + " object";
    fail("'{}' has no attribute '{}'", type, name);
  }
  if (!v->is_string()) fail("can only concatenate str (not \"{}\") to str", python_type_name(*v));
  return v->get_ref<const std::string&>();
}

std::string_view lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}

std::string_view rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// Lines 105-129.
void render_tool_calls(std::string& out, const Json& tool_calls, const std::string& content) {
  // A non-empty string passes the template's `is iterable and is not mapping` test; its first
  // character has no `name`.
  if (tool_calls.is_string()) fail("'str object' has no attribute 'name'");
  bool first = true;
  for (const Json& element : tool_calls) {
    const Json* call = &element;
    if (const Json* fn = attr(call, "function")) call = fn;
    const std::string& name = concat_operand(*call, "name");
    if (!first)
      out += "\n<tool_call>\n<function=";
    else if (!python_strip(content).empty())
      out += "\n\n<tool_call>\n<function=";
    else
      out += "<tool_call>\n<function=";
    first = false;
    out += name;
    out += ">\n";
    if (const Json* args = attr(call, "arguments")) {
      if (!args->is_object()) fail("Can only get item pairs from a mapping.");
      for (auto& [arg_name, arg_value] : args->items()) {
        out += "<parameter=" + arg_name + ">\n";
        if (arg_value.is_string())
          out += arg_value.get_ref<const std::string&>();
        else
          append_json(out, arg_value);
        out += "\n</parameter>\n";
      }
    }
    out += "</function>\n</tool_call>";
  }
}

// Lines 89-130.
void render_assistant(std::string& out, const Json& message, std::string content, bool with_thinking) {
  std::string reasoning;
  if (const Json* rc = attr(&message, "reasoning_content"); rc && rc->is_string()) {
    reasoning = rc->get<std::string>();
  } else if (content.find("</think>") != std::string::npos) {
    std::string_view before = rstrip_newlines(std::string_view(content).substr(0, content.find("</think>")));
    size_t open = before.rfind("<think>");
    if (open != std::string_view::npos) before.remove_prefix(open + 7);
    reasoning = std::string(lstrip_newlines(before));
    content = std::string(lstrip_newlines(std::string_view(content).substr(content.rfind("</think>") + 8)));
  }
  reasoning = std::string(python_strip(reasoning));
  out += "<|im_start|>assistant\n";
  if (with_thinking) out += "<think>\n" + reasoning + "\n</think>\n\n";
  out += content;
  const Json* calls = attr(&message, "tool_calls");
  bool truthy_sequence = calls && ((calls->is_array() && !calls->empty()) ||
                                   (calls->is_string() && !calls->get_ref<const std::string&>().empty()));
  if (truthy_sequence) render_tool_calls(out, *calls, content);
  out += "<|im_end|>\n";
}

}  // namespace

std::string render_chat(const Json& messages, const Json& tools, const TemplateOptions& options) {
  // Lines 42-44.
  if (messages.is_null() || (messages.is_array() && messages.empty())) fail("No messages provided.");
  if (!messages.is_array()) fail("messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array()) fail("tools must be null or a JSON array");
  const size_t n = messages.size();
  std::string out;

  // Lines 45-66: the system turn, with the tools block when tools are given.
  const bool first_is_system = role_is(messages[0], "system");
  if (tools.is_array() && !tools.empty()) {
    out += "<|im_start|>system\n";
    out += kToolsPreamble;
    for (const Json& tool : tools) {
      out += '\n';
      append_json(out, tool);
    }
    out += "\n</tools>";
    out += kToolsInstructions;
    if (first_is_system) {
      std::string content = trimmed_content(messages[0], true);
      if (!content.empty()) out += "\n\n" + content;
    }
    out += "<|im_end|>\n";
  } else if (first_is_system) {
    out += "<|im_start|>system\n" + trimmed_content(messages[0], true) + "<|im_end|>\n";
  }

  // Lines 67-80: the last user message that is not just a wrapped tool response.
  bool multi_step_tool = true;
  size_t last_query_index = n - 1;
  for (size_t k = n; k-- > 0 && multi_step_tool;) {
    if (!role_is(messages[k], "user")) continue;
    std::string content = trimmed_content(messages[k], false);
    bool tool_response = content.starts_with("<tool_response>") && content.ends_with("</tool_response>");
    if (!tool_response) {
      multi_step_tool = false;
      last_query_index = k;
    }
  }
  if (multi_step_tool) fail("No user query found in messages.");

  // Lines 81-146.
  const bool preserve_thinking = options.preserve_thinking == true;
  for (size_t i = 0; i < n; ++i) {
    const Json& message = messages[i];
    std::string content = trimmed_content(message, false);
    if (role_is(message, "system")) {
      if (i != 0) fail("System message must be at the beginning.");
    } else if (role_is(message, "user")) {
      out += "<|im_start|>user\n" + content + "<|im_end|>\n";
    } else if (role_is(message, "assistant")) {
      render_assistant(out, message, std::move(content), preserve_thinking || i > last_query_index);
    } else if (role_is(message, "tool")) {
      // Every earlier message passed the role checks, so loop.previtem is a non-empty dict.
      if (i > 0 && !role_is(messages[i - 1], "tool")) out += "<|im_start|>user";
      out += "\n<tool_response>\n" + content + "\n</tool_response>";
      if (i + 1 == n || !role_is(messages[i + 1], "tool")) out += "<|im_end|>\n";
    } else {
      fail("Unexpected message role.");
    }
  }

  // Lines 147-154.
  if (options.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    out += options.enable_thinking == false ? "<think>\n\n</think>\n\n" : "<think>\n";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Requests and checkpoints
// ---------------------------------------------------------------------------------------------
namespace {

void read_switches(const Json& obj, TemplateOptions& options) {
  if (auto it = obj.find("add_generation_prompt"); it != obj.end() && !it->is_null()) {
    if (!it->is_boolean()) fail("add_generation_prompt must be a boolean");
    options.add_generation_prompt = it->get<bool>();
  }
  // Passed to the template as given: only a real boolean can pass `is false` / `is true`, so
  // any other value is equivalent to not passing the variable.
  auto tri_state = [&](const char* key, std::optional<bool>& slot) {
    auto it = obj.find(key);
    if (it == obj.end()) return;
    slot = it->is_boolean() ? std::optional<bool>(it->get<bool>()) : std::nullopt;
  };
  tri_state("enable_thinking", options.enable_thinking);
  tri_state("preserve_thinking", options.preserve_thinking);
}

// OpenAI sends tool-call arguments as a JSON string; the template iterates them as a mapping.
void parse_string_arguments(Json& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    Json* calls =
        messages[i].is_object() && messages[i].contains("tool_calls") ? &messages[i]["tool_calls"] : nullptr;
    if (!calls || !calls->is_array()) continue;
    for (size_t j = 0; j < calls->size(); ++j) {
      Json& call = (*calls)[j];
      if (!call.is_object()) continue;
      Json& target = call.contains("function") ? call["function"] : call;
      if (!target.is_object() || !target.contains("arguments") || !target["arguments"].is_string()) continue;
      const std::string text = target["arguments"].get<std::string>();
      Json parsed =
          python_strip(text).empty()
              ? Json::object()
              : parse_json_exact(text, fmt::format("messages[{}].tool_calls[{}]: function.arguments", i, j));
      if (!parsed.is_object())
        fail("messages[{}].tool_calls[{}]: function.arguments must encode a JSON object, got {}", i, j,
             parsed.type_name());
      target["arguments"] = std::move(parsed);
    }
  }
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) fail("cannot read {}", p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

Json parse_json_exact(std::string_view text, std::string_view what) {
  // The DOM builder nlohmann itself uses, intercepting the one lossy conversion.
  struct Sax : nlohmann::detail::json_sax_dom_parser<Json> {
    using json_sax_dom_parser::json_sax_dom_parser;
    std::string too_big;
    bool number_float(double v, const std::string& literal) {
      if (literal.find_first_of(".eE") == std::string::npos) {
        too_big = literal;
        return false;
      }
      return json_sax_dom_parser::number_float(v, literal);
    }
  };
  Json result;
  Sax sax(result, false);
  bool ok = Json::sax_parse(text, &sax);
  if (!sax.too_big.empty()) fail("{}: integer {} does not fit in 64 bits", what, sax.too_big);
  if (!ok) fail("{} is not valid JSON", what);
  return result;
}

RenderRequest parse_render_request(const Json& body) {
  if (!body.is_object()) fail("request body must be a JSON object");
  RenderRequest req;
  auto messages = body.find("messages");
  if (messages == body.end()) fail("request has no 'messages'");
  if (!messages->is_array()) fail("'messages' must be an array");
  req.messages = *messages;
  parse_string_arguments(req.messages);
  if (auto tools = body.find("tools"); tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) fail("'tools' must be an array or null");
    req.tools = *tools;
  }
  read_switches(body, req.options);
  if (auto kw = body.find("chat_template_kwargs"); kw != body.end() && !kw->is_null()) {
    if (!kw->is_object()) fail("'chat_template_kwargs' must be an object");
    read_switches(*kw, req.options);
  }
  return req;
}

std::string render_request(const Json& body) {
  RenderRequest req = parse_render_request(body);
  return render_chat(req.messages, req.tools, req.options);
}

TemplateCheck check_checkpoint_template(const std::filesystem::path& model_dir) {
  TemplateCheck check;
  std::string text, source;
  const auto jinja = model_dir / "chat_template.jinja";
  const auto config = model_dir / "tokenizer_config.json";
  if (std::filesystem::is_regular_file(jinja)) {
    text = read_file(jinja);
    source = jinja.string();
    check.found = true;
  } else if (std::filesystem::is_regular_file(config)) {
    Json cfg = Json::parse(read_file(config), nullptr, false);
    if (cfg.is_discarded()) fail("{} is not valid JSON", config.string());
    source = config.string() + " (chat_template)";
    const Json* t = cfg.is_object() && cfg.contains("chat_template") ? &cfg["chat_template"] : nullptr;
    if (t && t->is_array()) {  // the older list-of-named-templates form
      const Json* named = nullptr;
      for (const Json& e : *t)
        if (e.is_object() && is_str(attr(&e, "name"), "default")) named = attr(&e, "template");
      t = named;
    }
    if (t && t->is_string()) {
      text = t->get<std::string>();
      check.found = true;
    }
  }
  if (!check.found) {
    check.description = fmt::format(
        "no chat template in {} (neither chat_template.jinja nor tokenizer_config.json's chat_template)",
        model_dir.string());
    return check;
  }
  // jinja2 drops one trailing newline of a template source (keep_trailing_newline=False), so a
  // file saved with a final newline renders identically.
  std::string_view body = text;
  if (body.ends_with('\n')) body.remove_suffix(1);
  check.identical = body == kQwen36Template;
  if (check.identical) {
    check.description = fmt::format("chat template from {} is the Qwen3.6 template", source);
  } else {
    size_t k = 0;
    while (k < body.size() && k < kQwen36Template.size() && body[k] == kQwen36Template[k]) ++k;
    check.description = fmt::format(
        "chat template from {} differs from the Qwen3.6 template implemented here ({} bytes vs {}, first "
        "difference at byte {}); only the Qwen3.6 template is supported",
        source, text.size(), kQwen36Template.size(), k);
  }
  return check;
}

}  // namespace tansy::text
