#!/usr/bin/env bash
# A/B timing of several tansy binaries (or one binary under several environments) in one device
# call: `tansy bench` at the same contexts, the arms alternating inside each round, so that drift
# of the card spreads over all of them (docs/PERFORMANCE.md's change log is measured this way).
#
#   tools/device/ab.sh pack OUT.tar.xz NAME=BINARY ...   # here: stripped binaries as tansy_NAME,
#                                                        # the shared libraries the image lacks
#   tools/device/ab.sh run OUT.tar.xz ARM ...            # there (carry OUT.tar.xz)
#
# An ARM is LABEL=NAME[,VAR=VALUE...]: binary tansy_NAME with those environment variables (an
# A/B switch of a temporary build, say). Every arm's greedy and sampled digests must equal the
# first arm's unless the arm's label ends in "~" (a timing-only arm that changes the tokens).
#
# run writes $OUT/ab.log (every bench's output) and prints one line per bench and a summary: the
# decode tok/s of each round, their median and its ratio to the first arm's. Knobs (environment):
# CONTEXTS (4096), ROUNDS (2), STAGES (labels whose arm also runs once with --stages, its log in
# $OUT/stages-LABEL.log), SYNTH_DIR (/dev/shm/tansy-synth; reused when it holds a checkpoint),
# DEADLINE_S (480: no round starts after it).
# Pack many near-identical binaries in one tarball: xz over the uncompressed tar with a dictionary
# larger than a binary finds their common bytes (three binaries and the libraries: ~15 MB).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=tools/device/common.sh
. tools/device/common.sh

pack() {
  set -e
  local out=$1
  shift
  local dir
  dir=$(mktemp -d)
  mkdir -p "$dir/lib"
  for spec in "$@"; do
    local name=${spec%%=*} bin=${spec#*=}
    [[ $spec == *=* && -x $bin ]] || { echo "ab.sh pack: '$spec' is not NAME=EXECUTABLE" >&2; exit 2; }
    cp "$bin" "$dir/tansy_$name"
    strip --strip-unneeded "$dir/tansy_$name"
    carry_libs "$bin" "$dir/lib"
  done
  build_commit >"$dir/COMMIT"
  tar -cf - -C "$dir" . | xz -9e -T1 --lzma2=preset=9e,dict=192MiB >"$out"
  rm -rf "$dir"
  echo "ab.sh pack: $out ($(du -h "$out" | cut -f1)): $*"
}

run() {
  local tarball=$1
  shift
  [ $# -ge 1 ] || { echo "ab.sh run: no arms" >&2; exit 2; }
  local t0 dev libs synth out
  t0=$(date +%s)
  out=${OUT:-/tmp/ab-out}
  mkdir -p "$out"
  dev=$(mktemp -d)
  tar -xJf "$tarball" -C "$dev" || { echo "ab.sh run: cannot unpack $tarball" >&2; exit 1; }
  libs=$dev/lib:/usr/local/cuda/lib64
  synth=${SYNTH_DIR:-/dev/shm/tansy-synth}
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "commit: $(cat "$dev/COMMIT")"
  local labels=() names=() envs=()
  for arm in "$@"; do
    local label=${arm%%=*} rest=${arm#*=}
    [[ $arm == *=* ]] || { echo "ab.sh run: '$arm' is not LABEL=NAME[,VAR=VALUE...]" >&2; exit 2; }
    local name=${rest%%,*} env=""
    [[ $rest == *,* ]] && env=${rest#*,}
    [ -x "$dev/tansy_$name" ] || { echo "ab.sh run: no binary tansy_$name in $tarball" >&2; exit 2; }
    labels+=("$label") names+=("$name") envs+=("${env//,/ }")
  done
  if [ ! -f "$synth/config.json" ]; then
    LD_LIBRARY_PATH=$libs timeout 90 "$dev/tansy_${names[0]}" synth --out "$synth" --seed 1 >/tmp/ab-synth.log 2>&1 ||
      { tail -3 /tmp/ab-synth.log; exit 1; }
  fi
  echo "synth ready at $(($(date +%s) - t0)) s"
  local contexts=${CONTEXTS:-4096} rounds=${ROUNDS:-2} deadline=${DEADLINE_S:-480}
  : >"$out/ab.log"
  for ((r = 1; r <= rounds; ++r)); do
    if (($(date +%s) - t0 > deadline)); then
      echo "deadline: round $r not started"
      break
    fi
    for i in "${!labels[@]}"; do
      local log=/tmp/ab-${labels[$i]}-$r.log
      # shellcheck disable=SC2086  # the arm's VAR=VALUE words
      env ${envs[$i]} LD_LIBRARY_PATH="$libs" timeout 120 "$dev/tansy_${names[$i]}" bench --model "$synth" \
        --contexts "$contexts" --rounds 1 --no-ceilings --commit "${labels[$i]}" >"$log" 2>&1
      local rc=$?
      { echo "== ${labels[$i]} round $r (exit $rc)"; cat "$log"; } >>"$out/ab.log"
      echo "${labels[$i]} r$r exit $rc: $(grep -E '^ +[0-9]+ ' "$log" | head -1 | tr -s ' ') |" \
        "$(grep -iE 'sampled' "$log" | head -1 | sed 's/.*decode/decode/')"
    done
  done
  for label in ${STAGES:-}; do
    for i in "${!labels[@]}"; do
      [ "${labels[$i]}" = "$label" ] || continue
      # shellcheck disable=SC2086
      env ${envs[$i]} LD_LIBRARY_PATH="$libs" timeout 120 "$dev/tansy_${names[$i]}" bench --model "$synth" \
        --contexts "${contexts%%,*}" --rounds 1 --stages --no-ceilings --commit "$label" >"$out/stages-$label.log" 2>&1
      echo "stages $label: exit $?"
      grep -E "^step detail" "$out/stages-$label.log" | sed 's/step detail step: //'
    done
  done
  python3 tools/device/ab_summary.py "$out/ab.log" "${labels[@]}"
  local rc=$?
  rm -rf "$dev"
  echo "ab.sh run: done in $(($(date +%s) - t0)) s"
  return $rc
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 pack OUT.tar.xz NAME=BINARY... | run OUT.tar.xz LABEL=NAME[,VAR=VALUE...]..." >&2; exit 2 ;;
esac
