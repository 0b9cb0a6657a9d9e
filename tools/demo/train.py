#!/usr/bin/env python3
"""Trains the tansy-demo model: a tiny Qwen3.6-35B-A3B-architecture chat model.

The architecture is transformers' qwen3_5_moe text model with the real model's per-head shapes
(attention head_dim 256 with partial RoPE 0.25 and an output gate, Gated DeltaNet key/value
heads of 128 with a width-4 causal conv, 3 GDN : 1 attention layers, routed experts plus a
sigmoid-gated shared expert); only the head counts, width, depth and expert counts shrink.

Input: the token files from tools/demo/build_data.py (--data, default .demo_data).
Output (--out): hf/ (transformers checkpoint, float32), loss.csv, loss.png, train_summary.json.
Training is time-boxed (--minutes): the learning-rate schedule (linear warm-up, cosine decay)
is a function of elapsed time, so the run ends on schedule however fast the machine is.

    python tools/demo/train.py --minutes 4.5                  # on the GPU machine
    python tools/demo/train.py --device cpu --minutes 0.5 --batch 2 --seq 128   # smoke test
"""
import argparse
import csv
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# The shape of the demo model; everything not listed is the real model's value.
DEMO_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=8,            # layers 3 and 7 are full attention
    num_attention_heads=4,
    num_key_value_heads=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
)


def fail(msg):
    sys.exit(f"train: {msg}")


def build_config(meta, **overrides):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    ids = meta["special_ids"]
    shape = dict(DEMO_SHAPE, **overrides)
    return Qwen3_5MoeTextConfig(
        vocab_size=meta["vocab_size"],
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        attention_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
        bos_token_id=None,
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        **shape,
    )


def load_tokens(path, device):
    if not os.path.exists(path):
        fail(f"missing {path}: run tools/demo/build_data.py (or carry .demo_data to this machine)")
    arr = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    return torch.from_numpy(arr).to(device)


def grouped_mm_works(device):
    """Whether torch's grouped GEMM runs forward and backward on float32 master weights here.

    Probed on a toy problem so that an unsupported dtype or GPU is reported at start-up and the
    run uses transformers' per-expert loop instead of dying minutes later."""
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            w = torch.randn(4, 64, 32, device=device, requires_grad=True)
            x = torch.randn(16, 64, device=device, requires_grad=True)
            offs = torch.tensor([4, 8, 12, 16], device=device, dtype=torch.int32)
            mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
            y = mm(x.to(w.dtype), w, offs=offs)
        y.float().sum().backward()
        ref = torch.cat([x[i * 4:(i + 1) * 4] @ w[i] for i in range(4)])
        torch.cuda.synchronize()
        return bool(torch.allclose(y.float(), ref.float(), atol=1e-1, rtol=1e-2))
    except Exception as e:  # any failure means "do not use it"; the reason is printed
        print(f"train: grouped_mm unusable here ({type(e).__name__}: {e}); using the per-expert loop",
              file=sys.stderr, flush=True)
        return False


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # Matrices (and the 3-D expert banks) decay; norms, gates' scalars and conv taps do not.
        (decay if p.ndim >= 2 and "conv1d" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(frac, peak, warmup_frac, final_ratio):
    if frac < warmup_frac:
        return peak * max(frac / warmup_frac, 0.01)
    t = min(1.0, (frac - warmup_frac) / (1.0 - warmup_frac))
    return peak * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, data, seq, batch, device, max_windows=None):
    """Mean next-token cross-entropy (nats) over non-overlapping windows of `seq` tokens."""
    model.eval()
    n = (data.numel() - 1) // seq
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for start in range(0, n, batch):
        idx = torch.arange(start, min(n, start + batch), device=device) * seq
        win = data[idx[:, None] + torch.arange(seq + 1, device=device)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=win[:, :-1], output_router_logits=False, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1),
                               reduction="sum")
        total += loss.item()
        count += win[:, 1:].numel()
    model.train()
    return total / count, count


def plot(csv_path, png_path, summary):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train: matplotlib is missing, no loss plot", file=sys.stderr)
        return False
    rows = list(csv.DictReader(open(csv_path)))
    tr = [(float(r["tokens"]) / 1e6, float(r["train_loss"])) for r in rows if r["train_loss"]]
    va = [(float(r["tokens"]) / 1e6, float(r["val_loss"])) for r in rows if r["val_loss"]]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*tr), label="train (batch mean)", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="held-out", ms=4)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"tansy-demo: {summary['params_total'] / 1e6:.1f} M params, "
                 f"{summary['train_seconds'] / 60:.1f} min on {summary['device_name']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    return True


def main():
    ap = argparse.ArgumentParser(description="Train the tansy-demo model (time-boxed).")
    ap.add_argument("--data", default=".demo_data")
    ap.add_argument("--out", default="out/demo")
    ap.add_argument("--minutes", type=float, default=4.5, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # The step rate of this tiny model on an H200 is bound by kernel launches (per-expert loop), so a
    # larger batch buys tokens almost for free.
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=float, default=0.04, help="warm-up, as a fraction of the budget")
    ap.add_argument("--eval-every", type=float, default=45.0, help="seconds between held-out evaluations")
    ap.add_argument("--final-eval-windows", type=int, default=0, help="limit the final evaluation (0: all)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--keep-best", action="store_true",
                    help="end with the weights of the best held-out evaluation, not the last ones (off: the "
                         "corpus is meant to be memorised, and its held-out part has none of the taught words)")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("CUDA requested but not available")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)

    meta = json.load(open(os.path.join(args.data, "meta.json")))
    train = load_tokens(os.path.join(args.data, "train.bin"), device)
    val = load_tokens(os.path.join(args.data, "val.bin"), device)
    if train.max().item() >= meta["vocab_size"] or val.max().item() >= meta["vocab_size"]:
        fail("token ids exceed the vocabulary")

    from transformers import Qwen3_5MoeForCausalLM

    config = build_config(meta)
    # grouped_mm runs all experts in one kernel on Hopper; the eager per-expert loop is the
    # fallback everywhere else (CPU smoke test).
    config._experts_implementation = "grouped_mm" if device.type == "cuda" and grouped_mm_works(device) else "eager"
    print(f"experts implementation: {config._experts_implementation}", flush=True)
    config._attn_implementation = "sdpa"
    model = Qwen3_5MoeForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    n_active = n_params - config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * per_expert \
        - model.model.embed_tokens.weight.numel()
    print(f"model: {n_params / 1e6:.2f} M parameters, {n_active / 1e6:.2f} M active per token "
          f"(embedding row excluded); layers {config.layer_types}", flush=True)

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    budget = args.minutes * 60.0
    csv_path = os.path.join(args.out, "loss.csv")
    log = open(csv_path, "w", newline="")
    writer = csv.writer(log)
    writer.writerow(["step", "seconds", "tokens", "lr", "train_loss", "aux_loss", "val_loss"])
    offsets = torch.arange(args.seq + 1, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    tokens_per_step = args.batch * args.seq

    step, tokens = 0, 0
    best = (float("inf"), None, 0)  # held-out loss, weights, step
    loss_acc = torch.zeros((), device=device)
    aux_acc = torch.zeros((), device=device)
    acc_n = 0
    last_log = last_eval = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    while True:
        elapsed = time.time() - t0
        frac = elapsed / budget
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(frac, args.lr, args.warmup, 0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), device=device, generator=gen)
        win = train[starts[:, None] + offsets]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=win[:, :-1], output_router_logits=True, use_cache=False)
        loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), win[:, 1:].reshape(-1))
        total = loss + config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += tokens_per_step
        loss_acc += loss.detach()
        aux_acc += out.aux_loss.detach()
        acc_n += 1
        now = time.time() - t0
        if now - last_log >= 2.0 or step == 1:
            val_loss = ""
            if now - last_eval >= args.eval_every:
                val_loss, _ = evaluate(model, val, args.seq, 64, device, max_windows=128)
                last_eval = now
                if args.keep_best and val_loss < best[0]:
                    best = (val_loss, {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
            train_loss = (loss_acc / acc_n).item()
            writer.writerow([step, f"{now:.1f}", tokens, f"{lr:.3e}", f"{train_loss:.4f}",
                             f"{(aux_acc / acc_n).item():.4f}", f"{val_loss:.4f}" if val_loss != "" else ""])
            log.flush()
            print(f"step {step:6d}  {now:6.1f}s  {tokens / 1e6:7.2f} M tok  lr {lr:.2e}  loss {train_loss:.4f}"
                  + (f"  val {val_loss:.4f}" if val_loss != "" else ""), flush=True)
            loss_acc.zero_()
            aux_acc.zero_()
            acc_n = 0
            last_log = now
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - t0

    # With --keep-best, if the last weights do worse on the held-out subset than an earlier
    # evaluation, the earlier weights are the result.
    kept_step = step
    if args.keep_best and best[1] is not None:
        last_loss, _ = evaluate(model, val, args.seq, 64, device, max_windows=128)
        if best[0] < last_loss:
            model.load_state_dict(best[1])
            kept_step = best[2]
            print(f"held-out loss rose to {last_loss:.4f}; keeping step {kept_step} ({best[0]:.4f})", flush=True)
    best = None
    val_loss, val_count = evaluate(model, val, args.seq, 64, device, max_windows=args.final_eval_windows or None)
    bits_per_byte = val_loss * val_count / math.log(2) / meta["val_bytes"] * (val.numel() / val_count)
    writer.writerow([step, f"{train_seconds:.1f}", tokens, "", "", "", f"{val_loss:.4f}"])
    log.close()
    summary = {
        "steps": step,
        "kept_step": kept_step,
        "train_tokens_seen": tokens,
        "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens / train_seconds),
        "epochs": round(tokens / train.numel(), 2),
        "val_loss": round(val_loss, 4),
        "val_perplexity": round(math.exp(val_loss), 3),
        "val_tokens_scored": val_count,
        # Approximate: the scored windows cover all but the last partial window of the split.
        "val_bits_per_byte": round(bits_per_byte, 4),
        "params_total": n_params,
        "params_active_per_token": n_active,
        "batch": args.batch, "seq": args.seq, "peak_lr": args.lr, "weight_decay": args.weight_decay,
        "warmup_fraction": args.warmup, "minutes_budget": args.minutes,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
    }
    import transformers
    summary["transformers"] = transformers.__version__
    print(f"held-out: loss {val_loss:.4f} nats/token, perplexity {math.exp(val_loss):.3f} over {val_count} "
          f"tokens, ~{bits_per_byte:.4f} bits/byte; {step} steps, {tokens / 1e6:.1f} M tokens "
          f"({summary['epochs']} epochs) in {train_seconds:.0f} s", flush=True)

    hf_dir = os.path.join(args.out, "hf")
    model.config.output_router_logits = False
    # The module's own tensor names (fused expert banks), not save_pretrained's on-disk
    # conversion, which splits the experts again: export.py maps exactly these names.
    from safetensors.torch import save_file
    os.makedirs(hf_dir, exist_ok=True)
    model.config.save_pretrained(hf_dir)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()},
              os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(csv_path, os.path.join(args.out, "loss.png"), summary)
    print(f"wrote {hf_dir}, {csv_path}", flush=True)


if __name__ == "__main__":
    main()
