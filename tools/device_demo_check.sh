#!/usr/bin/env bash
# On the GPU machine (carry out/device.tar.xz from `tools/device_bench.sh prepare`): the bundled
# demo model's checks on the CUDA backend — the CI greedy-answer test and the top-1 agreement with
# transformers on held-out text. Writes demo_cuda_pytest.log and agreement_cuda.json to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
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
echo "commit $(cat $DEV/COMMIT)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_demo_model.py 2>&1 | tee "$OUT/demo_cuda_pytest.log" | tail -15
timeout 120 python3 tools/demo/agreement.py --tansy "$TANSY_BIN" --tansy-backend cuda --saved-reference \
  --out "$OUT/agreement_cuda.json" 2>&1 | tail -8
