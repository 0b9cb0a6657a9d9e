#!/usr/bin/env python3
"""Teacher-forced top-1 agreement between tansy and transformers on held-out tansy-demo text.

Each window of the held-out sample is fed, from an empty state, to `tansy logits` (the chosen
backend) and to transformers (float32, the 4-bit checkpoint dequantized by mlx_to_hf.py); a
position agrees when both put the same token first. Also reported: max |dlogit| / max |logit|
and each side's loss on the windows.

The sample (tests/data/demo_heldout.npz) is committed because the held-out split (.demo_data/,
git-ignored) exists only where build_data.py ran. It also holds transformers' argmax and top-1
margin at every position, so tansy can be compared without torch (--saved-reference), which is
what the CI test does.

    # once, where .demo_data/ exists: choose the windows and record transformers' argmax
    python tools/demo/agreement.py --make-sample --data .demo_data
    # measure (torch + transformers present): live transformers logits
    python tools/demo/agreement.py --tansy-backend cpu --out out/demo/agreement_cpu.json
    # on the GPU machine
    python3 tools/demo/agreement.py --tansy build/tansy --tansy-backend cuda --out $OUT/agreement_cuda.json
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_SAMPLE = os.path.join(ROOT, "tests", "data", "demo_heldout.npz")


def fail(msg):
    sys.exit(f"agreement: {msg}")


def load_transformers(model_dir, device):
    import torch
    sys.path.insert(0, HERE)
    from mlx_to_hf import load_model
    return load_model(model_dir, torch.float32, torch.device(device))


def transformers_logits(model, windows, device, batch=8):
    """Yields float32 numpy logits [seq, vocab] per window."""
    import torch
    with torch.no_grad():
        for start in range(0, len(windows), batch):
            ids = torch.from_numpy(windows[start:start + batch].astype(np.int64)).to(device)
            logits = model(input_ids=ids, use_cache=False).logits.float().cpu().numpy()
            yield from logits


def make_sample(args):
    """Picks evenly spaced windows of the held-out split and records transformers' argmax."""
    meta = json.load(open(os.path.join(args.data, "meta.json")))
    val = np.fromfile(os.path.join(args.data, "val.bin"), dtype=np.uint16).astype(np.int32)
    if len(val) != meta["val_tokens"]:
        fail(f"val.bin has {len(val)} tokens, meta.json says {meta['val_tokens']}")
    span = len(val) - args.seq
    starts = np.linspace(0, span, args.windows).astype(np.int64)
    windows = np.stack([val[s:s + args.seq] for s in starts])
    model = load_transformers(args.model, args.hf_device)
    argmax, margin = [], []
    for lg in transformers_logits(model, windows, args.hf_device):
        top2 = np.sort(np.partition(lg, -2, axis=-1)[:, -2:], axis=-1)
        argmax.append(lg.argmax(-1).astype(np.int32))
        margin.append((top2[:, 1] - top2[:, 0]).astype(np.float32))
    os.makedirs(os.path.dirname(os.path.abspath(args.sample)), exist_ok=True)
    np.savez_compressed(args.sample, ids=windows, starts=starts, hf_argmax=np.stack(argmax),
                        hf_margin=np.stack(margin))
    print(f"agreement: wrote {args.sample}: {len(windows)} windows x {args.seq} tokens of .demo_data/val.bin")


def tansy_logits(tansy, model_dir, backend, ids, vocab, tmp, cuda_precision="auto"):
    ids_path, out_path = os.path.join(tmp, "ids.i32"), os.path.join(tmp, "logits.f32")
    ids.astype("<i4").tofile(ids_path)
    p = subprocess.run([tansy, "logits", "--model", model_dir, "--ids", ids_path, "--out", out_path,
                        "--backend", backend, "--cuda-precision", cuda_precision], capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"tansy logits failed: {p.stderr.strip()}")
    lg = np.fromfile(out_path, dtype="<f4")
    if lg.size != len(ids) * vocab:
        fail(f"tansy wrote {lg.size} logits, expected {len(ids)} x {vocab}")
    return lg.reshape(len(ids), vocab)


def nll(logits, targets):
    """Summed next-token negative log-likelihood (float64)."""
    lg = logits.astype(np.float64)
    m = lg.max(-1)
    lse = m + np.log(np.exp(lg - m[:, None]).sum(-1))
    return float((lse - lg[np.arange(len(targets)), targets]).sum())


def measure(args):
    sample = np.load(args.sample)
    windows, ref_argmax, ref_margin = sample["ids"], sample["hf_argmax"], sample["hf_margin"]
    if args.max_windows:
        windows, ref_argmax, ref_margin = (a[:args.max_windows] for a in (windows, ref_argmax, ref_margin))
    vocab = json.load(open(os.path.join(args.model, "config.json")))
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    live = not args.saved_reference
    hf = transformers_logits(load_transformers(args.model, args.hf_device), windows, args.hf_device) if live else None

    t0 = time.time()
    agree = total = 0
    agree_saved = 0
    max_diff = max_logit = 0.0
    nll_tansy = nll_hf = 0.0
    disagreements = []
    with tempfile.TemporaryDirectory() as tmp:
        for w, ids in enumerate(windows):
            t = tansy_logits(args.tansy, args.model, args.tansy_backend, ids, vocab, tmp, args.cuda_precision)
            if not np.isfinite(t).all():
                fail(f"tansy logits of window {w} are not all finite")
            t_arg = t.argmax(-1)
            agree_saved += int((t_arg == ref_argmax[w]).sum())
            if live:
                h = next(hf)
                ref = h.argmax(-1)
                max_diff = max(max_diff, float(np.abs(t - h).max()))
                max_logit = max(max_logit, float(np.abs(h).max()))
                nll_hf += nll(h[:-1], ids[1:])
            else:
                ref = ref_argmax[w]
            nll_tansy += nll(t[:-1], ids[1:])
            hit = t_arg == ref
            agree += int(hit.sum())
            total += len(ids)
            for pos in np.flatnonzero(~hit):
                disagreements.append({"window": w, "position": int(pos), "tansy": int(t_arg[pos]),
                                      "transformers": int(ref[pos]), "transformers_top1_margin":
                                      round(float(ref_margin[w][pos]), 6)})
    n_pred = total - len(windows)
    result = {
        "tansy_backend": args.tansy_backend,
        "tansy_cuda_precision": args.cuda_precision if args.tansy_backend == "cuda" else None,
        "reference": ("transformers float32 logits computed now on " + args.hf_device) if live
        else "transformers float32 argmax saved in " + os.path.relpath(args.sample, ROOT),
        "windows": int(len(windows)), "window_tokens": int(windows.shape[1]), "positions": total,
        "agreeing": agree, "agreement_percent": round(100.0 * agree / total, 4),
        "agreement_with_saved_argmax_percent": round(100.0 * agree_saved / total, 4),
        "disagreements": disagreements,
        "tansy_loss": round(nll_tansy / n_pred, 5),
        "machine": platform.node() + ", " + platform.machine() + ", " + str(os.cpu_count()) + " CPUs",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(time.time() - t0, 1),
    }
    if live:
        result["max_abs_dlogit_over_max_abs_logit"] = float(f"{max_diff / max_logit:.3e}")
        result["max_abs_dlogit"] = float(f"{max_diff:.3e}")
        result["max_abs_logit"] = round(max_logit, 4)
        result["transformers_loss"] = round(nll_hf / n_pred, 5)
    line = (f"agreement: tansy {args.tansy_backend}"
            f"{' ' + args.cuda_precision if args.tansy_backend == 'cuda' else ''} vs transformers: {result['agreement_percent']}% top-1 "
            f"({agree}/{total} positions, {len(windows)} windows)")
    if live:
        line += f", max|dlogit|/max|logit| {result['max_abs_dlogit_over_max_abs_logit']:.2e}"
    print(line)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"agreement: wrote {args.out}")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tansy-demo"))
    ap.add_argument("--sample", default=DEFAULT_SAMPLE, help="held-out windows (.npz) to read or --make-sample")
    ap.add_argument("--tansy", default=os.environ.get("TANSY_BIN", os.path.join(ROOT, "build", "tansy")))
    ap.add_argument("--tansy-backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cuda-precision", default="auto", choices=["auto", "bf16", "f32"],
                    help="the CUDA backend's plan (tansy --cuda-precision; auto is f32 for this small model)")
    ap.add_argument("--hf-device", default=None, help="transformers device (default: cuda if available, else cpu)")
    ap.add_argument("--saved-reference", action="store_true",
                    help="compare with the argmax saved in the sample instead of running transformers (no torch)")
    ap.add_argument("--max-windows", type=int, default=0)
    ap.add_argument("--out", default="", help="write the result as JSON here")
    ap.add_argument("--make-sample", action="store_true", help="build --sample from --data's held-out split")
    ap.add_argument("--data", default=os.path.join(ROOT, ".demo_data"))
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    if args.hf_device is None and (args.make_sample or not args.saved_reference):
        import torch
        args.hf_device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.make_sample:
        make_sample(args)
        return
    if not os.path.exists(args.sample):
        fail(f"no held-out sample at {args.sample} (build it with --make-sample)")
    if not os.access(args.tansy, os.X_OK):
        fail(f"no tansy executable at {args.tansy} (build it, or pass --tansy / set TANSY_BIN)")
    measure(args)


if __name__ == "__main__":
    main()
