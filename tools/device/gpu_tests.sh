#!/usr/bin/env bash
# Runs every GPU test on a machine with an H200, from a copy of the repository that holds a
# built tansy_gpu_tests (BIN, default build-cuda/tansy_gpu_tests; built elsewhere with
# `cmake --build build-cuda --target tansy_gpu_tests`). Set LIBDIR to a folder of shared
# libraries the machine lacks (libfmt.so.9). The full output goes to $OUT/log (default
# /tmp/out); each group's gtest report to $OUT/<group>.json, summarised from that JSON by
# tools/device/gtest_summary.py. Exits 1 when any group failed, crashed or timed out.
# The synthetic full-size checkpoint is written to /dev/shm/synth by the first Synthetic test.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export LD_LIBRARY_PATH=${LIBDIR:+$LIBDIR:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TANSY_SOURCE_DIR=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T=${BIN:-build-cuda/tansy_gpu_tests}
status=0

# group NAME SECONDS COMMAND...: runs COMMAND (ending in the test binary and its filter) with a
# JSON report, appends its output to the log and prints the summary of the report.
group() {
  local name=$1 cap=$2
  shift 2
  echo "== $name" | tee -a "$OUT/log"
  rm -f "$OUT/$name.json"
  timeout "$cap" "$@" --gtest_output="json:$OUT/$name.json" >>"$OUT/log" 2>&1
  local rc=$?
  echo "$name: exit $rc$([ $rc -eq 124 ] && echo " (timed out after $cap s)")" | tee -a "$OUT/log"
  python3 tools/device/gtest_summary.py "$OUT/$name.json" | tee -a "$OUT/log"
  local summary_rc=${PIPESTATUS[0]}
  if [ "$summary_rc" -ne 0 ] || [ "$rc" -ne 0 ]; then status=1; fi
}

nvidia-smi -L 2>&1 | tee "$OUT/log"
group kernels 300 "$T" --gtest_filter='Matvec.*:Gemm.*:Attention.*:Gdn.*:Moe.*:Norm.*:Head.*'
group models 90 "$T" --gtest_filter='*Golden*:ModelErrors.*'
group synthetic_timing 100 env TANSY_SYNTH_DIR=/dev/shm/synth "$T" --gtest_filter='Synthetic.Timing'
group synthetic_cuda_vs_cpu 120 env TANSY_SYNTH_DIR=/dev/shm/synth "$T" --gtest_filter='Synthetic.CudaVsCpu*'
# a 4,160-token prompt whole, in pieces and token by token (~4,200 decode steps)
group synthetic_split 90 env TANSY_SYNTH_DIR=/dev/shm/synth "$T" --gtest_filter='Synthetic.WholePiecesTokenByToken'
# the device sampler against the host's, the f32 plan
group sampling_f32 120 env TANSY_SYNTH_DIR=/dev/shm/synth "$T" --gtest_filter='Sample.*:SampledDecode.*:F32*:-Sample.Timing'
# batch invariance of the batched decode step (continuous batching) against each sequence alone
group batch 60 env TANSY_SYNTH_DIR=/dev/shm/synth "$T" --gtest_filter='Batch.*:Step.*'
# memcheck (tiny golden, GEMV path and decode graph): a memory error is exit 99, a test failure is
# in the report.
group memcheck 30 compute-sanitizer --tool memcheck --print-limit 5 --error-exitcode 99 "$T" \
  --gtest_filter='RealDims/Golden.LogitsGemvPath/0:RealDims/Golden.GreedyGraphMatchesEagerAndGolden/0'
echo "gpu_tests: $([ $status -eq 0 ] && echo "all groups passed" || echo "SOME GROUPS FAILED (see above and $OUT/log)")"
exit $status
