"""`tansy render` against Python jinja2 rendering the Qwen3.6 chat template in the environment
transformers uses (see tests/fixtures/README.md): the fixtures plus generated conversations,
byte for byte, errors included.

The reference does what the server does before rendering: it reads the switches from the top
level or `chat_template_kwargs` (which wins) and parses OpenAI wire-format `arguments` strings into
objects. Switch values are handed to jinja2 unchanged, so Jinja's own `is false` / `is true`
semantics decide for non-boolean values.
"""
import json
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


def make_template():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    with open(FIXTURES / "chat_template.jinja", encoding="utf-8", newline="") as f:
        return env.from_string(f.read())


TEMPLATE = make_template()


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


def reference(body):
    """('ok', prompt) | ('error', message) | ('server', None)."""
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
    except ServerSideError:
        return ("server", None)
    try:
        return ("ok", TEMPLATE.render(messages=messages, tools=body.get("tools"), documents=None, **kwargs))
    except Exception as e:  # jinja2 errors, and Python's TypeError as transformers would see them
        return ("error", str(e))


def tansy_jsonl(bodies):
    lines = "".join(json.dumps(b, ensure_ascii=False) + "\n" for b in bodies)
    proc = subprocess.run([str(TANSY), "render", "--model", str(FIXTURES), "--jsonl"], input=lines.encode(),
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode().split("\n")
    assert out[-1] == ""
    return [json.loads(line) for line in out[:-1]]


def compare(bodies, names):
    results = tansy_jsonl(bodies)
    assert len(results) == len(bodies)
    mismatches = []
    counts = {"ok": 0, "error": 0, "server": 0}
    for body, name, got in zip(bodies, names, results):
        kind, want = reference(body)
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


def rand_content(rng, allow_images):
    r = rng.random()
    if r < 0.65:
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


def test_cli_refuses_a_different_template(tmp_path):
    # Qwen3's own tokenizer_config.json carries the original Qwen3 template.
    proc = run_render(b'{"messages": [{"role": "user", "content": "x"}]}', FIXTURES.parent / "qwen3-tokenizer")
    assert proc.returncode != 0 and b"differs" in proc.stderr
    proc = run_render(b'{"messages": [{"role": "user", "content": "x"}]}', tmp_path)
    assert proc.returncode != 0 and b"no chat template" in proc.stderr
