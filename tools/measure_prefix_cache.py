#!/usr/bin/env python3
"""Measures prefix-cache policies of `tansy serve` on multi-turn chat workloads.

Usage: measure_prefix_cache.py [--tansy build/tansy] [--model models/tansy-demo] [--sizes 0,1,2,4]

For each --prefix-cache size it starts a server and replays the same workloads (multi-turn
conversations, thinking on and off, alone and interleaved), then prints the share of prompt tokens
restored from the cache and the time spent. Uses only the Python standard library and requests.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["Hello! Who are you?", "What does the word river mean?", "Tell me a fortune.",
             "Quote a verse about light.", "Define the word ocean.", "Give me a synonym for happy."]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(url, model, messages, think):
    r = requests.post(url + "/v1/chat/completions", timeout=600, json={
        "model": model, "messages": messages, "max_tokens": 24, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": think}})
    r.raise_for_status()
    j = r.json()
    return j["choices"][0]["message"], j["usage"]


def conversation(turns, think, offset):
    """A generator of requests: yields message lists, receives the assistant message of each."""
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": QUESTIONS[(t + offset) % len(QUESTIONS)]})
        answer = yield list(msgs)
        msgs.append({"role": "assistant", "content": answer.get("content") or "",
                     "reasoning_content": answer.get("reasoning_content")})


def run_workload(url, model, convs):
    """Interleaves the conversations round-robin; returns (prompt tokens, cached tokens)."""
    prompt = cached = 0
    gens = [(conversation(turns, think, i), think) for i, (turns, think) in enumerate(convs)]
    pending = [(g, next(g), think) for g, think in gens]
    while pending:
        nxt = []
        for g, msgs, think in pending:
            msg, usage = chat(url, model, msgs, think)
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            try:
                nxt.append((g, g.send(msg), think))
            except StopIteration:
                pass
        pending = nxt
    return prompt, cached


WORKLOADS = {
    "1 conversation, 6 turns, thinking off": [(6, False)],
    "1 conversation, 6 turns, thinking on": [(6, True)],
    "2 interleaved conversations, 4 turns each": [(4, False), (4, True)],
    "3 interleaved conversations, 3 turns each": [(3, False), (3, False), (3, True)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tansy", default=os.path.join(REPO, "build", "tansy"))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "tansy-demo"))
    ap.add_argument("--sizes", default="0,1,2,4")
    ap.add_argument("--threads", default="1")
    a = ap.parse_args()
    model = os.path.basename(os.path.normpath(a.model))
    rows = []
    for size in [int(x) for x in a.sizes.split(",")]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([a.tansy, "serve", "--model", a.model, "--port", str(port), "--prefix-cache", str(size),
                                 "--threads", a.threads], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(600):
                try:
                    if requests.get(url + "/health", timeout=1).ok:
                        break
                except requests.RequestException:
                    time.sleep(0.1)
            for name, convs in WORKLOADS.items():
                t0 = time.time()
                prompt, cached = run_workload(url, model, convs)
                rows.append((size, name, prompt, cached, time.time() - t0))
                print(f"cache {size}: {name}: {cached}/{prompt} prompt tokens cached "
                      f"({100 * cached / prompt:.1f}%), {time.time() - t0:.1f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait()
    print(json.dumps(rows))


if __name__ == "__main__":
    sys.exit(main())
