#!/usr/bin/env bash
# On the GPU machine (carry out/device.tar.xz from `tools/device/bench.sh prepare`): the bundled
# demo model's checks on the CUDA backend — the CI greedy-answer test (CUDA's default plan for this
# model, auto -> f32), the top-1 agreement with transformers on held-out text on both plans (f32
# against transformers run live on the GPU, bf16 against the saved argmax), greedy decode speed on
# both plans, and `tansy serve` with no model argument answering the README's curl on CUDA, compared
# with the same server on the CPU backend. Writes demo_cuda_pytest.log, agreement_cuda_f32.json,
# agreement_cuda_bf16.json, demo_speed.txt and serve_{cuda,cpu}.{sse,log} to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
DEV=out/device
rm -rf "$DEV" && mkdir -p "$DEV" && tar -xJf out/device.tar.xz -C "$DEV" || exit 1
# Only tansy's own processes see the carried Debian libraries.
cat >"$DEV/tansy-wrapper" <<WRAP
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$PWD/$DEV/lib:/usr/local/cuda/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$PWD/$DEV/tansy" "\$@"
WRAP
chmod +x "$DEV/tansy-wrapper"
export TANSY_BIN="$PWD/$DEV/tansy-wrapper" TANSY_DEMO_BACKEND=cuda PYTHONUNBUFFERED=1
echo "commit $(cat "$DEV/COMMIT")"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_demo_model.py 2>&1 | tee "$OUT/demo_cuda_pytest.log" | tail -15
timeout 150 python3 tools/demo/agreement.py --tansy "$TANSY_BIN" --tansy-backend cuda --cuda-precision f32 \
  --out "$OUT/agreement_cuda_f32.json" 2>&1 | tail -4
timeout 120 python3 tools/demo/agreement.py --tansy "$TANSY_BIN" --tansy-backend cuda --cuda-precision bf16 \
  --saved-reference --out "$OUT/agreement_cuda_bf16.json" 2>&1 | tail -4

# Greedy decode speed of each plan: (1 + 256)-token minus 1-token runs, best of 3 (no model load or prefill).
python3 - "$TANSY_BIN" <<'PY' 2>&1 | tee "$OUT/demo_speed.txt"
import json, subprocess, sys, tempfile, time
import numpy as np
tansy, n = sys.argv[1], 256
ids = json.load(open("models/tansy-demo/training/eval.json"))["samples"][0]["prompt_ids"]
path = tempfile.mktemp(suffix=".i32"); np.asarray(ids, dtype="<i4").tofile(path)
def run(prec, k):
    t = time.perf_counter()
    subprocess.run([tansy, "generate", "--model", "models/tansy-demo", "--ids", path, "--backend", "cuda",
                    "--cuda-precision", prec, "--max-tokens", str(k)], check=True, capture_output=True)
    return time.perf_counter() - t
for prec in ("f32", "bf16"):
    best = min(run(prec, 1 + n) - run(prec, 1) for _ in range(3))
    print(f"tansy-demo greedy decode, CUDA {prec} plan: {n / best:.0f} tok/s (best of 3)")
PY

# The README's main job on this machine: serve with no model argument, then the README's curl.
serve_check() {  # backend port
  "$TANSY_BIN" serve --backend "$1" --port "$2" >"$OUT/serve_$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$2/health" >/dev/null && break; sleep 0.5; done
  curl -sN "http://127.0.0.1:$2/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "tansy-demo", "stream": true, "messages": [{"role": "user", "content": "What does the word apple mean?"}]}' \
    >"$OUT/serve_$1.sse"
  kill $pid; wait $pid 2>/dev/null
  echo "serve $1: $(grep -c '^data: ' "$OUT/serve_$1.sse") SSE events, last: $(tail -c 40 "$OUT/serve_$1.sse" | tr '\n' ' ')"
}
serve_check cuda 8011
serve_check cpu 8012
grep -E "backend auto|cuda precision|loading" "$OUT/serve_cuda.log"
python3 - "$OUT" <<'PY'
import json, sys
def text(p):
    out = ""
    for line in open(p):
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                d = c.get("delta", {})
                out += d.get("reasoning_content") or ""
                out += d.get("content") or ""
    return out
a, b = text(f"{sys.argv[1]}/serve_cuda.sse"), text(f"{sys.argv[1]}/serve_cpu.sse")
print(f"serve: CUDA and CPU streamed answers identical: {a == b} ({len(a)} characters)")
print(repr(a[:300]))
PY
