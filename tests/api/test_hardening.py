"""The server against hostile and careless clients (issue 20): metrics labels, exclusive bind,
type checks of every field, protocol details, the request log, browser safety and CORS, slow
clients. Everything runs on loopback and is bounded in time."""
import copy
import json
import re
import socket
import subprocess
import threading
import time

import pytest
import requests

from api_support import MAX_SEQ, MODEL_ID, TANSY, ServerProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}


def post(s, path, body, headers=None, **kw):
    return requests.post(s.url + path, data=json.dumps(body), headers={**JSON, **(headers or {})},
                         timeout=kw.pop("timeout", 60), **kw)


def error_of(r):
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def chat(**kw):
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


def raw(s, data, source="127.0.0.1", timeout=10):
    """A raw connection (from `source`, a loopback address) that sends `data`; returns the socket."""
    c = socket.create_connection(("127.0.0.1", s.port), timeout=timeout, source_address=(source, 0))
    if data:
        c.sendall(data)
    return c


def read_all(c):
    out = b""
    try:
        while True:
            b = c.recv(65536)
            if not b:
                break
            out += b
    except (socket.timeout, ConnectionResetError):
        pass
    return out


# ---- 1: metrics labels -----------------------------------------------------------------------

METRIC_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*",?)*\})? '
                         r'[-+0-9.eE]+(Inf)?$')


def check_exposition(text):
    families = set()
    for line in text.split("\n"):
        if not line:
            continue
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
        if line.startswith("#"):
            continue
        assert METRIC_LINE.match(line), line
    return families


def test_metrics_labels_come_from_a_fixed_set(start_server):
    s = start_server("metrics-key", "--api-key", "k")
    before = requests.get(s.url + "/metrics", timeout=10).content
    for i in range(300):
        r = requests.get(s.url + "/v1/" + ("%04x" % i) * 128, timeout=10)  # 512-byte paths
        assert r.status_code == 401
    for path in ["/v1/x%22%7D%201%0Afake_metric%7Ba%3D%22b", "/v1/bad%FFutf8%00nul", "/nope%0Afake_metric 1"]:
        assert requests.get(s.url + path, timeout=10).status_code in (401, 404)
    requests.get(s.url + "/nope/" + "z" * 500, timeout=10)
    after = requests.get(s.url + "/metrics", timeout=10).content
    text = after.decode("ascii")  # raw 0xFF or NUL bytes would fail here
    assert len(after) < len(before) + 2000, (len(before), len(after))
    families = check_exposition(text)
    assert all(f.startswith("tansy_") for f in families), families
    assert "fake_metric" not in text
    assert s.metric("tansy_unauthorized_requests_total") == 302
    endpoints = set(re.findall(r'tansy_requests_total\{endpoint="([^"]*)"', text))
    assert endpoints <= {"other", "/v1/models", "/health", "/metrics", "/v1/chat/completions", "/v1/completions"}


# ---- 3: exclusive bind -----------------------------------------------------------------------

def test_port_in_use_is_a_startup_error(server, tiny_model):
    p = subprocess.Popen([TANSY, "serve", "--model", tiny_model, "--served-model-name", MODEL_ID, "--threads", "1",
                          "--backend", "cpu", "--max-seq", str(MAX_SEQ), "--port", str(server.port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError("a second server on a port in use kept running:\n" + out)
    assert p.returncode != 0, out
    assert f"127.0.0.1:{server.port}" in out and "listening" not in out, out
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


# ---- 5: every field type-checked ----------------------------------------------------------

VALUES = {"null": None, "true": True, "false": False, "int": 1, "zero": 0, "neg": -1, "float": 0.5,
          "str": "no", "empty_str": "", "list": [], "list1": [1], "obj": {}, "obj1": {"a": 1}}

TOOL = {"type": "function", "function": {"name": "get", "description": "d", "strict": False,
                                         "parameters": {"type": "object", "properties": {}}}}
VALID_CHAT = {
    "model": MODEL_ID,
    "messages": [{"role": "system", "content": "s"},
                 {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "u"},
                 {"role": "assistant", "content": "", "reasoning_content": "r",
                  "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
                 {"role": "tool", "content": "t", "tool_call_id": "c1"}],
    "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "stream_options": {"include_usage": True},
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "seed": 1, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {"5": 1}, "stop": ["zz"],
    "logprobs": True, "top_logprobs": 1, "tools": [TOOL], "tool_choice": "auto", "n": 1,
    "response_format": {"type": "text"}, "modalities": ["text"],
    "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": False},
    "enable_thinking": False, "ignore_eos": False, "user": "u", "parallel_tool_calls": True, "store": False,
    "metadata": {"k": "v"}, "service_tier": "auto",
}
VALID_COMPLETION = {
    "model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "stream": False, "stream_options": {"include_usage": True},
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "seed": 1, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {"5": 1}, "stop": "zz", "logprobs": 1,
    "n": 1, "best_of": 1, "echo": False, "ignore_eos": False, "user": "u",
}

BOOLS = {"true", "false"}
NON_NUMBERS = {"true", "false", "str", "empty_str", "list", "list1", "obj", "obj1"}
NON_STRINGS = {"true", "false", "int", "zero", "neg", "float", "list", "list1", "obj", "obj1"}
NON_OBJECTS = {"true", "false", "int", "zero", "neg", "float", "str", "empty_str", "list", "list1"}
NUMBER_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "top_k", "seed", "max_tokens", "max_completion_tokens", "top_logprobs", "n", "best_of"}
BOOL_FIELDS = {"stream", "ignore_eos", "enable_thinking", "preserve_thinking", "include_usage",
               "parallel_tool_calls", "store", "strict", "echo"}
STRING_FIELDS = {"model", "user", "service_tier", "name", "tool_call_id", "description", "id", "text", "type",
                 "reasoning_content", "arguments_"}
OBJECT_FIELDS = {"stream_options", "metadata", "logit_bias", "response_format", "chat_template_kwargs", "function"}


def must_be_refused(path, kind, completion):
    """Whether the schema says this value has the wrong type (so a 400 is due, never a 200)."""
    if "parameters" in path:
        return False  # a JSON schema of the tool's own: passed to the template as given
    last = path[-1]
    if completion and path == ("logprobs",):
        return kind in NON_NUMBERS or kind == "float"
    if last in BOOL_FIELDS or (last == "logprobs" and not completion):
        return kind not in BOOLS and kind != "null"
    if last in NUMBER_FIELDS and len(path) == 1:
        return kind in NON_NUMBERS
    if last in STRING_FIELDS:
        return kind in NON_STRINGS
    if last in OBJECT_FIELDS:
        return kind in NON_OBJECTS
    if last in ("messages",):
        return kind != "list1" and kind != "list"
    return False


def paths(obj, prefix=()):
    """Every path to a value inside obj."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from paths(v, prefix + (i,))


def mutated(obj, path, value):
    o = copy.deepcopy(obj)
    t = o
    for p in path[:-1]:
        t = t[p]
    t[path[-1]] = value
    return o


def run_mutations(server, valid, endpoint):
    completion = endpoint == COMPLETIONS
    r = post(server, endpoint, valid)
    assert r.status_code == 200, r.text
    # The cases the issue found (500s, or wrong types accepted and ignored).
    must_refuse = {
        ("response_format", "type"): {"null", "int", "true", "list", "obj"},
        ("tools", 0, "type"): {"null", "int", "true", "list", "obj", "str"},
        ("chat_template_kwargs", "enable_thinking"): {"str", "int", "list", "obj"},
        ("user",): {"int", "true", "list", "obj"},
        ("parallel_tool_calls",): {"str", "int", "list", "obj"},
        ("max_tokens",): {"str", "float", "zero", "neg", "true", "list", "obj"},
    }
    checked = 0
    for path in paths(valid):
        for kind, value in VALUES.items():
            body = mutated(valid, path, value)
            r = post(server, endpoint, body)
            checked += 1
            where = ".".join(str(p) for p in path)
            assert r.status_code < 500, (where, kind, r.status_code, r.text)
            refuse = must_be_refused(path, kind, completion) or kind in must_refuse.get(path, set())
            if refuse:
                assert r.status_code == 400, (where, kind, r.status_code, r.text)
            if r.status_code != 200:
                assert 400 <= r.status_code < 500, (where, kind, r.status_code)
                err = error_of(r)
                assert isinstance(err["type"], str) and err["type"], (where, kind, err)
                assert err["param"], (where, kind, err)
                if refuse:  # the field at fault is named
                    assert err["param"].split(".")[0].split("[")[0] == str(path[0]), (where, kind, err)
    return checked


def test_every_chat_field_mutated_to_every_type(server):
    assert run_mutations(server, VALID_CHAT, CHAT) > 500


def test_every_completion_field_mutated_to_every_type(server):
    assert run_mutations(server, VALID_COMPLETION, COMPLETIONS) > 200


def test_max_tokens_checked_beside_max_completion_tokens(server):
    r = post(server, CHAT, chat(max_tokens="lots", max_completion_tokens=2))
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens", r.text


# ---- 8: protocol details -------------------------------------------------------------------

def test_wrong_method_gets_405_with_allow(server):
    r = requests.get(server.url + CHAT, timeout=10)
    assert r.status_code == 405 and "POST" in r.headers["Allow"], (r.status_code, r.headers)
    error_of(r)
    r = requests.post(server.url + "/health", data="{}", headers=JSON, timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["Allow"] and "POST" not in r.headers["Allow"]
    r = requests.delete(server.url + "/v1/models", timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["Allow"]
    r = requests.put(server.url + "/v1/models/" + MODEL_ID, timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["Allow"]
    assert requests.get(server.url + "/no/such/route", timeout=10).status_code == 404


def test_503_carries_retry_after(start_server):
    s = start_server("retry-after", "--max-queue", "0", "--max-running", "1")
    long = requests.post(s.url + COMPLETIONS, stream=True, timeout=60, headers=JSON, data=json.dumps(
        {"model": MODEL_ID, "prompt": "slow", "max_tokens": MAX_SEQ - 32, "ignore_eos": True, "stream": True}))
    try:
        # The line iterator is kept: a discarded one closes the connection (urllib3 drops a stream
        # left unread), the server then rightly ends the request, and its place is free again.
        lines = long.iter_lines()
        next(lines)
        r = post(s, CHAT, chat())
        assert r.status_code == 503, r.text
        assert error_of(r)["code"] == "queue_full"
        assert int(r.headers["Retry-After"]) >= 1, r.headers
        assert health_time(s) < 2  # connection threads are not generation slots
        assert s.metric("tansy_requests_running") == 1  # the first request still holds the place
    finally:
        long.close()


def test_developer_role_is_treated_as_system(server):
    def usage(role):
        r = post(server, CHAT, {"model": MODEL_ID, "max_tokens": 1, "temperature": 0,
                                "messages": [{"role": role, "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    assert usage("developer") == usage("system")


def test_empty_completion_prompt_is_accepted(server):
    r = post(server, COMPLETIONS, {"model": MODEL_ID, "prompt": "", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1
    r = post(server, COMPLETIONS, {"model": MODEL_ID, "prompt": [""], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_404_errors_use_a_documented_type(server):
    for r in (post(server, CHAT, {**chat(), "model": "other"}), requests.get(server.url + "/v1/models/other"),
              requests.get(server.url + "/no/such/route")):
        assert r.status_code == 404
        assert error_of(r)["type"] == "invalid_request_error", r.text


# ---- 6: the request log ---------------------------------------------------------------------

def test_log_lines_are_escaped_and_every_request_logged(start_server):
    s = start_server("log")
    body = chat()
    body["x\nFORGED status 200 admin"] = 1
    assert post(s, CHAT, body).status_code == 200
    requests.get(s.url + "/v1/%0AFORGED%20line", timeout=10)
    post(s, CHAT, {**chat(), "model": "m\nFORGED"})
    # a streamed request the client leaves, and a non-streamed one
    r = requests.post(s.url + COMPLETIONS, stream=True, timeout=60, headers=JSON, data=json.dumps(
        {"model": MODEL_ID, "prompt": "slow", "max_tokens": MAX_SEQ - 32, "ignore_eos": True, "stream": True}))
    next(r.iter_lines())
    r.close()
    c = raw(s, b"")
    b = json.dumps({"model": MODEL_ID, "prompt": "slow", "max_tokens": MAX_SEQ - 32, "ignore_eos": True}).encode()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(b), b))
    time.sleep(0.5)
    c.close()
    deadline = time.time() + 30
    while time.time() < deadline and sum("cancelled" in x for x in s.log_text().splitlines()) < 2:
        time.sleep(0.2)
    log = s.log_text()
    assert not any(line.startswith("FORGED") for line in log.splitlines()), log
    assert "x\\nFORGED" in log
    cancelled = [line for line in log.splitlines() if "cancelled" in line]
    assert len(cancelled) == 2, log
    assert any(" stream " in line and "499" in line for line in cancelled), cancelled
    requests_logged = [line for line in log.splitlines() if re.match(r"^(GET|POST) /", line)]
    assert len(requests_logged) >= 5, log


# ---- 4: browser safety and CORS -------------------------------------------------------------

def test_cross_origin_simple_post_does_not_run(server):
    tokens = server.metric("tansy_generation_tokens_total")
    body = json.dumps(chat())
    r = requests.post(server.url + CHAT, data=body, timeout=30,
                      headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert r.status_code == 403, r.text
    assert "Access-Control-Allow-Origin" not in r.headers
    r = requests.post(server.url + CHAT, data=body, timeout=30, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    r = requests.post(server.url + CHAT, data=body, timeout=30,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415, r.text
    r = requests.post(server.url + CHAT, data=body, timeout=30, headers={**JSON, "Origin": "http://evil.example"})
    assert r.status_code == 403, r.text
    assert server.metric("tansy_generation_tokens_total") == tokens
    # same origin (a page this server served) is not cross-origin
    r = requests.post(server.url + CHAT, data=body, timeout=30,
                      headers={"Content-Type": "application/json; charset=utf-8", "Origin": server.url})
    assert r.status_code == 200, r.text


def test_host_header_must_name_this_server(server):
    for host in ["evil.example", f"evil.example:{server.port}", "127.0.0.2.nip.io", "10.1.2.3", "[::2]", "a b"]:
        r = requests.get(server.url + "/v1/models", headers={"Host": host}, timeout=10)
        assert r.status_code == 421, (host, r.status_code)
        error_of(r)
    for host in [f"localhost:{server.port}", f"127.0.0.1:{server.port}", "localhost", f"[::1]:{server.port}"]:
        assert requests.get(server.url + "/v1/models", headers={"Host": host}, timeout=10).status_code == 200, host


def test_allowed_hosts_flag(start_server):
    s = start_server("hosts", "--allowed-hosts", "tansy.lan")
    assert requests.get(s.url + "/health", headers={"Host": "tansy.lan:8000"}, timeout=10).status_code == 200
    assert requests.get(s.url + "/health", headers={"Host": "other.lan"}, timeout=10).status_code == 421


def test_cors_for_allowed_origins(start_server):
    s = start_server("cors", "--allowed-origins", "http://app.example, http://localhost:3000")
    pre = requests.options(s.url + CHAT, timeout=10, headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert pre.status_code == 204, (pre.status_code, pre.text)
    h = pre.headers
    assert h["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in h["Access-Control-Allow-Methods"]
    allowed = {x.strip().lower() for x in h["Access-Control-Allow-Headers"].split(",")}
    assert {"content-type", "authorization"} <= allowed
    assert int(h["Access-Control-Max-Age"]) > 0 and "Origin" in h["Vary"]
    r = post(s, CHAT, chat(), headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    r = requests.get(s.url + "/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "http://app.example"
    bad = requests.options(s.url + CHAT, timeout=10, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 403 and "Access-Control-Allow-Origin" not in bad.headers
    wrong = requests.options(s.url + "/health", timeout=10, headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert wrong.status_code == 405
    # streaming answers carry the header too
    r = post(s, CHAT, chat(stream=True), headers={"Origin": "http://app.example"}, stream=True)
    assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert list(r.iter_lines())[-2] == b"data: [DONE]"


def test_no_origin_is_allowed_by_default(server):
    pre = requests.options(server.url + CHAT, timeout=10, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 403 and "Access-Control-Allow-Origin" not in pre.headers


# ---- 2: slow clients ------------------------------------------------------------------------

def health_time(s):
    t = time.time()
    assert requests.get(s.url + "/health", timeout=10).status_code == 200
    return time.time() - t


def test_slow_clients_do_not_stall_health(start_server):
    # The old worker pool was --max-queue + 8 threads: 12 trickling clients held all of them.
    s = start_server("slow", "--max-queue", "2")
    conns = [raw(s, b"G", source="127.0.0.2") for _ in range(12)]
    stop = threading.Event()

    def trickle():
        while not stop.wait(1.0):
            for c in conns:
                try:
                    c.send(b"E")
                except OSError:
                    pass
    t = threading.Thread(target=trickle)
    t.start()
    try:
        time.sleep(1.5)
        assert health_time(s) < 2
        assert health_time(s) < 2
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()


def test_request_head_has_a_deadline(start_server):
    s = start_server("head-deadline", "--header-timeout", "2")
    c = raw(s, b"G")
    t0 = time.time()
    closed_at = None
    for ch in b"ET /health HTTP/1.1\r\nX-Slow: " + b"a" * 40:
        time.sleep(0.25)
        try:
            c.send(bytes([ch]))
        except OSError:
            closed_at = time.time()
            break
        c.settimeout(0.01)
        try:
            if c.recv(1024) == b"":
                closed_at = time.time()
                break
        except socket.timeout:
            pass
        except OSError:
            closed_at = time.time()
            break
    c.close()
    assert closed_at is not None and closed_at - t0 < 4, closed_at and closed_at - t0


def test_request_body_has_a_deadline(start_server):
    s = start_server("body-deadline", "--body-timeout", "2")
    c = raw(s, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 1000\r\n\r\n{")
    t0 = time.time()
    c.settimeout(0.25)
    closed_at = None
    while time.time() - t0 < 10:
        try:
            c.send(b" ")
            if c.recv(4096) == b"":
                closed_at = time.time()
                break
        except socket.timeout:
            continue
        except OSError:
            closed_at = time.time()
            break
    c.close()
    assert closed_at is not None and closed_at - t0 < 4, closed_at and closed_at - t0


def test_connections_per_client_and_in_total_are_bounded(start_server):
    s = start_server("bounds", "--max-connections", "6", "--max-connections-per-client", "3")
    held = [raw(s, b"", source="127.0.0.2") for _ in range(3)]
    time.sleep(0.3)
    extra = raw(s, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", source="127.0.0.2")
    reply = read_all(extra)
    assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After" in reply, reply
    assert health_time(s) < 2  # another client address is still served
    time.sleep(0.5)  # until the server has seen that connection close
    more = [raw(s, b"", source="127.0.0.3") for _ in range(3)]
    time.sleep(0.3)
    full = raw(s, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", source="127.0.0.4")
    assert read_all(full).startswith(b"HTTP/1.1 503")
    for c in held + more:
        c.close()
    time.sleep(0.5)
    assert health_time(s) < 2
    assert "refused a connection from 127.0.0.2" in s.log_text()


def test_prefix_cache_flag(tiny_model, tmp_path, start_server):
    # auto (the default) and a number are taken, and the startup line says what the cache became
    # (on the CPU backend auto keeps 4 states: its memory is the host's); anything else is refused.
    for bad in ("x", "-1", "4.5", "auto4"):
        with pytest.raises(RuntimeError, match="--prefix-cache expects auto or a number of states"):
            ServerProcess(tiny_model, str(tmp_path / "bad.log"), "--prefix-cache", bad)
    for name, extra, line in (("pc-default", (), "prefix cache 4 entries (auto)"),
                              ("pc-auto", ("--prefix-cache", "auto"), "prefix cache 4 entries (auto)"),
                              ("pc-3", ("--prefix-cache", "3"), "prefix cache 3 entries,")):
        s = start_server(name, *extra)
        assert line in s.log_text()
