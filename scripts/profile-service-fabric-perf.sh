#!/usr/bin/env bash
# Sampled kernel profiles of two `fluxvm-lab perf` paths, diffed by kernel
# function (issue 36): e.g. sock-lb against sock-direct, ns-xdp against ns-tc.
#
#   scripts/profile-service-fabric-perf.sh [-bulk] [-seconds N] BASE OTHER
#
# For each path in turn: `fluxvm-lab perf -paths PATH -conns-only` (or both
# workloads with -bulk) runs alone with 2 s measurements; once its first
# round is done, `perf record -e cpu-clock -a -g` samples every CPU for N
# seconds (default 10) inside its rounds (after the checks and the lab's
# setup, which are left out). Then, per path, the kernel functions by
# self time, and `perf diff` of OTHER against BASE, by kernel function,
# sorted by the change of their share. cpu-clock needs no hardware
# counters. The machine's other processes are sampled too: run it on a
# quiet machine, and compare shares of kernel functions, not totals.
# Needs root, nft and perf (apt-get install linux-perf). Short runs only;
# not part of any test or CI run. Output and data in a directory under /tmp
# (printed; kept).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=10
wl=(-conns-only)
paths=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -bulk) wl=() ;;
    -seconds) secs=$2; shift ;;
    *) paths+=("$1") ;;
  esac
  shift
done
if [ ${#paths[@]} != 2 ]; then
  echo "profile-service-fabric-perf.sh: want two paths (BASE OTHER), e.g. sock-direct sock-lb" >&2
  exit 2
fi
if [ "$(id -u)" != 0 ]; then
  echo "profile-service-fabric-perf.sh: needs root" >&2
  exit 1
fi
command -v perf >/dev/null || { echo "profile-service-fabric-perf.sh: perf not found (apt-get install linux-perf)" >&2; exit 1; }
out=$(mktemp -d /tmp/fluxvm-profile.XXXXXX)
go build -o "$out/fluxvm-lab" ./cmd/fluxvm-lab
lab=
trap '[ -n "$lab" ] && kill -INT "$lab" 2>/dev/null; wait 2>/dev/null || true' EXIT INT TERM
# Rounds of one 2 s measurement (4 s with -bulk): enough to outlast the
# recording after round 1.
per=2
[ ${#wl[@]} = 0 ] && per=4
rounds=$(( secs / per + 3 ))
for path in "${paths[@]}"; do
  "$out/fluxvm-lab" perf -paths "$path" "${wl[@]}" -rounds "$rounds" -duration 2s -max-others 0 >"$out/$path.log" 2>&1 &
  lab=$!
  until grep -q '^round 1 ' "$out/$path.log"; do
    if ! kill -0 "$lab" 2>/dev/null; then
      echo "fluxvm-lab perf -paths $path ended before its rounds:" >&2
      tail -20 "$out/$path.log" >&2
      exit 1
    fi
    sleep 0.2
  done
  perf record -q -e cpu-clock -a -g -o "$out/$path.data" -- sleep "$secs" 2>"$out/$path.record.log"
  wait "$lab"
  lab=
  perf report -i "$out/$path.data" --no-children --sort sym --stdio -q -g none --percent-limit 0.3 2>/dev/null |
    grep -F '[k]' >"$out/$path.kernel.txt" || true
  echo "== $path: kernel functions by self share of all samples (top 15; $out/$path.kernel.txt)"
  head -15 "$out/$path.kernel.txt"
  grep -E '^(results|  *connections/s|  *conn CPU)' "$out/$path.log" || true
done
base=${paths[0]} other=${paths[1]}
# perf diff: baseline share, then the change in points; kernel functions
# only, largest changes first.
perf diff --sort sym -q "$out/$base.data" "$out/$other.data" 2>/dev/null |
  grep -F '[k]' | awk '$2 ~ /^[+-][0-9.]+%$/ { d = $2; sub(/%/, "", d); a = d < 0 ? -d : d; print a "\t" $0 }' |
  sort -rn | cut -f2- >"$out/diff.txt" || true
echo "== $other against $base: kernel functions by change of share (top 25; $out/diff.txt)"
echo "   baseline  delta  function"
head -25 "$out/diff.txt"
echo "data: $out"
