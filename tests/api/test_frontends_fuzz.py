"""Random and damaged bodies for /v1/messages, /v1/responses, /tokenize and /detokenize: every answer
is a 200 or a 4xx in the endpoint's error shape, never a 500, a hang or a dead server; plus the
Anthropic shape of 413 and of a full queue (529)."""
import json
import random
import threading
import time

import requests

from api_support import MAX_SEQ, MODEL_ID

KEYS = ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
        "tool_choice", "thinking", "metadata", "stream", "input", "instructions", "max_output_tokens", "text",
        "reasoning", "store", "previous_response_id", "prompt", "tokens", "return_token_strs", "type", "role",
        "content", "name", "input_schema", "budget_tokens", "call_id", "arguments", "output", "id", "tool_use_id",
        "is_error", "format", "effort", "junk"]


def rand_value(rng, depth=0):
    kinds = ["int", "float", "str", "bool", "null", "list", "obj", "big"]
    k = rng.choice(kinds[:5] if depth > 3 else kinds)
    if k == "int":
        return rng.randint(-3, 40)
    if k == "big":
        return rng.choice([2 ** 31, 2 ** 63, 2 ** 64 + 5, -10 ** 30])
    if k == "float":
        return rng.choice([0.0, 0.5, 1.0, 2.5, -1e9, 1e308])
    if k == "str":
        return rng.choice(["", "tiny", "user", "assistant", "text", "tool_use", "tool_result", "thinking", "enabled",
                           "auto", "any", "tool", "none", "function", "function_call", "function_call_output",
                           "reasoning", "message", "input_text", "json_schema", "\u00e9\u4e2d", "\x00", "</think>"])
    if k == "bool":
        return rng.random() < 0.5
    if k == "null":
        return None
    if k == "list":
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def anthropic_block(rng):
    return rng.choice([
        {"type": "text", "text": rng.choice(["hi", "", 5])},
        {"type": "tool_use", "id": "t1", "name": "f", "input": rng.choice([{}, {"a": 1}, "x"])},
        {"type": "tool_result", "tool_use_id": "t1", "content": rng.choice(["ok", [{"type": "text", "text": "r"}], 3]),
         "is_error": rng.choice([True, False, "x"])},
        {"type": "thinking", "thinking": "hmm", "signature": rng.choice(["", None, 1])},
        rand_value(rng),
    ])


def anthropic_body(rng):
    body = {"model": MODEL_ID if rng.random() < 0.9 else rand_value(rng), "max_tokens": rng.randint(1, 4)}
    body["messages"] = [{"role": "user", "content": "hi"}] if rng.random() < 0.4 else [
                        {"role": rng.choice(["user", "assistant", "system"]),
                         "content": rng.choice(["hi", [anthropic_block(rng) for _ in range(rng.randint(0, 3))],
                                                rand_value(rng)])} for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.3:
        return body
    if rng.random() < 0.3:
        body["tools"] = [{"name": rng.choice(["f", "get_weather", "bad name", 1]),
                          "input_schema": rng.choice([{"type": "object"}, [], None])}]
    if rng.random() < 0.3:
        body["thinking"] = {"type": rng.choice(["enabled", "disabled", "x"]), "budget_tokens": rand_value(rng)}
    if rng.random() < 0.3:
        body["tool_choice"] = {"type": rng.choice(["auto", "any", "tool", "none", 5]), "name": "f"}
    for _ in range(rng.randint(0, 4)):
        body[rng.choice(KEYS)] = rand_value(rng)
    if rng.random() < 0.9 and isinstance(body.get("max_tokens"), int) and not 0 < body["max_tokens"] <= 4:
        body["max_tokens"] = 3
    return body


def responses_body(rng):
    item = lambda: rng.choice([  # noqa: E731
        {"role": rng.choice(["user", "assistant", "developer", "x"]),
         "content": rng.choice(["hi", [{"type": "input_text", "text": "a"}], [{"type": "input_image"}], 4])},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": rng.choice(["{}", "{", 1])},
        {"type": "function_call_output", "call_id": "c", "output": rng.choice(["ok", 1, None])},
        {"type": "reasoning", "content": rng.choice([[{"type": "reasoning_text", "text": "r"}], "x"]), "summary": []},
        rand_value(rng)])
    body = {"model": MODEL_ID if rng.random() < 0.9 else rand_value(rng), "max_output_tokens": rng.randint(1, 4),
            "input": rng.choice(["hi", [item() for _ in range(rng.randint(0, 3))], rand_value(rng)])}
    if rng.random() < 0.3:
        body["tools"] = [{"type": rng.choice(["function", "web_search"]), "name": rng.choice(["f", "", 3]),
                          "parameters": rng.choice([{"type": "object"}, []])}]
    for _ in range(rng.randint(0, 4)):
        body[rng.choice(KEYS)] = rand_value(rng)
    if rng.random() < 0.9:
        body["max_output_tokens"] = rng.randint(1, 4)
    return body


def tokenize_body(rng):
    body = rng.choice([{"prompt": rand_value(rng)}, {"prompt": "some text"}, {"messages": [{"role": "user", "content": "hi"}]},
                       {"messages": [{"role": "user", "content": rand_value(rng)}]}])
    for _ in range(rng.randint(0, 2)):
        body[rng.choice(KEYS)] = rand_value(rng)
    return body


def detokenize_body(rng):
    body = rng.choice([{"tokens": [rng.randint(-5, 9000) for _ in range(rng.randint(0, 4))]}, {"tokens": rand_value(rng)}])
    for _ in range(rng.randint(0, 2)):
        body[rng.choice(KEYS)] = rand_value(rng)
    return body


def check_anthropic_error(r):
    j = r.json()
    assert j["type"] == "error" and isinstance(j["error"]["type"], str) and isinstance(j["error"]["message"], str), j


def check_openai_error(r):
    e = r.json()["error"]
    assert isinstance(e["message"], str) and isinstance(e["type"], str), e


def test_fuzz(server):
    rng = random.Random(20261201)
    statuses = {}
    for i in range(300):
        kind = rng.choice(["messages", "responses", "tokenize", "detokenize"])
        body = {"messages": anthropic_body, "responses": responses_body, "tokenize": tokenize_body,
                "detokenize": detokenize_body}[kind](rng)
        text = json.dumps(body)
        if rng.random() < 0.1:
            cut = rng.randint(0, len(text))
            text = text[:cut] + rng.choice(["", "}", "\"", "\\", ","]) + text[cut + 1:]
        path = {"messages": "/v1/messages", "responses": "/v1/responses"}.get(kind, "/" + kind)
        stream = isinstance(body, dict) and body.get("stream") is True
        r = requests.post(server.url + path, data=text.encode("utf-8", "surrogatepass"), timeout=120, stream=stream,
                          headers={"Content-Type": "application/json"})
        statuses[(kind, r.status_code)] = statuses.get((kind, r.status_code), 0) + 1
        assert r.status_code in (200, 400, 404), (r.status_code, path, text, r.text[:300])
        if r.status_code != 200:
            (check_anthropic_error if kind == "messages" else check_openai_error)(r)
        elif stream:
            lines = [line for line in r.iter_lines(decode_unicode=True) if line]
            names = [line[7:] for line in lines if line.startswith("event: ")]
            assert names and names[-1] in ("message_stop", "response.completed", "response.incomplete"), names[-3:]
            for line in lines:
                if line.startswith("data: "):
                    json.loads(line[6:])
        else:
            r.json()
    assert server.alive()
    for kind in ["messages", "responses", "tokenize", "detokenize"]:
        assert statuses.get((kind, 400), 0) > 5 and statuses.get((kind, 200), 0) > 3, statuses


def test_anthropic_413(start_server):
    s = start_server("anthropic-small-body", "--max-body-mb", "1")
    big = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = requests.post(s.url + "/v1/messages", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    r = requests.post(s.url + "/v1/responses", json={"model": MODEL_ID, "input": "x" * (2 << 20)}, timeout=60)
    assert r.status_code == 413 and "error" in r.json() and "type" in r.json()["error"]


def test_anthropic_overloaded_529(start_server):
    s = start_server("anthropic-queue", "--max-queue", "1", "--max-running", "1")
    results = {}

    def long_request(i):
        body = {"model": MODEL_ID, "prompt": f"busy {i}", "max_tokens": MAX_SEQ - 32, "ignore_eos": True}
        results[i] = requests.post(s.url + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(2)]
    threads[0].start()
    deadline = time.time() + 30
    while time.time() < deadline and s.metric("tansy_requests_running") < 1:
        time.sleep(0.02)
    threads[1].start()
    while time.time() < deadline and s.metric("tansy_queue_depth") < 1:
        time.sleep(0.02)
    r = requests.post(s.url + "/v1/messages", timeout=30,
                      json={"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error", r.text
    r = requests.post(s.url + "/v1/responses", json={"model": MODEL_ID, "input": "Hi"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join()
    assert [results[i].status_code for i in range(2)] == [200, 200]


def test_malformed_requests_do_not_disturb_a_running_one(server):
    # A long greedy generation runs while malformed requests hit every new endpoint: those are
    # answered at once (validation precedes the queue) and the running one's text is unchanged.
    body = {"model": MODEL_ID, "prompt": "steady", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    result = {}
    t = threading.Thread(target=lambda: result.update(r=requests.post(server.url + "/v1/completions", json=body,
                                                                      timeout=120)))
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("tansy_requests_running") < 1:
        time.sleep(0.02)
    bad = [("/v1/messages", {"model": MODEL_ID, "messages": []}), ("/v1/messages", {"max_tokens": "x"}),
           ("/v1/responses", {"model": MODEL_ID, "input": 5}), ("/v1/responses", {"model": MODEL_ID, "store": True}),
           ("/tokenize", {"prompt": 1}), ("/detokenize", {"tokens": [-1]}),
           ("/v1/messages/count_tokens", {"model": MODEL_ID})]
    answered = 0
    while t.is_alive() and answered < 60:
        path, b = bad[answered % len(bad)]
        t0 = time.time()
        r = requests.post(server.url + path, json=b, timeout=30)
        assert r.status_code == 400 and time.time() - t0 < 5, (path, r.text)
        answered += 1
    t.join()
    assert answered >= len(bad)
    again = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    assert result["r"].status_code == again.status_code == 200
    assert result["r"].json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
