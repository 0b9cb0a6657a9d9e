"""Replicas behind nginx (issue 19, deploy/): three CPU-backend `tansy serve` replicas on loopback,
started, balanced and supervised by deploy/tansy-cluster, driven through the balancer.

Each replica's /metrics is read through the balancer (/replica/<i>/metrics), so the counters say
which replica answered what; nginx's access log names the upstreams each request tried.
"""
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests

from api_support import MODEL_ID, REPO, TANSY, free_port

LAUNCHER = os.path.join(REPO, "deploy", "tansy-cluster")
CHAT = "/v1/chat/completions"
FAIL_TIMEOUT = 2  # seconds a failed replica sits out (the launcher's --fail-timeout)


@pytest.fixture(scope="module")
def nginx_bin():
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if not path:
        pytest.fail("nginx is missing: scripts/setup installs it (nginx, libnginx-mod-http-js)")
    return path


def free_ports(n):
    """A base port with n free ports from it (checked now; the launcher binds them right after)."""
    for _ in range(50):
        base = free_port()
        if base + n >= 65536:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            pass
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


class Cluster:
    def __init__(self, tiny_model, run_dir, nginx, replicas, *serve_flags, launcher_flags=()):
        self.run_dir = str(run_dir)
        self.n = replicas
        self.listen_port = free_port()
        self.url = f"http://127.0.0.1:{self.listen_port}"
        self.out_path = os.path.join(self.run_dir, "launcher.out")
        os.makedirs(self.run_dir, exist_ok=True)
        self.out = open(self.out_path, "w")
        cmd = [LAUNCHER, "--cpu", "--replicas", str(replicas), "--base-port", str(free_ports(replicas)),
               "--listen", f"127.0.0.1:{self.listen_port}", "--fail-timeout", str(FAIL_TIMEOUT),
               "--nginx", nginx, "--tansy", TANSY, "--run-dir", self.run_dir, "--health-timeout", "120",
               *launcher_flags, "--",
               "--model", tiny_model, "--served-model-name", MODEL_ID, "--max-seq", "1024", "--threads", "1",
               *serve_flags]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.time() + 150
        while "tansy-cluster: ready" not in self.output():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansy-cluster exited with {self.proc.returncode}:\n{self.output()}")
            if time.time() > deadline:
                raise RuntimeError("tansy-cluster did not get ready:\n" + self.output())
            time.sleep(0.1)

    def output(self):
        if not self.out.closed:
            self.out.flush()
        with open(self.out_path) as f:
            return f.read()

    def pid(self, i):
        with open(os.path.join(self.run_dir, f"replica-{i}.pid")) as f:
            return int(f.read())

    def nginx_pid(self):
        with open(os.path.join(self.run_dir, "nginx-master.pid")) as f:
            return int(f.read())

    def access_log(self):
        with open(os.path.join(self.run_dir, "logs", "access.log")) as f:
            return f.read().splitlines()

    def log_lines(self, pred, n=1):
        """The access log's lines for which pred holds, once there are n (nginx writes a line just
        after the response)."""
        deadline = time.time() + 5
        while True:
            lines = [line for line in self.access_log() if pred(line)]
            if len(lines) >= n or time.time() > deadline:
                return lines
            time.sleep(0.05)

    def metrics(self, i):
        r = requests.get(f"{self.url}/replica/{i}/metrics", timeout=10)
        assert r.status_code == 200, (i, r.status_code, r.text)
        return r.text

    def metric(self, i, name, **labels):
        """The sum of a metric's series on replica i whose labels include these."""
        total = 0.0
        for line in self.metrics(i).splitlines():
            if not (line.startswith(name + " ") or line.startswith(name + "{")):
                continue
            series, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
        return total

    def answered(self, status=200):
        """Chat requests each replica answered with this status."""
        return [self.metric(i, "tansy_requests_total", endpoint=CHAT, status=status) for i in range(self.n)]

    def stop(self):
        """Stops the launcher with SIGTERM; returns its exit status and the processes it started
        that were still running after it exited (killed here, so that a failing test leaves none)."""
        started = []
        for path in os.listdir(self.run_dir):
            if (path.startswith("replica-") and path.endswith(".pid")) or path == "nginx-master.pid":
                with open(os.path.join(self.run_dir, path)) as f:
                    started.append(int(f.read()))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()
        left = [p for p in started if alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        return self.proc.returncode, left


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is no longer running
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, nginx_bin):
    c = Cluster(tiny_model, tmp_path_factory.mktemp("cluster"), nginx_bin, 3,
                "--prefix-cache", "8", "--max-body-mb", "1", "--timeout", "120")
    yield c
    _, left = c.stop()
    assert not left, f"still running after the launcher stopped: {left}"


def chat(cluster, content, max_tokens=4, headers=None, **extra):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            **extra}
    r = requests.post(cluster.url + CHAT, json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def key_on(cluster, replica):
    """A conversation key that the balancer sends to this replica (found by asking)."""
    for k in range(200):
        key = f"probe-{replica}-{k}"
        before = cluster.answered()
        chat(cluster, "which replica", prompt_cache_key=key)
        after = cluster.answered()
        if after[replica] > before[replica]:
            return key
    raise AssertionError(f"no key of 200 went to replica {replica}")


def test_rendered_config_passes_nginx_t(cluster, nginx_bin):
    r = subprocess.run([nginx_bin, "-t", "-p", cluster.run_dir + "/", "-c", cluster.run_dir + "/nginx.conf"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "test is successful" in r.stderr, r.stderr
    assert "nginx -t: " in cluster.output() and "is valid" in cluster.output()
    conf = open(os.path.join(cluster.run_dir, "nginx.conf")).read()
    proxy = open(os.path.join(cluster.run_dir, "proxy.conf")).read()
    # The balancer's limits follow the replicas' flags (--max-body-mb 1, --timeout 120).
    assert "client_max_body_size 1m;" in conf
    assert "proxy_read_timeout 150s;" in proxy
    assert "proxy_buffering off;" in proxy
    assert conf.count("hash $tansy_key consistent;") == 1 and conf.count("least_conn;") == 1


def test_launcher_check_refuses_a_config_nginx_rejects(tmp_path, nginx_bin):
    deploy = tmp_path / "deploy"
    shutil.copytree(os.path.join(REPO, "deploy"), deploy)
    ok = subprocess.run([str(deploy / "tansy-cluster"), "--check", "--replicas", "2", "--nginx", nginx_bin,
                         "--run-dir", str(tmp_path / "ok")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    conf = (deploy / "nginx.conf.in").read_text()
    (deploy / "nginx.conf.in").write_text(conf.replace("least_conn;", "least_conn;\n    no_such_directive on;"))
    bad = subprocess.run([str(deploy / "tansy-cluster"), "--check", "--replicas", "2", "--nginx", nginx_bin,
                          "--run-dir", str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode != 0
    assert "no_such_directive" in bad.stderr and "nginx -t rejected" in bad.stderr, bad.stderr


def test_requests_without_a_key_spread_over_the_replicas(cluster):
    before = cluster.answered()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: chat(cluster, f"spread {i}", max_tokens=60, ignore_eos=True), range(18)))
    gained = [a - b for a, b in zip(cluster.answered(), before)]
    assert sum(gained) == 18, gained
    assert all(g >= 3 for g in gained), gained  # least connections: each replica takes a share


def test_keys_spread_over_the_replicas_and_each_keeps_its_own(cluster):
    before = cluster.answered()
    keys = [f"spread-key-{k}-{time.time()}" for k in range(30)]
    for _ in range(2):
        for k in keys:
            chat(cluster, "keyed", prompt_cache_key=k)
    gained = [a - b for a, b in zip(cluster.answered(), before)]
    assert sum(gained) == 60 and all(g > 0 for g in gained), gained
    for k in keys:
        lines = cluster.log_lines(lambda line: f'key="{k}"' in line, 2)
        assert len({line.split('upstream="')[1].split('"')[0] for line in lines}) == 1, lines


@pytest.mark.parametrize("how", ["prompt_cache_key", "user", "X-Conversation-Id", "X-Session-Id"])
def test_a_conversation_with_a_key_stays_on_its_replica_and_hits_the_prefix_cache(cluster, how):
    from openai import OpenAI
    key = f"conversation-{how}-{time.time()}"
    headers, extra = {}, {}
    if how.startswith("X-"):
        headers[how] = key
    else:
        extra[how] = key
    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                    default_headers=headers)
    messages = [{"role": "system", "content": "You are a test."}]
    before = cluster.answered()
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: tell me more about the number {turn}"})
        r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12,
                                           extra_body={**extra, "chat_template_kwargs": {"enable_thinking": False}})
        cached = r.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0, cached
        else:
            assert cached > 0, (turn, r.usage)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        # Traffic without a key in between, which least connections spreads.
        chat(cluster, f"other {turn}")
    gained = [a - b for a, b in zip(cluster.answered(), before)]
    assert sum(gained) == 8, gained
    # The four turns on one replica (the access log names it), the keyless requests wherever.
    upstreams = [line.split('upstream="')[1].split('"')[0]
                 for line in cluster.log_lines(lambda line: f'key="{key}"' in line, 4)]
    assert len(upstreams) == 4 and len(set(upstreams)) == 1, upstreams


def test_the_body_limit_is_the_balancers_too(cluster):
    big = "word " * (1 << 18)  # 1.25 MiB, over --max-body-mb 1
    r = requests.post(cluster.url + CHAT, timeout=60,
                      json={"model": MODEL_ID, "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large", r.text
    # Just under it, the body reaches a replica whole (and the key inside it is read).
    fits = "word " * 200000
    r = requests.post(cluster.url + "/v1/completions", timeout=120,
                      json={"model": MODEL_ID, "prompt": fits, "max_tokens": 1, "prompt_cache_key": "big"})
    assert r.status_code == 400, r.text  # the replica's own answer: the prompt is too long
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert cluster.log_lines(lambda line: 'key="big"' in line)


def stream_until_error(cluster, key, got_first, outcome, idx):
    """A chat stream through the official client; records what it raised."""
    from openai import APIError, OpenAI
    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    text = ""
    try:
        s = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "a long story"}],
                                           max_tokens=900, stream=True, prompt_cache_key=key,
                                           extra_body={"ignore_eos": True})
        for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                got_first[idx].set()
        outcome[idx] = ("finished", text, None)
    except APIError as e:
        outcome[idx] = ("APIError", text, e)
    except Exception as e:  # noqa: BLE001 - recorded, and the test says what it was
        outcome[idx] = (type(e).__name__, text, e)
    finally:
        got_first[idx].set()


def raw_stream(cluster, key, got_first, outcome, idx):
    """The same through plain HTTP: every SSE line the client receives, and how the body ended."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    lines, ending = [], "complete"
    try:
        with requests.post(cluster.url + CHAT, json=body, headers={"X-Conversation-Id": key}, stream=True,
                           timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line.decode())
                    got_first[idx].set()
    except requests.RequestException as e:
        ending = type(e).__name__
    finally:
        got_first[idx].set()
    outcome[idx] = (ending, lines, None)


def test_killing_a_replica_loses_no_request_and_ends_its_streams_with_an_error(cluster):
    victim = 0
    key = key_on(cluster, victim)
    requests.post(cluster.url + CHAT, timeout=60, headers={"X-Conversation-Id": key},
                  json={"model": MODEL_ID, "messages": [{"role": "user", "content": "same key"}], "max_tokens": 1})
    n_streams = 3
    got_first = [threading.Event() for _ in range(n_streams)]
    outcome = [None] * n_streams
    streams = [threading.Thread(target=stream_until_error, args=(cluster, key, got_first, outcome, i))
               for i in range(n_streams - 1)]
    streams.append(threading.Thread(target=raw_stream, args=(cluster, key, got_first, outcome, n_streams - 1)))
    for t in streams:
        t.start()
    for e in got_first:
        assert e.wait(60)
    assert all(o is None for o in outcome), outcome  # all three still streaming from the victim

    # Requests without a key, before, across and after the kill.
    stop_sending = threading.Event()
    results = []

    def plain(i):
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": f"plain {i}"}], "max_tokens": 300,
                "ignore_eos": True}
        r = requests.post(cluster.url + CHAT, json=body, timeout=120)
        return r.status_code, r.json()

    def sender(w):
        i = 0
        while not stop_sending.is_set():
            started = time.time()
            results.append((started, *plain(f"{w}-{i}")))
            i += 1

    senders = [threading.Thread(target=sender, args=(w,)) for w in range(6)]
    for t in senders:
        t.start()
    # Kill once the victim runs non-streamed requests besides the streams.
    deadline = time.time() + 60
    while cluster.metric(victim, "tansy_requests_running") < n_streams + 1:
        assert time.time() < deadline, "the victim never ran a request without a key"
        time.sleep(0.02)
    victim_pid = cluster.pid(victim)
    os.kill(victim_pid, signal.SIGKILL)
    killed_at, killed_line = time.time(), len(cluster.access_log())
    for t in streams:
        t.join(120)
    # Requests keep coming while the victim is down and restarting.
    deadline = time.time() + 90
    while sum(1 for r in results if r[0] > killed_at) < 6:
        assert time.time() < deadline, len(results)
        time.sleep(0.1)
    stop_sending.set()
    for t in senders:
        t.join(120)

    # No non-streamed request was lost: each got a whole answer, some after a retry elsewhere.
    for _, status, body in results:
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 300 and body["choices"][0]["finish_reason"] == "length", body
    retried = [line for line in cluster.access_log()[max(0, killed_line - 40):]
               if '"POST /v1/chat/completions' in line and 'upstream_status="502, 200"' in line]
    assert retried, "no request was retried after the kill:\n" + "\n".join(cluster.access_log()[-40:])

    # The victim's streams ended with an error the client sees.
    for kind, text, err in outcome[:-1]:
        assert kind == "APIError", (kind, err)
        assert "stopped before the response was complete" in str(err), err
        assert text, "the stream had delivered text before the cut"
    ending, lines, _ = outcome[-1]
    assert ending == "complete", ending  # the balancer ends the chunked body properly ...
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][len("data: "):])  # ... after an error event in the API's shape
    assert err["error"]["code"] == "replica_failed" and err["error"]["type"] == "server_error", err
    assert all('"finish_reason":"length"' not in line for line in lines), "the stream was not cut"
    assert sum(1 for line in lines if '"content"' in line) >= 1

    # The launcher started the victim again.
    deadline = time.time() + 60
    while not (cluster.pid(victim) != victim_pid and alive(cluster.pid(victim))):
        assert time.time() < deadline, cluster.output()
        time.sleep(0.1)
    assert f"replica {victim} (pid {victim_pid}) exited with status 137" in cluster.output()


def test_a_restarted_replica_rejoins(cluster):
    victim = 1
    key = key_on(cluster, victim)
    old = cluster.pid(victim)
    os.kill(old, signal.SIGKILL)
    deadline = time.time() + 60
    while True:
        try:
            if cluster.pid(victim) != old and requests.get(f"{cluster.url}/replica/{victim}/health",
                                                           timeout=5).status_code == 200:
                break
        except (FileNotFoundError, ValueError):
            pass
        assert time.time() < deadline, cluster.output()
        time.sleep(0.1)
    assert cluster.answered()[victim] == 0  # a new process: its counters start again
    time.sleep(FAIL_TIMEOUT + 0.5)  # what nginx's passive check holds a failed replica out for
    # The conversation comes back to its replica (consistent hashing), and keyless requests reach it.
    for _ in range(3):
        chat(cluster, "back", prompt_cache_key=key)
    assert cluster.answered()[victim] == 3
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: chat(cluster, f"rejoin {i}", max_tokens=60, ignore_eos=True), range(12)))
    assert cluster.answered()[victim] >= 3 + 2


def test_an_overloaded_replica_is_skipped_and_everything_stops(tiny_model, tmp_path_factory, nginx_bin):
    # One request at a time per replica and no queue: a second request for the same replica gets
    # its 503 queue_full, which the balancer answers from the other replica instead.
    c = Cluster(tiny_model, tmp_path_factory.mktemp("cluster-busy"), nginx_bin, 2,
                "--max-running", "1", "--max-queue", "0")
    try:
        key = key_on(c, 0)
        before = c.answered()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = []
            for i in range(2):
                futs.append(pool.submit(chat, c, f"busy {i}", 400, None, ignore_eos=True, prompt_cache_key=key))
                time.sleep(0.3)
            # Both replicas busy: a third gets the last one's 503, as a replica would answer it.
            third = requests.post(c.url + CHAT, timeout=60, json={
                "model": MODEL_ID, "messages": [{"role": "user", "content": "busy 2"}], "max_tokens": 4,
                "prompt_cache_key": key})
            answers = [f.result() for f in futs]
        assert all(a["usage"]["completion_tokens"] == 400 for a in answers)
        assert third.status_code == 503 and third.json()["error"]["code"] == "queue_full", third.text
        assert third.headers.get("Retry-After") == "1"
        assert c.metric(0, "tansy_requests_total", endpoint=CHAT, status=503) == 2
        assert c.metric(1, "tansy_requests_total", endpoint=CHAT, status=503) == 1
        gained = [a - b for a, b in zip(c.answered(), before)]
        assert gained == [1, 1], gained  # the first on replica 0, the second on 1
        assert c.log_lines(lambda line: 'upstream_status="503, 200"' in line)
        assert c.log_lines(lambda line: 'upstream_status="503, 503"' in line)
        pids = [c.pid(0), c.pid(1), c.nginx_pid()]
        assert all(alive(p) for p in pids)
    finally:
        rc, left = c.stop()
    assert rc == 0, c.output()
    assert not left, f"still running after the launcher stopped: {left}"
    assert not any(alive(p) for p in pids), pids
    assert "tansy-cluster: stopping" in c.output()


class CutReplica:
    """A stand-in replica on loopback: answers /health, and answers a stream with the opening bytes
    of a real replica's stream, then drops the connection, as a replica that dies mid-stream does."""

    def __init__(self, openings):
        self.openings = openings  # path -> (the bytes of a stream's first events, seconds until the cut)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            path = lines[0].split(" ")[1]
            length = next((int(h.split(":", 1)[1]) for h in lines[1:] if h.lower().startswith("content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            if path == "/health":
                payload = b'{"status":"ok"}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                return
            opening, hold = self.openings[path]
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"%x\r\n%s\r\n" % (len(opening), opening))
            time.sleep(hold)  # the client has the opening events; then the "replica" dies

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (closing alone would not, on Linux)
        self.sock.close()


def stream_opening(cluster, path, body, events=3):
    """The first events of a real replica's stream for this request, as bytes."""
    with requests.post(cluster.url + path, json=body, stream=True, timeout=60,
                       headers={"x-api-key": "unused"}) as r:
        assert r.status_code == 200, r.text
        data = b""
        for chunk in r.iter_content(chunk_size=None):
            data += chunk
            if data.count(b"\n\n") >= events:
                break
    return b"\n\n".join(data.split(b"\n\n")[:events]) + b"\n\n"


def test_cut_streams_of_the_other_apis_end_with_their_error_events(cluster, tiny_model, tmp_path_factory,
                                                                 nginx_bin):
    import anthropic
    from openai import OpenAI
    messages = {"model": MODEL_ID, "max_tokens": 50, "stream": True,
                "messages": [{"role": "user", "content": "hello"}]}
    responses = {"model": MODEL_ID, "input": "hello", "max_output_tokens": 50, "stream": True}
    chat_body = {"model": MODEL_ID, "max_tokens": 50, "stream": True,
                 "messages": [{"role": "user", "content": "hello"}]}
    fake = CutReplica({"/v1/messages": (stream_opening(cluster, "/v1/messages", messages), 0.3),
                       "/v1/responses": (stream_opening(cluster, "/v1/responses", responses), 0.3),
                       CHAT: (stream_opening(cluster, CHAT, chat_body), 3)})
    # A balancer only, in front of a replica it did not start (the several-machines layout).
    c = Cluster(tiny_model, tmp_path_factory.mktemp("cluster-cut"), nginx_bin, 0,
                launcher_flags=("--upstream", f"127.0.0.1:{fake.port}", "--per-client", "2"))
    try:
        ac = anthropic.Anthropic(base_url=c.url, api_key="unused", max_retries=0, timeout=60)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as e:
            with ac.messages.stream(model=MODEL_ID, max_tokens=50,
                                    messages=[{"role": "user", "content": "hello"}]) as s:
                for ev in s:
                    seen.append(ev.type)
        assert "message_start" in seen, seen
        assert e.value.body["error"]["type"] == "api_error", e.value.body
        assert "stopped before the response was complete" in e.value.body["error"]["message"]

        oc = OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        events = list(oc.responses.create(model=MODEL_ID, input="hello", max_output_tokens=50, stream=True))
        assert events[0].type == "response.created", [ev.type for ev in events]
        last = events[-1]
        assert last.type == "error" and last.code == "replica_failed", last
        assert last.sequence_number == events[-2].sequence_number + 1, (events[-2], last)

        # Two streams held open: a third connection from this address is over --per-client 2. The
        # clients above close their connections first; nginx may count a closing one a moment
        # longer, so the two are opened again until both are in.
        ac.close()
        oc.close()
        deadline = time.time() + 15
        while True:
            held = [requests.post(c.url + CHAT, json=chat_body, stream=True, timeout=30) for _ in range(2)]
            if all(r.status_code == 200 for r in held):
                break
            codes = [r.status_code for r in held]
            for r in held:
                r.close()
            assert time.time() < deadline, codes
            time.sleep(0.2)
        over = requests.post(c.url + CHAT, json=chat_body, timeout=30)
        assert over.status_code == 503 and over.json()["error"]["code"] == "too_many_connections", over.text
        for r in held:
            r.close()

        # No replica answers at all: nginx's own 502, in the API's error shape.
        fake.close()
        time.sleep(0.5)
        gone = requests.post(c.url + CHAT, json=chat_body, timeout=30)
        assert gone.status_code == 502 and gone.json()["error"]["code"] == "no_replica", gone.text
        assert gone.headers.get("Retry-After") == "1"
    finally:
        _, left = c.stop()
        fake.close()
    assert not left, left


def test_gpu_replicas_get_one_device_each_and_keep_it_across_restarts(tiny_model, tmp_path, nginx_bin):
    # No GPU here: a wrapper records the device each replica was given, then runs the real binary
    # (on the CPU, as `--backend auto` picks without one).
    wrapper = tmp_path / "tansy-wrapper"
    wrapper.write_text('#!/bin/sh\n'
                       'port=""; prev=""\n'
                       'for a in "$@"; do [ "$prev" = --port ] && port="$a"; prev="$a"; done\n'
                       f'echo "$CUDA_VISIBLE_DEVICES" >> "{tmp_path}/device-$port"\n'
                       f'exec "{TANSY}" "$@"\n')
    wrapper.chmod(0o755)
    base = free_ports(2)
    out = open(tmp_path / "launcher.out", "w")
    proc = subprocess.Popen([LAUNCHER, "--gpus", "3,5", "--base-port", str(base), "--no-balancer",
                             "--tansy", str(wrapper), "--run-dir", str(tmp_path / "run"), "--",
                             "--model", tiny_model, "--served-model-name", MODEL_ID, "--max-seq", "1024",
                             "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while "tansy-cluster: ready" not in (tmp_path / "launcher.out").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "launcher.out").read_text()
            time.sleep(0.1)
        first = int((tmp_path / "run" / "replica-1.pid").read_text())
        os.kill(first, signal.SIGKILL)
        deadline = time.time() + 30
        while not (tmp_path / f"device-{base + 1}").exists() or \
                len((tmp_path / f"device-{base + 1}").read_text().split()) < 2:
            assert time.time() < deadline, (tmp_path / "launcher.out").read_text()
            time.sleep(0.1)
        assert (tmp_path / f"device-{base}").read_text().split() == ["3"]
        assert (tmp_path / f"device-{base + 1}").read_text().split() == ["5", "5"]  # restarted on its GPU
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=40)
        out.close()
    assert proc.returncode == 0



@pytest.mark.parametrize("drain", [10, 1])
def test_stopping_drains_the_streams_in_flight_then_cuts_them_with_the_error(tiny_model, tmp_path_factory,
                                                                            nginx_bin, drain):
    c = Cluster(tiny_model, tmp_path_factory.mktemp(f"cluster-stop-{drain}"), nginx_bin, 1,
                launcher_flags=("--drain", str(drain)))
    body = {"model": MODEL_ID, "prompt": "a long answer", "max_tokens": 900, "ignore_eos": True, "stream": True}
    lines, left = [], []
    try:
        pids = [c.pid(0), c.nginx_pid()]
        with requests.post(c.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
            it = r.iter_lines()
            lines.append(next(it))
            t0 = time.time()
            c.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(requests.ConnectionError):  # no new connections once stopping
                requests.get(c.url + "/health", timeout=5)
            lines += [line for line in it if line]
        took = time.time() - t0
        assert c.proc.wait(timeout=40) == 0, c.output()
    finally:
        _, left = c.stop()
    assert not left and not any(alive(p) for p in pids), (left, pids)
    assert lines[-1] == b"data: [DONE]", lines[-3:]
    if drain == 10:  # the stream (about 3 s) finished within the drain
        assert b'"finish_reason":"length"' in lines[-2], lines[-3:]
    else:  # cut after 1 s when its replica was stopped, and said so
        assert json.loads(lines[-2][6:])["error"]["code"] == "replica_failed", lines[-3:]
        assert took < 10, took
