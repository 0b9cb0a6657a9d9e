#!/usr/bin/env python3
"""Many requests at once through HTTP (issue 16): aggregate output tok/s, TTFT and inter-token
latency of a running `tansy serve` when 1, 4, 16 or 64 streaming requests arrive together.

Standard library only (the GPU machine has no openai package and no network). It starts nothing:

    tools/concurrency_bench.py --url http://127.0.0.1:8011 --model-dir DIR --json concurrency.json \
        [--concurrency 1,4,16,64] [--workloads distinct,shared-prefix] [--prompt-tokens 4096] \
        [--prefix-tokens 3000] [--new-tokens 256] [--settings greedy|qwen] [--warmup 1]

docs/BENCHMARK.md's section "Concurrency (issue 16)" is the definition; in short:

- Prompts are token ids from the synthetic rule of tansy bench and tools/http_latency.py: the id
  at position p is ((p * 2654435761) mod 2^32) mod vocab_size. Request k of a workload (k = salt + 1,
  salt + 2, ... in the order the tool sends them, warm-ups included; from 1, so that no request
  repeats the prompt of tansy bench or http_latency.py, which start at position 0) takes:
  "distinct": positions [k * N, (k + 1) * N) of the rule, N = --prompt-tokens;
  "shared-prefix": the common prefix, positions [B, B + P) with B = 2^31 and P = --prefix-tokens,
  followed by its own turn, positions [B + P + k * (N - P), B + P + (k + 1) * (N - P)).
- Each request is a streaming /v1/completions with max_tokens --new-tokens, ignore_eos,
  stream_options.include_usage, and temperature 0 ("greedy") or, with --settings qwen,
  temperature 0.6, top_p 0.95, top_k 20 and seed 1234 + k (seeded per request).
- A level of concurrency C: C threads each open one HTTP connection, wait at a barrier, then send
  their request at once. Per request: the send time, every token chunk's arrival time, usage's
  completion_tokens (must equal --new-tokens) and cached_tokens, the finish reason.
- Per level: output_tps = generated tokens of the successful requests / (last token chunk of any
  of them - first send); TTFT (send -> first chunk with generated text) p50/p99/max over the
  requests; ITL p50/p99 over every gap between consecutive token chunks of every request; wall
  time (first send -> last stream closed). Percentiles interpolate linearly between order
  statistics. A request that got an HTTP error, a stream error, no [DONE], no usage, a finish
  reason other than "length" or a token count other than --new-tokens is a failure: it is counted,
  listed with its reason, left out of the figures, and its level is marked "ok": false.
- Before each level the tool waits (up to 5 s, recorded as settle_s) until the busy gauges that
  exist (tansy_requests_running, tansy_requests_waiting, tansy_queue_depth, tansy_sequences_running,
  tansy_sequences_waiting) read 0, since the server may still be finishing the previous request.
- /metrics is read before and after each level (and, with --metrics-interval, sampled during it
  for the peak of each gauge): the gauges tansy_requests_*, tansy_sequences_*, tansy_queue_*,
  tansy_pool_* and tansy_prefix_cache_* that exist, and the prefix cache's and generation
  counters, whose differences are recorded. Names the server does not export are simply absent.

Timestamps are taken when a client thread has read an SSE line. The threads share one Python
interpreter lock, so when several have a line to parse at once, some arrivals are stamped late by
the others' parsing; the figures include that client-side delay.
The JSON (--json) is rewritten after every level, so a run stopped by an outer timeout keeps the
levels it finished. --time-budget-s skips a level (with its warm-ups) that the time per request of
the workload's previous level (else of the other workload's) says would not fit, which is
conservative for a server that batches, and cuts off a stream that outlasts the budget (counted as
failed; the server sees the connection close).
Exit status: 0 when every level ran without failure, 1 otherwise, 2 when the server cannot be used.
"""
import argparse
import http.client
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_latency import Server as LatencyServer, SseStream, StreamError, vocab_from_model_dir  # noqa: E402

CONTRACT = {
    "version": 1,
    "name": "docs/BENCHMARK.md, Concurrency (issue 16)",
    "summary": "C streaming /v1/completions sent together behind a barrier, synthetic token-id prompts "
               "(distinct, or a shared prefix plus a distinct turn), ignore_eos, usage checked; "
               "output tok/s over first send -> last token, TTFT and pooled ITL percentiles",
}
SHARED_BASE = 1 << 31  # where the shared-prefix workload's positions start: far from the distinct ones
WORKLOADS = ("distinct", "shared-prefix")
SETTINGS = {
    "greedy": {"temperature": 0},
    # Qwen's recommended thinking settings, as tools/http_latency.py's "qwen"; the seed is per request.
    "qwen": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 1234},
}
GAUGE_PREFIXES = ("tansy_requests_", "tansy_sequences_", "tansy_queue_", "tansy_pool_", "tansy_prefix_cache_")
BUSY_GAUGES = ("tansy_requests_running", "tansy_requests_waiting", "tansy_queue_depth", "tansy_sequences_running",
               "tansy_sequences_waiting")
COUNTERS = ("tansy_prefix_cache_hits_total", "tansy_prefix_cache_misses_total",
            "tansy_prefix_cache_cached_tokens_total", "tansy_generation_tokens_total", "tansy_prompt_tokens_total")


def rule(start, n, vocab_size):
    """Positions [start, start + n) of the synthetic prompt rule (tansy::synthetic_prompt)."""
    return [((i * 2654435761) % (1 << 32)) % vocab_size for i in range(start, start + n)]


def prompt_for(workload, k, prompt_tokens, prefix_tokens, vocab_size, prefix_ids=None):
    if workload == "distinct":
        return rule(k * prompt_tokens, prompt_tokens, vocab_size)
    turn = prompt_tokens - prefix_tokens
    prefix = prefix_ids if prefix_ids is not None else rule(SHARED_BASE, prefix_tokens, vocab_size)
    return prefix + rule(SHARED_BASE + prefix_tokens + k * turn, turn, vocab_size)


def percentile(values, q):
    """Linear interpolation between order statistics (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    x = (len(v) - 1) * q
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


class Server(LatencyServer):
    """http_latency.py's client; /metrics read with this tool's watched names."""

    def get(self, path, timeout=None):
        return super().get(path, timeout or min(self.timeout, 30))

    def metrics(self):
        """The watched gauges and counters of /metrics that exist (labelled series keep their labels)."""
        out, types = {}, {}
        for line in self.get("/metrics").splitlines():
            if line.startswith("# TYPE "):
                parts = line.split()
                if len(parts) >= 4:
                    types[parts[2]] = parts[3]
                continue
            if line.startswith("#") or " " not in line:
                continue
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            watched = (types.get(name) == "gauge" and name.startswith(GAUGE_PREFIXES)) or name in COUNTERS
            if watched:
                try:
                    out[series] = float(value)
                except ValueError:
                    pass
        return out


class Request:
    """One streaming request, run on its own thread: connect, wait at the barrier, send, read."""

    def __init__(self, server, body, index, barrier, deadline):
        self.server, self.body, self.index, self.barrier, self.deadline = server, body, index, barrier, deadline
        self.t_sent = self.t_end = None
        self.chunks = []  # arrival time of every chunk carrying generated text
        self.usage = self.finish = self.error = self.http_status = None

    def socket_timeout(self):
        t = self.server.timeout
        if self.deadline is not None:
            t = min(t, max(1.0, self.deadline - time.perf_counter()))
        return t

    def run(self):
        c = None
        try:
            try:
                c = self.server.conn(self.socket_timeout())
            except OSError as e:
                self.error = f"connect: {e}"
            finally:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    if self.error is None:
                        self.error = "the start barrier broke (another request's thread failed to start)"
            if self.error is None:
                self.stream(c)
        except Exception as e:  # noqa: BLE001  every request's outcome is recorded, whatever went wrong
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.t_end = time.perf_counter()
            if c is not None:
                c.close()

    def stream(self, c):
        data = json.dumps(self.body).encode()
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        self.t_sent = time.perf_counter()
        c.request("POST", self.server.base + "/v1/completions", body=data, headers=headers)
        r = c.getresponse()
        self.http_status = r.status
        if r.status != 200:
            self.error = f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
            return
        stream = SseStream(r, self.deadline)
        try:
            for t, ev in stream:
                if ev.get("usage"):
                    self.usage = ev["usage"]
                for ch in ev.get("choices", []):
                    if ch.get("text"):
                        self.chunks.append(t)
                    if ch.get("finish_reason"):
                        self.finish = ch["finish_reason"]
        except StreamError as e:
            self.error = str(e)
            return
        if not stream.done:
            self.error = "the stream ended without data: [DONE]"

    def check(self, new_tokens):
        """Sets self.error when a completed stream is not what the contract asks for."""
        if self.error:
            return
        if self.usage is None:
            self.error = "the stream carried no usage (stream_options.include_usage)"
        elif self.usage.get("completion_tokens") != new_tokens:
            self.error = f"usage.completion_tokens {self.usage.get('completion_tokens')} != --new-tokens {new_tokens}"
        elif self.finish != "length":
            self.error = f"finish_reason {self.finish!r}, expected 'length' (ignore_eos)"
        elif not self.chunks:
            self.error = "no chunk with generated text arrived"

    def record(self, t0):
        r = {"index": self.index, "ok": self.error is None}
        if self.t_sent is not None:
            r["sent_s"] = self.t_sent - t0
        if self.error is not None:
            r["error"] = self.error
            if self.http_status is not None:
                r["http_status"] = self.http_status
        if self.usage is not None:
            r["prompt_tokens"] = self.usage.get("prompt_tokens")
            r["completion_tokens"] = self.usage.get("completion_tokens")
            r["cached_tokens"] = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        r["finish_reason"] = self.finish
        r["token_chunks"] = len(self.chunks)
        if self.chunks and self.t_sent is not None:
            r["ttft_s"] = self.chunks[0] - self.t_sent
            # Every token chunk's arrival, seconds after the send, at microsecond resolution.
            r["chunk_times_s"] = [round(t - self.t_sent, 6) for t in self.chunks]
        return r


def request_body(model, prompt, new_tokens, setting, k):
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    body.update(SETTINGS[setting])
    if "seed" in body:
        body["seed"] = SETTINGS[setting]["seed"] + k
    return body


class MetricsSampler:
    """Polls /metrics during a level and keeps the peak of every watched gauge."""

    def __init__(self, server, interval):
        self.server, self.interval = server, interval
        self.peak, self.samples, self.errors = {}, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self):
        while not self.stop.wait(self.interval):
            try:
                m = self.server.metrics()
            except (OSError, RuntimeError, http.client.HTTPException):
                self.errors += 1
                continue
            self.samples += 1
            for k, v in m.items():
                if k.split("{", 1)[0] not in COUNTERS:
                    self.peak[k] = max(v, self.peak.get(k, v))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def run_level(server, bodies, indices, new_tokens, deadline, metrics_interval):
    barrier = threading.Barrier(len(bodies), timeout=120)
    reqs = [Request(server, b, k, barrier, deadline) for b, k in zip(bodies, indices)]
    threads = [threading.Thread(target=r.run, daemon=True) for r in reqs]
    sampler = MetricsSampler(server, metrics_interval) if metrics_interval else None
    if sampler:
        sampler.__enter__()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if sampler:
            sampler.__exit__()
    for r in reqs:
        r.check(new_tokens)
    sent = [r.t_sent for r in reqs if r.t_sent is not None]
    t0 = min(sent) if sent else min(r.t_end for r in reqs)
    good = [r for r in reqs if r.error is None]
    gaps = [b - a for r in good for a, b in zip(r.chunks, r.chunks[1:])]
    ttfts = [r.chunks[0] - r.t_sent for r in good]
    tokens = sum(r.usage["completion_tokens"] for r in good)
    last_token = max((r.chunks[-1] for r in good), default=None)
    span = last_token - t0 if last_token is not None else None
    res = {
        "requests": len(reqs),
        "succeeded": len(good),
        "failed": len(reqs) - len(good),
        "ok": len(good) == len(reqs),
        "generated_tokens": tokens,
        "output_tps": tokens / span if span else None,
        "first_send_to_last_token_s": span,
        "wall_s": max(r.t_end for r in reqs) - t0,
        "send_spread_s": max(sent) - t0 if sent else None,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_max_s": max(ttfts, default=None),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p99_s": percentile(gaps, 0.99),
        "itl_gaps": len(gaps),
        "chunks_match": all(len(r.chunks) == r.usage["completion_tokens"] for r in good),
        "cached_tokens": sum((r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in good),
        "failures": [{"index": r.index, "error": r.error, **({"http_status": r.http_status} if r.http_status else {})}
                     for r in reqs if r.error is not None],
    }
    if sampler:
        res["metrics_peak"] = sampler.peak
        res["metrics_samples"] = sampler.samples
        res["metrics_sample_errors"] = sampler.errors
    res["per_request"] = [r.record(t0) for r in reqs]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="base URL of a running tansy serve, e.g. http://127.0.0.1:8011")
    ap.add_argument("--concurrency", default="1,4,16,64", help="requests sent together per level, comma-separated")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length of every request")
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="shared-prefix: tokens common to all requests")
    ap.add_argument("--new-tokens", type=int, default=256, help="max_tokens of every request (with ignore_eos)")
    ap.add_argument("--settings", default="greedy", choices=sorted(SETTINGS), help="sampling settings")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured requests, one at a time, before a workload's first level (default 1)")
    ap.add_argument("--salt", type=int, default=0, help="shifts every request's index k (distinct prompts per run)")
    ap.add_argument("--vocab-size", type=int, help="default: from --model-dir's config.json, else 248320")
    ap.add_argument("--model-dir", help="the served checkpoint (for its vocab_size)")
    ap.add_argument("--model", help="served model id (default: the first of /v1/models)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds any one socket wait may take")
    ap.add_argument("--time-budget-s", type=float, help="skip levels that would not end within this many seconds")
    ap.add_argument("--metrics-interval", type=float, default=0,
                    help="seconds between /metrics samples during a level (0: off; each sample is one more "
                         "connection from this client, mind --max-connections-per-client)")
    ap.add_argument("--json", help="write the results here (rewritten after every level)")
    a = ap.parse_args()
    try:
        levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {a.concurrency!r}")
    workloads = [x.strip() for x in a.workloads.split(",") if x.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown {w!r} (known: {', '.join(WORKLOADS)})")
    if not levels or min(levels) < 1:
        ap.error("--concurrency needs at least one level, each >= 1")
    if not workloads:
        ap.error("--workloads needs at least one workload")
    if a.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (ITL needs two tokens)")
    if a.prompt_tokens < 2:
        ap.error("--prompt-tokens must be >= 2")
    if "shared-prefix" in workloads and not 1 <= a.prefix_tokens < a.prompt_tokens:
        ap.error("--prefix-tokens must be in [1, --prompt-tokens) for the shared-prefix workload")
    if a.warmup < 0 or a.salt < 0 or a.metrics_interval < 0:
        ap.error("--warmup, --salt and --metrics-interval must be >= 0")
    try:
        vocab = a.vocab_size or (vocab_from_model_dir(a.model_dir) if a.model_dir else 248320)
    except (OSError, ValueError, KeyError) as e:
        print(f"concurrency_bench: cannot read the vocab_size of --model-dir {a.model_dir}: {e}", file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    deadline = t_start + a.time_budget_s if a.time_budget_s else None
    server = Server(a.url, a.timeout)
    try:
        models = json.loads(server.get("/v1/models"))
        health = json.loads(server.get("/health"))
    except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:
        print(f"concurrency_bench: cannot query {a.url}: {e}", file=sys.stderr)
        return 2
    model = a.model or models["data"][0]["id"]
    max_len = next((m.get("max_model_len") for m in models["data"] if m["id"] == model), None)
    if max_len and a.prompt_tokens + a.new_tokens > max_len:
        print(f"concurrency_bench: --prompt-tokens {a.prompt_tokens} + --new-tokens {a.new_tokens} exceeds the "
              f"server's max_model_len {max_len}", file=sys.stderr)
        return 2

    report = {
        "tool": "tools/concurrency_bench.py",
        "contract": CONTRACT,
        "url": a.url,
        "model": model,
        "health": health,
        "settings": {
            "concurrency": levels, "workloads": workloads, "prompt_tokens": a.prompt_tokens,
            "prefix_tokens": a.prefix_tokens if "shared-prefix" in workloads else None,
            "new_tokens": a.new_tokens, "ignore_eos": True, "sampling": a.settings,
            "sampling_params": SETTINGS[a.settings], "seed_per_request": "seed + k" if "seed" in SETTINGS[a.settings] else None,
            "warmup": a.warmup, "salt": a.salt, "vocab_size": vocab, "timeout_s": a.timeout,
            "time_budget_s": a.time_budget_s, "metrics_interval_s": a.metrics_interval,
        },
        "definitions": {
            "prompt": "token ids, id at position p = ((p * 2654435761) mod 2^32) mod vocab_size; request k "
                      "(k = salt + 1, salt + 2, ... per workload, warm-ups included)",
            "distinct": "request k: positions [k * prompt_tokens, (k + 1) * prompt_tokens)",
            "shared-prefix": f"positions [B, B + prefix_tokens) then [B + prefix_tokens + k * turn, "
                             f"B + prefix_tokens + (k + 1) * turn), B = {SHARED_BASE}, turn = prompt_tokens - prefix_tokens",
            "output_tps": "completion tokens of the successful requests / (last token chunk of any of them - first send)",
            "ttft_s": "request sent on an open connection -> first SSE chunk with generated text (client clock)",
            "itl_s": "every gap between consecutive token chunks of each successful request, pooled over the level",
            "wall_s": "first send -> the last stream closed (failed requests included)",
            "percentiles": "linear interpolation between order statistics",
            "failure": "HTTP status != 200, connection error or timeout, stream error, no [DONE], no usage, "
                       "finish_reason != length or completion_tokens != new_tokens",
            "metrics_*": "watched /metrics series that exist: gauges " + ", ".join(p + "*" for p in GAUGE_PREFIXES)
                         + "; counters " + ", ".join(COUNTERS),
        },
        "results": [],
    }

    def save():
        if a.json:
            tmp = a.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
            os.replace(tmp, a.json)

    def scrape():
        try:
            return server.metrics()
        except (OSError, RuntimeError, http.client.HTTPException) as e:
            return {"error": str(e)}

    def settle(limit_s=5.0):
        """Waits until the busy gauges that exist read 0: the server may still be finishing the
        previous level's last request after its client saw [DONE]. Returns (/metrics, seconds waited)."""
        t = time.perf_counter()
        while True:
            m = scrape()
            busy = [k for k, v in m.items() if k.split("{", 1)[0] in BUSY_GAUGES and v]
            if not busy or "error" in m or time.perf_counter() - t > limit_s:
                return m, time.perf_counter() - t
            time.sleep(0.02)

    next_k = {w: a.salt + 1 for w in workloads}
    prefix = rule(SHARED_BASE, a.prefix_tokens, vocab) if "shared-prefix" in workloads else None

    def take(w, n):
        ks = list(range(next_k[w], next_k[w] + n))
        next_k[w] += n
        bodies = [request_body(model, prompt_for(w, k, a.prompt_tokens, a.prefix_tokens, vocab, prefix),
                               a.new_tokens, a.settings, k) for k in ks]
        return bodies, ks

    per_request_s = {}  # the last level's wall time per request, per workload (the server may serialise)
    warmed = set()
    bad = 0
    # Level-major, so that a time budget that runs out leaves both workloads' smaller levels.
    for c in levels:
        for w in workloads:
            row = {"workload": w, "concurrency": c}
            warm_now = a.warmup if w not in warmed else 0
            if deadline is not None:
                left = deadline - time.perf_counter()
                # Before a workload's first level, the other workload's time per request (the same
                # prompt length and token count) stands in for its own.
                per = per_request_s.get(w, max(per_request_s.values(), default=0.0))
                est = per * (c + warm_now)
                if left <= 0 or est > left:
                    row["skipped"] = f"time budget: {left:.1f} s left, estimated {est:.1f} s"
                    print(f"{w} x{c}: skipped ({row['skipped']})", file=sys.stderr)
                    report["results"].append(row)
                    bad += 1
                    save()
                    continue
            if warm_now:
                warmed.add(w)
                bodies, ks = take(w, warm_now)
                row["warmup"] = []
                for b, k in zip(bodies, ks):
                    wres = run_level(server, [b], [k], a.new_tokens, deadline, 0)
                    pr = wres["per_request"][0]
                    row["warmup"].append({"index": k, "ok": pr["ok"], "ttft_s": pr.get("ttft_s"),
                                          "completion_tokens": pr.get("completion_tokens"),
                                          "cached_tokens": pr.get("cached_tokens"),
                                          "wall_s": wres["wall_s"], **({"error": pr["error"]} if "error" in pr else {})})
                    per_request_s[w] = wres["wall_s"]
                    if not pr["ok"]:
                        bad += 1
                        print(f"{w}: warm-up request {k} FAILED: {pr['error']}", file=sys.stderr)
            bodies, ks = take(w, c)
            row["metrics_before"], row["settle_s"] = settle()
            row.update(run_level(server, bodies, ks, a.new_tokens, deadline, a.metrics_interval))
            row["metrics_after"] = scrape()
            if "error" not in row["metrics_before"] and "error" not in row["metrics_after"]:
                row["metrics_delta"] = {k: row["metrics_after"][k] - row["metrics_before"].get(k, 0.0)
                                        for k in row["metrics_after"] if k.split("{", 1)[0] in COUNTERS}
            per_request_s[w] = row["wall_s"] / c
            if not row["ok"]:
                bad += 1
                print(f"{w} x{c}: {row['failed']} of {c} requests FAILED, first: {row['failures'][0]['error']}",
                      file=sys.stderr)
            report["results"].append(row)
            save()
    report["elapsed_s"] = time.perf_counter() - t_start
    save()

    print(f"concurrency_bench  {a.url}  model {model}  prompt {a.prompt_tokens} tokens "
          f"(shared prefix {a.prefix_tokens}), {a.new_tokens} new, {a.settings}")
    print(f"{'workload':>13} {'conc':>5} {'ok':>6} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>9} "
          f"{'ITL p50':>8} {'p99':>8} {'wall s':>7} {'cached':>8}")
    for r in report["results"]:
        if "skipped" in r:
            print(f"{r['workload']:>13} {r['concurrency']:>5}  skipped: {r['skipped']}")
            continue
        f = lambda k, s=1e3, w=9, p=1: f"{r[k] * s:>{w}.{p}f}" if r.get(k) is not None else f"{'-':>{w}}"  # noqa
        ok = f"{r['succeeded']}/{r['requests']}"
        print(f"{r['workload']:>13} {r['concurrency']:>5} {ok:>6} {f('output_tps', 1, 10, 1)} {f('ttft_p50_s')} "
              f"{f('ttft_p99_s')} {f('itl_p50_s', 1e3, 8, 2)} {f('itl_p99_s', 1e3, 8, 2)} {f('wall_s', 1, 7, 1)} "
              f"{r['cached_tokens']:>8}{'' if r['ok'] else '  FAILURES'}")
    print("(TTFT and ITL in ms; cached = prompt tokens the server reported from its prefix cache)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
