#!/usr/bin/env python3
"""Rebuilds a transformers Qwen3_5MoeForCausalLM from an MLX 4-bit checkpoint (dequantized).

The result computes exactly the function the quantized checkpoint stores (w = scale·q + bias in
float32, norms stored as 1 + w shifted back), so it is the reference that tansy's backends are
compared with, token for token.

    python tools/demo/mlx_to_hf.py models/tansy-demo OUT_DIR [--dtype float32|bfloat16]
"""
import argparse
import json
import os
import re
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export import EIGHT_BIT, SHIFTED_NORMS, dequantize  # noqa: E402


def fail(msg):
    sys.exit(f"mlx_to_hf: {msg}")


def hf_state_dict(mlx_dir):
    """Returns (text config dict, float32 state dict with Qwen3_5MoeForCausalLM names)."""
    cfg = json.load(open(os.path.join(mlx_dir, "config.json")))
    tc = cfg["text_config"]
    st = load_file(os.path.join(mlx_dir, "model.safetensors"))
    out = {}
    experts = {}
    for name, t in st.items():
        if name.endswith(".scales") or name.endswith(".biases"):
            continue
        if name.startswith("language_model.model."):
            hf = "model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            hf = "lm_head." + name[len("language_model.lm_head."):]
        else:
            fail(f"unexpected tensor {name}")
        if t.dtype == torch.uint32:
            path = name[: -len(".weight")]
            bits = 8 if EIGHT_BIT.search(path) else 4
            if 32 * t.shape[-1] // bits != st[path + ".scales"].shape[-1] * 64:
                fail(f"{path}: packed width does not match {bits}-bit codes")
            w = dequantize(t, st[path + ".scales"], st[path + ".biases"], bits)
            m = re.search(r"switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$", hf)
            if m:
                experts[(hf[: m.start()], m.group(1))] = w
            else:
                out[hf] = w
        elif SHIFTED_NORMS.search(hf):
            out[hf] = t.to(torch.float32) - 1.0
        elif hf.endswith("conv1d.weight"):
            out[hf] = t.to(torch.float32).transpose(1, 2).contiguous()  # [C,K,1] -> [C,1,K]
        else:
            out[hf] = t.to(torch.float32)
    for (prefix, kind), w in experts.items():
        if kind == "gate_proj":
            out[prefix + "experts.gate_up_proj"] = torch.cat([w, experts[(prefix, "up_proj")]], dim=1)
        elif kind == "down_proj":
            out[prefix + "experts.down_proj"] = w
    return tc, out


def load_model(mlx_dir, dtype=torch.float32, device="cpu"):
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    tc, state = hf_state_dict(mlx_dir)
    tc = {k: v for k, v in tc.items() if k not in ("model_type", "mamba_ssm_dtype", "dtype", "full_attention_interval")}
    config = Qwen3_5MoeTextConfig(**tc)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        fail(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # Non-persistent buffers (rotary inv_freq) were never loaded: rebuild them on the target device.
    model = model.to(dtype)
    for mod in model.modules():
        if hasattr(mod, "inv_freq"):
            inv_freq, _ = mod.compute_default_rope_parameters(mod.config)
            mod.inv_freq = inv_freq
            mod.original_inv_freq = inv_freq.clone()
    return model.to(device).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mlx_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    model = load_model(args.mlx_dir, getattr(torch, args.dtype))
    model.save_pretrained(args.out_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        src = os.path.join(args.mlx_dir, f)
        if os.path.exists(src):
            with open(src, "rb") as i, open(os.path.join(args.out_dir, f), "wb") as o:
                o.write(i.read())
    print(f"mlx_to_hf: wrote {args.out_dir}")


if __name__ == "__main__":
    main()
