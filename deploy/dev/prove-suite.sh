#!/usr/bin/env bash
# The busy-machine proof: the whole suite (`make test`) RUNS times in a row with a CPU hog on
# one core (`stress-ng --cpu 1`), then RUNS times on a quiet machine; every run must be green. Prints one line
# per run and a summary; each run's output is kept under $OUT (default .prove/<timestamp>/).
# Usage: deploy/dev/prove-suite.sh [RUNS]   (or `make prove RUNS=3`; MODES="busy quiet" selects the halves)
set -uo pipefail
cd "$(dirname "$0")/../.."
RUNS="${1:-${RUNS:-3}}"
MODES="${MODES:-busy quiet}"
OUT="${OUT:-.prove/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"

if ! command -v stress-ng >/dev/null 2>&1; then
  echo "robobus: installing stress-ng (the CPU hog of the busy runs)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends stress-ng >/dev/null \
    || { DEBIAN_FRONTEND=noninteractive $SUDO apt-get update -qq \
         && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends stress-ng >/dev/null; }
fi

hog=""
stop_hog() { [ -n "$hog" ] && kill "$hog" 2>/dev/null && wait "$hog" 2>/dev/null; hog=""; }
trap stop_hog EXIT
trap 'stop_hog; exit 130' INT TERM  # stop here: a signalled proof run is no proof

failed=0
summary=()
for mode in $MODES; do
  for i in $(seq 1 "$RUNS"); do
    log="$OUT/$mode-$i.log"
    if [ "$mode" = busy ]; then
      stress-ng --cpu 1 --timeout 0 --quiet & hog=$!
    fi
    start=$(date +%s)
    CI=true make -s test </dev/null >"$log" 2>&1; rc=$?  # as CI runs it: no stdin, CI set
    secs=$(( $(date +%s) - start ))
    stop_hog
    tally=$(grep -Eo '[0-9]+ (passed|failed|skipped|errors?)' "$log" | tail -4 | paste -sd, -)
    line="$mode run $i: $([ $rc -eq 0 ] && echo green || echo RED) in ${secs}s (${tally:-no pytest summary}; load $(cut -d' ' -f1-3 /proc/loadavg)) log: $log"
    echo "$line"; summary+=("$line")
    [ $rc -eq 0 ] || failed=$((failed + 1))
  done
done
echo "== $(( ${#summary[@]} - failed )) of ${#summary[@]} runs green"
printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
[ $failed -eq 0 ]
