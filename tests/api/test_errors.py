"""Every error the API promises, with its status and OpenAI's error shape; malformed raw HTTP;
and a bounded fuzz run of random bodies (no crash, always a JSON answer with a sane status)."""
import json
import random
import socket
import threading
import time

import openai
import pytest
import requests

from api_support import MAX_SEQ, MODEL_ID

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(server, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"},
                         timeout=kw.pop("timeout", 60), **kw)


def expect_error(r, status, param=None, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def chat(**kw):
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


@pytest.mark.parametrize("body,param", [
    (chat(n=2), "n"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}}),
     "response_format.json_schema.schema"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=3), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=1.5), "max_tokens"),
    (chat(stream="yes"), "stream"),
    (chat(stop=[1, 2]), "stop"),
    (chat(stop=""), "stop"),
    (chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(seed="x"), "seed"),
    (chat(logit_bias={"abc": 1}), "logit_bias"),
    (chat(logit_bias={"5": 1000}), "logit_bias"),
    (chat(tool_choice="sometimes"), "tool_choice"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=[{"type": "function"}]), "tools[0]"),
    (chat(audio={"voice": "x"}), "audio"),
    (chat(reasoning_effort="high"), "reasoning_effort"),
    ({"model": MODEL_ID}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hello"), "messages"),
    (chat(messages=[{"content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "messages[0].content[0].type"),
    (chat(messages=[{"role": "system", "content": "x"}, {"role": "system", "content": "y"}]), "messages"),
    (chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]), "messages"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "model"),
])
def test_chat_400(server, body, param):
    expect_error(post(server, CHAT, body), 400, param)


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL_ID}, "prompt"),
    ({"model": MODEL_ID, "prompt": []}, "prompt"),
    ({"model": MODEL_ID, "prompt": [1, "a"]}, "prompt"),
    ({"model": MODEL_ID, "prompt": [-1]}, "prompt"),
    ({"model": MODEL_ID, "prompt": [10 ** 9]}, "prompt"),
    ({"model": MODEL_ID, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL_ID, "prompt": "x", "echo": True}, "echo"),
    ({"model": MODEL_ID, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": MODEL_ID, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL_ID, "prompt": "x", "logprobs": 99}, "logprobs"),
])
def test_completion_400(server, body, param):
    expect_error(post(server, COMPLETIONS, body), 400, param)


def test_openai_client_raises_the_right_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], n=3)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"


def test_context_overflow(server):
    err = expect_error(post(server, CHAT, chat(max_tokens=MAX_SEQ)), 400, "messages", "context_length_exceeded")
    assert str(MAX_SEQ) in err["message"]
    long_prompt = "word " * (MAX_SEQ + 10)
    expect_error(post(server, COMPLETIONS, {"model": MODEL_ID, "prompt": long_prompt}), 400, "prompt",
                 "context_length_exceeded")
    expect_error(post(server, CHAT, chat(messages=[{"role": "user", "content": long_prompt}], max_tokens=None)), 400,
                 "messages", "context_length_exceeded")


def test_unknown_model_404(server):
    expect_error(post(server, CHAT, chat(model="nope")), 404, "model", "model_not_found")
    expect_error(post(server, COMPLETIONS, {"model": "nope", "prompt": "x"}), 404, "model")
    assert requests.get(server.url + "/v1/models/nope").status_code == 404


def test_unknown_fields_are_ignored(server):
    r = post(server, CHAT, chat(my_client_extension={"a": 1}, another=5))
    assert r.status_code == 200, r.text
    # The request's log line is written after its response is sent: wait for it.
    deadline = time.time() + 10
    while "my_client_extension" not in server.log_text() and time.time() < deadline:
        time.sleep(0.05)
    assert "my_client_extension" in server.log_text()


@pytest.mark.parametrize("data", [b"", b"{", b"[1, 2]", b"null", b'"str"', b"{\"model\": }", b"\xff\xfe{}",
                                  b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
                                  b"[" * 10000 + b"]" * 10000])
def test_malformed_json(server, data):
    expect_error(post(server, CHAT, data), 400)


def test_unknown_route_and_method(server):
    r = requests.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = requests.get(server.url + CHAT)
    assert r.status_code in (404, 405) and "error" in r.json()


def raw_http(server, payload, read_timeout=10):
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_timeout) as s:
        s.sendall(payload)
        chunks = []
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
        except socket.timeout:
            pass
    return b"".join(chunks)


@pytest.mark.parametrize("payload", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{",  # short body
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\n" + b"X: " + b"a" * 100000 + b"\r\n\r\n",
])
def test_raw_malformed_http_does_not_hurt(server, payload):
    raw_http(server, payload, read_timeout=3)
    assert server.alive()
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_api_key(start_server):
    s = start_server("auth", "--api-key", "sekret")
    from openai import OpenAI
    body = chat()
    expect_error(post(s, CHAT, body), 401, code="invalid_api_key")
    expect_error(requests.post(s.url + CHAT, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    expect_error(requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekre"}), 401)
    ok = requests.post(s.url + CHAT, json=body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=s.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0).models.list().data[0].id == MODEL_ID
    assert requests.get(s.url + "/health").status_code == 200  # health checks need no key


def test_body_too_large(start_server):
    s = start_server("small-body", "--max-body-mb", "1")
    big = chat(messages=[{"role": "user", "content": "x" * (2 << 20)}])
    expect_error(post(s, CHAT, big), 413)
    assert post(s, CHAT, chat()).status_code == 200


def long_request(s, results, i, max_tokens=MAX_SEQ - 32):
    body = {"model": MODEL_ID, "prompt": f"busy {i}", "max_tokens": max_tokens, "ignore_eos": True}
    try:
        results[i] = post(s, COMPLETIONS, body, timeout=120)
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        results[i] = e


def test_queue_full_503(start_server):
    s = start_server("queue", "--max-queue", "1", "--max-running", "1")
    results = {}
    threads = [threading.Thread(target=long_request, args=(s, results, i)) for i in range(2)]
    threads[0].start()
    deadline = time.time() + 30
    while time.time() < deadline and s.metric("tansy_requests_running") < 1:
        time.sleep(0.02)
    threads[1].start()
    while time.time() < deadline and s.metric("tansy_queue_depth") < 1:
        time.sleep(0.02)
    assert s.metric("tansy_queue_depth") == 1
    expect_error(post(s, CHAT, chat()), 503, code="queue_full")
    for t in threads:
        t.join()
    assert [results[i].status_code for i in range(2)] == [200, 200]
    assert post(s, CHAT, chat()).status_code == 200


def test_request_timeout(start_server):
    s = start_server("timeout", "--timeout", "0.5")
    r = post(s, COMPLETIONS, {"model": MODEL_ID, "prompt": "slow", "max_tokens": MAX_SEQ - 32, "ignore_eos": True})
    expect_error(r, 504, code="timeout")
    # streaming: the error arrives as an event, then [DONE]
    r = requests.post(s.url + COMPLETIONS, stream=True, timeout=60, json={
        "model": MODEL_ID, "prompt": "slow", "max_tokens": MAX_SEQ - 32, "ignore_eos": True, "stream": True})
    events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "timeout"
    assert post(s, COMPLETIONS, {"model": MODEL_ID, "prompt": "fast", "max_tokens": 2}).status_code == 200


# ---- fuzz -----------------------------------------------------------------------------------

FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop", "logprobs", "top_logprobs", "tools", "tool_choice", "n", "logit_bias",
          "response_format", "chat_template_kwargs", "enable_thinking", "ignore_eos", "echo", "suffix", "junk"]


def rand_value(rng, depth=0):
    kinds = ["int", "float", "str", "bool", "null", "list", "obj", "bigint", "neg"]
    if depth > 3:
        kinds = kinds[:5]
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(0, 40)
    if k == "bigint":
        return rng.choice([2 ** 31, 2 ** 63, 2 ** 64 + 5, 10 ** 30])
    if k == "neg":
        return -rng.randint(1, 10 ** 6)
    if k == "float":
        return rng.choice([0.0, 0.5, 1.0, 2.5, -1e9, 1e308, float("nan")])
    if k == "str":
        return rng.choice(["", "tiny", "user", "auto", "none", "required", "\u00e9\u4e2d", "<tool_call>", "\x00",
                           "</think>", "a" * rng.randint(0, 300)])
    if k == "bool":
        return rng.random() < 0.5
    if k == "null":
        return None
    if k == "list":
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(FIELDS + ["role", "content", "type", "function", "name", "text"]): rand_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def rand_message(rng):
    m = {"role": rng.choice(["user", "system", "assistant", "tool", "x", None]),
         "content": rng.choice(["hello", "", None, [{"type": "text", "text": "hi"}], 5, [{"type": "image"}]])}
    if rng.random() < 0.2:
        m["tool_calls"] = [{"id": "c", "type": "function",
                            "function": {"name": rng.choice(["f", 1]),
                                         "arguments": rng.choice(['{"a": 1}', "{", '"s"', {"a": 1}])}}]
    if rng.random() < 0.1:
        m["reasoning_content"] = rand_value(rng)
    return m


def rand_body(rng, chat):
    body = {"model": MODEL_ID if rng.random() < 0.8 else rand_value(rng)}
    if chat:
        body["messages"] = [rand_message(rng) for _ in range(rng.randint(1, 4))] if rng.random() < 0.9 else \
            rand_value(rng)
    else:
        body["prompt"] = rng.choice(["hello", [1, 2, 3], rand_value(rng)])
    for _ in range(rng.randint(0, 6)):
        body[rng.choice(FIELDS)] = rand_value(rng)
    # Keep the run bounded: most bodies ask for few tokens.
    if rng.random() < 0.9:
        body["max_tokens"] = rng.randint(1, 4)
    return body


def test_fuzz_random_bodies(server):
    rng = random.Random(20261130)
    statuses = {}
    for i in range(300):
        chat = rng.random() < 0.6
        body = rand_body(rng, chat)
        text = json.dumps(body, allow_nan=True)
        if rng.random() < 0.1:  # also damage the JSON itself
            cut = rng.randint(0, len(text))
            text = text[:cut] + rng.choice(["", "}", "\"", "\\", ",", "\u0000"]) + text[cut + 1:]
        stream = isinstance(body, dict) and body.get("stream") is True
        r = requests.post(server.url + (CHAT if chat else COMPLETIONS), data=text.encode("utf-8", "surrogatepass"),
                          headers={"Content-Type": "application/json"}, timeout=120, stream=stream)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404), (r.status_code, text, r.text[:300])
        if r.status_code != 200:
            expect_error(r, r.status_code)
        elif stream:
            events = [line for line in r.iter_lines(decode_unicode=True) if line]
            assert events[-1] == "data: [DONE]", (text, events[-3:])
            for e in events[:-1]:
                json.loads(e[6:])
        else:
            assert "choices" in r.json()
    assert server.alive()
    assert statuses.get(400, 0) > 50 and statuses.get(200, 0) > 10, statuses
