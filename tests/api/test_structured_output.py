"""Structured output through the API: response_format json_object / json_schema on chat and
completions, schema-constrained tool calls, and the official openai client's helpers.

The tiny model has random weights, so what it writes inside a constraint is arbitrary: every
output must parse and validate (Python's jsonschema, formats checked) whatever it is.
"""
import copy
import json
import os
from typing import List, Literal, Optional

import jsonschema
import pytest
import requests
from pydantic import BaseModel, Field

from api_support import MODEL_ID, REPO, ServerProcess
from schema_corpus import corpus

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MAX_TOKENS = 128


def as_jsonschema(schema):
    """OpenAPI's `nullable: true` as JSON Schema spells it (jsonschema does not know the keyword)."""
    if isinstance(schema, list):
        return [as_jsonschema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    s = {k: as_jsonschema(v) for k, v in schema.items()}
    if s.pop("nullable", False):
        return {"anyOf": [s, {"type": "null"}]}
    return s


def validate(doc, schema):
    v = jsonschema.Draft202012Validator(as_jsonschema(schema),
                                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    errors = [e.message for e in v.iter_errors(doc)]
    assert not errors, (doc, errors)


def chat(server, schema=None, fmt=None, think=False, **kw):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Give me some data."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    if not think:
        body.update(NO_THINK)
    if fmt is not None:
        body["response_format"] = fmt
    elif schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)


CORPUS = corpus()


def test_corpus_is_large_and_compiles():
    assert len(CORPUS) >= 100
    for s in CORPUS:
        jsonschema.Draft202012Validator.check_schema(as_jsonschema(s))


@pytest.mark.parametrize("i", range(len(CORPUS)))
def test_corpus_outputs_validate(server, i):
    schema = CORPUS[i]
    # Greedy with the scripted reasoning first (the constraint starts after "</think>"), then
    # sampling with three seeds (two settings) on the answer alone.
    runs = [dict(think=True), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2 + i),
            dict(temperature=0.7, top_p=0.9, seed=1000 + i)]
    for run in runs:
        r = chat(server, schema, **run)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", (schema, run, c)
        content = c["message"]["content"]
        validate(json.loads(content), schema)
        if run.get("think"):
            assert c["message"]["reasoning_content"]


def test_json_object_parses_under_sampling(server):
    for seed in range(4):
        r = chat(server, fmt={"type": "json_object"}, temperature=1.0, seed=seed)
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop"
        assert isinstance(json.loads(c["message"]["content"]), dict)


def test_json_schema_on_completions_and_streaming(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "w": {"type": "string", "maxLength": 5}}, "required": ["n", "w"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    for seed in range(3):
        r = requests.post(server.url + "/v1/completions", json={
            "model": MODEL_ID, "prompt": "Data:", "max_tokens": 40, "temperature": 1.0, "seed": seed,
            "response_format": fmt}, timeout=60)
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop"
        validate(json.loads(c["text"]), schema)
    r = requests.post(server.url + "/v1/chat/completions", json={
        "model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "stream": True,
        "response_format": fmt, **NO_THINK}, stream=True, timeout=60)
    text, finish = "", None
    for line in r.iter_lines():
        line = line.decode("utf-8")
        if line.startswith("data: {"):
            ch = json.loads(line[6:])["choices"][0]
            text += ch["delta"].get("content") or ""
            finish = ch["finish_reason"] or finish
    assert finish == "stop"
    validate(json.loads(text), schema)


def test_cut_document_says_length(server):
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2000}}, "required": ["a"]}
    r = chat(server, schema, max_tokens=5, temperature=1.0, seed=3)
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(c["message"]["content"])


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 5}}}, "multipleOf"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"type": "string", "format": "hostname"}, "hostname"),
    ({"type": "string", "pattern": "(a)\\1"}, "\\1"),
    ({"if": {"type": "string"}}, "if"),
])
def test_unsupported_keywords_are_named(server, schema, keyword):
    r = chat(server, schema)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert keyword in err["message"] and err["param"] == "response_format.json_schema.schema", err
    assert "\n" not in err["message"]
    # The server is fine afterwards.
    assert chat(server, {"type": "boolean"}).status_code == 200


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_malformed_response_format(server, fmt, param):
    r = chat(server, fmt=fmt)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- tool calls -----------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"},
        "when": {"type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}},
                 "required": ["h"], "additionalProperties": False}},
        "required": ["zone"]}}}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in [WEATHER, TIME]}


def tool_chat(server, tool_choice, think=True, **kw):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}],
            "tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": MAX_TOKENS, **kw}
    if not think:
        body.update(NO_THINK)
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()


def check_calls(c, names):
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert calls
    for call in calls:
        assert call["function"]["name"] in names
        validate(json.loads(call["function"]["arguments"]), TOOLS[call["function"]["name"]])


@pytest.mark.parametrize("think", [True, False])
def test_required_tool_calls_validate(server, think):
    for seed in range(4):
        r = tool_chat(server, "required", think=think, temperature=1.0, seed=seed)
        check_calls(r["choices"][0], set(TOOLS))


def test_named_tool_call_validates(server):
    for seed in range(3):
        r = tool_chat(server, {"type": "function", "function": {"name": "get_time"}}, temperature=1.0, seed=seed)
        c = r["choices"][0]
        check_calls(c, {"get_time"})
        assert "zone" in json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])


def test_strict_tool_under_auto(server):
    # Greedy: the tiny model's scripted reasoning leads into its get_weather call, whose
    # arguments must now follow the strict schema (the script alone would give {"city": "Paris"}).
    r = tool_chat(server, "auto", temperature=0)
    c = r["choices"][0]
    check_calls(c, {"get_weather", "get_time"})
    calls = c["message"]["tool_calls"]
    assert any(x["function"]["name"] == "get_weather" for x in calls)


def test_tool_call_cut_short_says_length(server):
    r = tool_chat(server, "required", think=False, max_tokens=6, temperature=1.0, seed=5)
    c = r["choices"][0]
    assert c["finish_reason"] == "length"


def test_unsupported_keyword_in_tool_parameters(server):
    bad = copy.deepcopy(WEATHER)
    bad["function"]["parameters"]["properties"]["days"]["multipleOf"] = 2
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "tools": [bad],
            "tool_choice": "required", "max_tokens": 8}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "multipleOf" in r.json()["error"]["message"], r.text


# ---- the official client --------------------------------------------------------------------

class Color(BaseModel):
    name: Literal["red", "green", "blue"]
    hex: str = Field(pattern="^#[0-9a-f]{6}$")


class Palette(BaseModel):
    title: str = Field(max_length=12)
    colors: List[Color] = Field(max_length=3)
    rating: Optional[int] = Field(ge=1, le=5)


def test_openai_client_parse_with_pydantic(client):
    for seed in range(3):
        r = client.chat.completions.parse(model=MODEL_ID, messages=[{"role": "user", "content": "A palette"}],
                                          response_format=Palette, max_tokens=MAX_TOKENS, temperature=1.0,
                                          seed=seed, extra_body=NO_THINK)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Palette), msg
        assert Palette.model_validate_json(msg.content) == msg.parsed


def test_openai_client_response_format_dict(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "r", "schema": schema, "strict": True}},
                                       extra_body=NO_THINK)
    validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                       response_format={"type": "json_object"}, extra_body=NO_THINK)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_openai_client_strict_tool_parse(client):
    import openai

    class Lookup(BaseModel):
        query: str = Field(max_length=10)
        limit: int = Field(ge=1, le=3)

    r = client.chat.completions.parse(model=MODEL_ID, messages=[{"role": "user", "content": "find"}],
                                      tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
                                      max_tokens=MAX_TOKENS, temperature=1.0, seed=4, extra_body=NO_THINK)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Lookup)


def test_openai_client_responses_parse(client):
    r = client.responses.parse(model=MODEL_ID, input="A palette", text_format=Palette, max_output_tokens=MAX_TOKENS,
                               temperature=1.0, reasoning={"effort": "none"})
    assert isinstance(r.output_parsed, Palette), r
    assert r.text.format.type == "json_schema"


# ---- the bundled demo model (trained weights, its own 8k vocabulary) ------------------------

DEMO = os.path.join(REPO, "models", "tansy-demo")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    if not os.path.isdir(DEMO):
        pytest.skip("models/tansy-demo is not in this checkout")
    s = ServerProcess(None, str(tmp_path_factory.mktemp("logs") / "demo-structured.log"))
    yield s
    s.stop()


WORD = {"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 20},
    "part_of_speech": {"enum": ["noun", "verb", "adjective", "adverb"]},
    "meaning": {"type": "string", "minLength": 5},
    "examples": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 2}},
    "required": ["word", "part_of_speech", "meaning"], "additionalProperties": False}


@pytest.mark.parametrize("i", range(len(CORPUS)))
def test_demo_model_outputs_validate(demo, i):
    # The whole corpus, greedy with reasoning and sampled without; the word schema now and then.
    schemas = [CORPUS[i]] + ([WORD] if i % 10 == 0 else [])
    for schema in schemas:
        for run in [dict(think=True), dict(temperature=0.8, seed=i)]:
            body = {"model": "tansy-demo", "messages": [{"role": "user", "content": "What does the word river mean?"}],
                    "max_tokens": MAX_TOKENS, "temperature": 0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
            body.update({k: v for k, v in run.items() if k != "think"})
            if not run.get("think"):
                body.update(NO_THINK)
            r = requests.post(demo.url + "/v1/chat/completions", json=body, timeout=120).json()
            c = r["choices"][0]
            assert c["finish_reason"] == "stop", c
            validate(json.loads(c["message"]["content"]), schema)


def test_demo_model_required_tool_call(demo):
    body = {"model": "tansy-demo", "messages": [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}],
            "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": MAX_TOKENS}
    for seed in range(2):
        r = requests.post(demo.url + "/v1/chat/completions", json={**body, "temperature": 0.7, "seed": seed},
                          timeout=120).json()
        check_calls(r["choices"][0], set(TOOLS))


def test_mutated_schemas_never_break_the_server(server):
    # Every keyword of corpus schemas replaced by values of other types: a 200 or a 400 naming the
    # schema, never a 5xx, and the server keeps serving.
    import random
    rng = random.Random(11)
    junk = [None, True, -1, 2.5, "x", "^(", [], [1, "a"], {}, {"type": "nope"}, 10**30]

    def mutate(s):
        if isinstance(s, dict) and s:
            s = dict(s)
            k = rng.choice(list(s))
            s[k] = rng.choice(junk) if rng.random() < 0.5 else mutate(s[k])
        elif isinstance(s, list) and s:
            s = list(s)
            i = rng.randrange(len(s))
            s[i] = mutate(s[i])
        return s

    statuses = {}
    for i in range(150):
        schema = mutate(CORPUS[i % len(CORPUS)])
        r = chat(server, schema, max_tokens=8, temperature=1.0, seed=i)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400), (schema, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["param"].startswith("response_format"), r.text
    assert statuses.get(400, 0) > 10 and statuses.get(200, 0) > 10, statuses


def test_json_answer_or_tool_call(server):
    # response_format with tools under auto: the answer is either the document or tool calls.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for seed in range(6):
        r = tool_chat(server, "auto", think=seed % 2 == 0, temperature=1.0, seed=seed,
                      response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
        c = r["choices"][0]
        if c["message"].get("tool_calls"):
            check_calls(c, set(TOOLS))
        else:
            assert c["finish_reason"] == "stop", c
            validate(json.loads(c["message"]["content"]), schema)
    # Greedy with thinking follows the tiny model's script into a get_weather call.
    r = tool_chat(server, "auto", temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    check_calls(r["choices"][0], {"get_weather"})


def test_streamed_tool_calls_match_and_validate(server):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}],
            "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 9}
    full = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    check_calls(full, set(TOOLS))
    r = requests.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=120)
    calls, finish = {}, None
    for line in r.iter_lines():
        line = line.decode("utf-8")
        if not line.startswith("data: {"):
            continue
        ch = json.loads(line[6:])["choices"][0]
        finish = ch["finish_reason"] or finish
        for tc in ch["delta"].get("tool_calls") or []:
            e = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            e["name"] += tc.get("function", {}).get("name") or ""
            e["arguments"] += tc.get("function", {}).get("arguments") or ""
    assert finish == "tool_calls"
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in full["message"]["tool_calls"]]
    assert got == want


def test_anthropic_tool_choice_any_follows_the_schema(server):
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    for seed in range(2):
        r = requests.post(server.url + "/v1/messages", json={
            "model": MODEL_ID, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "Paris?"}],
            "tools": [tool], "tool_choice": {"type": "any"}, "temperature": 1.0}, timeout=120).json()
        uses = [b for b in r["content"] if b["type"] == "tool_use"]
        assert r["stop_reason"] == "tool_use" and uses, r
        for u in uses:
            validate(u["input"], tool["input_schema"])


def test_parallel_tool_calls_false_gives_one_call(server):
    f = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}

    def calls(seed, **kw):
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "tools": [f],
                "tool_choice": "required", "max_tokens": MAX_TOKENS, "temperature": 1.5, "seed": seed, **NO_THINK, **kw}
        c = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        return len(c["message"]["tool_calls"])

    # With parallel calls allowed the random model opens a second call now and then (some 15% of
    # seeds); with parallel_tool_calls false, never.
    assert max(calls(s) for s in range(40)) > 1
    assert {calls(s, parallel_tool_calls=False) for s in range(40)} == {1}


def test_ignore_eos_with_forced_tool_call(server):
    # ignore_eos keeps generating past the end of turn: after the call only end-of-turn tokens follow.
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 60, "temperature": 1.0, "seed": 2, "ignore_eos": True, **NO_THINK}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["message"]["tool_calls"], c
    validate(json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]), TOOLS["get_weather"])
    # A JSON response_format refuses ignore_eos.
    r = chat(server, {"type": "boolean"}, ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text
