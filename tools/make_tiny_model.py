#!/usr/bin/env python3
"""Writes a tiny random-weight checkpoint of tansy's architecture for API tests.

Usage: make_tiny_model.py OUT_DIR --tokenizer DIR --template FILE [--seed N]

The model is qwen3_5_moe (Hugging Face bf16 layout, docs/MODEL.md §8.1) with hidden size 64,
4 layers (3 Gated DeltaNet + 1 gated attention, per-head dims of the real model), 4 experts
top-2, and the Qwen3 tokenizer's 151,936-row vocabulary, so it runs in milliseconds per token
on the CPU backend. Needs only numpy: the safetensors file is written by hand.

Random weights generate arbitrary text. So that the tests can also exercise the chat features
(reasoning split, tool calls, stop strings) end to end, a few "scripted" continuations are
written into the weights as bigram transitions: the embedding of token s points, through the
final norm, at the lm_head row of the token that must follow s, with a margin that survives the
(deliberately weaker) mixer and expert contributions. Every token of a script is distinct, so a
bigram decides the whole continuation:

  after "\\n" (the end of a thinking-mode generation prompt "<think>\\n"):
      SCRIPT_THINK (reasoning, then a get_weather tool call), then <|im_end|>
  after "\\n\\n" (the end of a no-thinking prompt "</think>\\n\\n"):
      SCRIPT_ANSWER, then <|im_end|>

Everywhere else the model samples from its random distribution, which depends on the whole
sequence state (KV cache, GDN state), so determinism and prefix-cache tests stay meaningful.
The chosen token ids are written to OUT_DIR/tiny_model_scripts.json for the tests.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

from safetensors_np import write_safetensors

# Newlines are scarce: "\n" itself starts a script, and no vocabulary token joins "\n" to a
# following "<". So the tool call is spelled without the optional newlines of the format.
SCRIPT_THINK = ("The user asked about the weather, so I will call get_weather.\n</think>\n\n\n"
                "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>")
SCRIPT_ANSWER = "Hello! The answer is 42 from a tiny model."

HIDDEN = 64
LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 256
LIN_K_HEADS, LIN_V_HEADS, LIN_DIM = 1, 2, 128
EXPERTS, TOP_K, MOE_INTER, SHARED_INTER = 4, 2, 32, 32
VOCAB = 151936
CHAIN_GAIN = 3.0      # lm_head weight along a script source's direction: logit ~ 3 * 8 = 24
RANDOM_LOGIT_STD = 1.5


def bytes_to_unicode():
    """GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def load_vocab(tokenizer_json):
    """token bytes -> id for the BPE vocabulary, and added-token text -> id."""
    tj = json.load(open(tokenizer_json, encoding="utf-8"))
    dec = {c: b for b, c in bytes_to_unicode().items()}
    by_bytes = {}
    for tok, i in tj["model"]["vocab"].items():
        by_bytes[bytes(dec[c] for c in tok)] = i
    added = {a["content"]: a["id"] for a in tj["added_tokens"]}
    return by_bytes, added


def tokenize_distinct(text, by_bytes, added, forbidden):
    """A token sequence decoding to `text` in which no token repeats or is forbidden.

    Added tokens (<tool_call>, </think>, ...) stay atomic; plain stretches are covered by any
    vocabulary tokens, longest first, with backtracking."""
    pieces, i = [], 0
    names = sorted(added, key=len, reverse=True)
    buf = ""
    while i < len(text):
        hit = next((n for n in names if text.startswith(n, i)), None)
        if hit:
            if buf:
                pieces.append(("text", buf.encode()))
                buf = ""
            pieces.append(("added", hit))
            i += len(hit)
        else:
            buf += text[i]
            i += 1
    if buf:
        pieces.append(("text", buf.encode()))
    used = set(forbidden)
    out = []
    for kind, p in pieces:
        if kind == "added":
            tid = added[p]
            if tid in used:
                sys.exit(f"make_tiny_model: added token {p} repeats in a script")
            used.add(tid)
            out.append(tid)
            continue
        seq = []

        def dfs(pos):
            if pos == len(p):
                return True
            for end in range(min(len(p), pos + 24), pos, -1):
                tid = by_bytes.get(p[pos:end])
                if tid is None or tid in used:
                    continue
                used.add(tid)
                seq.append(tid)
                if dfs(end):
                    return True
                seq.pop()
                used.discard(tid)
            return False

        if not dfs(0):
            sys.exit(f"make_tiny_model: cannot spell {p!r} with distinct tokens")
        out.extend(seq)
    return out


def bf16(a):
    """float32 array -> bf16 bit patterns (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True, help="directory with tokenizer.json (Qwen3)")
    ap.add_argument("--template", required=True, help="the Qwen3.6 chat_template.jinja")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()

    by_bytes, added = load_vocab(os.path.join(a.tokenizer, "tokenizer.json"))
    nl, nl2 = by_bytes[b"\n"], by_bytes[b"\n\n"]
    im_end = added["<|im_end|>"]
    think = tokenize_distinct(SCRIPT_THINK, by_bytes, added, {nl, nl2, im_end})
    answer = tokenize_distinct(SCRIPT_ANSWER, by_bytes, added, {nl, nl2, im_end} | set(think))
    transitions = {}
    for start, script in ((nl, think), (nl2, answer)):
        chain = [start] + script + [im_end]
        for s, t in zip(chain, chain[1:]):
            transitions[s] = t

    rng = np.random.default_rng(a.seed)
    H = HIDDEN
    f32 = lambda *shape, std: (rng.standard_normal(shape) * std).astype(np.float32)
    T = {}
    P = "model.language_model."

    def put(name, arr):
        T[name] = ("BF16", bf16(arr))

    embed = f32(VOCAB, H, std=1.0)
    final_norm = f32(H, std=0.02)  # zero-centred: the multiplier is 1 + w
    lm_head = f32(VOCAB, H, std=RANDOM_LOGIT_STD / np.sqrt(H))
    for s, t in transitions.items():
        d = embed[s] * (1.0 + final_norm)
        lm_head[t] += CHAIN_GAIN * d / np.linalg.norm(d)
    put(P + "embed_tokens.weight", embed)
    put(P + "norm.weight", final_norm)
    put("lm_head.weight", lm_head)

    # Mixers and experts read O(1) projections but write back at ~0.2 of the residual's
    # scale: enough to make the random continuations depend on the whole sequence state,
    # too little to break the scripted transitions.
    w_in = 1.0 / np.sqrt(H)
    conv_dim = 2 * LIN_K_HEADS * LIN_DIM + LIN_V_HEADS * LIN_DIM
    for i, kind in enumerate(LAYERS):
        p = f"{P}layers.{i}."
        put(p + "input_layernorm.weight", f32(H, std=0.02))
        put(p + "post_attention_layernorm.weight", f32(H, std=0.02))
        if kind == "linear_attention":
            vd = LIN_V_HEADS * LIN_DIM
            put(p + "linear_attn.in_proj_qkv.weight", f32(conv_dim, H, std=w_in))
            put(p + "linear_attn.in_proj_z.weight", f32(vd, H, std=w_in))
            put(p + "linear_attn.in_proj_b.weight", f32(LIN_V_HEADS, H, std=w_in))
            put(p + "linear_attn.in_proj_a.weight", f32(LIN_V_HEADS, H, std=w_in))
            put(p + "linear_attn.conv1d.weight", f32(conv_dim, 1, 4, std=0.5))
            T[p + "linear_attn.A_log"] = ("F32", np.log(rng.uniform(1, 16, LIN_V_HEADS)).astype(np.float32))
            put(p + "linear_attn.dt_bias", f32(LIN_V_HEADS, std=0.1))
            put(p + "linear_attn.norm.weight", 1.0 + f32(LIN_DIM, std=0.02))
            put(p + "linear_attn.out_proj.weight", f32(H, vd, std=0.2 / np.sqrt(vd)))
        else:
            q = HEADS * HEAD_DIM
            put(p + "self_attn.q_proj.weight", f32(2 * q, H, std=w_in))
            put(p + "self_attn.k_proj.weight", f32(KV_HEADS * HEAD_DIM, H, std=w_in))
            put(p + "self_attn.v_proj.weight", f32(KV_HEADS * HEAD_DIM, H, std=w_in))
            put(p + "self_attn.o_proj.weight", f32(H, q, std=0.2 / np.sqrt(q)))
            put(p + "self_attn.q_norm.weight", f32(HEAD_DIM, std=0.02))
            put(p + "self_attn.k_norm.weight", f32(HEAD_DIM, std=0.02))
        put(p + "mlp.gate.weight", f32(EXPERTS, H, std=w_in))
        put(p + "mlp.experts.gate_up_proj", f32(EXPERTS, 2 * MOE_INTER, H, std=w_in))
        put(p + "mlp.experts.down_proj", f32(EXPERTS, H, MOE_INTER, std=0.2 / np.sqrt(MOE_INTER)))
        put(p + "mlp.shared_expert.gate_proj.weight", f32(SHARED_INTER, H, std=w_in))
        put(p + "mlp.shared_expert.up_proj.weight", f32(SHARED_INTER, H, std=w_in))
        put(p + "mlp.shared_expert.down_proj.weight", f32(H, SHARED_INTER, std=0.2 / np.sqrt(SHARED_INTER)))
        put(p + "mlp.shared_expert_gate.weight", f32(1, H, std=w_in))

    os.makedirs(a.out, exist_ok=True)
    write_safetensors(os.path.join(a.out, "model.safetensors"), T)
    text_config = {
        "model_type": "qwen3_5_moe_text", "hidden_size": H, "num_hidden_layers": len(LAYERS), "vocab_size": VOCAB,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "linear_num_key_heads": LIN_K_HEADS, "linear_num_value_heads": LIN_V_HEADS,
        "linear_key_head_dim": LIN_DIM, "linear_value_head_dim": LIN_DIM, "linear_conv_kernel_dim": 4,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": MOE_INTER,
        "shared_expert_intermediate_size": SHARED_INTER, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "attn_output_gate": True, "tie_word_embeddings": False,
        "layer_types": LAYERS, "eos_token_id": im_end,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    }
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "eos_token_id": [im_end, added["<|endoftext|>"]],
              "text_config": text_config}
    json.dump(config, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    gen = {"eos_token_id": [im_end, added["<|endoftext|>"]], "do_sample": True, "temperature": 0.9, "top_p": 0.95,
           "top_k": 50}
    json.dump(gen, open(os.path.join(a.out, "generation_config.json"), "w"), indent=2)
    shutil.copyfile(os.path.join(a.tokenizer, "tokenizer.json"), os.path.join(a.out, "tokenizer.json"))
    if os.path.exists(os.path.join(a.tokenizer, "tokenizer_config.json")):
        tc = json.load(open(os.path.join(a.tokenizer, "tokenizer_config.json"), encoding="utf-8"))
        tc.pop("chat_template", None)  # the Qwen3 template; chat_template.jinja is the one used
        json.dump(tc, open(os.path.join(a.out, "tokenizer_config.json"), "w"), indent=2)
    shutil.copyfile(a.template, os.path.join(a.out, "chat_template.jinja"))
    json.dump({"think": {"start": nl, "tokens": think, "text": SCRIPT_THINK},
               "answer": {"start": nl2, "tokens": answer, "text": SCRIPT_ANSWER}, "eos": im_end},
              open(os.path.join(a.out, "tiny_model_scripts.json"), "w"), indent=2)


if __name__ == "__main__":
    main()
