"""`tansy render` against Python jinja2 rendering chat templates in the environment transformers
uses (see tests/fixtures/README.md): the Qwen3.6 fixtures plus generated conversations over the
Qwen3.6 template, the Qwen3 template of the tokenizer fixture and edited variants of Qwen3.6 (as
fine-tunes ship them), byte for byte, errors included; then small templates exercising each
construct of the supported Jinja subset (docs/API.md).

The reference does what the server does before rendering: it reads the switches from the top
level or `chat_template_kwargs` (which wins) and parses OpenAI wire-format `arguments` strings into
objects. Switch values are handed to jinja2 unchanged, so Jinja's own `is false` / `is true`
semantics decide for non-boolean values.
"""
import json
from datetime import datetime
import os
import random
import subprocess
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "qwen3.6"
TANSY = Path(os.environ.get("TANSY_BIN", REPO / "build" / "tansy"))
GENERATED = 1500


class ServerSideError(Exception):
    """A request the server rejects before the template runs (not a template error)."""


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_template(source):
    return make_env().from_string(source)


with open(FIXTURES / "chat_template.jinja", encoding="utf-8", newline="") as f:
    QWEN36 = f.read()
TEMPLATE = compile_template(QWEN36)


def parse_arguments(messages):
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("tool_calls"), list):
            continue
        for call in message["tool_calls"]:
            if not isinstance(call, dict):
                continue
            target = call["function"] if "function" in call else call
            if isinstance(target, dict) and isinstance(target.get("arguments"), str):
                text = target["arguments"]
                if text.strip() == "":
                    target["arguments"] = {}
                    continue
                try:
                    parsed = json.loads(text)
                except ValueError:
                    raise ServerSideError("arguments not JSON")
                check_integers(parsed)
                if not isinstance(parsed, dict):
                    raise ServerSideError("arguments not an object")
                target["arguments"] = parsed


def check_integers(value):
    """tansy refuses integers beyond 64 bits rather than rounding them (Python keeps them exact)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        raise ServerSideError("integer out of range")
    if isinstance(value, dict):
        for v in value.values():
            check_integers(v)
    if isinstance(value, list):
        for v in value:
            check_integers(v)


def reference(body, template=None, extra=None):
    """('ok', prompt) | ('error', message) | ('server', None)."""
    template = template or TEMPLATE
    try:
        check_integers(body)
        body = json.loads(json.dumps(body))  # a private copy
        messages = body["messages"]
        parse_arguments(messages)
        kwargs = {"add_generation_prompt": True}
        for source in (body, body.get("chat_template_kwargs") or {}):
            agp = source.get("add_generation_prompt")
            if agp is not None:
                if not isinstance(agp, bool):
                    raise ServerSideError("add_generation_prompt")
                kwargs["add_generation_prompt"] = agp
            for key in ("enable_thinking", "preserve_thinking"):
                if key in source:
                    kwargs[key] = source[key]
        for key, value in (body.get("chat_template_kwargs") or {}).items():
            if key not in ("add_generation_prompt", "enable_thinking", "preserve_thinking", "messages", "tools",
                           "documents"):
                kwargs[key] = value
    except ServerSideError:
        return ("server", None)
    try:
        return ("ok", template.render(messages=messages, tools=body.get("tools"), documents=None, **(extra or {}),
                                      **kwargs))
    except Exception as e:  # jinja2 errors, and Python's TypeError as transformers would see them
        return ("error", str(e))


def tansy_jsonl(bodies, model=FIXTURES, *flags):
    lines = "".join(json.dumps(b, ensure_ascii=False) + "\n" for b in bodies)
    proc = subprocess.run([str(TANSY), "render", "--model", str(model), "--jsonl", *flags], input=lines.encode(),
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode().split("\n")
    assert out[-1] == ""
    return [json.loads(line) for line in out[:-1]]


def compare(bodies, names, model=FIXTURES, template=None, extra=None):
    results = tansy_jsonl(bodies, model)
    assert len(results) == len(bodies)
    mismatches = []
    counts = {"ok": 0, "error": 0, "server": 0}
    for body, name, got in zip(bodies, names, results):
        kind, want = reference(body, template, extra)
        counts[kind] += 1
        if kind == "ok":
            good = got.get("prompt") == want
        elif kind == "error":
            good = got.get("error") == want
        else:
            good = "error" in got
        if not good:
            mismatches.append((name, kind, want, got))
    return counts, mismatches


# ---------------------------------------------------------------------------------------------
# Generated conversations
# ---------------------------------------------------------------------------------------------
PY_SPACE = ["\t", "\n", "\x0b", "\x0c", "\r", "\x1c", "\x1d", "\x1e", "\x1f", " ", "\x85", "\xa0", "\u1680"] + \
    [chr(c) for c in range(0x2000, 0x200B)] + ["\u2028", "\u2029", "\u202f", "\u205f", "\u3000"]
NOT_SPACE = ["\u200b", "\u200e", "\u200f", "\ufeff", "\u200d"]
WORDS = ["Hello", "world", "x", "a b", "What's the weather?", "é", "e\u0301", "日本語", "かな", "🙂🏽",
         "👨‍👩‍👧‍👦", "مرحبا", "\u200fשלום\u200e", "tab\tinside", "line1\n\nline3", "\"quoted\"", "back\\slash",
         "\x01ctl", "\x7f", "/", "<think>", "</think>", "<tool_response>", "</tool_response>", "<tool_call>",
         "{\"k\": 1}", "\n", "\n\n", "  ", "Ünïcödé", "\U0001F600", "{{ not jinja }}", "{% raw %}"]
FLOATS = [2.5, 1e-05, 1.0, 0.1, 1e16, 1e15, -0.0, 0.0, 3.141592653589793, 1e-07, 123456.789, 1.5e300, 0.30000000000000004,
          -2.75, 1e22, 5e-324, 0.0001, 1234567890123456.7]


def rand_text(rng, max_parts=6):
    parts = [rng.choice(WORDS) for _ in range(rng.randint(0, max_parts))]
    if rng.random() < 0.4:
        parts.insert(0, "".join(rng.choice(PY_SPACE + NOT_SPACE) for _ in range(rng.randint(1, 3))))
    if rng.random() < 0.4:
        parts.append("".join(rng.choice(PY_SPACE + NOT_SPACE) for _ in range(rng.randint(1, 3))))
    return "".join(parts)


def rand_value(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.55:
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice([0, 1, -7, 42, 2**53 + 1, -(2**63), 2**63 - 1, 2**64 - 1] + [2**64, -(2**63) - 1] * (rng.random() < 0.05))
        if kind == 1:
            return rng.choice(FLOATS + [rng.uniform(-1e3, 1e3), rng.random() * 10 ** rng.randint(-12, 25)])
        if kind == 2:
            return rng.choice([True, False, None])
        return rand_text(rng, 3)
    if r < 0.75:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rand_text(rng, 1) or "k": rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


TEXT_SHARE = [0.65]  # how often content is a plain string (templates that only take strings raise the rest)


def rand_content(rng, allow_images):
    r = rng.random()
    if r < TEXT_SHARE[0]:
        return rand_text(rng)
    if r < 0.75:
        return None
    parts = []
    for _ in range(rng.randint(0, 3)):
        q = rng.random()
        if q < 0.75:
            parts.append({"type": "text", "text": rand_text(rng, 3)})
        elif q < 0.85 and allow_images:
            parts.append({"type": "image", "image": "file:///x.png"})
        elif q < 0.9:
            parts.append({"text": rand_value(rng)})  # non-string text prints as Python str()
        else:
            parts.append("some text part")  # a bare string: `'text' in item` is a substring test
    return parts


def rand_tool(rng, i):
    props = {}
    for j in range(rng.randint(0, 4)):
        props[f"p{j}_{rng.choice(['loc', 'n', 'flag', 'obj'])}"] = {
            "type": rng.choice(["string", "integer", "number", "boolean", "object", "array"]),
            "description": rand_text(rng, 2)}
    fn = {"name": f"tool_{i}", "description": rand_text(rng, 3),
          "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}
    if rng.random() < 0.2:
        fn["parameters"]["additionalProperties"] = False
        fn["strict"] = rng.choice([True, 1.5, None])
    return {"type": "function", "function": fn}


def rand_tool_call(rng, i):
    args = {f"arg{k}": rand_value(rng) for k in range(rng.randint(0, 4))}
    r = rng.random()
    if r < 0.45:
        arguments = args
    elif r < 0.9:
        arguments = json.dumps(args, ensure_ascii=rng.random() < 0.5)
    else:
        arguments = rng.choice(["", "  "])
    fn = {"name": f"tool_{i}", "arguments": arguments}
    if rng.random() < 0.1:
        del fn["arguments"]
    if rng.random() < 0.15:
        return fn  # the bare form without the "function" wrapper
    return {"id": f"call_{i}", "type": "function", "function": fn}


def rand_assistant(rng):
    m = {"role": "assistant"}
    r = rng.random()
    if r < 0.3:
        m["content"] = rand_text(rng) + "\n</think>\n" + rand_text(rng)
        if rng.random() < 0.7:
            m["content"] = "<think>" + rng.choice(["\n", "", "\n\n"]) + m["content"]
    elif r < 0.85:
        m["content"] = rand_content(rng, allow_images=True)
    if rng.random() < 0.4:
        m["reasoning_content"] = rng.choice([rand_text(rng), rand_text(rng), None, 3])
    if rng.random() < 0.35:
        m["tool_calls"] = [rand_tool_call(rng, i) for i in range(rng.randint(0, 3))]
    return m


def rand_messages(rng):
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rand_content(rng, allow_images=False)})
    if rng.random() < 0.9:
        messages.append({"role": "user", "content": rand_content(rng, allow_images=True)})
    for _ in range(rng.randint(1, 7)):
        r = rng.random()
        if r < 0.35:
            content = rand_content(rng, allow_images=True)
            if rng.random() < 0.15:
                content = rng.choice(["", " "]) + "<tool_response>\n" + rand_text(rng, 2) + "\n</tool_response>"
            messages.append({"role": "user", "content": content})
        elif r < 0.7:
            messages.append(rand_assistant(rng))
        else:
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "tool", "tool_call_id": "call_0", "content": rand_content(rng, False)})
    return messages


# Deliberate failures, each checked against jinja2's message.
def corrupt(rng, messages):
    kind = rng.randrange(9)
    target = rng.randrange(len(messages))
    if kind == 0:
        messages.insert(rng.randrange(1, len(messages) + 1), {"role": "system", "content": "late"})
    elif kind == 1:
        messages[target]["role"] = rng.choice(["developer", "function", None, 5])
    elif kind == 2:
        messages[target]["content"] = rng.choice([5, 2.5, True, {"text": "x"}])
    elif kind == 3:
        messages[target]["content"] = [rng.choice([7, None, 1.5, False, {"kind": "x"}, ["text"]])]
    elif kind == 4:
        messages[:] = [m for m in messages if m.get("role") != "user"]
        if not messages:
            messages.append({"role": "tool", "content": "r"})
    elif kind == 5:
        messages.append({"role": "assistant", "content": "c",
                         "tool_calls": [rng.choice([{"function": {"arguments": {}}}, {"function": {"name": 3}},
                                                    {"function": None}, {"function": {"name": "f", "arguments": None}},
                                                    {"function": {"name": "f", "arguments": "[1]"}},
                                                    {"function": {"name": "f", "arguments": "{bad"}}, 5])]})
    elif kind == 6:
        messages.append({"role": "assistant", "content": "c", "tool_calls": rng.choice(["abc", {"a": 1}, 7, ""])})
    elif kind == 7:
        messages[0] = {"role": "system", "content": [{"type": "image_url", "image_url": "u"}]}
    else:
        messages.clear()


def switch_value(rng):
    return rng.choice([True, False, True, False, 0, 1, "false", None, "yes"])


def rand_body(rng):
    messages = rand_messages(rng)
    if rng.random() < 0.15:
        corrupt(rng, messages)
    body = {"model": "qwen3.6", "messages": messages}
    r = rng.random()
    if r < 0.4:
        body["tools"] = [rand_tool(rng, i) for i in range(rng.randint(1, 3))]
    elif r < 0.5:
        body["tools"] = rng.choice([None, []])
    kwargs = {}
    for key in ("add_generation_prompt", "enable_thinking", "preserve_thinking"):
        for where in (body, kwargs):
            if rng.random() < 0.3:
                value = switch_value(rng)
                if key == "add_generation_prompt" and rng.random() < 0.9:
                    value = rng.choice([True, False, None])
                where[key] = value
    if rng.random() < 0.15:
        kwargs[rng.choice(["add_vision_id", "add_vision_id", "custom_flag", "tools", "messages"])] = \
            rng.choice([True, False, 1, "yes", None])
    if kwargs or rng.random() < 0.1:
        body["chat_template_kwargs"] = kwargs
    return body


def fixture_bodies():
    bodies, names = [], []
    for path in sorted((FIXTURES / "renders").glob("*.json")):
        case = json.loads(path.read_text(encoding="utf-8"))
        bodies.append({k: v for k, v in case.items() if k not in ("error", "error_type")})
        names.append(path.stem)
    return bodies, names


def test_binary_exists():
    assert TANSY.exists(), f"build tansy first (or set TANSY_BIN): {TANSY}"


def test_fixtures_match_jinja_and_files():
    bodies, names = fixture_bodies()
    assert len(bodies) == 16
    counts, mismatches = compare(bodies, names)
    assert mismatches == []
    # The reference reproduces the recorded files, so it is the environment the fixtures describe.
    for body, name in zip(bodies, names):
        txt = FIXTURES / "renders" / (name + ".txt")
        if txt.exists():
            assert reference(body) == ("ok", txt.read_bytes().decode("utf-8"))
    assert counts["ok"] == 11 and counts["error"] == 5  # the JSON-string arguments case renders once parsed


def test_generated_conversations_match_jinja():
    rng = random.Random(20261130)
    bodies = [rand_body(rng) for _ in range(GENERATED)]
    counts, mismatches = compare(bodies, [f"gen{i}" for i in range(GENERATED)])
    report = "\n".join(f"{n} [{k}]\nwant: {w!r}\ngot:  {g!r}" for n, k, w, g in mismatches[:5])
    assert not mismatches, f"{len(mismatches)} of {GENERATED} differ\n{report}"
    # The generator must really cover both outcomes and the interesting features.
    assert counts["ok"] >= 1000 and counts["error"] >= 100 and counts["server"] >= 5, counts
    print(f"compared {GENERATED} generated conversations: {counts}")


def run_render(stdin, model=FIXTURES):
    return subprocess.run([str(TANSY), "render", "--model", str(model)], input=stdin, capture_output=True, timeout=30)


def test_cli_plain_mode():
    proc = run_render(json.dumps({"messages": [{"role": "user", "content": "Hello"}]}).encode())
    assert proc.returncode == 0
    assert proc.stdout == (FIXTURES / "renders" / "a_user_hello.txt").read_bytes()
    proc = run_render(b'{"messages": []}')
    assert proc.returncode != 0 and b"No messages provided." in proc.stderr and proc.stdout == b""
    proc = run_render(b'{"messages": ')
    assert proc.returncode != 0 and b"not valid JSON" in proc.stderr


def test_cli_without_a_template(tmp_path):
    proc = run_render(b'{"messages": [{"role": "user", "content": "x"}]}', tmp_path)
    assert proc.returncode != 0 and b"no chat template" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Other templates: Qwen3's, and Qwen3.6 as fine-tunes and converters re-save it
# ---------------------------------------------------------------------------------------------
QWEN3_DIR = FIXTURES.parent / "qwen3-tokenizer"
QWEN3_CONFIG = json.loads((QWEN3_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))


def special_tokens(config):
    """What transformers passes besides the request: the tokenizer's special-token strings."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


def edited(old, new, source=QWEN36):
    assert source.count(old) == 1, old
    return source.replace(old, new)


GEN_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""
PARAM_LOOP = """                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\\n' }}
                        {%- set args_value = args_value | string if args_value is string else args_value | tojson | safe %}
                        {{- args_value }}
                        {{- '\\n</parameter>\\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\\n</tool_call>' }}"""

VARIANTS = {
    # A converter's banner comment, and a comment line inside the body, with a trailing newline.
    "comment": "{#- Converted for tansy; edit freely. -#}\n" +
               edited("{%- if not messages %}", "{# validation #}\n{%- if not messages %}") + "\n",
    # A fine-tune's own system preamble before the tools block, and a default system prompt.
    "preamble": edited("# Tools\\n\\nYou have access to the following functions:",
                       "# Tools\\n\\nYou are Tansy, a careful assistant. You may call these functions:",
                       edited("{%- else %}\n    {%- if messages[0].role == 'system' %}",
                              "{%- else %}\n    {%- if messages[0].role != 'system' %}\n"
                              "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
                              "    {%- endif %}\n    {%- if messages[0].role == 'system' %}")),
    # Hermes-style JSON tool calls instead of Qwen3.6's XML parameters.
    "toolcall-json": edited(PARAM_LOOP, """                {{- '{"name": ' + tool_call.name|tojson + ', "arguments": ' }}
                {%- if tool_call.arguments is defined %}
                    {{- tool_call.arguments|tojson(indent=2) if tool_call.arguments|length > 2 else tool_call.arguments|tojson }}
                {%- else %}
                    {{- {}|tojson }}
                {%- endif %}
                {{- '}\\n</function>\\n</tool_call>' }}"""),
    # Thinking forced off, whatever the request says.
    "nothink": edited(GEN_PROMPT, """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}
{%- endif %}"""),
    # The Qwen3.5 template (two lines differ; fixtures README): scalars through Python str().
    "qwen3.5": edited("{%- if (preserve_thinking is defined and preserve_thinking is true) or "
                      "(loop.index0 > ns.last_query_index) %}", "{%- if loop.index0 > ns.last_query_index %}",
                      edited("args_value | string if args_value is string else args_value | tojson | safe",
                             "args_value | tojson | safe if args_value is mapping or (args_value is sequence and "
                             "args_value is not string) else args_value | string")),
}

TEMPLATE_CASES = [(name, 300) for name in VARIANTS] + [("qwen3", 400)]


@pytest.mark.parametrize("name,count", TEMPLATE_CASES)
def test_other_templates_match_jinja(tmp_path, name, count):
    if name == "qwen3":
        model, source, extra = QWEN3_DIR, QWEN3_CONFIG["chat_template"], special_tokens(QWEN3_CONFIG)
        TEXT_SHARE[0] = 0.97  # this template concatenates content as a string
    else:
        model, source, extra = tmp_path, VARIANTS[name], {}
        (tmp_path / "chat_template.jinja").write_bytes(source.encode("utf-8"))
    try:
        rng = random.Random(f"{name}-20261201")
        bodies = [rand_body(rng) for _ in range(count)]
    finally:
        TEXT_SHARE[0] = 0.65
    counts, mismatches = compare(bodies, [f"{name}-{i}" for i in range(count)], model, compile_template(source),
                                 extra)
    report = "\n".join(f"{n} [{k}]\nwant: {w!r}\ngot:  {g!r}" for n, k, w, g in mismatches[:5])
    assert not mismatches, f"{len(mismatches)} of {count} differ\n{report}"
    assert counts["ok"] >= count * 0.55 and counts["error"] >= 10, counts
    print(f"{name}: compared {count} generated conversations: {counts}")


# ---------------------------------------------------------------------------------------------
# The Jinja subset, construct by construct
# ---------------------------------------------------------------------------------------------
SNIPPETS = [
    # whitespace control, trim_blocks, lstrip_blocks, comments, raw
    "a\n  {% if true %}\n  b\n  {% endif %}\nc",
    "a  {%- if true -%}  b  {%- endif -%}  c",
    "a\n  {%+ if true %}b{% endif +%}\nc",
    "x {{ 1 }} \n{{- 2 -}}\n y",
    "  {# comment #}\nline\n    {#- c -#}   z",
    "{% raw %}{{ not rendered }}{% endraw %}\n  {%- raw -%}  {% x %}  {%- endraw %}",
    "\t\u00a0{% if true %}x{% endif %}\n{% for i in [1, 2] %}\n{{ i }}\n{% endfor %}\n",
    "a\r\nb\rc{% if true %}\r\nd{% endif %}\n\n",
    "{{ 'a' }}{# x #}{{ 'b' }}  {% if 1 %}  y{% endif %}",
    # literals and strings
    "{{ 'it\\'s' }}|{{ \"q\\\"\" }}|{{ '\\n\\t\\\\' }}|{{ '\\x41\\u00e9\\U0001F600' }}|{{ '\\d\\101' }}|{{ 'a' 'b' }}",
    "{{ 1_000 }} {{ 1.5e3 }} {{ 0.1 + 0.2 }} {{ 1e-7 }} {{ 10 / 4 }} {{ 7 // 2 }} {{ -7 % 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }}",
    "{{ [1, 'a', none, true, 1.0, (1,), (), {'k': [false]}] }} {{ (1, 2) }} {{ {'a': 1, 'a': 2} }}",
    "{{ none }} {{ True }} {{ false }} {{ 18446744073709551615 + 1 }} {{ 3 * 'ab' }} {{ [0] * 3 }}",
    # expressions and operators
    "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' != 'a' }}",
    "{{ 'b' in 'abc' }} {{ 'x' not in ['x'] }} {{ 'k' in {'k': 1} }} {{ 1 in [1.0] }} {{ u in [1] }}",
    "{{ 1 and 'x' }} {{ 0 or '' or 'z' }} {{ not none }} {{ not 1 == 2 }} {{ 'y' if 0 else 'n' }} [{{ 'y' if 0 }}]",
    "{{ 'a' ~ 1 ~ none ~ undefined_thing ~ [1] }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ -(3) }} {{ +4 }} {{ -1.5|abs }}",
    # attribute and item access, slicing
    "{{ messages[0].role }} {{ messages[0]['content'] }} {{ messages.0.role }} {{ messages[-1].role }} [{{ messages[5] }}]",
    "{% set s = 'héllo wörld' %}{{ s[1:4] }}|{{ s[::-1] }}|{{ s[-3:] }}|{{ s[::2] }}|{{ s[10:2:-3] }}|{{ s[1] }}|{{ [1,2,3,4][1::2] }}",
    "{{ messages[0].nope }}|{{ messages[0].nope is defined }}|{{ none.x }}|{{ 'str'.x }}|{{ {}.get('a', 'dflt') }}",
    # tests
    "{% for v in [none, true, false, 0, 1.5, 'x', [], {}, u] %}{{ v is none }}{{ v is true }}{{ v is false }}{{ v is number }}"
    "{{ v is integer }}{{ v is float }}{{ v is string }}{{ v is mapping }}{{ v is iterable }}{{ v is sequence }}"
    "{{ v is boolean }}{{ v is defined }}{{ v is undefined }}{{ v is callable }}|{% endfor %}",
    "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 2 is eq 2 }} {{ 2 is ne(3) }} {{ 'a' is in 'cat' }} {{ none is sameas none }} {{ 'ab' is lower }} {{ 'AB' is upper }} {{ 1 is not none }}",
    # filters
    "{{ '  x  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 5|trim }}|{{ none|trim }}|{{ 'AbC'|lower }}{{ 'aBc'|upper }}|{{ 'hello world'|title }}|{{ 'hELLO'|capitalize }}",
    "{{ 'a-b-c'|replace('-', '+') }}|{{ 'aaa'|replace('a', 'b', 2) }}|{{ 'ab'|replace('', '.') }}|{{ [1, 'a', none]|join(', ') }}|{{ 'abc'|join('-') }}",
    "{{ [3, 4]|first }} {{ [3, 4]|last }} {{ 'xyz'|first }} {{ 'xyz'|last }} [{{ []|first }}] {{ {'a': 1}|first }} {{ [1, 2]|reverse|list }} {{ 'abc'|reverse }}",
    "{{ u|default('d') }} {{ ''|default('e', true) }} {{ 0|d('z') }} {{ none|default('n') }} {{ 'abc'|list }} {{ {'a': 1, 'b': 2}|list }} {{ 'é'|length }} {{ {'a': 1}|count }}",
    "{{ '42'|int }} {{ ' 7 '|int }} {{ '3.9'|int }} {{ 'x'|int }} {{ 'x'|int(5) }} {{ 2.9|int }} {{ true|int }} {{ '1e3'|float }} {{ 3|float }} {{ none|int }}",
    "{{ 5|string ~ 'x' }} {{ [1]|string }} {{ none|string }} {{ 'x'|safe }} {{ {'b': 1, 'a': [1, 2]}|items|list }}",
    "{{ {'k': 'é\"\\\\\\n\\u2028/', 'n': [1, 2.5, none, true], 'e': {}, 'l': []}|tojson }}",
    "{{ {'b': 1, 'a': {'c': [1, {}]}}|tojson(indent=2) }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|{{ 'é😀'|tojson(ensure_ascii=true) }}|{{ [1, {'a': 2}]|tojson(separators=(',', ':')) }}",
    "{{ tools|tojson }}|{{ messages|tojson(indent=4) }}",
    # string methods
    "{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(none, 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ 'abc'.split('b')[-1] }}",
    "{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ 'xy\\n\\n'.rstrip() }}|{{ '..a..'.strip('.') }}|{{ 'ab'.startswith('a') }}{{ 'ab'.endswith(('x', 'b')) }}|{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}",
    # Case mapping beyond ASCII (full Unicode mappings, final sigma, title case of digraphs) and the
    # title filter (jinja2's own word split) against str.title().
    "{{ 'straße ǆemal σοφός ΟΔΟΣ İstanbul Ꭰ ﬁ ŉ'|upper }}|{{ 'STRASSE ΟΔΟΣ ΣΑΣ İ Ǆ Ꭰ'|lower }}|{{ 'ǆemal ßa'|capitalize }}",
    "{{ \"they're bill's-friends (x y) [ab] {cd} <ef> ǆx ßa\"|title }}|{{ \"they're bill's-friends ǆx ßa 3rd\".title() }}",
    "{{ 'σοφός' is lower }} {{ 'ΟΔΟΣ' is upper }} {{ 'ǅx' is lower }} {{ 'Ꭰ' is upper }} {{ 'ꭰ' is lower }} {{ '3' is lower }}",
    "{{ 'ΟΔΟΣ'.lower() }} {{ 'ß'.upper() }} {{ 'ǆ'.capitalize() }} {{ 'ﬀ x'.title() }} {{ 'Ὀδυσσεύς'.upper() }}",
    "{{ 'a-b'.replace('-', '') }} {{ 'hello'.find('l') }} {{ 'hello'.count('l') }} {{ '-'.join(['a', 'b']) }} {{ 'ab cd'.title() }} {{ 'aB'.capitalize() }}",
    # dict and list methods
    "{% for k, v in {'x': 1, 'y': [2]}.items() %}{{ k }}={{ v }};{% endfor %}{{ {'a': 1}.keys()|list }}{{ {'a': 1}.values()|list }}{{ {'a': 1}.get('b') }}{{ [1, 2, 1].count(1) }}{{ [5, 6].index(6) }}",
    # loops
    "{% for x in [10, 20, 30] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('a', 'b') }}|{% endfor %}",
    "{% for x in [] %}no{% else %}empty{% endfor %}{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}{% for x in u %}never{% endfor %}",
    "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}{{ range(2, 9, 3)|list }}{{ range(5, 0, -2)|list }}",
    "{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %}{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for k in {'p': 1, 'q': 2} %}{{ k }}{% endfor %}",
    "{% for row in [[1, 2], [3]] %}{% for x in row %}{{ loop.index }}/{{ loop.length }} {% endfor %}{{ loop.index }};{% endfor %}",
    # scoping
    "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = x + 10 %}{{ x }} {% endfor %}{{ x }}{% if true %}{% set x = 5 %}{% endif %}{{ x }}",
    "{% set ns = namespace(n=0, items=[]) %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.n }} {{ ns.items }} {{ ns.missing }}",
    "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, %}{{ t }}{% set block %}  in a block {{ a }}  {% endset %}[{{ block }}]{% set trimmed | trim | upper %}  x  {% endset %}[{{ trimmed }}]",
    # macros and call
    "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', '?') }} {{ greet(punct='.', name='C') }} [{{ greet() }}]",
    "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}{{ f(3)|length }}",
    "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}inner {{ 1 + 1 }}{% endcall %}",
    "{% macro m() %}{{ outer }}{% endmacro %}{% set outer = 'late' %}{{ m() }}{% for i in [1] %}{% set outer = 'loop' %}{{ m() }}{% endfor %}",
    "{% macro content(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}{{ p.text }}{% endfor %}{% endif %}{% endmacro %}[{{ content(messages[0].content)|trim }}]",
    # globals
    "{{ namespace(a=1).a }} {{ dict(a=1, b=2) }} {{ range(3)|list }} {{ strftime_now('%%') }}",
    # errors, each with jinja2's message
    "{{ raise_exception('custom failure') }}",
    "{{ 1 + 'a' }}", "{{ 'a' + 1 }}", "{{ [1] + 'a' }}", "{{ {} + {} }}", "{{ 'a' - 1 }}", "{{ -'a' }}", "{{ 1 / 0 }}",
    "{{ 1 // 0 }}", "{{ 1 % 0 }}", "{{ 'a' * 1.5 }}", "{{ 1 < 'a' }}", "{{ [1] < 'a' }}", "{{ 'a' in 1 }}", "{{ 1 in 'a' }}",
    "{{ u + 1 }}", "{{ u.attr }}", "{{ u() }}", "{{ u[0] }}", "{{ u < 1 }}", "{{ messages[0].nope.deeper }}",
    "{{ messages[9].role.x }}", "{{ none.a.b }}", "{{ 5() }}", "{{ 'abc'.nope() }}", "{{ {}.pop('a') }}", "{{ [].append(1) }}",
    "{{ 3|length }}", "{{ none|length }}", "{% for a in 1|items %}{% endfor %}", "{{ u|tojson }}", "{{ 5|first }}", "{{ 5|last }}", "{% for x in 5 %}{% endfor %}",
    "{% for x in none %}{% endfor %}", "{% for a, b in [1] %}{% endfor %}", "{% for a, b in [[1]] %}{% endfor %}",
    "{% for a, b in [[1, 2, 3]] %}{% endfor %}", "{% set x = 1 %}{% set x.y = 2 %}", "{{ ''.split('') }}",
    "{{ 'a'.startswith(1) }}", "{{ range(200000) }}", "{{ [1, 2][::0] }}",
    "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "{% macro m(a) %}{% endmacro %}{{ m(b=1) }}",
    "{% macro m(a) %}{{ a + 1 }}{% endmacro %}{{ m() }}", "{% for x in [1] %}{{ loop.previtem + 1 }}{% endfor %}",
    "{{ [1, 2]|first + u }}", "{{ ('a' if false) + 'b' }}", "{{ u|abs }}", "{{ 5|reverse }}", "{{ 'x'|abs }}",
    "{% set v = 5 %}{{ v[1:] }}", "{% set v = none %}{{ v[::-1] }}", "{% set v = {} %}{{ v[:1] }}", "{{ u[1:] }}",
    "{{ 'abc'.index('z') }}", "{{ 'abc'.find(1) }}", "{{ none * [1] }}", "{{ [1] * [2] }}", "{{ 2.5 * 'a' }}",
]


def test_snippets_match_jinja(tmp_path):
    body = {"messages": [{"role": "user", "content": "  H\u00e9 llo \u3000"}, {"role": "assistant", "content": "ok"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    mismatches, kinds = [], {"ok": 0, "error": 0}
    for i, source in enumerate(SNIPPETS):
        d = tmp_path / f"s{i}"
        d.mkdir()
        (d / "chat_template.jinja").write_bytes(source.encode("utf-8"))
        kind, want = reference(body, compile_template(source))
        kinds[kind] += 1
        [got] = tansy_jsonl([body], d)
        if got.get("prompt" if kind == "ok" else "error") != want:
            mismatches.append(f"{source!r}\nwant {kind}: {want!r}\ngot:  {got!r}")
    assert not mismatches, f"{len(mismatches)} of {len(SNIPPETS)} differ:\n" + "\n".join(mismatches)
    assert kinds["ok"] >= 45 and kinds["error"] >= 45, kinds


@pytest.mark.parametrize("source,construct", [
    ("{% include 'x' %}", "the 'include' tag"), ("{% extends 'x' %}", "the 'extends' tag"),
    ("{% import 'x' as y %}", "the 'import' tag"), ("{% with a = 1 %}{% endwith %}", "the 'with' tag"),
    ("{{ x|map(attribute='a') }}", "the filter 'map'"), ("{{ x|selectattr('a') }}", "the filter 'selectattr'"),
    ("{{ x is escaped }}", "the test 'escaped'"), ("{% for x in y recursive %}{% endfor %}", "recursive for loops"),
    ("{{ f(*args) }}", "*args / **kwargs"), ("{% filter upper %}x{% endfilter %}", "the 'filter' tag"),
])
def test_constructs_outside_the_subset_fail_at_load(tmp_path, source, construct):
    (tmp_path / "chat_template.jinja").write_text("{# first line #}\n" + source, encoding="utf-8")
    proc = run_render(b'{"messages": [{"role": "user", "content": "x"}]}', tmp_path)
    assert proc.returncode != 0 and proc.stdout == b""
    err = proc.stderr.decode()
    assert "line 2" in err and construct in err, err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("source", ["{% if x %}", "{{ 1 + }}", "{% for %}", "{{ 'unterminated }}", "{% endif %}",
                                    "{{ (1 }}", "{% set %}", "{% macro %}", "{# open comment"])
def test_syntax_errors_fail_at_load(tmp_path, source):
    with pytest.raises(jinja2.TemplateSyntaxError):
        compile_template(source)
    (tmp_path / "chat_template.jinja").write_text(source, encoding="utf-8")
    proc = run_render(b'{"messages": [{"role": "user", "content": "x"}]}', tmp_path)
    assert proc.returncode != 0 and b"chat template line" in proc.stderr, proc.stderr


def test_chat_template_kwargs_reach_the_template():
    """Other chat_template_kwargs are template variables (as vLLM passes them): Qwen's add_vision_id."""
    image = {"type": "image", "image": "file:///x.png"}
    body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "and"}, image]},
                         {"role": "assistant", "content": "ok"}, {"role": "user", "content": [image]}],
            "chat_template_kwargs": {"add_vision_id": True, "messages": "ignored", "documents": 5}}
    [got] = tansy_jsonl([body])
    kind, want = reference(body)
    assert kind == "ok" and got["prompt"] == want
    assert "Picture 1: <|vision_start|>" in want and "Picture 3: " in want
    del body["chat_template_kwargs"]["add_vision_id"]
    [got] = tansy_jsonl([body])
    assert "Picture" not in got["prompt"] and got["prompt"] == reference(body)[1]
