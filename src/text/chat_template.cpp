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
#include "text/jinja_internal.h"

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

bool python_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
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

}  // namespace

std::string python_str_repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    size_t len = jinja::utf8_decode(s, i, cp);
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

namespace {

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
    size_t len = jinja::utf8_decode(s, b, cp);
    if (len == 0 || !python_isspace(cp)) break;
    b += len;
  }
  size_t e = s.size();
  while (e > b) {
    size_t start = e - 1;
    while (start > b && (static_cast<unsigned char>(s[start]) >> 6) == 2) --start;
    char32_t cp = 0;
    size_t len = jinja::utf8_decode(s, start, cp);
    if (len != e - start || !python_isspace(cp)) break;
    e = start;
  }
  return s.substr(b, e - b);
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
  // Passed to the template as given: the template's own tests decide what a value means.
  if (auto it = obj.find("enable_thinking"); it != obj.end()) options.enable_thinking = *it;
  if (auto it = obj.find("preserve_thinking"); it != obj.end()) options.preserve_thinking = *it;
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
    for (auto& [key, value] : kw->items())
      if (key != "add_generation_prompt" && key != "enable_thinking" && key != "preserve_thinking" &&
          key != "messages" && key != "tools" && key != "documents")
        req.options.extra[key] = value;
  }
  return req;
}

std::string sha256_hex(std::string_view bytes) {
  static const uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
      0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
      0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
      0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
      0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
      0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
      0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string msg(bytes);
  const uint64_t bits = uint64_t(bytes.size()) * 8;
  msg += char(0x80);
  while (msg.size() % 64 != 56) msg += char(0);
  for (int i = 7; i >= 0; --i) msg += char((bits >> (i * 8)) & 0xFF);
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (size_t off = 0; off < msg.size(); off += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(uint8_t(msg[off + 4 * i])) << 24 | uint32_t(uint8_t(msg[off + 4 * i + 1])) << 16 |
             uint32_t(uint8_t(msg[off + 4 * i + 2])) << 8 | uint32_t(uint8_t(msg[off + 4 * i + 3]));
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }
  std::string out;
  for (uint32_t x : h) out += fmt::format("{:08x}", x);
  return out;
}

ChatTemplate ChatTemplate::from_source(std::string source, std::string origin) {
  ChatTemplate t;
  t.sha256_ = sha256_hex(source);
  // jinja2 drops one trailing newline of a template source (keep_trailing_newline=False), so a
  // file saved with a final newline renders identically.
  std::string_view body = source;
  if (body.ends_with('\n')) body.remove_suffix(1);
  t.is_qwen36_ = body == kQwen36Template;
  try {
    t.compiled_ = std::make_shared<const jinja::Template>(jinja::Template::parse(source));
  } catch (const Error& e) {
    fail("{}: {}", origin, e.what());
  }
  t.source_ = std::move(source);
  t.origin_ = std::move(origin);
  return t;
}

ChatTemplate ChatTemplate::load(const std::filesystem::path& model_dir) {
  const auto jinja_file = model_dir / "chat_template.jinja";
  const auto config = model_dir / "tokenizer_config.json";
  Json cfg;
  if (std::filesystem::is_regular_file(config)) {
    cfg = Json::parse(read_file(config), nullptr, false);
    if (cfg.is_discarded() || !cfg.is_object()) fail("{} is not a valid JSON object", config.string());
  }
  std::string text, origin;
  bool found = false;
  if (std::filesystem::is_regular_file(jinja_file)) {
    text = read_file(jinja_file);
    origin = jinja_file.string();
    found = true;
  } else if (cfg.is_object() && cfg.contains("chat_template")) {
    origin = config.string() + " (chat_template)";
    const Json* t = &cfg["chat_template"];
    if (t->is_array()) {  // the older list-of-named-templates form
      const Json* named = nullptr;
      for (const Json& e : *t)
        if (e.is_object() && e.contains("name") && e["name"] == "default" && e.contains("template"))
          named = &e["template"];
      if (!named) fail("{} has no template named \"default\"", origin);
      t = named;
    }
    if (!t->is_string()) fail("{} must be a string or a list of named templates", origin);
    text = t->get<std::string>();
    found = true;
  }
  if (!found)
    fail("no chat template in {} (neither chat_template.jinja nor tokenizer_config.json's chat_template)",
         model_dir.string());
  ChatTemplate t = from_source(std::move(text), std::move(origin));
  // transformers passes the tokenizer's special-token strings to the template.
  if (cfg.is_object())
    for (const char* key : {"bos_token", "eos_token", "pad_token", "unk_token"}) {
      auto it = cfg.find(key);
      if (it == cfg.end()) continue;
      if (it->is_string())
        t.special_tokens_[key] = *it;
      else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
        t.special_tokens_[key] = (*it)["content"];
    }
  return t;
}

const ChatTemplate& ChatTemplate::qwen36() {
  static const ChatTemplate t = from_source(std::string(kQwen36Template), "the built-in Qwen3.6 template");
  return t;
}

RenderedPrompt ChatTemplate::render(const RenderRequest& req) const {
  Json ctx = special_tokens_;
  for (auto& [key, value] : req.options.extra.items()) ctx[key] = value;
  ctx["messages"] = req.messages;
  ctx["tools"] = req.tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = req.options.add_generation_prompt;
  if (req.options.enable_thinking) ctx["enable_thinking"] = *req.options.enable_thinking;
  if (req.options.preserve_thinking) ctx["preserve_thinking"] = *req.options.preserve_thinking;
  return compiled_->render(ctx);
}

std::string ChatTemplate::describe() const {
  return fmt::format(
      "chat template from {} (sha256 {}, {} bytes): {}", origin_, sha256_.substr(0, 12), source_.size(),
      is_qwen36_ ? "the known Qwen3.6 template" : "not the known Qwen3.6 template, rendered as written");
}

std::vector<int32_t> encode_prompt(const Tokenizer& tok, const RenderedPrompt& prompt,
                                   bool parse_special_in_content) {
  if (parse_special_in_content) return tok.encode(prompt.text, true);
  return tok.encode_plain_ranges(prompt.text, prompt.data);
}

std::string render_chat(const Json& messages, const Json& tools, const TemplateOptions& options) {
  if (!messages.is_array() && !messages.is_null()) fail("messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array()) fail("tools must be null or a JSON array");
  return ChatTemplate::qwen36().render_text({messages, tools, options});
}

std::string render_request(const Json& body) {
  return ChatTemplate::qwen36().render_text(parse_render_request(body));
}

}  // namespace tansy::text
