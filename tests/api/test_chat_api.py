"""The OpenAI-compatible API driven by the official openai client against the real server.

The tiny model's scripted continuations (tools/make_tiny_model.py) make a few outputs known in
advance; everything else is checked for consistency (streaming vs not, alone vs concurrent,
cached vs not) rather than against fixed text.
"""
import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest
import requests

from api_support import MAX_SEQ, MODEL_ID

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
REASONING = "The user asked about the weather, so I will call get_weather."


def user(text):
    return [{"role": "user", "content": text}]


def stream_chat(client, **kw):
    """Runs a streaming chat completion; returns (content, reasoning, tool_calls, finish, chunks)."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        d = c.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                e["id"] = tc.id
            if tc.function and tc.function.name:
                e["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                e["arguments"] += tc.function.arguments
        if c.finish_reason:
            finish = c.finish_reason
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, chunks


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert models.data[0].model_extra["max_model_len"] == MAX_SEQ
    # the tiny model's generation_config.json sets these; the rest are OpenAI's defaults
    d = models.data[0].model_extra["sampling_defaults"]
    assert (d["temperature"], d["top_p"], d["top_k"], d["min_p"]) == (0.9, 0.95, 50, 0.0)
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    h = requests.get(server.url + "/health").json()
    assert h["status"] == "ok"


def test_answer_without_thinking(client, scripts):
    r = client.chat.completions.create(model=MODEL_ID, messages=user("Hi"), temperature=0, extra_body=NO_THINK)
    m = r.choices[0].message
    assert m.content == scripts["answer"]["text"]
    assert m.model_extra.get("reasoning_content") is None
    assert m.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    # every scripted token plus the end-of-turn token
    assert r.usage.completion_tokens == len(scripts["answer"]["tokens"]) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == MODEL_ID and r.id.startswith("chatcmpl-")


def test_top_level_enable_thinking_switch(client, scripts):
    r = client.chat.completions.create(model=MODEL_ID, messages=user("Hi"), temperature=0,
                                       extra_body={"enable_thinking": False})
    assert r.choices[0].message.content == scripts["answer"]["text"]


def test_reasoning_split_without_tools(client):
    # Thinking is on by default; without tools the call markup after the reasoning is plain content.
    r = client.chat.completions.create(model=MODEL_ID, messages=user("Weather in Paris?"), temperature=0)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == REASONING
    assert m.tool_calls is None
    assert m.content.startswith("<tool_call><function=get_weather>")
    assert r.choices[0].finish_reason == "stop"


def test_tool_call_parsed(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=user("Weather in Paris?"), temperature=0,
                                       tools=[WEATHER_TOOL])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.model_extra["reasoning_content"] == REASONING
    assert not c.message.content
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id


def test_tool_choice_none_hides_tools(client):
    with_tools = client.chat.completions.create(model=MODEL_ID, messages=user("Weather?"), temperature=0,
                                                tools=[WEATHER_TOOL], max_tokens=1)
    none = client.chat.completions.create(model=MODEL_ID, messages=user("Weather?"), temperature=0,
                                          tools=[WEATHER_TOOL], tool_choice="none")
    plain = client.chat.completions.create(model=MODEL_ID, messages=user("Weather?"), temperature=0, max_tokens=1)
    # "none" renders the prompt without the tools block and parses no calls.
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


def test_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL_ID, messages=user("Weather in Paris?"), temperature=0, tools=[WEATHER_TOOL])
    full = client.chat.completions.create(**kw)
    content, reasoning, calls, finish, chunks = stream_chat(client, stream_options={"include_usage": True}, **kw)
    assert reasoning == full.choices[0].message.model_extra["reasoning_content"]
    assert content == (full.choices[0].message.content or "")
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"]
    # Several chunks carry reasoning: it streams token by token.
    assert sum(1 for ch in chunks if ch.choices and (ch.choices[0].delta.model_extra or {}).get("reasoning_content")) > 5
    assert chunks[0].choices[0].delta.role == "assistant"
    # include_usage: a last chunk with no choices and the usage; earlier chunks have usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stream_raw_sse_ends_with_done(server):
    body = {"model": MODEL_ID, "messages": user("Hi"), "stream": True, "max_tokens": 5, **NO_THINK}
    r = requests.post(server.url + "/v1/chat/completions", json=body, stream=True)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[6:])


def test_tool_call_round_trip(client):
    msgs = user("Weather in Paris?")
    first = client.chat.completions.create(model=MODEL_ID, messages=msgs, temperature=0, tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]
    msgs = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    second = client.chat.completions.create(model=MODEL_ID, messages=msgs, temperature=0, tools=[WEATHER_TOOL])
    # The history (call arguments given as a JSON string, a tool result) rendered and ran.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].finish_reason == "tool_calls"
    assert json.loads(second.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_tool_choice_named_forces_a_call(client):
    # Thinking off: the model's own continuation is the plain answer; a named tool_choice must still
    # yield a call of that function (its opening is written for the model, which continues from there).
    tool2 = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    r = client.chat.completions.create(model=MODEL_ID, messages=user("Hi"), temperature=0, max_tokens=20,
                                       tools=[WEATHER_TOOL, tool2], extra_body=NO_THINK,
                                       tool_choice={"type": "function", "function": {"name": "lookup"}})
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "lookup"
    json.loads(calls[0].function.arguments)


def test_stop_strings(client, scripts):
    text = scripts["answer"]["text"]  # "Hello! The answer is 42 from a tiny model."
    kw = dict(model=MODEL_ID, messages=user("Hi"), temperature=0, extra_body=NO_THINK)
    for stop in [" answer", "swer is 4", "Hello", "42 from", "l."]:
        want = text[:text.index(stop)]
        r = client.chat.completions.create(stop=[stop, "never appears"], **kw)
        assert r.choices[0].message.content == want, stop
        assert r.choices[0].finish_reason == "stop"
        content, _, _, finish, _ = stream_chat(client, stop=stop, **kw)
        assert content == want and finish == "stop", stop
    r = client.chat.completions.create(stop="never appears", **kw)
    assert r.choices[0].message.content == text


def test_stop_string_in_random_text(client):
    # Learn a greedy continuation of the random model, then stop on a piece from its middle that
    # starts and ends inside tokens.
    kw = dict(model=MODEL_ID, prompt="Once upon a time", temperature=0, max_tokens=40,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    assert len(text) > 20
    stop = text[7:15]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs(client, scripts):
    r = client.chat.completions.create(model=MODEL_ID, messages=user("Hi"), temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=NO_THINK)
    lp = r.choices[0].logprobs.content
    assert len(lp) == len(scripts["answer"]["tokens"])  # the end-of-turn token has no entry
    assert "".join(t.token for t in lp) == r.choices[0].message.content
    for t in lp:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert bytes(t.bytes).decode() == t.token
    # streaming returns the same entries
    entries = []
    for ch in client.chat.completions.create(model=MODEL_ID, messages=user("Hi"), temperature=0, logprobs=True,
                                             top_logprobs=3, extra_body=NO_THINK, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            entries += ch.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [(e.token, round(e.logprob, 4)) for e in lp]


def test_completion_logprobs_and_token_prompt(client, hf_tokenizer):
    ids = hf_tokenizer.encode("The quick brown fox").ids
    a = client.completions.create(model=MODEL_ID, prompt=ids, temperature=0, max_tokens=12, logprobs=2,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL_ID, prompt="The quick brown fox", temperature=0, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL_ID, prompt="Seeds", temperature=1.0, top_p=0.9, max_tokens=30, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 99}).choices[0].text
    assert a == b
    assert a != c


def test_cached_tokens_on_second_turn(server, client, scripts, hf_tokenizer):
    convo = user("Tell me something about caching, please.")
    hits0 = server.metric("tansy_prefix_cache_hits_total")
    first = client.chat.completions.create(model=MODEL_ID, messages=convo, temperature=0, extra_body=NO_THINK)
    answer = first.choices[0].message.content
    assert answer == scripts["answer"]["text"]
    convo2 = convo + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL_ID, messages=convo2, temperature=0, extra_body=NO_THINK)
    # Everything before the first turn's assistant header is reused: the first prompt minus its
    # generation prompt.
    gen_prompt = len(hf_tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n").ids)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - gen_prompt
    assert server.metric("tansy_prefix_cache_hits_total") >= hits0 + 1
    assert server.metric("tansy_prefix_cache_cached_tokens_total") >= second.usage.prompt_tokens_details.cached_tokens
    # A cache hit must not change the result: the same request again, now fully cached up to the cut.
    again = client.chat.completions.create(model=MODEL_ID, messages=convo2, temperature=0, extra_body=NO_THINK)
    assert again.choices[0].message.content == second.choices[0].message.content


def test_cache_hit_gives_identical_sampled_text(client):
    kw = dict(model=MODEL_ID, temperature=0.8, seed=5, max_tokens=25, extra_body={"ignore_eos": True})
    cold = client.completions.create(prompt="A long shared prefix for the cache test, then: one", **kw)
    warm = client.completions.create(prompt="A long shared prefix for the cache test, then: one", **kw)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert warm.choices[0].text == cold.choices[0].text


def test_concurrent_clients_match_running_alone(server):
    from openai import OpenAI
    jobs = [dict(prompt=f"Story number {i}:", seed=i, temperature=1.0, max_tokens=30) for i in range(5)]
    chat_jobs = [dict(messages=user(f"Question {i}?"), seed=i, temperature=0.7, max_tokens=30) for i in range(3)]

    def run(job):
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        if "prompt" in job:
            return c.completions.create(model=MODEL_ID, extra_body={"ignore_eos": True}, **job).choices[0].text
        return c.chat.completions.create(model=MODEL_ID, **job).choices[0].message.model_dump_json(
            include={"content", "tool_calls"})

    all_jobs = jobs + chat_jobs
    alone = [run(j) for j in all_jobs]
    with cf.ThreadPoolExecutor(len(all_jobs)) as ex:
        together = list(ex.map(run, all_jobs))
    assert together == alone
    # The random continuations differ from each other (the chat ones may all follow a script).
    assert len(set(alone[:len(jobs)])) == len(jobs)


def test_cancellation_stops_generation(server):
    # A streaming request abandoned after a few chunks: the server stops computing it.
    gen0 = server.metric("tansy_generation_tokens_total")
    body = {"model": MODEL_ID, "prompt": "Never ending", "max_tokens": MAX_SEQ - 16, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # Wait until the server has finished with it (the metric moves when the request ends).
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("tansy_generation_tokens_total") == gen0:
        time.sleep(0.05)
    generated = server.metric("tansy_generation_tokens_total") - gen0
    assert 0 < generated < body["max_tokens"] / 2, generated

    # A non-streaming request whose client gives up: same.
    gen1 = server.metric("tansy_generation_tokens_total")
    t0 = time.time()
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/v1/completions", timeout=0.5,
                      json={**body, "stream": False})
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("tansy_generation_tokens_total") == gen1:
        time.sleep(0.05)
    assert server.metric("tansy_generation_tokens_total") - gen1 < body["max_tokens"]
    # The server is free again right away.
    r = requests.post(server.url + "/v1/completions", json={"model": MODEL_ID, "prompt": "x", "max_tokens": 2},
                      timeout=30)
    assert r.status_code == 200
    assert time.time() - t0 < 20


def test_metrics_exposition(server, client):
    client.chat.completions.create(model=MODEL_ID, messages=user("Hi"), max_tokens=3, extra_body=NO_THINK)
    text = requests.get(server.url + "/metrics").text
    for name in ["tansy_requests_total", "tansy_prompt_tokens_total", "tansy_generation_tokens_total",
                 "tansy_queue_depth", "tansy_time_to_first_token_seconds_bucket",
                 "tansy_inter_token_latency_seconds_bucket", "tansy_prefix_cache_hits_total"]:
        assert name in text, name
    assert server.metric("tansy_time_to_first_token_seconds_count") >= 1
    assert 'tansy_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.split(" ")) == 2, line
