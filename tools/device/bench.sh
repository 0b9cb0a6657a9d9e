#!/usr/bin/env bash
# The benchmark run on the GPU machine, in one device call (docs/BENCHMARK.md, docs/PERFORMANCE.md).
#
#   tools/device/bench.sh prepare   # here: CUDA build, then stripped binaries + the shared
#                                   # libraries the device image lacks + COMMIT, packed into
#                                   # out/device.tar.xz (git-ignored; xz keeps ICU's 31 MB data
#                                   # library and the binaries inside the 64 MiB carry limit)
#   tools/device/bench.sh run       # there (carry: out/device.tar.xz): synth -> GPU tests ->
#                                   # tansy bench (all contexts, 2 rounds, per-stage breakdown)
#                                   # -> tansy serve latency, then concurrency (and multi-turn), through HTTP
#                                   # -> HF peer arm
#
# `run` writes at most 12 files to $OUT: env.txt synth.log gpu_tests.log gpu_tests.json bench.log
# bench.json server.log server_latency.json concurrency.json multiturn.json peer.log peer.json. The GPU tests'
# result is read from their gtest JSON report (tools/device/gtest_summary.py). It keeps to a total deadline (DEADLINE_S,
# default 540 s) and gives each step what is left, so a slow step shortens the later ones instead
# of losing every result.
# The server step starts `tansy serve` on the synthetic checkpoint (CUDA, --prefix-cache 0 so
# that every request prefills its whole prompt, as tansy bench does), waits for /health and runs
# tools/http_latency.py: streamed TTFT and inter-token latency at SERVER_CONTEXTS against
# bench.json (issue 5: within 5%). Then, on the same server, tools/concurrency_bench.py (issue 16,
# docs/BENCHMARK.md "Concurrency (issue 16)"): CONCURRENCY_LEVELS requests sent together, both
# workloads, 4,096-token prompts, 256 new tokens, into concurrency.json (its table goes to stdout).
# It runs only with CONCURRENCY=1: one call does not hold the GPU tests, the whole contract, the
# latency step, the peer and it (measured at ad86d88: with it, the GPU tests and the bench ran out
# of their caps). Its share of the time is CONCURRENCY_CAP (default 120 s), reserved from tansy bench's; the tool
# gets that as --time-budget-s, skips the levels that its previous level's time per request says
# will not fit (recorded as skipped in the JSON) and cuts off a stream that outlasts it (counted as
# failed). While the server runs one request at a time, a level's time grows with its number of
# requests (1 + 4 + 16 + 64 per workload), so with the default cap the largest levels may be
# skipped; a concurrency-focused call sets CONCURRENCY=1 SKIP_GPU_TESTS=1 SKIP_BENCH=1 SKIP_PEER=1
# CONCURRENCY_CAP=400.
# With MULTITURN=1, tools/multiturn_bench.py (issue 22, docs/BENCHMARK.md "Multi-turn (issue 22)")
# runs last on the same server: a 4,096-token prefix, turns of +64, +256, +1,024 tokens, 16 new
# tokens each, MULTITURN_ROUNDS (3) conversations, into multiturn.json. Its share is MULTITURN_CAP
# (default 90 s), added to the server step's time (and reserved from tansy bench's). The server's
# --prefix-cache 0 makes it the cache-off side (cold TTFT, no turn cached); SERVER_ARGS="--prefix-cache auto"
# (the server's default) gives the cache-on side. The JSON's label records SERVER_ARGS.
# The server gets --max-queue and --max-connections-per-client above the largest level (its
# defaults, 16 and 64, would answer 503 at 64), before SERVER_ARGS, which may override them.
# With --prefix-cache 0 the shared-prefix workload gets no prefix reuse; SERVER_ARGS can set
# --prefix-cache N, which http_latency.py then flags (its repeated prompts hit the cache).
# The server is always stopped afterwards.
# Knobs (environment): BENCH_CONTEXTS (default: all ten), BENCH_ROUNDS (2), PEER_CONTEXTS
# (256,512,1024,2048,4096), SERVER_CONTEXTS (256,4096), SERVER_ROUNDS (5), SERVER_ARGS (extra
# `tansy serve` flags, e.g. "--prefill-chunk 4096"), SERVER_SETTINGS (greedy,qwen,qwen_logprobs,t1,presence,json_schema:
# tools/http_latency.py --settings), GPU_TESTS_CAP (seconds), GPU_TESTS_FILTER (a --gtest_filter), SKIP_GPU_TESTS=1, SKIP_PEER=1, SKIP_BENCH=1,
# SKIP_SERVER=1, SKIP_CONCURRENCY=1, MULTITURN=1, MULTITURN_CAP (90), MULTITURN_ROUNDS (3), CONCURRENCY_LEVELS (1,4,16,64), CONCURRENCY_CAP (seconds, 120),
# CONCURRENCY_SETTINGS (greedy; qwen: tools/concurrency_bench.py --settings),
# SYNTH_DIR (/dev/shm/tansy-synth), KEEP_SYNTH=1 (leave it for a later run in the same
# call), REUSE_SYNTH=1 (use the one there).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=tools/device/common.sh
. tools/device/common.sh
DEV=out/device

prepare() {
  set -e
  BUILD_DIR=${BUILD_DIR:-build-bench} scripts/build
  local b=${BUILD_DIR:-build-bench}
  rm -rf "$DEV" && mkdir -p "$DEV/lib"
  cp "$b/tansy" "$DEV/"
  [ -x "$b/tansy_gpu_tests" ] && cp "$b/tansy_gpu_tests" "$DEV/"
  for bin in "$DEV"/tansy "$DEV"/tansy_gpu_tests; do
    if [ -x "$bin" ]; then carry_libs "$bin" "$DEV/lib"; fi
  done
  strip --strip-unneeded "$DEV"/tansy*
  build_commit >"$DEV/COMMIT"
  tar -cJf out/device.tar.xz -C "$DEV" .
  du -sh "$DEV" out/device.tar.xz
  # shellcheck disable=SC2012  # a listing for the eye only
  echo "prepared out/device.tar.xz (commit $(cat "$DEV/COMMIT")): $(ls "$DEV" "$DEV/lib" | tr '\n' ' ')"
}

# tansy serve on the synthetic checkpoint + tools/http_latency.py + tools/concurrency_bench.py,
# within $1 seconds, the last $2 of them the concurrency step's (0: no concurrency step) and
# after those the last $3 the multi-turn step's (0: none); the server is stopped on every path
# (TERM, then KILL).
server_step() {
  local cap=$1 conc_cap=${2:-0} mt_cap=${3:-0} port=${SERVER_PORT:-8011}
  local end=$(( $(date +%s) + cap ))
  local levels=${CONCURRENCY_LEVELS:-1,4,16,64} maxc=16
  for c in ${levels//,/ }; do [ "$c" -gt "$maxc" ] 2>/dev/null && maxc=$c; done
  # Room for every request of the largest level at once, plus /metrics samples.
  local room=$((maxc + 8))
  # shellcheck disable=SC2086  # SERVER_ARGS is a list of flags
  env LD_LIBRARY_PATH="$tld" "$T" serve --model "$synth_dir" --backend cuda --port "$port" --max-seq 8192 \
    --prefix-cache 0 --max-running "$maxc" --max-queue "$room" --max-connections "$((room > 256 ? room : 256))" \
    --max-connections-per-client "$room" ${SERVER_ARGS:-} >"$OUT/server.log" 2>&1 &
  local pid=$! healthy='' t0
  t0=$(date +%s)
  while [ "$(date +%s)" -lt $((end - 10)) ]; do
    kill -0 "$pid" 2>/dev/null || break
    if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$port/health" 2>/dev/null; then healthy=1; break; fi
    sleep 0.5
  done
  if [ -n "$healthy" ]; then
    echo "server healthy after $(( $(date +%s) - t0 )) s"
    local bench_flag=()
    [ -f "$OUT/bench.json" ] && bench_flag=(--bench "$OUT/bench.json")
    local lat_left=$((end - conc_cap - mt_cap - $(date +%s)))
    [ "$lat_left" -lt 5 ] && lat_left=5
    timeout "$lat_left" python3 tools/http_latency.py --url "http://127.0.0.1:$port" \
      --contexts "${SERVER_CONTEXTS:-256,4096}" --rounds "${SERVER_ROUNDS:-5}" --model-dir "$synth_dir" \
      --settings "${SERVER_SETTINGS:-greedy,qwen,qwen_logprobs,t1,presence,json_schema}" \
      "${bench_flag[@]}" --json "$OUT/server_latency.json"
    echo "http_latency exit $?"
    if [ "$conc_cap" -gt 0 ]; then
      # The tool stops itself within its budget; the outer timeout is a backstop (its JSON is
      # rewritten after every level, so what finished survives).
      local budget=$((end - mt_cap - $(date +%s) - 5))
      echo "== concurrency through HTTP (levels $levels, budget $budget s)"
      if [ "$budget" -lt 15 ]; then
        echo "device/bench.sh: no time left for the concurrency step"
      else
        timeout $((budget + 3)) python3 tools/concurrency_bench.py --url "http://127.0.0.1:$port" \
          --model-dir "$synth_dir" --concurrency "$levels" --time-budget-s "$budget" --metrics-interval 0.5 \
          ${CONCURRENCY_SETTINGS:+--settings "$CONCURRENCY_SETTINGS"} \
          --json "$OUT/concurrency.json"
        echo "concurrency_bench exit $?"
      fi
    fi
    if [ "$mt_cap" -gt 0 ]; then
      local mt_budget=$((end - $(date +%s) - 5))
      echo "== multi-turn through HTTP (budget $mt_budget s)"
      if [ "$mt_budget" -lt 15 ]; then
        echo "device/bench.sh: no time left for the multi-turn step"
      else
        timeout $((mt_budget + 3)) python3 tools/multiturn_bench.py --url "http://127.0.0.1:$port" \
          --model-dir "$synth_dir" --rounds "${MULTITURN_ROUNDS:-3}" --time-budget-s "$mt_budget" \
          --label "SERVER_ARGS=${SERVER_ARGS:-}" --json "$OUT/multiturn.json"
        echo "multiturn_bench exit $?"
      fi
    fi
  elif kill -0 "$pid" 2>/dev/null; then
    echo "device/bench.sh: tansy serve not healthy within the step's time"
  else
    wait "$pid"; echo "device/bench.sh: tansy serve exited ($?) before becoming healthy"
  fi
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  tail -5 "$OUT/server.log"
}

run() {
  [ -n "${CONCURRENCY:-}" ] || SKIP_CONCURRENCY=1
  : "${OUT:?OUT must name the output folder}"
  if [ -f out/device.tar.xz ]; then rm -rf "$DEV" && mkdir -p "$DEV" && tar -xJf out/device.tar.xz -C "$DEV" || return 1; fi
  [ -x "$DEV/tansy" ] || { echo "device/bench.sh: $DEV/tansy missing (run 'prepare' here and carry out/device.tar.xz)"; return 1; }
  local start now left
  start=$(date +%s)
  local deadline=${DEADLINE_S:-540}
  remaining() { now=$(date +%s); echo $((deadline - (now - start))); }
  local synth_dir=${SYNTH_DIR:-/dev/shm/tansy-synth}
  local commit
  commit=$(cat "$DEV/COMMIT" 2>/dev/null || echo unknown)
  export TANSY_COMMIT=$commit HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  local cublas_dir
  cublas_dir=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(os.path.dirname(nvidia.cublas.__file__), "lib"))' 2>/dev/null || true)
  # Only tansy's processes see the carried Debian libraries (python3 keeps the image's own).
  local tld="$PWD/$DEV/lib:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${cublas_dir:+:$cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local T="$DEV/tansy"
  tenv() { env LD_LIBRARY_PATH="$tld" "$@"; }

  {
    echo "commit $commit"; date -u; uname -a; nproc; free -g; df -h /dev/shm
    nvidia-smi; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
    echo "== ldd"; tenv ldd "$T"
  } >"$OUT/env.txt" 2>&1
  if tenv ldd "$T" | grep -q "not found"; then
    echo "device/bench.sh: missing libraries for $T:"; tenv ldd "$T" | grep "not found"; return 1
  fi

  if [ -n "${REUSE_SYNTH:-}" ] && [ -f "$synth_dir/config.json" ]; then
    echo "== synth: reusing $synth_dir"
  else
    echo "== synth ($(remaining) s left)"
    rm -rf "$synth_dir"
    timeout 120 env LD_LIBRARY_PATH="$tld" "$T" synth --out "$synth_dir" --seed 1 >"$OUT/synth.log" 2>&1
    local rc=$?; cat "$OUT/synth.log"
    [ $rc -eq 0 ] || { echo "device/bench.sh: synth failed ($rc)"; return 1; }
  fi

  if [ -z "${SKIP_GPU_TESTS:-}" ] && [ -x "$DEV/tansy_gpu_tests" ]; then
    left=$(remaining); local cap=$(( left > 480 ? 90 : 45 ))
    [ -n "${GPU_TESTS_CAP:-}" ] && cap=$GPU_TESTS_CAP
    echo "== GPU tests (cap $cap s, $left s left)"
    TANSY_SYNTH_DIR="$synth_dir" timeout "$cap" env LD_LIBRARY_PATH="$tld" "$DEV/tansy_gpu_tests" \
      ${GPU_TESTS_FILTER:+--gtest_filter=$GPU_TESTS_FILTER} --gtest_output="json:$OUT/gpu_tests.json" \
      >"$OUT/gpu_tests.log" 2>&1
    echo "gpu tests exit $?"; python3 tools/device/gtest_summary.py "$OUT/gpu_tests.json"
  fi

  if [ -z "${SKIP_BENCH:-}" ]; then
    left=$(remaining)
    # Leave the peer arm ~150 s, the server step ~75 s (five sampling settings) and the concurrency
    # step CONCURRENCY_CAP when they are to run.
    local bench_cap=$((left - 10))
    [ -z "${SKIP_PEER:-}" ] && bench_cap=$((bench_cap - 140))
    [ -z "${SKIP_SERVER:-}" ] && bench_cap=$((bench_cap - 75))
    [ -z "${SKIP_SERVER:-}" ] && [ -z "${SKIP_CONCURRENCY:-}" ] && bench_cap=$((bench_cap - ${CONCURRENCY_CAP:-120}))
    [ -z "${SKIP_SERVER:-}" ] && [ -n "${MULTITURN:-}" ] && bench_cap=$((bench_cap - ${MULTITURN_CAP:-90}))
    [ "$bench_cap" -lt 30 ] && bench_cap=30
    echo "== tansy bench (cap $bench_cap s)"
    local ctx_flag=()
    [ -n "${BENCH_CONTEXTS:-}" ] && ctx_flag=(--contexts "$BENCH_CONTEXTS")
    timeout "$bench_cap" env LD_LIBRARY_PATH="$tld" "$T" bench --model "$synth_dir" "${ctx_flag[@]}" --rounds "${BENCH_ROUNDS:-2}" \
      --json "$OUT/bench.json" --commit "$commit" --stages --child-timeout 150 >"$OUT/bench.log" 2>&1
    echo "bench exit $?"
  fi

  if [ -z "${SKIP_SERVER:-}" ]; then
    left=$(remaining)
    local avail=$((left - 10))
    [ -z "${SKIP_PEER:-}" ] && avail=$((left - 150))
    local srv_cap=$avail
    [ "$srv_cap" -gt 120 ] && srv_cap=120
    local conc_cap=0
    if [ -z "${SKIP_CONCURRENCY:-}" ]; then
      conc_cap=$((avail - srv_cap))
      [ "$conc_cap" -gt "${CONCURRENCY_CAP:-120}" ] && conc_cap=${CONCURRENCY_CAP:-120}
      [ "$conc_cap" -lt 20 ] && conc_cap=0
    fi
    echo "== tansy serve latency through HTTP (cap $srv_cap s, concurrency $conc_cap s, $left s left)"
    if [ "$srv_cap" -lt 20 ]; then
      echo "device/bench.sh: no time left for the server step" | tee "$OUT/server.log"
    else
      local mt_cap=0
      if [ -n "${MULTITURN:-}" ]; then
        mt_cap=$((avail - srv_cap - conc_cap))
        [ "$mt_cap" -gt "${MULTITURN_CAP:-90}" ] && mt_cap=${MULTITURN_CAP:-90}
        [ "$mt_cap" -lt 20 ] && mt_cap=0
      fi
      server_step $((srv_cap + conc_cap + mt_cap)) "$conc_cap" "$mt_cap"
    fi
  fi

  if [ -z "${SKIP_PEER:-}" ]; then
    left=$(( $(remaining) - 5 ))
    echo "== HF transformers peer ($left s left)"
    if [ "$left" -gt 60 ]; then
      timeout "$left" python3 tools/peer_hf.py --model "$synth_dir" --contexts "${PEER_CONTEXTS:-256,512,1024,2048,4096}" \
        --rounds 2 --json "$OUT/peer.json" --commit "$commit" --time-budget-s $((left - 30)) >"$OUT/peer.log" 2>&1
      echo "peer exit $?"; tail -8 "$OUT/peer.log"
    else
      echo "device/bench.sh: no time left for the peer arm" | tee "$OUT/peer.log"
    fi
  fi
  [ -n "${KEEP_SYNTH:-}" ] || rm -rf "$synth_dir"
  echo "== tansy bench table"
  [ -f "$OUT/bench.log" ] && grep -v "^tansy bench: round" "$OUT/bench.log" | tail -60
  # The device tool brings back at most 8 files from $OUT: the logs travel as one archive beside
  # the JSON results.
  (
    cd "$OUT" || exit
    logs=()
    for f in ./*.log env.txt; do [ -f "$f" ] && logs+=("${f#./}"); done
    if [ "${#logs[@]}" -gt 0 ]; then tar -cJf logs.tar.xz -- "${logs[@]}" && rm -f -- "${logs[@]}"; fi
  )
  echo "device/bench.sh: done in $(( $(date +%s) - start )) s; in \$OUT:" "$OUT"/*
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: tools/device/bench.sh prepare|run" >&2; exit 2 ;;
esac
