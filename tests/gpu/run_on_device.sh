#!/bin/bash
# Runs every GPU test on a machine with an H200, from a copy of the repository that holds a
# built tansy_gpu_tests (BIN, default build-cuda/tansy_gpu_tests; built elsewhere with
# `cmake --build build-cuda --target tansy_gpu_tests`). Set LIBDIR to a folder of shared
# libraries the machine lacks (libfmt.so.9). Logs go to $OUT/log (default /tmp/out).
# The synthetic full-size checkpoint is written to /dev/shm/synth by the first Synthetic test.
set -o pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=${LIBDIR:+$LIBDIR:}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export TANSY_SOURCE_DIR=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T=${BIN:-build-cuda/tansy_gpu_tests}
nvidia-smi -L 2>&1 | tee "$OUT/log"
echo "== kernels" | tee -a "$OUT/log"
timeout 45 $T --gtest_filter='DecodeKernels.*:PrefillKernels.*-PrefillKernels.Timing' 2>&1 | tee -a "$OUT/log" | grep -E "rel err|FAILED|OK \]|Failure|error|argmax|route|PASSED" | tail -90
echo "== models" | tee -a "$OUT/log"
timeout 45 $T --gtest_filter='*Golden*:ModelErrors.*' 2>&1 | tee -a "$OUT/log" | grep -E "FAILED|OK \]|Failure|error|top-1|worst|greedy|refused|rel err|PASSED" | tail -60
echo "== synthetic" | tee -a "$OUT/log"
TANSY_SYNTH_DIR=/dev/shm/synth timeout 100 $T --gtest_filter='Synthetic.Timing' 2>&1 | tee -a "$OUT/log" | grep -E "FAILED|OK \]|Failure|error|TIMING|wrote|PASSED" | tail -40
TANSY_SYNTH_DIR=/dev/shm/synth timeout 60 $T --gtest_filter='Synthetic.CudaVsCpu*' 2>&1 | tee -a "$OUT/log" | grep -E "FAILED|OK \]|Failure|error|top-1|worst|PASSED" | tail -20
echo "== memcheck (tiny golden, GEMV path and decode graph)" | tee -a "$OUT/log"
timeout 30 compute-sanitizer --tool memcheck --print-limit 5 $T --gtest_filter='RealDims/Golden.LogitsGemvPath/0:RealDims/Golden.GreedyGraphMatchesEagerAndGolden/0' 2>&1 | tee -a "$OUT/log" | grep -E "ERROR SUMMARY|Invalid|FAILED|PASSED|OK \]" | head -20
