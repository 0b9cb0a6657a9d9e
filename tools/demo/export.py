#!/usr/bin/env python3
"""Exports the trained tansy-demo model as an MLX 4-bit checkpoint (docs/MODEL.md §8.2, §8.3).

    python tools/demo/export.py --hf out/demo/hf --tokenizer .demo_data/tokenizer --out models/tansy-demo
    python tools/demo/export.py ... --bf16-out models/tansy-demo-bf16   # also the HF-format bf16 copy
    python tools/demo/export.py --card-only --out models/tansy-demo --summary out/demo/train_summary.json \
        --eval out/demo/eval.json                                       # fill the model card only

The weights are first rounded to bf16 (what an HF bf16 checkpoint holds), then quantized the way
mlx's `mx.quantize` (affine mode) does: groups of 64 along the input dimension, the group's
larger-magnitude edge represented exactly, float32 arithmetic, round half away from zero, codes
packed little-endian into uint32, scales and biases stored as bf16. The router (`mlp.gate`) and
`mlp.shared_expert_gate` are 8-bit, everything else (embedding and lm_head included) 4-bit.
"""
import argparse
import json
import os
import re
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

GROUP = 64
HERE = os.path.dirname(os.path.abspath(__file__))

# HF (zero-centred) norms that MLX stores as 1 + w.
SHIFTED_NORMS = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$|^model\.norm\.weight$")
EIGHT_BIT = re.compile(r"mlp\.(gate|shared_expert_gate)$")


def fail(msg):
    sys.exit(f"export: {msg}")


def round_half_away(x):
    return torch.sign(x) * torch.floor(torch.abs(x) + 0.5)


def quantize(w, bits):
    """MLX affine quantization of a float tensor [..., in]; returns (packed u32, scales, biases)."""
    if w.shape[-1] % GROUP:
        fail(f"input dimension {w.shape[-1]} is not a multiple of {GROUP}")
    n_bins = float(2 ** bits - 1)
    g = w.to(torch.float32).reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    w_min = g.amin(-1, keepdim=True)
    w_max = g.amax(-1, keepdim=True)
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    min_edge = w_min.abs() > w_max.abs()
    scale = torch.where(min_edge, scale, -scale)
    edge = torch.where(min_edge, w_min, w_max)
    q0 = round_half_away(edge / scale)
    scale = torch.where(q0 != 0, edge / q0, scale)
    bias = torch.where(q0 != 0, edge, torch.zeros_like(edge))
    q = torch.clamp(round_half_away((g - bias) / scale), 0, n_bins).to(torch.int64)
    per_word = 32 // bits
    q = q.reshape(*w.shape[:-1], w.shape[-1] // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    packed = (q << shifts).sum(-1)  # < 2^32, exact in int64
    packed = packed.to(torch.int64).numpy().astype("uint32")
    return (torch.from_numpy(packed), scale.squeeze(-1).to(torch.bfloat16), bias.squeeze(-1).to(torch.bfloat16))


def dequantize(packed, scales, biases, bits):
    """Inverse of `quantize` (w = scale·q + bias in float32), as MODEL.md §8.3 specifies."""
    per_word = 32 // bits
    words = packed.numpy().astype("int64")
    words = torch.from_numpy(words)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    q = (words.unsqueeze(-1) >> shifts) & (2 ** bits - 1)
    q = q.reshape(*packed.shape[:-1], -1).to(torch.float32)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // GROUP, GROUP)
    w = q * scales.to(torch.float32).unsqueeze(-1) + biases.to(torch.float32).unsqueeze(-1)
    return w.reshape(*w.shape[:-2], -1)


def mlx_tensors(hf, text_config):
    """HF Qwen3_5MoeForCausalLM state dict -> MLX tensor dict (names per MODEL.md §8.2)."""
    inter = text_config["moe_intermediate_size"]
    out = {}
    quant_paths = {}

    def put_linear(path, w):
        bits = 8 if EIGHT_BIT.search(path) else 4
        packed, scales, biases = quantize(w.to(torch.bfloat16), bits)
        out[path + ".weight"], out[path + ".scales"], out[path + ".biases"] = packed, scales, biases
        quant_paths[path] = bits

    for name, w in hf.items():
        if name.startswith("model."):
            path = "language_model.model." + name[len("model."):]
        elif name == "lm_head.weight":
            path = "language_model.lm_head.weight"
        else:
            fail(f"unexpected tensor {name}")
        if SHIFTED_NORMS.search(name):
            out[path] = (1.0 + w.to(torch.float32)).to(torch.bfloat16)
        elif name.endswith("linear_attn.norm.weight"):
            out[path] = w.to(torch.bfloat16)
        elif name.endswith("conv1d.weight"):
            out[path] = w.to(torch.bfloat16).transpose(1, 2).contiguous()  # [C,1,K] -> [C,K,1]
        elif name.endswith("A_log"):
            out[path] = w.to(torch.float32)
        elif name.endswith("dt_bias"):
            out[path] = w.to(torch.bfloat16)
        elif name.endswith("mlp.experts.gate_up_proj"):
            base = path[: -len("experts.gate_up_proj")] + "switch_mlp."
            if w.shape[1] != 2 * inter:
                fail(f"{name} has shape {tuple(w.shape)}")
            put_linear(base + "gate_proj", w[:, :inter, :])
            put_linear(base + "up_proj", w[:, inter:, :])
        elif name.endswith("mlp.experts.down_proj"):
            put_linear(path[: -len("experts.down_proj")] + "switch_mlp.down_proj", w)
        elif name.endswith(".weight") and w.ndim == 2:
            put_linear(path[: -len(".weight")], w)
        else:
            fail(f"no export rule for {name} {tuple(w.shape)}")
    return out, quant_paths


def fuse_experts(hf, num_experts):
    """Accepts transformers' on-disk per-expert layout (experts.{e}.{gate,up,down}_proj.weight)
    as well as the module's fused banks, and returns the fused form."""
    per_expert = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    prefixes = sorted({m.group(1) for m in map(per_expert.match, hf) if m})
    out = {k: v for k, v in hf.items() if not per_expert.match(k)}
    for p in prefixes:
        try:
            gate = [hf[f"{p}.{e}.gate_proj.weight"] for e in range(num_experts)]
            up = [hf[f"{p}.{e}.up_proj.weight"] for e in range(num_experts)]
            down = [hf[f"{p}.{e}.down_proj.weight"] for e in range(num_experts)]
        except KeyError as e:
            fail(f"incomplete expert bank {p}: missing {e}")
        out[p + ".gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
        out[p + ".down_proj"] = torch.stack(down)
    return out


def hf_bf16_tensors(hf):
    """HF VLM-style names (MODEL.md §8.1): prefix model.language_model., lm_head at top level."""
    out = {}
    for name, w in hf.items():
        new = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        out[new] = w.to(torch.float32 if name.endswith("A_log") else torch.bfloat16).contiguous()
    return out


def wrapper_config(text_config, ids, quantization):
    tc = {k: v for k, v in text_config.items() if k not in (
        "architectures", "transformers_version", "output_router_logits", "_name_or_path", "dtype", "torch_dtype",
        "use_cache")}
    tc["model_type"] = "qwen3_5_moe_text"
    tc["dtype"] = "bfloat16"
    tc["mamba_ssm_dtype"] = "float32"
    tc["full_attention_interval"] = 4  # the real config carries it beside layer_types
    tc["eos_token_id"] = ids["<|endoftext|>"]
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": tc,
        "tie_word_embeddings": False,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "dtype": "bfloat16",
    }
    if quantization is not None:
        cfg["quantization"] = quantization
        cfg["quantization_config"] = quantization
    return cfg


def write_common(out_dir, tok_dir, ids):
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(os.path.join(tok_dir, f), os.path.join(out_dir, f))
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
           "do_sample": False}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------- model card

def fill_card(out_dir, summary_path, eval_path, sizes):
    """Writes README.md from tools/demo/model_card.md. Values come only from the files the
    training and evaluation runs wrote; anything missing stays a visible <<FILL: ...>> marker."""
    with open(os.path.join(HERE, "model_card.md"), encoding="utf-8") as f:
        card = f.read()
    values = dict(sizes)
    if summary_path and os.path.exists(summary_path):
        s = json.load(open(summary_path))
        values.update({
            "train_minutes": f"{s['train_seconds'] / 60:.1f}",
            "device_name": s["device_name"],
            "steps": str(s["steps"]),
            "kept_step": str(s.get("kept_step", s["steps"])),
            "train_tokens_seen": f"{s['train_tokens_seen'] / 1e6:.1f} M",
            "epochs": str(s["epochs"]),
            "tokens_per_second": f"{s['tokens_per_second']:,}",
            "val_perplexity_bf16": f"{s['val_perplexity']:.2f}",
            "val_bpb_bf16": f"{s['val_bits_per_byte']:.3f}",
            "batch": str(s["batch"]), "seq": str(s["seq"]), "peak_lr": str(s["peak_lr"]),
            "weight_decay": str(s["weight_decay"]), "versions": f"torch {s['torch']}, transformers {s['transformers']}",
        })
    if eval_path and os.path.exists(eval_path):
        e = json.load(open(eval_path))
        values["val_perplexity_4bit"] = f"{e['val_perplexity']:.2f}"
        if "word_score" in e:
            w = e["word_score"]
            values["word_score"] = f"{w['right']}/{w['total']} words ({100 * w['score']:.1f}%)"
            values["word_recall"] = f"{100 * w['mean_token_recall']:.1f}%"
        values["samples"] = "\n".join(
            f"* **{x['question']}**{' (thinking on)' if x['enable_thinking'] else ''}\n\n  ```text\n  "
            + x["completion"].replace("\n", "\n  ") + "\n  ```" for x in e["samples"])

    def sub(m):
        return values.get(m.group(1), m.group(0))
    card = re.sub(r"<<FILL: ([a-z0-9_]+)>>", sub, card)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    missing = sorted(set(re.findall(r"<<FILL: ([a-z0-9_]+)>>", card)))
    if missing:
        print(f"export: model card still has placeholders: {', '.join(missing)}")


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main():
    ap = argparse.ArgumentParser(description="Export tansy-demo to the MLX 4-bit format.")
    ap.add_argument("--hf", default="out/demo/hf", help="transformers checkpoint written by train.py")
    ap.add_argument("--tokenizer", default=".demo_data/tokenizer")
    ap.add_argument("--meta", default=".demo_data/meta.json")
    ap.add_argument("--out", default="models/tansy-demo")
    ap.add_argument("--bf16-out", default="", help="also write an HF-format bf16 copy here")
    ap.add_argument("--summary", default="", help="train_summary.json, for the model card")
    ap.add_argument("--eval", default="", help="eval.json from evaluate.py, for the model card")
    ap.add_argument("--loss-png", default="", help="loss plot to copy next to the model card")
    ap.add_argument("--card-only", action="store_true", help="only (re)write README.md")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    if args.loss_png:
        shutil.copyfile(args.loss_png, os.path.join(args.out, "loss.png"))
    if args.card_only:
        cfg = json.load(open(os.path.join(args.out, "config.json")))
        fill_card(args.out, args.summary, args.eval, card_sizes(cfg, args.out, args.bf16_out))
        return

    meta = json.load(open(args.meta))
    ids = meta["special_ids"]
    text_config = json.load(open(os.path.join(args.hf, "config.json")))
    hf = fuse_experts(load_file(os.path.join(args.hf, "model.safetensors")), text_config["num_experts"])

    tensors, quant_paths = mlx_tensors(hf, text_config)
    quantization = {"group_size": GROUP, "bits": 4, "mode": "affine"}
    for path, bits in sorted(quant_paths.items()):
        if bits != 4:
            quantization[path] = {"group_size": GROUP, "bits": bits}
    cfg = wrapper_config(text_config, ids, quantization)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "mlx"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    write_common(args.out, args.tokenizer, ids)

    # Round-trip check of what was written: every quantized tensor must dequantize to within
    # about one quantization step of the bf16 weights (half a step, except where rounding the
    # edge's code clips the opposite extreme of a group; plus bf16 rounding of scale and bias).
    written = load_file(os.path.join(args.out, "model.safetensors"))
    worst = 0.0
    for path, bits in quant_paths.items():
        w = dequantize(written[path + ".weight"], written[path + ".scales"], written[path + ".biases"], bits)
        step = written[path + ".scales"].to(torch.float32).abs().unsqueeze(-1)
        bias = written[path + ".biases"].to(torch.float32).abs().unsqueeze(-1)
        bound = 1.1 * step + ((2 ** bits - 1) * step + bias) * 2 ** -8 + 1e-7
        ref = reference_weight(hf, path, text_config["moe_intermediate_size"]).to(torch.bfloat16).to(torch.float32)
        err = ((w - ref).reshape(*step.shape[:-1], GROUP).abs() / bound).max().item()
        worst = max(worst, err)
    if worst > 1.0:
        fail(f"quantization round trip error is {worst:.3f} times its bound")
    print(f"export: {len(written)} tensors, worst round-trip error {worst:.3f} of its bound")

    if args.bf16_out:
        os.makedirs(args.bf16_out, exist_ok=True)
        save_file(hf_bf16_tensors(hf), os.path.join(args.bf16_out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(args.bf16_out, "config.json"), "w") as f:
            json.dump(wrapper_config(text_config, ids, None), f, indent=2)
            f.write("\n")
        write_common(args.bf16_out, args.tokenizer, ids)
    fill_card(args.out, args.summary, args.eval, card_sizes(cfg, args.out, args.bf16_out))
    print(f"export: wrote {args.out} ({dir_size(args.out) / 1e6:.2f} MB)"
          + (f" and {args.bf16_out} ({dir_size(args.bf16_out) / 1e6:.2f} MB)" if args.bf16_out else ""))


def reference_weight(hf, mlx_path, inter):
    """The HF weight an MLX quantized path came from."""
    name = mlx_path.replace("language_model.model.", "model.").replace("language_model.lm_head", "lm_head")
    for part, sl in (("switch_mlp.gate_proj", slice(0, inter)), ("switch_mlp.up_proj", slice(inter, None))):
        if name.endswith(part):
            return hf[name[: -len(part)] + "experts.gate_up_proj"][:, sl, :]
    if name.endswith("switch_mlp.down_proj"):
        return hf[name[: -len("switch_mlp.down_proj")] + "experts.down_proj"]
    return hf[name + ".weight"]


def card_sizes(cfg, out_dir, bf16_dir):
    tc = cfg["text_config"]
    st = load_file(os.path.join(out_dir, "model.safetensors"))
    n = 0
    for name, t in st.items():
        if name.endswith(".scales") or name.endswith(".biases"):
            continue
        if t.dtype == torch.uint32:
            bits = 8 if EIGHT_BIT.search(name[: -len(".weight")]) else 4
            n += t.numel() * 32 // bits
        else:
            n += t.numel()
    E, k, inter = tc["num_experts"], tc["num_experts_per_tok"], tc["moe_intermediate_size"]
    H, V, L = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    active = n - L * (E - k) * 3 * H * inter - V * H
    sizes = {
        "params_total": f"{n / 1e6:.2f} M",
        "params_active": f"{active / 1e6:.2f} M",
        "mlx_mb": f"{os.path.getsize(os.path.join(out_dir, 'model.safetensors')) / 1e6:.1f} MB",
        "hidden_size": str(H), "num_layers": str(L), "vocab_size": str(V), "num_experts": str(E),
        "experts_per_tok": str(k), "moe_intermediate": str(inter),
        "shared_intermediate": str(tc["shared_expert_intermediate_size"]),
        "attn_heads": f"{tc['num_attention_heads']} query / {tc['num_key_value_heads']} key-value",
        "gdn_heads": f"{tc['linear_num_key_heads']} key / {tc['linear_num_value_heads']} value",
    }
    if bf16_dir:
        sizes["bf16_note"] = f"and an HF-format bf16 copy in `{os.path.basename(bf16_dir.rstrip('/'))}/` " \
                             f"({os.path.getsize(os.path.join(bf16_dir, 'model.safetensors')) / 1e6:.1f} MB)"
    else:
        sizes["bf16_note"] = "(no bf16 copy is committed, to keep the repository small: " \
                             "`tools/demo/mlx_to_hf.py` rebuilds an HF-format checkpoint from this one)"
    return sizes


if __name__ == "__main__":
    main()
