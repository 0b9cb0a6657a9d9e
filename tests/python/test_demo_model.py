"""The bundled tansy-demo model on tansy's CPU backend against transformers' recorded outputs.

* Greedy answers: each fixed question of models/tansy-demo/training/eval.json (transformers
  generate, float32, dequantized 4-bit weights) is rendered with `tansy render`, tokenized with
  `tansy tokenize` (must give the recorded prompt ids), and greedily continued with
  `tansy generate --stop-at-eos`; the new ids and their detokenized text must equal the recorded
  ones exactly. On another backend (CUDA: bf16 activations) one exception: the answer may leave
  the recorded one at a position where the float32 CPU backend's top-2 logits are within
  TIE_LOGITS and the backend picks the other of the two (printed; the answers up to there equal).
* Teacher-forced agreement: top-1 of `tansy logits` against transformers' argmax saved in
  tests/data/demo_heldout.npz (held-out windows; see tools/demo/agreement.py) must be >= 99.5%.
* Speed: CPU decode tok/s, printed (run with -s), not asserted: it depends on the machine.

The binary is build/tansy or $TANSY_BIN; the backend is $TANSY_DEMO_BACKEND (default cpu), so the
same checks run on the GPU machine with TANSY_DEMO_BACKEND=cuda."""
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TANSY = Path(os.environ.get("TANSY_BIN", REPO / "build" / "tansy"))
MODEL = REPO / "models" / "tansy-demo"
BACKEND = os.environ.get("TANSY_DEMO_BACKEND", "cpu")
EVAL = json.loads((MODEL / "training" / "eval.json").read_text(encoding="utf-8"))
EOS = json.loads((MODEL / "generation_config.json").read_text())["eos_token_id"]
SAMPLE = REPO / "tests" / "data" / "demo_heldout.npz"
AGREEMENT_WINDOWS = 12  # of the sample's 40 x 256 tokens: 3,072 positions keep CI quick
# A float32-reference top-2 margin below this is a tie that bf16 activations may break either way:
# rounding the CPU backend's activations to bf16 where the CUDA backend does (an emulation in the
# CPU forward pass, 2026-11-30; model card) moves the eval answers' margins by 0.005 logits
# (median |change|), and depending on which points round it flips each of the three smallest
# (0.0022, 0.0025, 0.0049).
TIE_LOGITS = 0.01

sys.path.insert(0, str(REPO / "tools" / "demo"))
pytestmark = pytest.mark.skipif(not TANSY.exists(), reason=f"no tansy binary at {TANSY}")


def tansy(*args, stdin=b""):
    p = subprocess.run([str(TANSY), *args], input=stdin, capture_output=True, timeout=600)
    assert p.returncode == 0, f"tansy {args[0]} failed: {p.stderr.decode(errors='replace')}"
    return p.stdout


def request(sample):
    body = {"model": "tansy-demo", "messages": [{"role": "user", "content": sample["question"]}]}
    # evaluate.py's prompts pass enable_thinking=False only for thinking-off questions; thinking-on
    # ones leave it unset (the template's default), which is what the server does without kwargs.
    if not sample["enable_thinking"]:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return json.dumps(body).encode()


def prompt_ids(sample):
    prompt = tansy("render", "--model", str(MODEL), stdin=request(sample))
    return [int(x) for x in tansy("tokenize", "--model", str(MODEL), stdin=prompt).split()]


def write_ids(path, ids):
    np.asarray(ids, dtype="<i4").tofile(path)
    return str(path)


@pytest.mark.parametrize("sample", EVAL["samples"], ids=lambda s: s["question"] + (" [thinking]" if s["enable_thinking"] else ""))
def test_greedy_answer_matches_transformers(sample, tmp_path):
    ids = prompt_ids(sample)
    assert ids == sample["prompt_ids"], "tansy render + tokenize disagree with the prompt evaluate.py used"
    out = tansy("generate", "--model", str(MODEL), "--ids", write_ids(tmp_path / "p.i32", ids), "--backend", BACKEND,
                "--max-tokens", str(max(96, len(sample["completion_ids"]))), "--stop-at-eos")
    new = [int(x) for x in out.split()]
    golden = sample["completion_ids"]
    if BACKEND != "cpu" and new != golden:
        # bf16 activations (CUDA) may resolve a tie of the float32 reference the other way; after
        # that token the answers cannot be compared. Accepted only where the f32 CPU backend's
        # own top-2 margin at that position is below TIE_LOGITS, with the CUDA token one of the two.
        j = next((i for i, (a, b) in enumerate(zip(new, golden)) if a != b), min(len(new), len(golden)))
        assert j < min(len(new), len(golden)), f"answers differ in length only: {len(new)} vs {len(golden)} ids"
        seq = ids + golden[:j]
        tansy("logits", "--model", str(MODEL), "--ids", write_ids(tmp_path / "tf.i32", seq), "--backend", "cpu",
              "--out", str(tmp_path / "tf.f32"))
        row = np.fromfile(tmp_path / "tf.f32", dtype="<f4").reshape(len(seq), -1)[-1]
        top2 = np.argsort(row)[::-1][:2]
        margin = float(row[top2[0]] - row[top2[1]])
        print(f"\n  {BACKEND}: diverges at completion index {j} ({new[j]} vs golden {golden[j]}); "
              f"f32 CPU top-2 {top2.tolist()} margin {margin:.4f} logits")
        assert top2[0] == golden[j], "the golden answer is not the f32 CPU backend's own argmax there"
        assert margin < TIE_LOGITS and new[j] in top2.tolist(), (
            f"{BACKEND} diverges at index {j} ({new[j]} vs {golden[j]}) where the reference is decisive "
            f"(margin {margin:.4f} >= {TIE_LOGITS})")
        return
    assert new == golden
    text = tansy("detokenize", "--model", str(MODEL), stdin=" ".join(str(t) for t in new if t not in EOS).encode())
    assert text.decode("utf-8") == sample["completion"]


@pytest.mark.skipif(not SAMPLE.exists(), reason="no held-out sample")
def test_teacher_forced_agreement_with_transformers(tmp_path):
    from agreement import tansy_logits
    sample = np.load(SAMPLE)
    vocab = json.loads((MODEL / "config.json").read_text())["text_config"]["vocab_size"]
    agree = total = 0
    for ids, ref in zip(sample["ids"][:AGREEMENT_WINDOWS], sample["hf_argmax"][:AGREEMENT_WINDOWS]):
        logits = tansy_logits(str(TANSY), str(MODEL), BACKEND, ids, vocab, str(tmp_path))
        assert np.isfinite(logits).all()
        agree += int((logits.argmax(-1) == ref).sum())
        total += len(ids)
    print(f"\ntansy-demo teacher-forced top-1 agreement ({BACKEND}): {100 * agree / total:.2f}% of {total}")
    assert agree >= 0.995 * total, f"{agree}/{total} positions agree"


def generate_timed(ids_path, n):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = tansy("generate", "--model", str(MODEL), "--ids", ids_path, "--backend", BACKEND, "--max-tokens", str(n))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert len(out.split()) == n
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_decode_speed_benchmark(tmp_path):
    """Benchmark printout, not a pass/fail criterion: decode tok/s of the demo model. The difference
    between a 1-token and a (1 + N)-token run removes model loading and prefill."""
    n = 256
    ids_path = write_ids(tmp_path / "p.i32", EVAL["samples"][0]["prompt_ids"])
    runs = [(generate_timed(ids_path, 1), generate_timed(ids_path, 1 + n)) for _ in range(3)]
    wall = min(b[0] - a[0] for a, b in runs)
    cpu = min(b[1] - a[1] for a, b in runs)
    print(f"\ntansy-demo decode on {BACKEND}: {n / wall:.1f} tok/s wall-clock, {n / cpu:.1f} tok/s per CPU-second "
          f"({os.cpu_count()} CPUs, best of 3)")
