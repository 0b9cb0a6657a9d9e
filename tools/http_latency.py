#!/usr/bin/env python3
"""Time to first token and inter-token latency of a running `tansy serve`, measured through HTTP,
against `tansy bench` for the same prompt (issue 5: "within 5% of tansy bench").

Standard library only (the GPU machine has no openai package and no network). It starts nothing:

    tools/http_latency.py --url http://127.0.0.1:8011 --contexts 256,4096 \
        --bench bench.json --json server_latency.json [--rounds 5] [--model-dir DIR]

Per context: the prompt is docs/BENCHMARK.md's synthetic one, sent as token ids (token i =
((i * 2654435761) mod 2^32) mod vocab_size, as tansy::synthetic_prompt), to a streaming
/v1/completions with max_tokens 65, temperature 0 (the engine's greedy fast path), ignore_eos;
one warm-up, then --rounds measured requests, medians reported. --settings adds sampled arms
(each compared with the bench's greedy decode, issue 14's floor): "qwen" = temperature 0.6,
top_p 0.95, top_k 20, seed 1234 (Qwen's recommended thinking settings); "qwen_logprobs" = the
same with logprobs 5; "t1" = temperature 1.0 over the whole vocabulary; "presence" = qwen with
presence_penalty 1.5; "json_schema" = qwen under a JSON Schema response_format (structured
output: the grammar's mask every step; the document may end before max_tokens, so ITL is per
step between the first and last chunks).

- TTFT = request sent (connection already open) -> first SSE chunk carrying generated text.
  tansy bench's counterpart is its prefill time (submit -> first id on the host) = context /
  prefill_tps.
- ITL = (last token chunk - first token chunk) / 64, BENCHMARK.md's decode definition;
  tansy bench's counterpart is 1 / decode_tps.

One chunk per token. tansy streams a completion chunk for every token whose text is complete
UTF-8 and holds back a token that ends inside a multi-byte character (its bytes go out with the
next chunk). Logprobs would attach per-token data but turn off the greedy fast path (they need
host logits), so they are not requested. Instead the stream's usage (stream_options.include_usage)
gives the number of tokens generated, and the tool checks that it equals the number of text
chunks ("chunks_match"). With `tansy synth`'s tokenizer every merged token is complete UTF-8 and
only 51 of its 248070 ids (lone UTF-8 lead bytes) can be held back; when one is, ITL over the 64
steps is still exact unless it is the first token, and the result says so instead of guessing.
The usage also reports prefix-cache hits: a measured request must prefill the whole prompt like
tansy bench does, so the server should run with --prefix-cache 0 (a hit is flagged).
Server-side figures from /metrics (arrival -> first token, mean gap between tokens) are recorded
next to the client's, to tell HTTP overhead from engine time.
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import time
import urllib.parse

DECODE_STEPS = 64


def synthetic_prompt(n, vocab_size):
    return [((i * 2654435761) % (1 << 32)) % vocab_size for i in range(n)]


def vocab_from_model_dir(d):
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    return int(c.get("text_config", c)["vocab_size"])


class StreamError(RuntimeError):
    """An error event in a stream, or --time-budget-s running out while reading one."""


class SseStream:
    """The `data:` events of a streaming response as (client time its line was read, event), up to
    `data: [DONE]` (then .done is True). Raises StreamError on an error event, or once `deadline`
    (a time.perf_counter() value) has passed."""

    def __init__(self, resp, deadline=None):
        self.resp, self.deadline, self.done = resp, deadline, False

    def __iter__(self):
        while True:
            line = self.resp.readline()
            if not line:
                return
            t = time.perf_counter()
            if self.deadline is not None and t > self.deadline:
                raise StreamError("cut off: --time-budget-s ran out during the stream")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                return
            ev = json.loads(payload)
            if "error" in ev:
                raise StreamError(f"stream error: {json.dumps(ev['error'])[:300]}")
            yield t, ev


class Server:
    def __init__(self, url, timeout):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(f"{os.path.basename(sys.argv[0])}: --url must be http://HOST:PORT, got {url!r}")
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout
        self.base = u.path.rstrip("/")

    def conn(self, timeout=None):
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        c.connect()
        return c

    def get(self, path, timeout=None):
        c = self.conn(timeout)
        try:
            c.request("GET", self.base + path)
            r = c.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {r.status}: {body[:300]!r}")
            return body.decode()
        finally:
            c.close()

    def metrics(self):
        out = {}
        for line in self.get("/metrics").splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            if name.startswith(("tansy_time_to_first_token_seconds_", "tansy_inter_token_latency_seconds_")):
                out[name] = float(value)
        return out

    def stream_completion(self, body):
        """POSTs a streaming completion; returns (t_sent, [(t, text)], usage, finish_reason)."""
        data = json.dumps(body).encode()
        c = self.conn()
        try:
            headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
            t_sent = time.perf_counter()
            c.request("POST", self.base + "/v1/completions", body=data, headers=headers)
            r = c.getresponse()
            if r.status != 200:
                raise RuntimeError(f"POST /v1/completions: HTTP {r.status}: {r.read()[:500]!r}")
            chunks, usage, finish = [], None, None
            stream = SseStream(r)
            for t, ev in stream:
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices", []):
                    if ch.get("text"):
                        chunks.append((t, ch["text"]))
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
            if not stream.done:
                raise RuntimeError("the stream ended without data: [DONE]")
            return t_sent, chunks, usage, finish
        finally:
            c.close()


QWEN = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 1234}
SETTINGS = {
    "greedy": {"temperature": 0},
    "qwen": QWEN,
    "qwen_logprobs": dict(QWEN, logprobs=5),
    "t1": {"temperature": 1.0, "seed": 1234},
    "presence": dict(QWEN, presence_penalty=1.5),
    # Structured output (issue 17): a JSON document with one free string, the mask on every step.
    "json_schema": dict(QWEN, response_format={"type": "json_schema", "json_schema": {
        "name": "note", "schema": {"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"], "additionalProperties": False}}}),
}


def one_request(server, model, prompt, max_tokens, settings=None):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    body.update(settings or SETTINGS["greedy"])
    if "response_format" in body:
        body.pop("ignore_eos")  # refused with a JSON format: the document decides where it ends
    m0 = server.metrics()
    t_sent, chunks, usage, finish = server.stream_completion(body)
    m1 = server.metrics()
    if not chunks:
        raise RuntimeError("no token chunk arrived")
    if usage is None:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    n_tokens = usage["completion_tokens"]
    t_first, t_last = chunks[0][0], chunks[-1][0]

    def delta(name):
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    n_itl = delta("tansy_inter_token_latency_seconds_count")
    return {
        "ttft_s": t_first - t_sent,
        # Per step between the first and the last token chunk (a structured document may end
        # before max_tokens).
        "itl_s": (t_last - t_first) / (len(chunks) - 1) if len(chunks) > 1 else None,
        "total_s": t_last - t_sent,
        "token_chunks": len(chunks),
        "completion_tokens": n_tokens,
        "chunks_match": len(chunks) == n_tokens == max_tokens,
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "prompt_tokens": usage["prompt_tokens"],
        "finish_reason": finish,
        "server_ttft_s": delta("tansy_time_to_first_token_seconds_sum"),
        "server_itl_s": delta("tansy_inter_token_latency_seconds_sum") / n_itl if n_itl else None,
        "text_sha": hash_text("".join(t for _, t in chunks)),
    }


def hash_text(s):
    h = 0xcbf29ce484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def bench_rows(path):
    with open(path) as f:
        j = json.load(f)
    rows = {}
    for r in j.get("results", []):
        if "prefill_tps" in r and "decode_tps" in r:
            rows[int(r["context"])] = r
    return j, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="base URL of a running tansy serve, e.g. http://127.0.0.1:8011")
    ap.add_argument("--contexts", default="256,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="measured requests per context (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=DECODE_STEPS + 1)
    ap.add_argument("--vocab-size", type=int, help="default: from --model-dir's config.json, else 248320")
    ap.add_argument("--model-dir", help="the served checkpoint (for its vocab_size)")
    ap.add_argument("--model", help="served model id (default: the first of /v1/models)")
    ap.add_argument("--bench", help="tansy bench --json output to compare with")
    ap.add_argument("--tolerance", type=float, default=0.05, help="allowed relative difference (default 0.05)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per HTTP request")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--settings", default="greedy",
                    help="comma-separated sampling settings per context: " + ", ".join(SETTINGS))
    a = ap.parse_args()
    settings = [x.strip() for x in a.settings.split(",") if x.strip()]
    for x in settings:
        if x not in SETTINGS:
            ap.error(f"--settings: unknown {x!r} (known: {', '.join(SETTINGS)})")
    if a.rounds < 1 or a.max_tokens < 2:
        ap.error("--rounds must be >= 1 and --max-tokens >= 2")
    contexts = [int(x) for x in a.contexts.split(",") if x.strip()]
    vocab = a.vocab_size or (vocab_from_model_dir(a.model_dir) if a.model_dir else 248320)

    server = Server(a.url, a.timeout)
    try:
        models = json.loads(server.get("/v1/models"))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"http_latency: cannot query {a.url}/v1/models: {e}", file=sys.stderr)
        return 2
    model = a.model or models["data"][0]["id"]
    max_len = next((m.get("max_model_len") for m in models["data"] if m["id"] == model), None)
    try:
        bench, rows = bench_rows(a.bench) if a.bench else (None, {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"http_latency: cannot read --bench {a.bench}: {e}", file=sys.stderr)
        return 2

    report = {
        "tool": "tools/http_latency.py",
        "url": a.url,
        "model": model,
        "vocab_size": vocab,
        "max_tokens": a.max_tokens,
        "rounds": a.rounds,
        "tolerance": a.tolerance,
        "definitions": {
            "ttft_s": "request sent on an open connection -> first SSE chunk with generated text (client clock)",
            "itl_s": f"(last token chunk - first token chunk) / {a.max_tokens - 1}",
            "bench_ttft_s": "context / prefill_tps of tansy bench (submit -> first id on the host)",
            "bench_itl_s": "1 / decode_tps of tansy bench",
            "server_*": "the same request seen by the server's /metrics histograms (arrival -> first token; mean gap)",
        },
        "bench": {k: bench.get(k) for k in ("commit", "date", "backend", "gpu", "model_dir")} if bench else None,
        "results": [],
    }
    failures = 0
    for ctx, setting in [(c, x) for c in contexts for x in settings]:
        if max_len and ctx + a.max_tokens > max_len:
            print(f"context {ctx}: skipped, {ctx} + {a.max_tokens} exceeds the server's max_model_len {max_len}",
                  file=sys.stderr)
            report["results"].append({"context": ctx, "error": f"exceeds max_model_len {max_len}"})
            failures += 1
            continue
        prompt = synthetic_prompt(ctx, vocab)
        row = {"context": ctx, "settings": setting, "sampling": SETTINGS[setting]}
        try:
            warm = one_request(server, model, prompt, a.max_tokens, SETTINGS[setting])
            runs = [one_request(server, model, prompt, a.max_tokens, SETTINGS[setting]) for _ in range(a.rounds)]
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            print(f"context {ctx}: FAILED: {e}", file=sys.stderr)
            row["error"] = str(e)
            report["results"].append(row)
            failures += 1
            continue
        def med(k):
            v = [r[k] for r in runs if r[k] is not None]
            return statistics.median(v) if v else None

        row.update({
            "ttft_s": med("ttft_s"),
            "itl_s": med("itl_s"),
            "server_ttft_s": med("server_ttft_s"),
            "server_itl_s": med("server_itl_s"),
            "ttft_s_rounds": [r["ttft_s"] for r in runs],
            "itl_s_rounds": [r["itl_s"] for r in runs],
            "warmup": {k: warm[k] for k in ("ttft_s", "itl_s")},
            "token_chunks": runs[0]["token_chunks"],
            "completion_tokens": runs[0]["completion_tokens"],
            "chunks_match": all(r["chunks_match"] for r in runs),
            "cached_tokens": max(r["cached_tokens"] for r in runs),
            "texts_agree": len({r["text_sha"] for r in runs + [warm]}) == 1,
        })
        notes = []
        if not row["chunks_match"]:
            notes.append(f"{row['completion_tokens']} tokens arrived in {row['token_chunks']} chunks (a token ending "
                         "inside a UTF-8 character waits for the next); if it was the first, TTFT includes one "
                         "decode step")
        if row["cached_tokens"]:
            notes.append(f"{row['cached_tokens']} prompt tokens came from the prefix cache (run the server with "
                         "--prefix-cache 0): TTFT is not a full prefill")
        if not row["texts_agree"]:
            notes.append("rounds produced different text (greedy, or sampling with a fixed seed)")
        b = rows.get(ctx)
        if b:
            row["bench_ttft_s"] = ctx / b["prefill_tps"]
            row["bench_itl_s"] = 1.0 / b["decode_tps"]
            row["ttft_ratio"] = row["ttft_s"] / row["bench_ttft_s"]
            row["itl_ratio"] = row["itl_s"] / row["bench_itl_s"]
            row["ttft_within"] = abs(row["ttft_ratio"] - 1) <= a.tolerance
            row["itl_within"] = abs(row["itl_ratio"] - 1) <= a.tolerance
        elif a.bench:
            notes.append("no row for this context in the bench JSON")
        if notes:
            row["notes"] = notes
        report["results"].append(row)

    # Table.
    print(f"http_latency  {a.url}  model {model}  {a.rounds} round(s) after 1 warm-up, medians; "
          f"tolerance {a.tolerance:.0%}")
    print(f"{'context':>8} {'settings':>13} {'TTFT ms':>9} {'bench':>9} {'ratio':>6} {'ok':>3} {'ITL ms':>8} {'bench':>8} "
          f"{'ratio':>6} {'ok':>3} {'srv TTFT':>9} {'srv ITL':>8}  chunks")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['context']:>8} {r.get('settings', ''):>13}  FAILED: {r['error']}")
            continue
        f = lambda k, s=1e3, w=9, p=2: f"{r[k] * s:>{w}.{p}f}" if r.get(k) is not None else f"{'-':>{w}}"  # noqa
        ok = lambda k: (" yes" if r[k] else "  NO") if k in r else "   -"  # noqa: E731
        print(f"{r['context']:>8} {r['settings']:>13} {f('ttft_s')} {f('bench_ttft_s')} {f('ttft_ratio', 1, 6, 3)}{ok('ttft_within')} "
              f"{f('itl_s', 1e3, 8, 3)} {f('bench_itl_s', 1e3, 8, 3)} {f('itl_ratio', 1, 6, 3)}{ok('itl_within')} "
              f"{f('server_ttft_s')} {f('server_itl_s', 1e3, 8, 3)}  {r['token_chunks']}/{r['completion_tokens']}")
        for n in r.get("notes", []):
            print(f"{'':>8} note: {n}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
