#!/usr/bin/env python3
"""Builds tiny Qwen3.5/3.6-MoE models with random weights, writes each in both checkpoint formats
tansy loads (MLX affine 4/8-bit and Hugging Face bf16), and records Hugging Face transformers'
float32 logits and greedy continuations as test goldens.

The reference for each format is computed on exactly the weights tansy reads: the MLX copy on the
dequantized weights (scale * q + bias with bf16 scale and bias), the bf16 copy on the bf16-rounded
weights. Needs torch and transformers >= 5 (qwen3_5_moe). Usage:
    python tools/make_goldens.py --out tests/goldens
"""
import argparse
import json
import os

import numpy as np

from safetensors_np import write_safetensors
import torch
import transformers
from transformers import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

# Two architectures: "realdims" keeps the real model's per-head dims (attention 256, GDN 128) so the
# CUDA path can run it; "smalldims" changes every per-head dim, the head ratios and the expert count.
CONFIGS = {
    "realdims": dict(hidden_size=64, num_hidden_layers=4, vocab_size=256, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=64, partial_rotary_factor=0.25, rope_theta=10000000.0),
    "smalldims": dict(hidden_size=64, num_hidden_layers=8, vocab_size=300, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
                      linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                      num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, partial_rotary_factor=0.5, rope_theta=10000.0),
}
SEQ_LENS = [1, 7, 64, 65, 200]
GREEDY_PROMPT_LEN = 7
GREEDY_NEW = 32


def bf16_round(a):
    """Rounds float32 to bfloat16 (nearest even); returns (float32 values, uint16 bits)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return (r.astype(np.uint32) << 16).view(np.float32), r


def quantize_affine(w, bits, group=64):
    """MLX-style affine quantization along the last axis: w ~ scale * q + bias per group of 64.
    Returns (dequantized float32, packed uint32 codes, bf16 scales bits, bf16 biases bits)."""
    shape = w.shape
    g = w.reshape(-1, shape[-1] // group, group).astype(np.float32)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    levels = (1 << bits) - 1
    scale_f, scale_b = bf16_round(np.maximum((hi - lo) / levels, 1e-8))
    bias_f, bias_b = bf16_round(lo)
    q = np.clip(np.rint((g - bias_f) / scale_f), 0, levels).astype(np.uint32)
    deq = (scale_f * q.astype(np.float32) + bias_f).reshape(shape).astype(np.float32)
    per_word = 32 // bits
    qw = q.reshape(-1, shape[-1] // per_word, per_word)
    packed = np.zeros(qw.shape[:-1], dtype=np.uint32)
    for i in range(per_word):
        packed |= qw[..., i] << np.uint32(bits * i)
    lead = shape[:-1]
    return (deq, packed.reshape(*lead, shape[-1] // per_word),
            scale_b.reshape(*lead, shape[-1] // group), bias_b.reshape(*lead, shape[-1] // group))


def random_weights(cfg, rng):
    """HF-named float32 weights (zero-centred norms) at scales that keep hidden states of order 1
    and make logits peaked."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    E, I, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    kd, vd = nk * dk, nv * dv
    conv = 2 * kd + vd

    def lin(o, i, gain=1.0):
        return (rng.standard_normal((o, i)) * gain / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
         "model.norm.weight": norm(H),
         "lm_head.weight": lin(V, H, 4.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        if (i + 1) % 4:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = lin(conv, H)
            w[a + "in_proj_z.weight"] = lin(vd, H)
            w[a + "in_proj_b.weight"] = lin(nv, H)
            w[a + "in_proj_a.weight"] = lin(nv, H)
            w[a + "conv1d.weight"] = (rng.standard_normal((conv, 1, cfg["linear_conv_kernel_dim"])) * 0.5).astype(np.float32)
            w[a + "A_log"] = np.log(rng.uniform(1, 16, nv)).astype(np.float32)
            w[a + "dt_bias"] = (1.0 + 0.1 * rng.standard_normal(nv)).astype(np.float32)
            w[a + "norm.weight"] = (1.0 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
            w[a + "out_proj.weight"] = lin(H, vd)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = lin(2 * nh * hd, H)
            w[a + "k_proj.weight"] = lin(nkv * hd, H)
            w[a + "v_proj.weight"] = lin(nkv * hd, H)
            w[a + "o_proj.weight"] = lin(H, nh * hd)
            w[a + "q_norm.weight"] = norm(hd)
            w[a + "k_norm.weight"] = norm(hd)
        m = p + "mlp."
        w[m + "gate.weight"] = lin(E, H, 2.0)
        w[m + "experts.gate_up_proj"] = np.stack([lin(2 * I, H) for _ in range(E)])
        w[m + "experts.down_proj"] = np.stack([lin(H, I) for _ in range(E)])
        w[m + "shared_expert.gate_proj.weight"] = lin(S, H)
        w[m + "shared_expert.up_proj.weight"] = lin(S, H)
        w[m + "shared_expert.down_proj.weight"] = lin(H, S)
        w[m + "shared_expert_gate.weight"] = lin(1, H)
    return w


def is_norm(name):
    return name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                          "k_norm.weight")) or name == "model.norm.weight"


def export_mlx(w, cfg):
    """Returns (tensors for the MLX file, the float32 weights HF must use to match them)."""
    out, ref = {}, {}
    for name, a in w.items():
        mname = name.replace("model.", "language_model.model.", 1) if name.startswith("model.") else "language_model." + name
        if is_norm(name):
            f, b = bf16_round(1.0 + a)  # MLX stores the multiplier 1 + w
            out[mname] = ("BF16", b)
            ref[name] = f - 1.0
        elif name.endswith("conv1d.weight"):
            f, b = bf16_round(a)
            out[mname] = ("BF16", b.reshape(a.shape[0], a.shape[2], 1))
            ref[name] = f
        elif name.endswith("A_log"):
            out[mname] = ("F32", a)
            ref[name] = a
        elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
            f, b = bf16_round(a)
            out[mname] = ("BF16", b)
            ref[name] = f
        elif name.endswith("experts.gate_up_proj"):
            I = cfg["moe_intermediate_size"]
            base = mname.replace("experts.gate_up_proj", "switch_mlp.")
            parts = []
            for proj, sl in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
                deq, q, s, bb = quantize_affine(a[:, sl, :], 4)
                out[base + proj + ".weight"] = ("U32", q)
                out[base + proj + ".scales"] = ("BF16", s)
                out[base + proj + ".biases"] = ("BF16", bb)
                parts.append(deq)
            ref[name] = np.concatenate(parts, axis=1)
        else:
            base = mname[:-len(".weight")] if mname.endswith(".weight") else mname.replace("experts.down_proj", "switch_mlp.down_proj")
            bits = 8 if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else 4
            deq, q, s, bb = quantize_affine(a, bits)
            out[base + ".weight"] = ("U32", q)
            out[base + ".scales"] = ("BF16", s)
            out[base + ".biases"] = ("BF16", bb)
            ref[name] = deq
    return out, ref


def export_bf16(w):
    out, ref = {}, {}
    for name, a in w.items():
        hname = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        if name.endswith("A_log"):
            out[hname] = ("F32", a)
            ref[name] = a
        else:
            f, b = bf16_round(a)
            out[hname] = ("BF16", b)
            ref[name] = f
    return out, ref


def hf_config_dict(cfg, quant):
    text = {k: v for k, v in cfg.items() if k not in ("partial_rotary_factor", "rope_theta")}
    text.update(model_type="qwen3_5_moe_text", hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                attention_bias=False, attn_output_gate=True, max_position_embeddings=4096, full_attention_interval=4,
                layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(cfg["num_hidden_layers"])],
                rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                 "partial_rotary_factor": cfg["partial_rotary_factor"],
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                eos_token_id=cfg["vocab_size"] - 1, dtype="bfloat16")
    top = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": False}
    if quant:
        q = {"group_size": 64, "bits": 4, "mode": "affine"}
        for i in range(cfg["num_hidden_layers"]):
            for mod in ("mlp.gate", "mlp.shared_expert_gate"):
                q[f"language_model.model.layers.{i}.{mod}"] = {"group_size": 64, "bits": 8}
        top["quantization"] = q
        top["quantization_config"] = q
    return top


def build_hf(cfg, ref):
    tc = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k not in ("partial_rotary_factor", "rope_theta")},
                              rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                               "partial_rotary_factor": cfg["partial_rotary_factor"]},
                              hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=None,
                              max_position_embeddings=4096)
    tc._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(tc).float().eval()
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ref.items()}
    missing, unexpected = model.load_state_dict(sd, strict=True), None
    return model


@torch.no_grad()
def run_reference(model, seqs, prompt):
    logits = [model(input_ids=torch.tensor([s])).logits[0].float().numpy() for s in seqs]
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_NEW,
                         min_new_tokens=GREEDY_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/goldens")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    manifest = {"generator": "tools/make_goldens.py", "transformers": transformers.__version__,
                "torch": torch.__version__, "models": []}
    for ci, (cname, cfg) in enumerate(CONFIGS.items()):
        rng = np.random.default_rng(args.seed + ci)
        w = random_weights(cfg, rng)
        seqs = [rng.integers(0, cfg["vocab_size"], n).tolist() for n in SEQ_LENS]
        prompt = rng.integers(0, cfg["vocab_size"], GREEDY_PROMPT_LEN).tolist()
        for fmt, (tensors, ref) in (("mlx", export_mlx(w, cfg)), ("bf16", export_bf16(w))):
            name = f"{cname}-{fmt}"
            d = os.path.join(args.out, name)
            os.makedirs(d, exist_ok=True)
            write_safetensors(os.path.join(d, "model.safetensors"), tensors)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(hf_config_dict(cfg, fmt == "mlx"), f, indent=1)
            model = build_hf(cfg, ref)
            logits, greedy = run_reference(model, seqs, prompt)
            entry = {"name": name, "format": fmt, "config": cname, "sequences": [], "greedy": {}}
            for s, lg in zip(seqs, logits):
                base = f"seq{len(s)}"
                np.asarray(s, dtype="<i4").tofile(os.path.join(d, base + ".ids"))
                lg.astype("<f4").tofile(os.path.join(d, base + ".logits"))
                entry["sequences"].append({"len": len(s), "ids": base + ".ids", "logits": base + ".logits",
                                           "max_abs_logit": float(np.abs(lg).max())})
            np.asarray(prompt, dtype="<i4").tofile(os.path.join(d, "greedy_prompt.ids"))
            entry["greedy"] = {"prompt": "greedy_prompt.ids", "tokens": greedy}
            with open(os.path.join(d, "golden.json"), "w") as f:
                json.dump(entry, f, indent=1)
            manifest["models"].append(name)
            print(name, "max|logit|", [round(e["max_abs_logit"], 2) for e in entry["sequences"]], "greedy", greedy[:8])
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
