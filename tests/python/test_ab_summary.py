"""tools/device/ab_summary.py, the summary of tools/device/ab.sh's alternating `tansy bench` runs.

The log is built here from `tansy bench`'s own line formats (its table row and its sampled-arm
line), two rounds of two arms, at one or two contexts."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "device" / "ab_summary.py"

GREEDY, SAMPLED = "ffaa696e518140ae", "a9c5df5fa8bceb26"


def bench(label, rnd, rows):
    """One `tansy bench` output after ab.sh's header line; rows: (context, decode, digest, sampled)."""
    out = [f"== {label} round {rnd} (exit 0)",
           "tansy bench: warning: --rounds 1: the contract asks for the median of >= 2",
           f"tansy bench  commit {label}  backend cuda  model Qwen3.6-35B-A3B",
           "  context prefill tok/s decode tok/s             digest  BW floor  FLOP flr  status"]
    for ctx, decode, digest, sampled in rows:
        # the progress line on stderr carries a digest too; the summary must not take it
        out.insert(2, f"tansy bench: round 1/1 context {ctx}: prefill 49548.6 tok/s, decode {decode} tok/s, "
                      f"digest 0123456789abcdef (load 5.1 s)")
        out.append(f"   {ctx:6d}       49548.6       {decode:.2f}   {digest}         -         -  ok")
        out.append(f"   {ctx:6d} sampled (T 0.6, top_p 0.95, top_k 20, seed 1234): decode {decode - 4:.2f} tok/s "
                   f"= 0.99 of greedy, digest {sampled} ok")
    return "\n".join(out) + "\n"


def summary(tmp_path, text, *labels):
    log = tmp_path / "ab.log"
    log.write_text(text)
    return subprocess.run([sys.executable, str(TOOL), str(log), *labels], capture_output=True, text=True,
                          timeout=60)


def test_medians_ratios_and_equal_digests(tmp_path):
    text = (bench("base", 1, [(4096, 452.55, GREEDY, SAMPLED)]) + bench("new", 1, [(4096, 397.37, GREEDY, SAMPLED)])
            + bench("base", 2, [(4096, 452.83, GREEDY, SAMPLED)]) + bench("new", 2, [(4096, 396.69, GREEDY, SAMPLED)]))
    r = summary(tmp_path, text, "base", "new")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "4096 base: decode 452.6 / 452.8 tok/s, median 452.7, 1.000x the first arm; digests equal the first arm's",
        "4096 new: decode 397.4 / 396.7 tok/s, median 397.0, 0.877x the first arm; digests equal the first arm's",
    ]


def test_a_different_digest_fails_unless_the_arm_is_timing_only(tmp_path):
    for label, sampled_differs in (("new", False), ("new", True), ("new~", False)):
        new = (GREEDY, "0" * 16) if sampled_differs else ("1" * 16, SAMPLED)
        text = bench("base", 1, [(4096, 452.0, GREEDY, SAMPLED)]) + bench(label, 1, [(4096, 460.0, *new)])
        r = summary(tmp_path, text, "base", label)
        if label.endswith("~"):
            assert r.returncode == 0, r.stdout
            assert "timing only" in r.stdout
        else:
            assert r.returncode == 1, r.stdout
            assert "DIGESTS DIFFER" in r.stdout


def test_each_context_on_its_own_and_a_missing_arm_fails(tmp_path):
    rows_a = [(4096, 450.0, GREEDY, SAMPLED), (131072, 340.0, "2" * 16, "3" * 16)]
    rows_b = [(4096, 495.0, GREEDY, SAMPLED), (131072, 374.0, "2" * 16, "3" * 16)]
    r = summary(tmp_path, bench("a", 1, rows_a) + bench("b", 1, rows_b), "a", "b")
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[1] == "4096 b: decode 495.0 tok/s, median 495.0, 1.100x the first arm; digests equal the first arm's"
    assert lines[3] == ("131072 b: decode 374.0 tok/s, median 374.0, 1.100x the first arm; "
                        "digests equal the first arm's")
    r = summary(tmp_path, bench("a", 1, rows_a), "a", "b")
    assert r.returncode == 1 and "4096 b: no result" in r.stdout
    r = summary(tmp_path, "nothing ran\n", "a")
    assert r.returncode == 1 and "no bench result" in r.stdout
