#!/usr/bin/env bash
# Trains, exports and evaluates tansy-demo in one go, then packs the results into $OUT.
# Run from the repository root on the GPU machine, with .demo_data/ carried along
# (tools/demo/build_data.py makes it where the Debian packages are):
#   MINUTES=4.5 tools/device/demo_train.sh
# Writes to $OUT (at most 8 files): tansy-demo.tar.gz (models/tansy-demo/), loss.png, loss.csv,
# train_summary.json, eval.json (with the 200-word definition score), demo_heldout.npz (the
# teacher-forced agreement sample with transformers' argmax, for tests/data/), run.log.
# Environment: MINUTES (training budget, default 4.5), PYTHON (default python3), OUT (default out/demo-run),
# EXTRA_TRAIN_ARGS (passed to train.py, e.g. for the CPU smoke test), EVAL_ARGS (passed to evaluate.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
MINUTES=${MINUTES:-4.5}
OUT=${OUT:-out/demo-run}
WORK=out/demo
mkdir -p "$OUT" "$WORK"
# No network on the GPU machine: never wait for the Hugging Face hub (kernel look-ups).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
: > "$LOG"
start=$(date +%s)
{
  echo "== $(date -u) on $(hostname); $($PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())')"
  if [ ! -f .demo_data/train.bin ]; then echo "demo_train: .demo_data/ is missing (carry it)"; exit 2; fi
  echo "== train ($MINUTES min)"
  # shellcheck disable=SC2086
  $PY tools/demo/train.py --data .demo_data --out "$WORK" --minutes "$MINUTES" ${EXTRA_TRAIN_ARGS:-}
  echo "== export ($(( $(date +%s) - start )) s)"
  png=()
  if [ -f "$WORK/loss.png" ]; then png=(--loss-png "$WORK/loss.png"); else echo "WARNING: no loss plot (matplotlib missing?)"; fi
  rm -rf models/tansy-demo
  $PY tools/demo/export.py --hf "$WORK/hf" --tokenizer .demo_data/tokenizer --meta .demo_data/meta.json \
      --out models/tansy-demo --summary "$WORK/train_summary.json" "${png[@]}"
  echo "== evaluate the 4-bit checkpoint ($(( $(date +%s) - start )) s)"
  # shellcheck disable=SC2086
  $PY tools/demo/evaluate.py --model models/tansy-demo --data .demo_data --out "$WORK/eval.json" ${EVAL_ARGS:-}
  echo "== agreement sample ($(( $(date +%s) - start )) s)"
  $PY tools/demo/agreement.py --make-sample --data .demo_data --model models/tansy-demo --sample "$WORK/demo_heldout.npz"
  $PY tools/demo/export.py --card-only --out models/tansy-demo --summary "$WORK/train_summary.json" \
      --eval "$WORK/eval.json"
  echo "== pack ($(( $(date +%s) - start )) s)"
  tar -czf "$OUT/tansy-demo.tar.gz" models/tansy-demo
  cp "$WORK/loss.csv" "$WORK/train_summary.json" "$WORK/eval.json" "$WORK/demo_heldout.npz" "$OUT/"
  if [ -f "$WORK/loss.png" ]; then cp "$WORK/loss.png" "$OUT/"; fi
  ls -l "$OUT" models/tansy-demo
  echo "== done in $(( $(date +%s) - start )) s"
} 2>&1 | grep --line-buffered -v "is falling back to its reference PyTorch implementation" | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
