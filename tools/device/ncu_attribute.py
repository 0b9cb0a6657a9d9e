#!/usr/bin/env python3
"""Warp-stall samples of one kernel, by the function of a source file they fall in.

Inputs: the per-instruction CSV of an Nsight Compute report
(`ncu -i rep.ncu-rep --page source --csv --print-source sass`, with the SourceCounters section),
the kernel's SASS with inline line info from the same build (`cuobjdump -xelf all obj.o`, then
`nvdisasm -gi -c file.cubin`), and the source file at the commit that was built. Each instruction
is attributed to the innermost line of SOURCE in its inline chain, and that line to the
`__device__` / `__global__` function whose definition precedes it. Prints the share of samples per
function, the stall reasons of the largest ones, and the hottest (function, line, leaf) triples.
"""
import argparse
import collections
import csv
import re


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True)
    ap.add_argument("--sass", required=True)
    ap.add_argument("--source", required=True, help="the source file (its text at the built commit)")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    name = args.source.split("/")[-1]

    chain, off2, pending = [], {}, False
    for line in open(args.sass):
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            if not pending:
                chain = []
            pending = True
            chain.append((m.group(1).split("/")[-1], int(m.group(2))))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            off2[int(m.group(1), 16)] = (list(chain), m.group(2))
            pending = False

    funcs = []
    for i, line in enumerate(open(args.source), 1):
        m = re.match(r"\s*(?:template <[^>]*>\s*)?__device__ (?:__forceinline__ )?[\w:<>&*]+ (\w+)\(", line) or re.match(
            r"__global__.*?(\w+)\(const", line)
        if m:
            funcs.append((i, m.group(1)))

    def func_of(ln):
        best = "?"
        for start, fn in funcs:
            if start <= ln:
                best = fn
        return best

    rows = list(csv.reader(open(args.csv)))
    hdr, data = rows[1], rows[2:]
    ia = hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    base = min(int(r[0], 16) for r in data)
    by_fn, by_line = collections.Counter(), collections.Counter()
    why = collections.defaultdict(collections.Counter)
    total = 0.0
    for r in data:
        v = float(r[ia] or 0)
        total += v
        ch, ins = off2.get(int(r[0], 16) - base, ([], ""))
        lines = [ln for f, ln in ch if f == name]
        fn = func_of(lines[0]) if lines else "?"
        by_fn[fn] += v
        by_line[(fn, lines[0] if lines else None, ch[0] if ch else None, ins.split()[0] if ins else "")] += v
        for h in reasons:
            why[fn][h[6:]] += float(r[hdr.index(h)] or 0)
    print(f"samples {total:.0f}")
    for fn, v in by_fn.most_common():
        w = why[fn]
        t = sum(w.values()) or 1
        print(f"{v:8.0f} {100 * v / total:5.1f}%  {fn:16s} " +
              " ".join(f"{k}={100 * x / t:.0f}%" for k, x in w.most_common(5)))
    print()
    for k, v in by_line.most_common(args.top):
        print(f"{v:8.0f} {100 * v / total:5.1f}%  {k}")


if __name__ == "__main__":
    main()
