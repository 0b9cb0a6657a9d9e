#!/usr/bin/env python3
"""The summary of tools/device/ab.sh's log: per context and arm, the decode tok/s of each round,
their median and its ratio to the first arm's, and whether the arm's greedy and sampled digests
equal the first arm's (an arm whose label ends in "~" is timing only: its digests are not
compared). Exits 1 when an arm has no result or its digests differ.

    ab_summary.py AB_LOG LABEL...

AB_LOG holds `tansy bench` outputs, each after a line "== LABEL round N ...". Standard library
only (it runs on the GPU machine's python3); its test is tests/python/test_ab_summary.py.
"""
import re
import statistics
import sys


def main(log, labels):
    runs = {}  # (label, context) -> [[decode tok/s, digest, sampled digest]]
    label = None
    with open(log) as f:
        lines = f.readlines()
    for line in lines:
        m = re.match(r"== (\S+) round", line)
        if m:
            label = m.group(1)
            continue
        m = re.match(r"\s+(\d+)\s+[\d.]+\s+([\d.]+)\s+([0-9a-f]{16})", line)
        if m and label in labels:
            runs.setdefault((label, int(m.group(1))), []).append([float(m.group(2)), m.group(3), None])
        m = re.match(r"\s+(\d+) sampled.*digest ([0-9a-f]{16})", line)
        if m and (label, int(m.group(1))) in runs:
            runs[(label, int(m.group(1)))][-1][2] = m.group(2)
    if not runs:
        print("no bench result in the log")
        return 1
    bad = False
    for ctx in sorted({c for _, c in runs}):
        ref = runs.get((labels[0], ctx), [])
        base = statistics.median(r[0] for r in ref) if ref else None
        for l in labels:
            rs = runs.get((l, ctx), [])
            if not rs:
                print(f"{ctx} {l}: no result")
                bad = True
                continue
            med = statistics.median(r[0] for r in rs)
            same = bool(ref) and all(r[1:] == ref[0][1:] for r in rs)
            check = "timing only" if l.endswith("~") else ("digests equal the first arm's" if same else "DIGESTS DIFFER")
            bad |= not same and not l.endswith("~")
            ratio = f", {med / base:.3f}x the first arm" if base else ""
            print(f"{ctx} {l}: decode {' / '.join(f'{r[0]:.1f}' for r in rs)} tok/s, median {med:.1f}{ratio}; {check}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: ab_summary.py AB_LOG LABEL...")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
