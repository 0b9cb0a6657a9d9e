"""Checks of the bundled tansy-demo model files and of tools/demo's MLX 4-bit export.

The checkpoint checks read models/tansy-demo/ with a small safetensors reader written here, so
they need only numpy and run in the test venv; they skip when the model has not been exported
yet. The export tests need torch and skip without it."""
import json
import os
import re
import struct
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.environ.get("TANSY_DEMO_MODEL", os.path.join(ROOT, "models", "tansy-demo"))
FIXTURES = os.environ.get("TANSY_FIXTURES", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
TOKENIZER_DIRS = [d for d in (MODEL, os.path.join(ROOT, ".demo_data", "tokenizer"))
                  if os.path.exists(os.path.join(d, "tokenizer.json"))]
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
         ("</tool_call>", False), ("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
         ("</think>", False)]


def read_safetensors(path):
    """{name: (dtype string, shape, raw bytes)}"""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[a:b])
    return out


def as_f32(dtype, shape, raw):
    if dtype == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if dtype == "F32":
        return np.frombuffer(raw, np.float32).reshape(shape)
    raise AssertionError(dtype)


def np_dequantize(packed, scales, biases, bits):
    per_word = 32 // bits
    q = (packed[..., None] >> (np.arange(per_word, dtype=np.uint32) * bits)) & (2 ** bits - 1)
    q = q.reshape(*packed.shape[:-1], -1, 64).astype(np.float32)
    return (q * scales[..., None] + biases[..., None]).reshape(*packed.shape[:-1], -1)


# ---------------------------------------------------------------------------- tokenizer files

@pytest.mark.parametrize("tok_dir", TOKENIZER_DIRS or [pytest.param(None, marks=pytest.mark.skip("no tokenizer built"))])
def test_tokenizer_is_qwen_style(tok_dir):
    tj = json.load(open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8"))
    regex = open(os.path.join(FIXTURES, "qwen3.6", "pretokenizer_regex.txt"), encoding="utf-8").read()
    assert tj["normalizer"] == {"type": "NFC"}
    pre = tj["pre_tokenizer"]["pretokenizers"]
    assert pre[0]["type"] == "Split" and pre[0]["pattern"] == {"Regex": regex} and pre[0]["behavior"] == "Isolated"
    assert pre[1] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    assert tj["decoder"]["type"] == "ByteLevel"
    assert tj["model"]["type"] == "BPE" and not tj["model"]["byte_fallback"]
    base = len(tj["model"]["vocab"])
    got = [(t["content"], t["special"], t["id"]) for t in tj["added_tokens"]]
    assert got == [(c, s, base + i) for i, (c, s) in enumerate(ADDED)]
    assert (base + len(ADDED)) % 64 == 0

    config = json.load(open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8"))
    template = open(os.path.join(FIXTURES, "qwen3.6", "chat_template.jinja"), "rb").read()
    assert open(os.path.join(tok_dir, "chat_template.jinja"), "rb").read() == template
    assert config["chat_template"].encode() == template
    assert config["eos_token"] == "<|im_end|>" and config["add_bos_token"] is False

    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    text = "<|im_start|>user\nWhat does the word café mean?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.ids[0] == base + 1 and enc.ids[-4] == base + 7 and enc.ids[-2] == base + 8
    assert tok.decode(enc.ids, skip_special_tokens=False) == text


# ---------------------------------------------------------------------------- committed checkpoint

needs_model = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors")),
                                 reason="models/tansy-demo has not been exported")


@needs_model
def test_checkpoint_matches_mlx_layout():
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    tc = cfg["text_config"]
    st = read_safetensors(os.path.join(MODEL, "model.safetensors"))
    H, L, E, I = tc["hidden_size"], tc["num_hidden_layers"], tc["num_experts"], tc["moe_intermediate_size"]
    V, S = tc["vocab_size"], tc["shared_expert_intermediate_size"]
    # The real model's per-head shapes, which the CUDA kernels are written for.
    assert (tc["head_dim"], tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]) == (256, 128, 128, 4)
    assert tc["layer_types"] == ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)]
    assert cfg["tie_word_embeddings"] is False and tc["tie_word_embeddings"] is False
    tok = json.load(open(os.path.join(MODEL, "tokenizer.json"), encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert cfg["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    q = cfg["quantization"]
    assert q == cfg["quantization_config"] and q["bits"] == 4 and q["group_size"] == 64

    kd, vd = tc["linear_num_key_heads"] * 128, tc["linear_num_value_heads"] * 128
    nh, nkv = tc["num_attention_heads"], tc["num_key_value_heads"]
    expected = {"embed_tokens": (V, H), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        expected.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                         p + "mlp.gate": (E, H), p + "mlp.shared_expert_gate": (1, H),
                         p + "mlp.switch_mlp.gate_proj": (E, I, H), p + "mlp.switch_mlp.up_proj": (E, I, H),
                         p + "mlp.switch_mlp.down_proj": (E, H, I), p + "mlp.shared_expert.gate_proj": (S, H),
                         p + "mlp.shared_expert.up_proj": (S, H), p + "mlp.shared_expert.down_proj": (H, S)})
        if tc["layer_types"][i] == "full_attention":
            expected.update({p + "self_attn.q_proj": (nh * 512, H), p + "self_attn.k_proj": (nkv * 256, H),
                             p + "self_attn.v_proj": (nkv * 256, H), p + "self_attn.o_proj": (H, nh * 256),
                             p + "self_attn.q_norm.weight": (256,), p + "self_attn.k_norm.weight": (256,)})
        else:
            nv = tc["linear_num_value_heads"]
            expected.update({p + "linear_attn.in_proj_qkv": (2 * kd + vd, H), p + "linear_attn.in_proj_z": (vd, H),
                             p + "linear_attn.in_proj_a": (nv, H), p + "linear_attn.in_proj_b": (nv, H),
                             p + "linear_attn.out_proj": (H, vd), p + "linear_attn.conv1d.weight": (2 * kd + vd, 4, 1),
                             p + "linear_attn.A_log": (nv,), p + "linear_attn.dt_bias": (nv,),
                             p + "linear_attn.norm.weight": (128,)})
    names = set()
    for short, shape in expected.items():
        name = "language_model.model." + short
        if short.endswith(".weight") or short.endswith("A_log") or short.endswith("dt_bias"):
            dtype, got, _ = st[name]
            assert tuple(got) == shape, name
            assert dtype == ("F32" if short.endswith("A_log") else "BF16"), name
            names.add(name)
            continue
        bits = 8 if re.search(r"mlp\.(gate|shared_expert_gate)$", short) else 4
        assert (bits == 8) == (name in q), name
        w, s, b = st[name + ".weight"], st[name + ".scales"], st[name + ".biases"]
        assert w[0] == "U32" and s[0] == "BF16" and b[0] == "BF16", name
        assert tuple(w[1]) == shape[:-1] + (shape[-1] * bits // 32,), name
        assert tuple(s[1]) == tuple(b[1]) == shape[:-1] + (shape[-1] // 64,), name
        names.update(name + x for x in (".weight", ".scales", ".biases"))
    head = "language_model.lm_head"
    assert tuple(st[head + ".weight"][1]) == (V, H // 8)
    names.update(head + x for x in (".weight", ".scales", ".biases"))
    assert set(st) == names


@needs_model
def test_checkpoint_weights_are_sane():
    st = read_safetensors(os.path.join(MODEL, "model.safetensors"))
    # Norms are stored as 1 + w; a trained model keeps them positive and near 1.
    for name, (dtype, shape, raw) in st.items():
        if re.search(r"(layernorm|norm)\.weight$", name) and "linear_attn" not in name:
            w = as_f32(dtype, shape, raw)
            assert np.all(np.isfinite(w)) and 0.0 < np.median(w) < 5.0, name
    name = "language_model.model.embed_tokens"
    w = np_dequantize(np.frombuffer(st[name + ".weight"][2], np.uint32).reshape(st[name + ".weight"][1]),
                      as_f32(*st[name + ".scales"]), as_f32(*st[name + ".biases"]), 4)
    assert np.all(np.isfinite(w)) and 0.0 < np.abs(w).mean() < 1.0


# ---------------------------------------------------------------------------- export (torch)

def _export_module():
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    sys.path.insert(0, os.path.join(ROOT, "tools", "demo"))
    import export
    return export


def test_quantize_known_group():
    export = _export_module()
    import torch
    # |min| > |max|: scale = 1.5/15, the minimum is represented exactly (bias = -1, code 0).
    g = torch.zeros(1, 64)
    g[0, 62], g[0, 63] = -1.0, 0.5
    packed, scales, biases = export.quantize(g, 4)
    assert packed.shape == (1, 8) and scales.shape == (1, 1)
    assert scales.float().item() == pytest.approx(0.1, rel=1e-2) and biases.float().item() == -1.0
    words = packed.numpy().astype(np.uint64)
    assert all(int(x) == 0xAAAAAAAA for x in words[0, :7])
    assert int(words[0, 7]) == 0xF0AAAAAA  # codes 10,10,10,10,10,10,0,15, lowest nibble first
    # |max| >= |min|: the scale is negative and the maximum is the exact edge.
    packed, scales, biases = export.quantize(-g, 4)
    assert scales.float().item() < 0 and biases.float().item() == 1.0


def test_quantize_round_trip_and_8_bit():
    export = _export_module()
    import torch
    torch.manual_seed(0)
    for bits in (4, 8):
        w = torch.randn(3, 5, 256) * 0.05
        packed, scales, biases = export.quantize(w, bits)
        assert packed.shape == (3, 5, 256 * bits // 32)
        back = export.dequantize(packed, scales, biases, bits)
        step = scales.float().abs().repeat_interleave(64, dim=-1)
        bias = biases.float().abs().repeat_interleave(64, dim=-1)
        # Storing the float32 scale and bias as bf16 moves a value by at most
        # (code · |scale| + |bias|) · 2^-8. Rounding the edge's code (q0) can shrink the scale so
        # far that the opposite extreme is clipped, by at most about one step; elsewhere the
        # error is half a step.
        bf16_err = step * (2 ** bits - 1) * 2 ** -8 + bias * 2 ** -8 + 1e-7
        err = (back - w).abs()
        assert (err <= 1.1 * step + bf16_err).all()
        g_min = w.reshape(3, 5, 4, 64).amin(-1).repeat_interleave(64, -1)
        g_max = w.reshape(3, 5, 4, 64).amax(-1).repeat_interleave(64, -1)
        inner = (w > g_min) & (w < g_max)
        assert (err[inner] <= 0.5 * step[inner] + bf16_err[inner]).float().mean() > 0.99
        ref = np_dequantize(packed.numpy(), scales.float().numpy(), biases.float().numpy(), bits)
        assert np.array_equal(ref, back.numpy())


def test_export_names_round_trip(tmp_path):
    export = _export_module()
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, os.path.join(ROOT, "tools", "demo"))
    import mlx_to_hf
    pytest.importorskip("transformers")
    from train import build_config
    from transformers import Qwen3_5MoeForCausalLM

    meta = {"vocab_size": 256, "special_ids": {"<|endoftext|>": 247, "<|im_end|>": 249}}
    config = build_config(meta, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                          linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, shared_expert_intermediate_size=64)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config)
    with torch.no_grad():  # non-zero norms, so that the 1 + w shift is exercised
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors, quant_paths = export.mlx_tensors(hf, config.to_dict())
    assert quant_paths["language_model.model.layers.0.mlp.gate"] == 8
    assert tensors["language_model.model.layers.0.linear_attn.conv1d.weight"].shape == (2 * 128 + 2 * 128, 4, 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = export.wrapper_config(config.to_dict(), meta["special_ids"], {"group_size": 64, "bits": 4})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, back = mlx_to_hf.hf_state_dict(str(tmp_path))
    assert set(back) == set(hf)
    for name, w in hf.items():
        assert back[name].shape == w.shape, name
        tol = 1e-2 if w.ndim == 1 else (w.abs().max().item() / 7 + 1e-6)
        assert (back[name] - w.float()).abs().max().item() <= tol, name
