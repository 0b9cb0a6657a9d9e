"""`tansy synth` checkpoints are servable, `--backend auto` says what it chose, and
tools/http_latency.py (the device run's HTTP latency step) works end to end against `tansy serve`
and a `tansy bench --json` file: on a tiny synthetic model, CPU backend, small contexts."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import requests

from api_support import MODEL_ID, REPO, TANSY, ServerProcess

TOOL = os.path.join(REPO, "tools", "http_latency.py")

TINY = {"model_type": "qwen3_5_moe_text", "hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 512,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}


def load_tool():
    spec = importlib.util.spec_from_file_location("http_latency", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    cfg = d / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = d / "model"
    p = subprocess.run([TANSY, "synth", "--config", str(cfg), "--out", str(out), "--seed", "5"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "tokenizer (512 ids)" in p.stdout
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (out / f).is_file(), f
    return str(out)


@pytest.fixture(scope="module")
def bench_json(synth_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bench") / "bench.json")
    p = subprocess.run([TANSY, "bench", "--model", synth_model, "--backend", "cpu", "--contexts", "16,40",
                        "--rounds", "2", "--json", path], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return path


@pytest.fixture(scope="module")
def synth_server(synth_model, tmp_path_factory):
    # The default backend (auto): CPU here unless this is a CUDA build on a Hopper machine, where
    # the tiny model's shapes are not what the CUDA kernels serve; skip there.
    log = str(tmp_path_factory.mktemp("logs") / "synth.log")
    s = ServerProcess(synth_model, log, "--prefix-cache", "0", backend=None)
    if "backend auto -> cuda" in s.log_text():
        s.stop()
        pytest.skip("--backend auto picked CUDA on this machine; these checks are for the CPU backend")
    yield s
    s.stop()


def test_prompt_matches_the_engines(synth_model):
    tool = load_tool()
    # tansy::synthetic_prompt (tests/unit/test_synth.cpp: BenchWorkload.PromptAndDigestFollowTheContract)
    assert tool.synthetic_prompt(5, 248320) == [0, 143281, 13666, 156947, 27332]
    assert tool.vocab_from_model_dir(synth_model) == 512


def test_auto_backend_is_reported(synth_server):
    log = synth_server.log_text()
    line = next(l for l in log.splitlines() if l.startswith("tansy: backend auto -> "))
    assert line.startswith("tansy: backend auto -> cpu (") and line.endswith(")"), line


def test_synth_checkpoint_serves_chat_and_ids(synth_server):
    r = requests.post(synth_server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_ID, "max_tokens": 8, "temperature": 0,
                            "messages": [{"role": "user", "content": "Hello, caf\u00e9!"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    r = requests.post(synth_server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL_ID, "prompt": list(range(500, 512)) + [0, 255], "max_tokens": 5,
                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5


def run_tool(server, bench, out, *extra):
    p = subprocess.run([sys.executable, TOOL, "--url", server.url, "--contexts", "16,40", "--rounds", "2",
                        "--bench", bench, "--json", str(out), *extra], capture_output=True, text=True, timeout=300)
    return p, json.loads(out.read_text()) if out.exists() else None


def test_http_latency_against_bench(synth_server, synth_model, bench_json, tmp_path):
    p, rep = run_tool(synth_server, bench_json, tmp_path / "lat.json", "--model-dir", synth_model)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TTFT ms" in p.stdout
    assert rep["vocab_size"] == 512 and rep["model"] == MODEL_ID
    assert [r["context"] for r in rep["results"]] == [16, 40]
    with open(bench_json) as f:
        bench = {r["context"]: r for r in json.load(f)["results"]}
    for r in rep["results"]:
        assert "error" not in r, r
        assert r["completion_tokens"] == 65
        assert 1 <= r["token_chunks"] <= 65
        assert r["chunks_match"] == (r["token_chunks"] == 65)
        assert r["cached_tokens"] == 0
        assert r["texts_agree"]
        assert len(r["ttft_s_rounds"]) == 2 and r["ttft_s"] > 0 and r["itl_s"] > 0
        assert r["server_ttft_s"] > 0 and r["server_itl_s"] > 0
        # the client sees at least what the server measured from arrival
        assert r["ttft_s"] >= r["server_ttft_s"] * 0.9
        b = bench[r["context"]]
        assert r["bench_ttft_s"] == pytest.approx(r["context"] / b["prefill_tps"])
        assert r["bench_itl_s"] == pytest.approx(1 / b["decode_tps"])
        assert r["ttft_ratio"] == pytest.approx(r["ttft_s"] / r["bench_ttft_s"])
        assert r["ttft_within"] == (abs(r["ttft_ratio"] - 1) <= 0.05)
        assert r["itl_within"] == (abs(r["itl_ratio"] - 1) <= 0.05)


def test_http_latency_flags_prefix_cache_hits(synth_model, bench_json, tmp_path):
    # With the prefix cache on, repeated prompts skip their prefill: the tool must say so.
    s = ServerProcess(synth_model, str(tmp_path / "cached.log"))
    try:
        p, rep = run_tool(s, bench_json, tmp_path / "lat.json", "--vocab-size", "512")
    finally:
        s.stop()
    assert p.returncode == 0, p.stdout + p.stderr
    for r in rep["results"]:
        assert r["cached_tokens"] == r["context"] - 1
        assert any("prefix cache" in n for n in r["notes"])


def test_http_latency_fails_cleanly(synth_server, bench_json, tmp_path):
    # A context over the server's --max-seq is reported as an error and a non-zero exit, not a traceback.
    p, rep = run_tool(synth_server, bench_json, tmp_path / "lat.json", "--contexts", "16,2000", "--vocab-size", "512")
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert "error" in rep["results"][1] and "error" not in rep["results"][0]


def test_http_latency_reports_unusable_inputs(synth_server, tmp_path):
    for args in (["--url", "http://127.0.0.1:9"], ["--url", synth_server.url, "--bench", str(tmp_path / "missing.json")]):
        p = subprocess.run([sys.executable, TOOL, "--contexts", "16", *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr and p.stderr.startswith("http_latency: "), p.stderr
