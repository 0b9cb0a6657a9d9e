#!/usr/bin/env python3
"""Agent turns through HTTP (issue 22): time to first token of each turn of a conversation that
grows by a short new piece per turn on a cached prefix, and of a cold request of the prefix's size.

Standard library only (the GPU machine has no openai package and no network). It starts nothing:

    tools/multiturn_bench.py --url http://127.0.0.1:8011 --model-dir DIR --json multiturn.json \
        [--prefix-tokens 4096] [--turns 64,256,1024] [--new-tokens 16] [--rounds 3] [--warmup 1] \
        [--salt 0] [--label TEXT] [--time-budget-s S]

docs/BENCHMARK.md's section "Multi-turn (issue 22)" is the definition; in short:

- Token ids from the synthetic rule of tansy bench and tools/http_latency.py: the id at position p
  is ((p * 2654435761) mod 2^32) mod vocab_size. With P = --prefix-tokens, T = the sum of --turns
  and L = 2P + T, conversation c (c = salt + 1, salt + 2, ... one per round; c = 0 is the warm-ups')
  owns the positions [M + c * L, M + (c + 1) * L), M = 3 * 2^30 + 1: far from concurrency_bench.py's
  (below 2^31 + a few million) and those of tansy bench and http_latency.py (from 0), and odd, since
  with a vocab_size of 2^n the rule repeats every 2^n positions (the test model's 8192). Its first
  request is positions [M + c * L, + P); turn i's new piece continues right after the previous
  piece; the cold request is the last P positions of the block, [M + c * L + P + T, + P).
- Turn i's prompt = turn i-1's prompt + turn i-1's answer, as token ids (the completion API
  returns text, not ids, so the answer's text is turned into ids by the server's /tokenize, as a
  client that sends the conversation's text would have it tokenized) + turn i's new piece.
- Each request is a streaming /v1/completions with a token-id prompt, max_tokens --new-tokens,
  ignore_eos, temperature 0 and stream_options.include_usage. Per request: TTFT (request sent on
  an open connection -> first SSE chunk with generated text), usage's prompt_tokens (must equal
  the ids sent), completion_tokens (must equal --new-tokens) and prompt_tokens_details.cached_tokens.
- A round: the cold request, then the conversation's requests one after another. Medians over the
  rounds per turn and for the cold request.
- The server's prefix-cache capacity (the gauge tansy_prefix_cache_capacity of /metrics, 0 when
  off) is recorded, with --label for anything else the caller wants to note.

A request that got an HTTP error, a stream error, no [DONE], no usage, a finish reason other than
"length", a completion_tokens other than --new-tokens or a prompt_tokens other than the ids sent is
a failure: it is recorded with its reason, its round is marked "ok": false (the conversation stops
there, since later turns would extend a prompt that was not served) and left out of the medians.
The JSON (--json) is rewritten after every round. --time-budget-s skips a round that the previous
round's time says would not fit (recorded as skipped) and cuts off a stream that outlasts it.
Exit status: 0 when every round ran without failure, 1 otherwise, 2 when the server cannot be used.
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_latency import Server, SseStream, StreamError, vocab_from_model_dir  # noqa: E402  (the shared client)

CONTRACT = {
    "version": 1,
    "name": "docs/BENCHMARK.md, Multi-turn (issue 22)",
    "summary": "a synthetic token-id prefix, then turns that each send the previous prompt + its answer "
               "(ids via /tokenize) + a new synthetic piece; a cold request of the prefix's size; streaming "
               "/v1/completions, ignore_eos, greedy, usage checked; TTFT and cached tokens per turn, medians "
               "over rounds",
}
BASE = (3 << 30) + 1  # M: where this tool's positions start


def rule(start, n, vocab_size):
    """Positions [start, start + n) of the synthetic prompt rule (tansy::synthetic_prompt)."""
    return [((i * 2654435761) % (1 << 32)) % vocab_size for i in range(start, start + n)]


def block(prefix_tokens, turns):
    """L: the positions one conversation owns (its prefix, its turns' pieces, its cold request)."""
    return 2 * prefix_tokens + sum(turns)


def conversation_pieces(c, prefix_tokens, turns, vocab_size):
    """The new ids of each request of conversation c: the prefix, then each turn's piece."""
    start, out = BASE + c * block(prefix_tokens, turns), []
    for n in [prefix_tokens] + list(turns):
        out.append(rule(start, n, vocab_size))
        start += n
    return out


def cold_prompt(c, prefix_tokens, turns, vocab_size):
    return rule(BASE + c * block(prefix_tokens, turns) + prefix_tokens + sum(turns), prefix_tokens, vocab_size)


def request_body(model, prompt, new_tokens):
    return {"model": model, "prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def stream(server, body, deadline):
    """One streaming completion. Returns a record: ttft_s, text, usage, finish_reason, error."""
    rec = {"ok": False, "sent_ids": len(body["prompt"])}
    timeout = server.timeout
    if deadline is not None:
        timeout = min(timeout, max(1.0, deadline - time.perf_counter()))
    c = None
    text, first, finish, usage, done = [], None, None, None, False
    try:
        c = server.conn(timeout)
        data = json.dumps(body).encode()
        t_sent = time.perf_counter()
        c.request("POST", server.base + "/v1/completions", body=data,
                  headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        r = c.getresponse()
        if r.status != 200:
            rec["http_status"] = r.status
            rec["error"] = f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
            return rec
        stream = SseStream(r, deadline)
        try:
            for t, ev in stream:
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices", []):
                    if ch.get("text"):
                        if first is None:
                            first = t
                        text.append(ch["text"])
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
        except StreamError as e:
            rec["error"] = str(e)
            return rec
        done = stream.done
        rec["wall_s"] = time.perf_counter() - t_sent
        if first is not None:
            rec["ttft_s"] = first - t_sent
    except Exception as e:  # noqa: BLE001  every request's outcome is recorded, whatever went wrong
        rec["error"] = f"{type(e).__name__}: {e}"
        if isinstance(e, TimeoutError) and deadline is not None and time.perf_counter() >= deadline - 0.01:
            rec["error"] = "cut off: --time-budget-s ran out during the request (socket timeout)"
        return rec
    finally:
        if c is not None:
            c.close()
    rec["text"] = "".join(text)
    rec["finish_reason"] = finish
    if usage is not None:
        rec["prompt_tokens"] = usage.get("prompt_tokens")
        rec["completion_tokens"] = usage.get("completion_tokens")
        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if not done:
        rec["error"] = "the stream ended without data: [DONE]"
    elif usage is None:
        rec["error"] = "the stream carried no usage (stream_options.include_usage)"
    elif rec["completion_tokens"] != body["max_tokens"]:
        rec["error"] = f"usage.completion_tokens {rec['completion_tokens']} != --new-tokens {body['max_tokens']}"
    elif rec["prompt_tokens"] != len(body["prompt"]):
        rec["error"] = f"usage.prompt_tokens {rec['prompt_tokens']} != the {len(body['prompt'])} ids sent"
    elif finish != "length":
        rec["error"] = f"finish_reason {finish!r}, expected 'length' (ignore_eos)"
    elif first is None:
        rec["error"] = "no chunk with generated text arrived"
    else:
        rec["ok"] = True
    return rec


def tokenize(server, model, text):
    """The server's ids for `text` (POST /tokenize)."""
    c = server.conn(min(server.timeout, 60))
    try:
        c.request("POST", server.base + "/tokenize", body=json.dumps({"model": model, "prompt": text}).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"POST /tokenize: HTTP {r.status}: {body[:300]!r}")
        ids = json.loads(body)["tokens"]
        if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
            raise RuntimeError("POST /tokenize: 'tokens' is not a list of ids")
        return ids
    finally:
        c.close()


def prefix_cache_capacity(server):
    """tansy_prefix_cache_capacity from /metrics, or None when the server does not export it."""
    for line in server.get("/metrics", min(server.timeout, 30)).splitlines():
        if line.startswith("tansy_prefix_cache_capacity "):
            v = float(line.split()[1])
            return int(v) if v.is_integer() else v
    return None


def run_round(server, model, c, a, vocab, deadline):
    """The cold request, then conversation c. Returns the round's record."""
    row = {"conversation": c, "ok": True}
    rec = stream(server, request_body(model, cold_prompt(c, a.prefix_tokens, a.turns, vocab), a.new_tokens), deadline)
    rec.pop("text", None)
    row["cold"] = rec
    if not rec["ok"]:
        row["ok"] = False
        row["failure"] = f"cold request: {rec['error']}"
        return row
    row["turns"] = []
    prompt = []
    for i, piece in enumerate(conversation_pieces(c, a.prefix_tokens, a.turns, vocab)):
        prompt = prompt + piece
        rec = stream(server, request_body(model, prompt, a.new_tokens), deadline)
        rec = {"turn": i, "new_tokens": len(piece), **rec}
        row["turns"].append(rec)
        if not rec["ok"]:
            row["ok"] = False
            row["failure"] = f"turn {i}: {rec['error']}"
            return row
        try:
            answer = tokenize(server, model, rec.pop("text"))
        except (OSError, RuntimeError, ValueError, KeyError, http.client.HTTPException) as e:
            row["ok"] = False
            row["failure"] = f"turn {i}: {e}"
            return row
        rec["answer_ids"] = len(answer)
        prompt = prompt + answer
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="base URL of a running tansy serve, e.g. http://127.0.0.1:8011")
    ap.add_argument("--prefix-tokens", type=int, default=4096, help="the first request's prompt (and the cold one's)")
    ap.add_argument("--turns", default="64,256,1024", help="new tokens of each later turn, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=16, help="max_tokens of every request (with ignore_eos)")
    ap.add_argument("--rounds", type=int, default=3, help="conversations (each with its cold request); medians")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first, on conversation 0 (default 1)")
    ap.add_argument("--salt", type=int, default=0, help="the measured conversations are salt + 1, salt + 2, ...")
    ap.add_argument("--label", help="recorded in the JSON (e.g. the server's flags)")
    ap.add_argument("--vocab-size", type=int, help="default: from --model-dir's config.json, else 248320")
    ap.add_argument("--model-dir", help="the served checkpoint (for its vocab_size)")
    ap.add_argument("--model", help="served model id (default: the first of /v1/models)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds any one socket wait may take")
    ap.add_argument("--time-budget-s", type=float, help="skip rounds that would not end within this many seconds")
    ap.add_argument("--json", help="write the results here (rewritten after every round)")
    a = ap.parse_args()
    try:
        a.turns = [int(x) for x in a.turns.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--turns must be comma-separated integers, got {a.turns!r}")
    if min(a.turns, default=1) < 1:
        ap.error("--turns: every turn must add >= 1 token")
    if a.prefix_tokens < 1 or a.new_tokens < 1 or a.rounds < 1 or a.warmup < 0 or a.salt < 0:
        ap.error("--prefix-tokens, --new-tokens and --rounds must be >= 1, --warmup and --salt >= 0")
    if BASE + (a.salt + a.rounds + 1) * block(a.prefix_tokens, a.turns) > 1 << 32:
        ap.error("--salt, --rounds, --prefix-tokens and --turns take positions past 2^32 (where the rule wraps)")
    try:
        vocab = a.vocab_size or (vocab_from_model_dir(a.model_dir) if a.model_dir else 248320)
    except (OSError, ValueError, KeyError) as e:
        print(f"multiturn_bench: cannot read the vocab_size of --model-dir {a.model_dir}: {e}", file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    deadline = t_start + a.time_budget_s if a.time_budget_s else None
    server = Server(a.url, a.timeout)
    try:
        models = json.loads(server.get("/v1/models", min(a.timeout, 30)))
        health = json.loads(server.get("/health", min(a.timeout, 30)))
        capacity = prefix_cache_capacity(server)
    except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:
        print(f"multiturn_bench: cannot query {a.url}: {e}", file=sys.stderr)
        return 2
    model = a.model or models["data"][0]["id"]
    max_len = next((m.get("max_model_len") for m in models["data"] if m["id"] == model), None)
    longest = a.prefix_tokens + sum(a.turns) + (len(a.turns) + 1) * a.new_tokens
    if max_len and longest > max_len:
        print(f"multiturn_bench: the last turn's context (about {longest} tokens) exceeds the server's "
              f"max_model_len {max_len}", file=sys.stderr)
        return 2

    report = {
        "tool": "tools/multiturn_bench.py",
        "contract": CONTRACT,
        "url": a.url,
        "model": model,
        "label": a.label,
        "health": health,
        "prefix_cache_capacity": capacity,
        "settings": {
            "prefix_tokens": a.prefix_tokens, "turns": a.turns, "new_tokens": a.new_tokens, "rounds": a.rounds,
            "warmup": a.warmup, "salt": a.salt, "vocab_size": vocab, "ignore_eos": True, "temperature": 0,
            "timeout_s": a.timeout, "time_budget_s": a.time_budget_s,
        },
        "definitions": {
            "ids": "id at position p = ((p * 2654435761) mod 2^32) mod vocab_size",
            "conversation": f"c owns positions [M + c * L, M + (c + 1) * L), M = {BASE}, L = 2 * prefix_tokens + "
                            "sum(turns); request 0 = [M + c * L, + prefix_tokens), each turn's piece the next positions",
            "turn_prompt": "previous prompt + /tokenize(previous answer's text) + the turn's new piece",
            "cold": "positions [M + c * L + prefix_tokens + sum(turns), + prefix_tokens), sent before the conversation",
            "ttft_s": "request sent on an open connection -> first SSE chunk with generated text (client clock)",
            "cached_tokens": "usage.prompt_tokens_details.cached_tokens",
            "median": "over the rounds that succeeded",
            "failure": "HTTP status != 200, connection error or timeout, stream error, no [DONE], no usage, "
                       "finish_reason != length, completion_tokens != new_tokens, prompt_tokens != ids sent",
        },
        "warmup": [],
        "rounds": [],
    }

    def save():
        if a.json:
            tmp = a.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
            os.replace(tmp, a.json)

    def summarise():
        good = [r for r in report["rounds"] if r.get("ok")]
        s = {"rounds_ok": len(good), "cold_ttft_median_s": None, "turns": []}
        if good:
            s["cold_ttft_median_s"] = statistics.median(r["cold"]["ttft_s"] for r in good)
            for i, n in enumerate([a.prefix_tokens] + a.turns):
                s["turns"].append({
                    "turn": i, "new_tokens": n,
                    "ttft_median_s": statistics.median(r["turns"][i]["ttft_s"] for r in good),
                    "prompt_tokens_median": statistics.median(r["turns"][i]["prompt_tokens"] for r in good),
                    "cached_tokens_median": statistics.median(r["turns"][i]["cached_tokens"] for r in good),
                })
        report["summary"] = s

    bad = 0
    last_round_s = 0.0
    plan = [(0, True)] * a.warmup + [(a.salt + 1 + r, False) for r in range(a.rounds)]
    for c, warm in plan:
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0 or last_round_s > left:
                row = {"conversation": c, "ok": False, "skipped": f"time budget: {left:.1f} s left, "
                       f"the previous round took {last_round_s:.1f} s"}
                print(f"conversation {c}: skipped ({row['skipped']})", file=sys.stderr)
                (report["warmup"] if warm else report["rounds"]).append(row)
                bad += 1
                save()
                continue
        t = time.perf_counter()
        row = run_round(server, model, c, a, vocab, deadline)
        last_round_s = row["wall_s"] = time.perf_counter() - t
        (report["warmup"] if warm else report["rounds"]).append(row)
        if not row["ok"]:
            bad += 1
            print(f"conversation {c}{' (warm-up)' if warm else ''} FAILED: {row['failure']}", file=sys.stderr)
        summarise()
        save()
    summarise()
    report["elapsed_s"] = time.perf_counter() - t_start
    save()

    s = report["summary"]
    print(f"multiturn_bench  {a.url}  model {model}  prefix {a.prefix_tokens}, turns {a.turns}, {a.new_tokens} new, "
          f"prefix cache capacity {capacity}{'  ' + a.label if a.label else ''}")
    print(f"rounds ok: {s['rounds_ok']}/{a.rounds}")
    cold = s["cold_ttft_median_s"]
    print(f"{'cold':>6} {'+' + str(a.prefix_tokens):>7} TTFT {cold * 1e3 if cold is not None else float('nan'):9.1f} ms")
    for t in s["turns"]:
        print(f"{'turn ' + str(t['turn']):>6} {'+' + str(t['new_tokens']):>7} TTFT {t['ttft_median_s'] * 1e3:9.1f} ms"
              f"  prompt {t['prompt_tokens_median']:>8}  cached {t['cached_tokens_median']:>8}")
    print("(medians over the rounds; cached = prompt tokens the server reported from its prefix cache)"
          + ("  FAILURES" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
