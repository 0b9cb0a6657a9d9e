#!/usr/bin/env python3
"""Evaluates the exported (4-bit) tansy-demo checkpoint with transformers.

Dequantizes models/tansy-demo into a float32 Qwen3_5MoeForCausalLM (tools/demo/mlx_to_hf.py),
measures held-out perplexity, and writes greedy answers to the fixed questions of
.demo_data/prompts.json, with their token ids, to eval.json, with the word-definition score on
the 200 words of tools/demo/eval_words.json (prompts from .demo_data/word_prompts.json; scored by
tools/demo/word_score.py's rule).

    python tools/demo/evaluate.py --model models/tansy-demo --data .demo_data --out out/demo/eval.json
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlx_to_hf import load_model  # noqa: E402
from word_score import MAX_TOKENS, load_words, score  # noqa: E402


@torch.no_grad()
def perplexity(model, val, seq, batch, max_windows):
    n = min((val.numel() - 1) // seq, max_windows) if max_windows else (val.numel() - 1) // seq
    total, count = 0.0, 0
    for start in range(0, n, batch):
        idx = torch.arange(start, min(n, start + batch), device=val.device) * seq
        win = val[idx[:, None] + torch.arange(seq + 1, device=val.device)]
        logits = model(input_ids=win[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += win[:, 1:].numel()
    return total / count, count


@torch.no_grad()
def word_answers(model, tok, data_dir, eos, pad, max_new_tokens, limit=0, batch=64):
    """Greedy answers to the evaluation words' prompts, batched by prompt length (no padding)."""
    prompts = json.load(open(os.path.join(data_dir, "word_prompts.json")))
    _, words = load_words()
    if [p["word"] for p in prompts] != [w["word"] for w in words]:
        sys.exit("evaluate: .demo_data/word_prompts.json is not for tools/demo/eval_words.json (rebuild the data)")
    if limit:
        prompts, words = prompts[:limit], words[:limit]
    device = next(model.parameters()).device
    answers = [None] * len(prompts)
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p["ids"]), []).append(i)
    for idx_all in by_len.values():
        for start in range(0, len(idx_all), batch):
            idx = idx_all[start:start + batch]
            ids = torch.tensor([prompts[i]["ids"] for i in idx], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
            for row, i in enumerate(idx):
                new = out[row, ids.shape[1]:].tolist()
                cut = next((k for k, t in enumerate(new) if t in eos), len(new))
                answers[i] = tok.decode(new[:cut], skip_special_tokens=False)
    return words, answers


def main():
    ap = argparse.ArgumentParser(description="Evaluate the exported tansy-demo checkpoint.")
    ap.add_argument("--model", default="models/tansy-demo")
    ap.add_argument("--data", default=".demo_data")
    ap.add_argument("--out", default="out/demo/eval.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=0, help="limit the perplexity windows (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-prompts", type=int, default=0)
    ap.add_argument("--max-words", type=int, default=0, help="score only the first N evaluation words (smoke test)")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    device = torch.device(args.device)
    model = load_model(args.model, torch.float32, device)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            sys.exit(f"evaluate: {name} was not loaded")
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    gen_cfg = json.load(open(os.path.join(args.model, "generation_config.json")))
    eos = gen_cfg["eos_token_id"]

    val = torch.from_numpy(np.fromfile(os.path.join(args.data, "val.bin"), dtype=np.uint16).astype(np.int64))
    t0 = time.time()
    loss, count = perplexity(model, val.to(device), args.seq, 16, args.max_windows)
    print(f"evaluate: 4-bit checkpoint held-out loss {loss:.4f}, perplexity {math.exp(loss):.3f} "
          f"over {count} tokens ({time.time() - t0:.0f} s)", flush=True)

    prompts = json.load(open(os.path.join(args.data, "prompts.json")))
    if args.max_prompts:
        prompts = prompts[: args.max_prompts]
    samples = []
    for p in prompts:
        ids = torch.tensor([p["ids"]], device=device)
        if tok.encode(p["prompt"], add_special_tokens=False).ids != p["ids"]:
            sys.exit("evaluate: prompts.json does not match this tokenizer")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=gen_cfg["pad_token_id"])
        new = out[0, ids.shape[1]:].tolist()
        text = tok.decode([t for t in new if t not in eos], skip_special_tokens=False)
        samples.append({"question": p["question"], "enable_thinking": p["enable_thinking"],
                        "prompt_ids": p["ids"], "completion_ids": new, "completion": text,
                        "stopped": bool(new and new[-1] in eos)})
        print(f"--- {p['question']}{' [thinking]' if p['enable_thinking'] else ''}\n{text}", flush=True)

    t0 = time.time()
    words, answers = word_answers(model, tok, args.data, eos, gen_cfg["pad_token_id"], MAX_TOKENS, args.max_words)
    word_result = score(words, answers, "transformers generate, float32, dequantized 4-bit weights, greedy, "
                        f"max_new_tokens {MAX_TOKENS}, device " + device.type)
    print(f"evaluate: word-definition score {word_result['right']}/{word_result['total']} = "
          f"{100 * word_result['score']:.1f}% (mean token recall {100 * word_result['mean_token_recall']:.1f}%, "
          f"{time.time() - t0:.0f} s)", flush=True)
    for r in word_result["answers"][:3]:
        print(f"  {r['word']}: {r['answer']}", flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"val_loss": round(loss, 4), "val_perplexity": round(math.exp(loss), 3), "val_tokens_scored": count,
                   "greedy": "transformers generate, float32, dequantized 4-bit weights, device " + device.type,
                   "samples": samples, "word_score": word_result}, f, ensure_ascii=False, indent=1)
    print(f"evaluate: wrote {args.out}")


if __name__ == "__main__":
    main()
