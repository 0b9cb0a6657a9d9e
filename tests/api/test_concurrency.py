"""Many requests at once through HTTP (issue 16): every request, streamed or not, chat or
completion, greedy or seeded sampling, gets the same answer among others as alone; the gauges
report what runs and waits; a client that leaves mid-stream or reads slowly holds up nobody."""
import json
import socket
import threading
import time

import requests

from api_support import MODEL_ID

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def bodies():
    out = []
    for i in range(8):
        sampling = [{"temperature": 0},
                    {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 100 + i},
                    {"temperature": 1.0, "seed": 7 + i, "logprobs": 2},
                    {"temperature": 0.8, "presence_penalty": 1.5, "seed": 3 * i}][i % 4]
        if i % 2 == 0:
            body = {"model": MODEL_ID, "prompt": f"request {i}: " + "word " * (3 + 7 * i),
                    "max_tokens": 24 + i, "ignore_eos": True, **sampling}
            if "logprobs" in body:
                body["logprobs"] = 2
            out.append((COMPLETIONS, body))
        else:
            body = {"model": MODEL_ID, "messages": [{"role": "user", "content": f"conversation {i} " * (1 + i)}],
                    "max_tokens": 20 + i, **sampling}
            if "logprobs" in body:
                body["logprobs"], body["top_logprobs"] = True, 2
            out.append((CHAT, body))
    return out


def answer(server, path, body, stream):
    """The answer's text, logprobs and finish reason, from a plain or a streamed response."""
    b = dict(body, stream=stream)
    r = requests.post(server.url + path, json=b, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        c = r.json()["choices"][0]
        text = c["text"] if path == COMPLETIONS else (c["message"].get("reasoning_content") or "") + "|" + (
            c["message"].get("content") or "")
        return text, json.dumps(c.get("logprobs")), c["finish_reason"]
    text, reasoning, lps, finish = "", "", [], None
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        c = json.loads(line[6:])["choices"][0]
        if path == COMPLETIONS:
            text += c["text"]
            if c.get("logprobs"):
                lps += c["logprobs"]["token_logprobs"]
        else:
            text += c["delta"].get("content") or ""
            reasoning += c["delta"].get("reasoning_content") or ""
            if c.get("logprobs"):
                lps += [e["logprob"] for e in c["logprobs"]["content"]]
        finish = c.get("finish_reason") or finish
    return (text if path == COMPLETIONS else reasoning + "|" + text), json.dumps(lps), finish


def logprob_values(path, plain):
    """A plain answer's logprobs as the list a stream gives."""
    lp = json.loads(plain)
    if lp is None:
        return json.dumps([])
    return json.dumps(lp["token_logprobs"] if path == COMPLETIONS else [e["logprob"] for e in lp["content"]])


def test_answers_among_others_equal_answers_alone(start_server):
    s = start_server("concurrency", "--max-running", "4", "--max-queue", "32", "--prefill-chunk", "16")
    reqs = bodies()
    alone = [answer(s, p, b, False) for p, b in reqs]
    steps_alone = s.metric("tansy_engine_steps_total")
    results = {}

    def go(i, stream):
        p, b = reqs[i]
        results[(i, stream)] = answer(s, p, b, stream)

    threads = [threading.Thread(target=go, args=(i, st)) for i in range(len(reqs)) for st in (False, True)]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, s.metric("tansy_requests_running"))
        assert s.metric("tansy_requests_running") <= 4
        time.sleep(0.01)
    for t in threads:
        t.join()
    for i, (p, _) in enumerate(reqs):
        text, lps, finish = alone[i]
        assert results[(i, False)] == alone[i], i
        st_text, st_lps, st_finish = results[(i, True)]
        assert (st_text, st_finish) == (text, finish), i
        assert st_lps == logprob_values(p, lps), i
    # 16 requests of 20-31 tokens each in fewer steps than alone: they shared steps.
    steps_together = s.metric("tansy_engine_steps_total") - steps_alone
    assert steps_together < steps_alone, (steps_together, steps_alone)
    assert peak >= 2
    h = requests.get(s.url + "/health", timeout=10).json()
    assert h["max_running"] == 4 and h["running"] == 0 and h["waiting"] == 0, h
    assert 1 <= h["pool"]["used"] <= h["pool"]["states"], h
    assert s.metric("tansy_state_pool_used") <= s.metric("tansy_state_pool_states")


def test_a_stalled_reader_and_a_leaver_hold_up_nobody(start_server):
    s = start_server("concurrency-stall", "--max-running", "4")
    body = {"model": MODEL_ID, "prompt": "a long answer", "max_tokens": 900, "ignore_eos": True, "stream": True}
    # A client that sends its request and never reads: the server's writes fill the socket buffers.
    stalled = socket.create_connection(("127.0.0.1", s.port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payload = json.dumps(body).encode()
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    # One that leaves after its first chunk.
    leaver = requests.post(s.url + COMPLETIONS, json=body, stream=True, timeout=60)
    next(leaver.iter_lines())
    leaver.close()
    try:
        t0 = time.time()
        r = requests.post(s.url + COMPLETIONS, timeout=60,
                          json={"model": MODEL_ID, "prompt": "quick", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert time.time() - t0 < 20
        # The leaver's request ends; the stalled one at most holds its place (sitting out the steps
        # once 16 tokens wait for it; unless the socket buffers took its whole answer).
        deadline = time.time() + 30
        while time.time() < deadline and s.metric("tansy_requests_running") > 1:
            time.sleep(0.05)
        assert s.metric("tansy_requests_running") <= 1
    finally:
        stalled.close()
    deadline = time.time() + 30
    while time.time() < deadline and s.metric("tansy_requests_running") > 0:
        time.sleep(0.05)
    assert s.metric("tansy_requests_running") == 0
