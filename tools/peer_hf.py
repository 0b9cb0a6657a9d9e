#!/usr/bin/env python3
"""Peer arm of the benchmark (docs/BENCHMARK.md "Peers"): Hugging Face transformers on the same
checkpoint tansy benchmarks, dequantized to bf16.

Reads the MLX 4/8-bit safetensors (docs/MODEL.md §8.2-8.3), dequantizes every tensor on the target
device, renames it to the text-only Qwen3_5MoeForCausalLM layout (MODEL.md §8.1, prefix
`model.`; norms back to zero-centred; conv1d [C,K,1] -> [C,1,K]; experts fused into
gate_up_proj), and runs the contract: synthetic prompt ids, one warm-up of the same shape, one
measured prefill (submit -> first id on the host) and 64 measured greedy decode steps with the
model's own cache, timed with device synchronisation, median over rounds, FNV-1a digest of the
64 decoded ids. Writes JSON shaped like `tansy bench --json`.

Deviation from the contract, stated in the JSON: all contexts run in one process, because
loading and dequantizing ~70 GB of bf16 weights per context would not fit a device call.

  python3 tools/peer_hf.py --model DIR [--contexts 256,...,4096] [--rounds 2] [--json FILE]
                           [--device cuda] [--time-budget-s 240]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the device machine has no network

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

DECODE_STEPS = 64
MLX_PREFIX = "language_model.model."


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [((i * 2654435761) % 2**32) % vocab for i in range(n)]


def fnv1a64_ids(ids: list[int]) -> int:
    h = 0xCBF29CE484222325
    for i in ids:
        for b in (i & 0xFFFFFFFF).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def dequantize(q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int) -> torch.Tensor:
    """MLX affine dequantization (MODEL.md §8.3): w = s * code + b per group of `group` inputs;
    codes packed little-endian in u32, lowest bits = lowest column. Returns bf16 [..., out, in]."""
    q = q.view(torch.int32)  # torch has few ops for uint32; the masks below undo sign extension
    n_groups = scales.shape[-1]
    words = q.shape[-1]
    in_features = n_groups * group
    bits = words * 32 // in_features
    if bits not in (4, 8) or words * 32 != bits * in_features:
        raise ValueError(f"unsupported packing: {words} words for {in_features} inputs")
    shifts = torch.arange(0, 32, bits, device=q.device, dtype=torch.int32)
    codes = (q.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*q.shape[:-1], n_groups, group).to(torch.float32)
    w = codes * scales.to(torch.float32).unsqueeze(-1) + biases.to(torch.float32).unsqueeze(-1)
    return w.reshape(*q.shape[:-1], in_features).to(torch.bfloat16)


class MlxCheckpoint:
    """Tensors of an MLX checkpoint directory (index + shards, or one model.safetensors)."""

    def __init__(self, path: str, device: str):
        self.device = device
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.handles = {}
        self.where = {}
        for fn in files:
            h = safe_open(os.path.join(path, fn), framework="pt", device="cpu")
            self.handles[fn] = h
            for k in h.keys():
                self.where[k] = fn
        self.used: set[str] = set()

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"checkpoint has no tensor {name}")
        self.used.add(name)
        return self.handles[self.where[name]].get_tensor(name).to(self.device)

    def linear(self, module: str, group: int) -> torch.Tensor:
        return dequantize(self.raw(module + ".weight"), self.raw(module + ".scales"), self.raw(module + ".biases"), group)

    def unused(self) -> list[str]:
        return sorted(k for k in self.where if k not in self.used and not k.startswith("vision_tower."))


def hf_tensors(ck: MlxCheckpoint, layer_types: list[str], group: int):
    """Yields (HF parameter name, bf16/f32 tensor) for Qwen3_5MoeForCausalLM."""
    P = MLX_PREFIX
    yield "model.embed_tokens.weight", ck.linear(P + "embed_tokens", group)
    yield "lm_head.weight", ck.linear("language_model.lm_head", group)
    # HF norms are zero-centred (y = x * (1 + w)); MLX stores (1 + w) (MODEL.md §3).
    yield "model.norm.weight", ck.raw(P + "norm.weight").float() - 1.0
    for i, kind in enumerate(layer_types):
        L, H = f"{P}layers.{i}.", f"model.layers.{i}."
        yield H + "input_layernorm.weight", ck.raw(L + "input_layernorm.weight").float() - 1.0
        yield H + "post_attention_layernorm.weight", ck.raw(L + "post_attention_layernorm.weight").float() - 1.0
        if kind == "linear_attention":
            for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                yield H + f"linear_attn.{p}.weight", ck.linear(L + f"linear_attn.{p}", group)
            yield H + "linear_attn.conv1d.weight", ck.raw(L + "linear_attn.conv1d.weight").transpose(1, 2).contiguous()
            yield H + "linear_attn.A_log", ck.raw(L + "linear_attn.A_log")
            yield H + "linear_attn.dt_bias", ck.raw(L + "linear_attn.dt_bias")
            yield H + "linear_attn.norm.weight", ck.raw(L + "linear_attn.norm.weight")  # plain weight
        else:
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield H + f"self_attn.{p}.weight", ck.linear(L + f"self_attn.{p}", group)
            yield H + "self_attn.q_norm.weight", ck.raw(L + "self_attn.q_norm.weight").float() - 1.0
            yield H + "self_attn.k_norm.weight", ck.raw(L + "self_attn.k_norm.weight").float() - 1.0
        M = L + "mlp."
        yield H + "mlp.gate.weight", ck.linear(M + "gate", group)
        gate = ck.linear(M + "switch_mlp.gate_proj", group)
        up = ck.linear(M + "switch_mlp.up_proj", group)
        yield H + "mlp.experts.gate_up_proj", torch.cat([gate, up], dim=1)
        del gate, up
        yield H + "mlp.experts.down_proj", ck.linear(M + "switch_mlp.down_proj", group)
        for p in ("gate_proj", "up_proj", "down_proj"):
            yield H + f"mlp.shared_expert.{p}.weight", ck.linear(M + f"shared_expert.{p}", group)
        yield H + "mlp.shared_expert_gate.weight", ck.linear(M + "shared_expert_gate", group)


def build_model(model_dir: str, device: str):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    with open(os.path.join(model_dir, "config.json")) as f:
        top = json.load(f)
    text = dict(top.get("text_config", top))
    quant = top.get("quantization") or top.get("quantization_config") or {}
    group = int(quant.get("group_size", 64))
    text.pop("model_type", None)
    text.pop("dtype", None)
    cfg = Qwen3_5MoeTextConfig(**text)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    params = dict(model.named_parameters())
    ck = MlxCheckpoint(model_dir, device)
    assigned = set()
    with torch.no_grad():
        for name, t in hf_tensors(ck, cfg.layer_types, group):
            if name not in params:
                raise KeyError(f"transformers model has no parameter {name}")
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"{name}: checkpoint gives {tuple(t.shape)}, model expects {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
            assigned.add(name)
            del t
    missing = sorted(set(params) - assigned)
    if missing:
        raise ValueError(f"parameters not assigned from the checkpoint: {missing[:8]}")
    if ck.unused():
        raise ValueError(f"checkpoint tensors not used: {ck.unused()[:8]}")
    return model, cfg


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def measure_once(model, prompt: torch.Tensor, device: str):
    """Prefill: submit -> first id on the host. Decode: first id -> the id of the 64th decode
    step on the host. Each id is copied to the host as it is produced (.item())."""
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1)
    ids = [int(tok.item())]
    t1 = time.perf_counter()
    past = out.past_key_values
    for _ in range(DECODE_STEPS):
        out = model(input_ids=tok.view(1, 1), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1)
        ids.append(int(tok.item()))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, ids


def device_info(device: str) -> dict:
    info = {"torch": torch.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001 - version is informational
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda_runtime"] = torch.version.cuda
        try:
            with open("/proc/driver/nvidia/version") as f:
                line = f.readline()
            # "NVRM version: NVIDIA UNIX [Open ]Kernel Module for x86_64  580.159.04  ..."
            m = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", line)
            info["driver"] = m.group(1) if m else "unknown"
        except Exception:  # noqa: BLE001
            info["driver"] = "unknown"
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", default="256,512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--commit", default=os.environ.get("TANSY_COMMIT", "unknown"))
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="stop starting new measurements past this many seconds (0: no limit)")
    a = ap.parse_args()
    try:
        contexts = [int(x) for x in a.contexts.split(",")]
        if not contexts or min(contexts) < 1:
            raise ValueError
    except ValueError:
        print(f"peer_hf: --contexts must be a comma-separated list of positive integers, got {a.contexts!r}",
              file=sys.stderr)
        return 2
    if a.rounds < 1:
        print("peer_hf: --rounds must be >= 1", file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(a.model, "config.json")):
        print(f"peer_hf: {a.model} has no config.json", file=sys.stderr)
        return 2
    start = time.perf_counter()
    t0 = time.perf_counter()
    model, cfg = build_model(a.model, a.device)
    sync(a.device)
    load_s = time.perf_counter() - t0
    print(f"peer_hf: loaded and dequantized in {load_s:.1f} s; experts implementation "
          f"{getattr(cfg, '_experts_implementation', None)!s}", file=sys.stderr, flush=True)
    if a.device.startswith("cuda"):
        print(f"peer_hf: GPU memory allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB", file=sys.stderr)

    runs: dict[int, list[dict]] = {c: [] for c in contexts}
    skipped: list[str] = []
    for r in range(a.rounds):
        for c in contexts:
            if a.time_budget_s and time.perf_counter() - start > a.time_budget_s:
                skipped.append(f"round {r + 1} context {c}: time budget {a.time_budget_s:.0f} s spent")
                continue
            prompt = torch.tensor([synthetic_prompt(c, cfg.vocab_size)], dtype=torch.long, device=a.device)
            wp, wd, wids = measure_once(model, prompt, a.device)  # warm-up, same shape
            p, d, ids = measure_once(model, prompt, a.device)
            run = {"prefill_tps": c / p, "decode_tps": DECODE_STEPS / d, "digest": f"{fnv1a64_ids(ids[1:]):016x}",
                   "warmup_digest": f"{fnv1a64_ids(wids[1:]):016x}", "first_token": ids[0], "ids": ids,
                   "warmup_prefill_tps": c / wp, "warmup_decode_tps": DECODE_STEPS / wd}
            runs[c].append(run)
            print(f"peer_hf: round {r + 1}/{a.rounds} context {c}: prefill {run['prefill_tps']:.1f} tok/s, "
                  f"decode {run['decode_tps']:.2f} tok/s, digest {run['digest']}", file=sys.stderr, flush=True)

    results = []
    for c in contexts:
        rs = runs[c]
        if not rs:
            results.append({"context": c, "error": ["not measured (time budget)"]})
            continue
        digests = [x["digest"] for x in rs]
        agree = all(x["digest"] == x["warmup_digest"] == digests[0] for x in rs)
        results.append({"context": c,
                        "prefill_tps": statistics.median(x["prefill_tps"] for x in rs),
                        "decode_tps": statistics.median(x["decode_tps"] for x in rs),
                        "digest": digests[0], "digests_agree": agree, "rounds_measured": len(rs),
                        "first_token": rs[0]["first_token"], "ids": rs[0]["ids"],
                        "prefill_tps_rounds": [x["prefill_tps"] for x in rs],
                        "decode_tps_rounds": [x["decode_tps"] for x in rs], "digest_rounds": digests})
    report = {
        "contract": "BENCHMARK.md peer arm: Hugging Face transformers, same synthetic weights dequantized to bf16",
        "engine": "transformers", "commit": a.commit, "backend": a.device,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model_dir": a.model,
        "rounds": a.rounds, "decode_steps": DECODE_STEPS,
        "digest_of": "64-bit FNV-1a over the little-endian int32 ids produced by the 64 decode steps",
        "deviation": "all contexts in one process (one load); each measurement preceded by a warm-up of the same shape",
        "load_s": load_s, "attn_implementation": "sdpa",
        "experts_implementation": str(getattr(cfg, "_experts_implementation", None)),
        "skipped": skipped, "results": results, **device_info(a.device),
    }
    text = json.dumps(report, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(f"{'context':>9} {'prefill tok/s':>13} {'decode tok/s':>12} {'digest':>18}")
    for row in results:
        if "prefill_tps" in row:
            print(f"{row['context']:>9} {row['prefill_tps']:>13.1f} {row['decode_tps']:>12.2f} {row['digest']:>18}"
                  f"{'' if row['digests_agree'] else '  DIGEST MISMATCH'}")
        else:
            print(f"{row['context']:>9} {'-':>13} {'-':>12} {'-':>18}  {row['error'][0]}")
    return 0 if all("prefill_tps" in r and r["digests_agree"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
