"""tools/concurrency_bench.py (issue 16's concurrency benchmark) against the real `tansy serve` on the
bundled demo model (CPU backend), with tiny settings: the JSON has its fields, every request got its
tokens, the figures agree with the per-request records and with the server's own counters, the
prompts follow docs/BENCHMARK.md's rule, cached tokens are reported when the server's prefix cache
gives them, and failed requests are counted rather than dropped.
"""
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest
import requests

from api_support import REPO, ServerProcess

DEMO = os.path.join(REPO, "models", "tansy-demo")
TOOL = os.path.join(REPO, "tools", "concurrency_bench.py")
pytestmark = pytest.mark.skipif(not os.path.isdir(DEMO), reason="models/tansy-demo is not in this checkout")

N, P, NEW = 64, 32, 8  # prompt tokens, shared prefix, new tokens
LEVELS = (1, 3)
WORKLOADS = ("distinct", "shared-prefix")
COUNTERS = ("tansy_generation_tokens_total", "tansy_prefix_cache_cached_tokens_total", "tansy_prompt_tokens_total")


def load_tool():
    spec = importlib.util.spec_from_file_location("concurrency_bench", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def counters(url):
    out = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split(" ", 1)[0]
        if name in COUNTERS:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def run_tool(url, out_json, *extra):
    cmd = [sys.executable, TOOL, "--url", url, "--model-dir", DEMO, "--json", str(out_json),
           "--prompt-tokens", str(N), "--prefix-tokens", str(P), "--new-tokens", str(NEW),
           "--concurrency", ",".join(map(str, LEVELS)), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    with open(out_json) as f:
        return p.returncode, json.load(f), p.stdout + p.stderr


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    # A prefix cache with room for every request of two runs' worth of prompts.
    s = ServerProcess(None, str(tmp_path_factory.mktemp("logs") / "concurrency.log"), "--prefix-cache", "32")
    yield s
    alive = s.alive()
    s.stop()
    assert alive, "the server died:\n" + s.log_text()


@pytest.fixture(scope="module")
def first_run(demo, tmp_path_factory):
    before = counters(demo.url)
    rc, report, out = run_tool(demo.url, tmp_path_factory.mktemp("bench") / "first.json", "--metrics-interval", "0.05")
    return rc, report, out, before, counters(demo.url)


def all_requests(report):
    """(record, is_warmup) of every request the tool sent."""
    for row in report["results"]:
        for w in row.get("warmup", []):
            yield w, True
        for r in row["per_request"]:
            yield r, False


def test_the_prompts_follow_the_documented_rule():
    t = load_tool()
    vocab = 8192
    ref = lambda p: ((p * 2654435761) % (1 << 32)) % vocab  # noqa: E731
    assert t.prompt_for("distinct", 3, N, P, vocab) == [ref(p) for p in range(3 * N, 4 * N)]
    b = 1 << 31
    shared = t.prompt_for("shared-prefix", 2, N, P, vocab)
    assert shared == [ref(p) for p in range(b, b + P)] + [ref(p) for p in range(b + P + 2 * (N - P), b + P + 3 * (N - P))]
    prompts = [tuple(t.prompt_for(w, k, N, P, vocab)) for w in WORKLOADS for k in range(1, 10)]
    assert len(set(prompts)) == len(prompts)
    assert all(len(p) == N for p in prompts)
    assert len({p[:P] for p in prompts[9:]}) == 1  # one common prefix
    assert len({p[P:] for p in prompts[9:]}) == 9  # distinct turns
    q = t.request_body("m", [1, 2], NEW, "qwen", 5)
    assert (q["seed"], q["temperature"], q["top_p"], q["top_k"]) == (1234 + 5, 0.6, 0.95, 20)
    g = t.request_body("m", [1, 2], NEW, "greedy", 5)
    assert (g["temperature"], g["ignore_eos"], g["stream"], g["max_tokens"]) == (0, True, True, NEW) and "seed" not in g
    assert g["stream_options"] == {"include_usage": True}
    assert t.percentile([4, 1, 3, 2], 0.5) == 2.5 and t.percentile([7], 0.99) == 7
    assert t.percentile(list(range(101)), 0.99) == pytest.approx(99)


def test_report_fields_and_every_request_got_its_tokens(first_run):
    rc, report, out, before, after = first_run
    assert rc == 0, out
    assert report["tool"] == "tools/concurrency_bench.py"
    assert report["contract"]["version"] == 1
    assert report["health"]["status"] == "ok"
    s = report["settings"]
    assert (s["prompt_tokens"], s["prefix_tokens"], s["new_tokens"], s["concurrency"]) == (N, P, NEW, list(LEVELS))
    assert s["vocab_size"] == json.load(open(os.path.join(DEMO, "config.json")))["text_config"]["vocab_size"]
    rows = report["results"]
    assert [(r["concurrency"], r["workload"]) for r in rows] == [(c, w) for c in LEVELS for w in WORKLOADS]
    for row in rows:
        c = row["concurrency"]
        assert row["ok"] and (row["requests"], row["succeeded"], row["failed"]) == (c, c, 0) and row["failures"] == []
        assert row["generated_tokens"] == NEW * c
        pr = row["per_request"]
        assert len(pr) == c and len({r["index"] for r in pr}) == c
        for r in pr:
            assert (r["ok"], r["prompt_tokens"], r["completion_tokens"], r["finish_reason"]) == (True, N, NEW, "length")
            ts = r["chunk_times_s"]
            assert len(ts) == r["token_chunks"] and 1 <= len(ts) <= NEW
            assert ts == sorted(ts) and r["ttft_s"] == pytest.approx(ts[0], abs=1e-6)
        # The level's figures from its per-request records.
        span = max(r["sent_s"] + r["chunk_times_s"][-1] for r in pr)
        assert row["first_send_to_last_token_s"] == pytest.approx(span, abs=1e-5)
        assert row["output_tps"] == pytest.approx(NEW * c / span, rel=1e-3)
        assert row["wall_s"] >= row["first_send_to_last_token_s"] > 0
        ttfts = sorted(r["ttft_s"] for r in pr)
        assert row["ttft_p50_s"] == pytest.approx(statistics.median(ttfts), abs=1e-5)
        assert row["ttft_max_s"] == pytest.approx(ttfts[-1], abs=1e-5)
        gaps = [b - a for r in pr for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:])]
        assert row["itl_gaps"] == len(gaps) == sum(r["token_chunks"] - 1 for r in pr)
        assert min(gaps) - 1e-5 <= row["itl_p50_s"] <= row["itl_p99_s"] <= max(gaps) + 1e-5
        # The server's own counters over the level agree with what the tool counted.
        assert row["metrics_delta"]["tansy_generation_tokens_total"] == NEW * c
        assert row["metrics_delta"]["tansy_prompt_tokens_total"] == N * c
        # A gauge the server exports today; the tool waits for it to read 0 before a level.
        assert row["metrics_before"]["tansy_requests_running"] == 0 and row["settle_s"] < 5
        assert row["metrics_samples"] >= 1 and "tansy_requests_running" in row["metrics_peak"]
    # One warm-up per workload, before its first level.
    assert [len(r.get("warmup", [])) for r in rows] == [1, 1, 0, 0]
    sent = list(all_requests(report))
    assert len(sent) == 2 + 2 * sum(LEVELS)
    assert after["tansy_generation_tokens_total"] - before["tansy_generation_tokens_total"] == NEW * len(sent)
    assert "FAILURES" not in out and "distinct" in out


def test_cached_tokens_are_what_the_server_reports(first_run):
    _, report, _, before, after = first_run
    reported = sum(r["cached_tokens"] for r, _ in all_requests(report))
    assert reported == after["tansy_prefix_cache_cached_tokens_total"] - before["tansy_prefix_cache_cached_tokens_total"]
    for row in report["results"]:
        assert row["cached_tokens"] == row["metrics_delta"]["tansy_prefix_cache_cached_tokens_total"]
        assert all(0 <= r["cached_tokens"] < N for r in row["per_request"])
        if row["workload"] == "distinct":  # no request repeats or extends another's prompt
            assert row["cached_tokens"] == 0


def test_a_rerun_reports_the_cached_prompts(demo, first_run, tmp_path):
    # The same prompts again (same --salt): the server resumes a repeated completion prompt from
    # its prefix cache, so every request reports cached tokens, and a new --salt gets none.
    before = counters(demo.url)
    rc, report, out = run_tool(demo.url, tmp_path / "again.json")
    after = counters(demo.url)
    assert rc == 0, out
    for row in report["results"]:
        assert all(r["cached_tokens"] > 0 for r in row["per_request"]), row["per_request"]
    reported = sum(r["cached_tokens"] for r, _ in all_requests(report))
    assert reported == after["tansy_prefix_cache_cached_tokens_total"] - before["tansy_prefix_cache_cached_tokens_total"]
    rc, fresh, out = run_tool(demo.url, tmp_path / "fresh.json", "--salt", "100", "--workloads", "distinct",
                              "--warmup", "0")
    assert rc == 0, out
    assert [row["cached_tokens"] for row in fresh["results"]] == [0] * len(LEVELS)


def test_failures_are_counted_and_flag_the_level(tmp_path):
    # One request waiting at most: of 6 sent together, those beyond the running one and the one
    # waiting get 503.
    s = ServerProcess(None, str(tmp_path / "busy.log"), "--max-queue", "1", "--max-running", "1")
    try:
        rc, report, out = run_tool(s.url, tmp_path / "busy.json", "--concurrency", "6", "--workloads", "distinct",
                                   "--warmup", "0", "--new-tokens", "24")
    finally:
        s.stop()
    assert rc == 1, out
    [row] = report["results"]
    assert not row["ok"] and row["failed"] >= 1 and row["succeeded"] >= 1
    assert row["succeeded"] + row["failed"] == row["requests"] == 6
    assert len(row["failures"]) == row["failed"]
    assert all(f["http_status"] == 503 and "busy" in f["error"] for f in row["failures"])
    assert row["generated_tokens"] == 24 * row["succeeded"]
    assert sum(not r["ok"] for r in row["per_request"]) == row["failed"]
    assert "FAILURES" in out and "FAILED" in out
