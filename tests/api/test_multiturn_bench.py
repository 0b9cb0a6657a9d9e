"""tools/multiturn_bench.py (issue 22's multi-turn benchmark) against the real `tansy serve` on the
bundled demo model (CPU backend), with tiny settings: the JSON has its fields, every turn's prompt
extends the previous one by its answer and its new piece, the server's prefix cache resumes each
turn where the engine's rule says it must (and nowhere with the cache off), failures are recorded
and an unusable server gives exit status 2.
"""
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest
import requests

from api_support import REPO, ServerProcess, free_port

DEMO = os.path.join(REPO, "models", "tansy-demo")
TOOL = os.path.join(REPO, "tools", "multiturn_bench.py")
pytestmark = pytest.mark.skipif(not os.path.isdir(DEMO), reason="models/tansy-demo is not in this checkout")

P, TURNS, NEW, ROUNDS = 64, (8, 16), 4, 2


def load_tool():
    spec = importlib.util.spec_from_file_location("multiturn_bench", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(url, out_json, *extra):
    cmd = [sys.executable, TOOL, "--url", url, "--model-dir", DEMO, "--json", str(out_json),
           "--prefix-tokens", str(P), "--turns", ",".join(map(str, TURNS)), "--new-tokens", str(NEW),
           "--rounds", str(ROUNDS), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    report = None
    if os.path.exists(out_json):
        with open(out_json) as f:
            report = json.load(f)
    return p.returncode, report, p.stdout + p.stderr


def cached_total(url):
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tansy_prefix_cache_cached_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no tansy_prefix_cache_cached_tokens_total in /metrics")


def server(tmp_path_factory, name, *args):
    s = ServerProcess(None, str(tmp_path_factory.mktemp("logs") / f"{name}.log"), *args)
    return s


@pytest.fixture(scope="module")
def cache_on(tmp_path_factory):
    s = server(tmp_path_factory, "multiturn-on", "--prefix-cache", "8")
    try:
        before = cached_total(s.url)
        rc, report, out = run_tool(s.url, tmp_path_factory.mktemp("bench") / "on.json", "--label", "cache on")
        yield rc, report, out, cached_total(s.url) - before
    finally:
        alive = s.alive()
        s.stop()
    assert alive, "the server died:\n" + s.log_text()


def test_the_prompts_follow_the_documented_rule():
    t = load_tool()
    vocab = 8192
    ref = lambda p: ((p * 2654435761) % (1 << 32)) % vocab  # noqa: E731
    m, span = (3 << 30) + 1, 2 * P + sum(TURNS)
    pieces = t.conversation_pieces(5, P, TURNS, vocab)
    start = m + 5 * span
    assert pieces[0] == [ref(p) for p in range(start, start + P)]
    assert pieces[1] == [ref(p) for p in range(start + P, start + P + TURNS[0])]
    assert pieces[2] == [ref(p) for p in range(start + P + TURNS[0], start + P + sum(TURNS))]
    cold = start + P + sum(TURNS)
    assert t.cold_prompt(5, P, TURNS, vocab) == [ref(p) for p in range(cold, cold + P)]
    # No two conversations or cold requests begin with the same id (so share no prefix), with the
    # test model's vocabulary, whose 2^13 ids make the rule repeat every 2^13 positions.
    firsts = [t.conversation_pieces(c, P, TURNS, vocab)[0][0] for c in range(6)]
    colds = [t.cold_prompt(c, P, TURNS, vocab)[0] for c in range(6)]
    assert len(set(firsts + colds)) == 12
    b = t.request_body("m", [1, 2], NEW)
    assert (b["temperature"], b["ignore_eos"], b["stream"], b["max_tokens"]) == (0, True, True, NEW)
    assert b["stream_options"] == {"include_usage": True}


def test_report_fields_and_every_turn_extends_the_previous(cache_on):
    rc, report, out, _ = cache_on
    assert rc == 0, out
    assert report["tool"] == "tools/multiturn_bench.py" and report["contract"]["version"] == 1
    assert report["health"]["status"] == "ok" and report["label"] == "cache on"
    assert report["prefix_cache_capacity"] == 8
    s = report["settings"]
    assert (s["prefix_tokens"], s["turns"], s["new_tokens"], s["rounds"]) == (P, list(TURNS), NEW, ROUNDS)
    assert len(report["warmup"]) == 1 and report["warmup"][0]["conversation"] == 0
    rows = report["rounds"]
    assert [r["conversation"] for r in rows] == [1, 2] and all(r["ok"] for r in rows)
    for row in report["warmup"] + rows:
        cold = row["cold"]
        assert (cold["ok"], cold["prompt_tokens"], cold["completion_tokens"]) == (True, P, NEW)
        assert cold["ttft_s"] > 0 and cold["cached_tokens"] == 0
        turns = row["turns"]
        assert [t["turn"] for t in turns] == [0, 1, 2]
        assert [t["new_tokens"] for t in turns] == [P, *TURNS]
        assert turns[0]["prompt_tokens"] == P
        for prev, t in zip(turns, turns[1:]):
            # The previous prompt, its answer (ids from /tokenize) and the new piece.
            assert t["prompt_tokens"] == prev["prompt_tokens"] + prev["answer_ids"] + t["new_tokens"]
        for t in turns:
            assert (t["ok"], t["completion_tokens"], t["finish_reason"]) == (True, NEW, "length")
            assert 0 < t["ttft_s"] <= t["wall_s"] and t["answer_ids"] >= 1
    summ = report["summary"]
    assert summ["rounds_ok"] == ROUNDS
    assert summ["cold_ttft_median_s"] == pytest.approx(statistics.median(r["cold"]["ttft_s"] for r in rows))
    for i, t in enumerate(summ["turns"]):
        assert t["ttft_median_s"] == pytest.approx(statistics.median(r["turns"][i]["ttft_s"] for r in rows))
        assert t["cached_tokens_median"] == statistics.median(r["turns"][i]["cached_tokens"] for r in rows)
    assert "FAILURES" not in out and "turn 2" in out


def test_each_turn_resumes_from_the_previous_turn(cache_on):
    # A completion's prompt is cached after all but its last token (hot), and its end state,
    # prompt + every generated token but the last, is cached cold. The next turn's prompt extends
    # both when /tokenize gives the answer's ids back as generated, else only the first: so it
    # resumes after prev - 1 or prev + NEW - 1 tokens, nothing else. The first turn and the cold
    # request are never seen before: 0.
    _, report, _, counted = cache_on
    reported = 0
    outcomes = set()
    for row in report["warmup"] + report["rounds"]:
        turns = row["turns"]
        assert turns[0]["cached_tokens"] == 0
        for prev, t in zip(turns, turns[1:]):
            expected = {prev["prompt_tokens"] - 1, prev["prompt_tokens"] + NEW - 1}
            assert t["cached_tokens"] in expected, (prev, t)
            outcomes.add(t["cached_tokens"] - prev["prompt_tokens"])
        reported += sum(t["cached_tokens"] for t in turns) + row["cold"]["cached_tokens"]
    assert reported == counted  # what the tool recorded is what the server counted
    print("resumed at prev +", sorted(outcomes))


def test_cache_off_reports_no_cached_tokens(tmp_path_factory):
    s = server(tmp_path_factory, "multiturn-off", "--prefix-cache", "0")
    try:
        rc, report, out = run_tool(s.url, tmp_path_factory.mktemp("bench") / "off.json", "--rounds", "1",
                                   "--warmup", "0")
    finally:
        s.stop()
    assert rc == 0, out
    assert report["prefix_cache_capacity"] == 0
    [row] = report["rounds"]
    assert row["ok"] and [t["cached_tokens"] for t in row["turns"]] == [0, 0, 0]


def test_failures_are_recorded_and_exit_1(tmp_path_factory):
    # An unknown model id: every completion is refused, the tool records it and goes on.
    s = server(tmp_path_factory, "multiturn-bad")
    try:
        rc, report, out = run_tool(s.url, tmp_path_factory.mktemp("bench") / "bad.json", "--model", "no-such-model",
                                   "--warmup", "0")
    finally:
        s.stop()
    assert rc == 1, out
    assert len(report["rounds"]) == ROUNDS
    for row in report["rounds"]:
        assert not row["ok"] and row["failure"].startswith("cold request: HTTP 4")
        assert 400 <= row["cold"]["http_status"] < 500 and "turns" not in row
    assert report["summary"]["rounds_ok"] == 0
    assert "FAILED" in out and "FAILURES" in out


def test_a_spent_time_budget_skips_or_cuts_off_rounds(tmp_path_factory):
    s = server(tmp_path_factory, "multiturn-budget")
    try:
        rc, report, out = run_tool(s.url, tmp_path_factory.mktemp("bench") / "budget.json", "--time-budget-s", "0.001")
    finally:
        s.stop()
    assert rc == 1, out
    rows = report["warmup"] + report["rounds"]
    assert [r["conversation"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert not r["ok"] and ("skipped" in r or "cut off" in r["failure"]), r
    assert report["summary"]["rounds_ok"] == 0


def test_a_server_that_cannot_be_used_gives_exit_2(tmp_path):
    rc, report, out = run_tool(f"http://127.0.0.1:{free_port()}", tmp_path / "none.json")
    assert rc == 2, out
    assert report is None and "cannot query" in out
