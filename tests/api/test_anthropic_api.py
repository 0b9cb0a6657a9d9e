"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official
`anthropic` client against the real server on the tiny scripted model (see make_tiny_model.py):
with thinking on it reasons and calls get_weather(city="Paris"); with thinking off it answers
the scripted sentence.
"""
import json

import anthropic
import pytest
import requests

from api_support import MODEL_ID

REASONING = "The user asked about the weather, so I will call get_weather."
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
THINK = {"type": "enabled", "budget_tokens": 200}


@pytest.fixture
def ac(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


def test_create_text(ac, scripts):
    m = ac.messages.create(model=MODEL_ID, max_tokens=100, messages=user("Hi"), temperature=0)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_ID and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == scripts["answer"]["text"]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens == len(scripts["answer"]["tokens"]) + 1
    assert m.usage.input_tokens > 0


def test_thinking_on_gives_thinking_and_tool_use(ac):
    m = ac.messages.create(model=MODEL_ID, max_tokens=300, messages=user("Weather in Paris?"), temperature=0,
                           tools=[WEATHER], thinking=THINK)
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == REASONING
    call = m.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
    assert m.stop_reason == "tool_use"


def test_thinking_off_has_no_thinking_block(ac, scripts):
    m = ac.messages.create(model=MODEL_ID, max_tokens=300, messages=user("Weather in Paris?"), temperature=0,
                           tools=[WEATHER], thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == scripts["answer"]["text"]


def test_thinking_budget_ends_the_thinking_block(ac):
    m = ac.messages.create(model=MODEL_ID, max_tokens=300, messages=user("Weather in Paris?"), temperature=0,
                           thinking={"type": "enabled", "budget_tokens": 4})
    assert m.content[0].type == "thinking"
    # The first 4 tokens of the scripted reasoning, then the forced end of the block.
    assert m.content[0].thinking == "The user asked about"
    assert REASONING.startswith(m.content[0].thinking)


def test_system_and_stop_sequences(ac, scripts):
    text = scripts["answer"]["text"]
    m = ac.messages.create(model=MODEL_ID, max_tokens=100, messages=user("Hi"), temperature=0,
                           system=[{"type": "text", "text": "Be brief."}], stop_sequences=["42"])
    assert m.content[0].text == text[:text.index("42")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "42"
    with_system = ac.messages.count_tokens(model=MODEL_ID, messages=user("Hi"), system="Be brief.")
    without = ac.messages.count_tokens(model=MODEL_ID, messages=user("Hi"))
    assert with_system.input_tokens > without.input_tokens > 0


def test_max_tokens_stop_reason(ac):
    m = ac.messages.create(model=MODEL_ID, max_tokens=3, messages=user("Hi"), temperature=0)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_count_tokens_matches_create(ac):
    kw = dict(model=MODEL_ID, messages=user("Weather in Paris?"), tools=[WEATHER], thinking=THINK)
    n = ac.messages.count_tokens(**kw).input_tokens
    m = ac.messages.create(max_tokens=201, temperature=0, **kw)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n


def collect_stream(ac, **kw):
    events = []
    with ac.messages.stream(**kw) as stream:
        for ev in stream:
            events.append(ev)
        final = stream.get_final_message()
    return events, final


def test_stream_matches_create(ac, server):
    kw = dict(model=MODEL_ID, max_tokens=300, messages=user("Weather in Paris?"), temperature=0, tools=[WEATHER],
              thinking=THINK)
    full = ac.messages.create(**kw)
    events, final = collect_stream(ac, **kw)
    dump = lambda blocks: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]  # noqa: E731
    assert dump(final.content) == dump(full.content)
    assert final.stop_reason == full.stop_reason == "tool_use"
    assert final.usage.output_tokens == full.usage.output_tokens

    # The raw event sequence, exactly as Anthropic orders it.
    r = requests.post(server.url + "/v1/messages", json={**kw, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    raw = []
    name = None
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name
            raw.append(data)
    kinds = [e["type"] for e in raw]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [e["content_block"]["type"] for e in raw if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "tool_use"]
    # Every block is started, receives deltas of its own kind under its index, and is stopped in order.
    open_index = None
    for e in raw:
        if e["type"] == "content_block_start":
            assert open_index is None
            open_index = e["index"]
            kind = e["content_block"]["type"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            assert e["delta"]["type"] == {"thinking": "thinking_delta", "text": "text_delta",
                                          "tool_use": "input_json_delta"}[kind]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
    assert sum(1 for e in raw if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta") > 5
    start = raw[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert raw[-2]["delta"]["stop_reason"] == "tool_use"


def test_stream_text_events(ac, scripts):
    events, final = collect_stream(ac, model=MODEL_ID, max_tokens=100, messages=user("Hi"), temperature=0)
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == scripts["answer"]["text"]
    assert final.stop_reason == "end_turn"


def test_tool_use_round_trip(ac, scripts):
    msgs = user("Weather in Paris?")
    first = ac.messages.create(model=MODEL_ID, max_tokens=300, messages=msgs, temperature=0, tools=[WEATHER],
                               thinking=THINK)
    call = next(b for b in first.content if b.type == "tool_use")
    msgs = msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": [{"type": "text", "text": "21 degrees"}]}]}]
    second = ac.messages.create(model=MODEL_ID, max_tokens=300, messages=msgs, temperature=0, tools=[WEATHER],
                                thinking=THINK)
    # The history (thinking, tool_use, tool_result) rendered and ran; the prefix came from the cache.
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.stop_reason == "tool_use"
    # An error result is accepted too.
    msgs[-1]["content"][0]["is_error"] = True
    third = ac.messages.count_tokens(model=MODEL_ID, messages=msgs, tools=[WEATHER])
    assert third.input_tokens > 0


def test_tool_choice_tool_forces_the_call(ac):
    lookup = {"name": "lookup", "input_schema": {"type": "object", "properties": {}}}
    m = ac.messages.create(model=MODEL_ID, max_tokens=30, messages=user("Hi"), temperature=0,
                           tools=[WEATHER, lookup], tool_choice={"type": "tool", "name": "lookup"})
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and calls[0].name == "lookup" and isinstance(calls[0].input, dict)
    # The random model may not close the call within max_tokens.
    assert m.stop_reason == ("max_tokens" if m.usage.output_tokens == 30 else "tool_use")


def post(server, body, path="/v1/messages", **kw):
    return requests.post(server.url + path, json=body, timeout=60, **kw)


def expect_error(r, status, etype, field=None):
    assert r.status_code == status, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == etype, j
    assert isinstance(j["error"]["message"], str) and "\n" not in j["error"]["message"]
    if field:
        assert field in j["error"]["message"], j


BASE = {"model": MODEL_ID, "max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("change,field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"model": 3}, "model"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "is_error": "yes"}]}]},
     "messages[0].content[0].is_error"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]},
                   {"role": "user", "content": "x"}]}, "messages[1].content[0].input"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "pre"}]}, "prefill"),
    ({"system": 7}, "system"),
    ({"system": [{"type": "text", "text": 1}]}, "system[0].text"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": [1]}, "stop_sequences[0]"),
    ({"temperature": 1.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stream": "yes"}, "stream"),
    ({"tools": {}}, "tools"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
])
def test_malformed_400(server, change, field):
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    expect_error(post(server, body), 400, "invalid_request_error", field)


def test_errors_other_statuses(server):
    expect_error(post(server, {**BASE, "model": "other"}), 404, "not_found_error", "other")
    r = requests.post(server.url + "/v1/messages", data="{not json", timeout=30,
                      headers={"Content-Type": "application/json"})
    expect_error(r, 400, "invalid_request_error")
    r = requests.get(server.url + "/v1/messages", timeout=30)  # a known path, another method
    expect_error(r, 405, "invalid_request_error")
    assert "POST" in r.headers["Allow"]
    r = requests.post(server.url + "/v1/messages/nothing", json=BASE, timeout=30)
    expect_error(r, 404, "not_found_error")
    expect_error(post(server, {"model": MODEL_ID}, "/v1/messages/count_tokens"), 400, "invalid_request_error",
                 "messages")
    # The server still serves after all that.
    assert post(server, BASE).status_code == 200


def test_client_raises_typed_errors(ac):
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="other", max_tokens=5, messages=user("Hi"))
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL_ID, max_tokens=5, messages=user("Hi"), temperature=3)
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_api_key_header(start_server):
    s = start_server("anthropic-auth", "--api-key", "sekret")
    body = {**BASE, "max_tokens": 2}
    r = requests.post(s.url + "/v1/messages", json=body, timeout=30)
    expect_error(r, 401, "authentication_error")
    r = requests.post(s.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=30)
    expect_error(r, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(**body)
    m = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0).messages.create(**body)
    assert m.usage.output_tokens == 2
    r = requests.post(s.url + "/v1/messages", json=body, headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert r.status_code == 200
    # The other new endpoints are behind the key too (OpenAI's error shape there); the page is not.
    for path, b in [("/v1/responses", {"model": MODEL_ID, "input": "Hi"}), ("/tokenize", {"prompt": "x"}),
                    ("/detokenize", {"tokens": [1]})]:
        r = requests.post(s.url + path, json=b, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert requests.post(s.url + path, json=b, headers={"x-api-key": "sekret"}, timeout=30).status_code == 200
    assert requests.get(s.url + "/", timeout=30).status_code == 200
