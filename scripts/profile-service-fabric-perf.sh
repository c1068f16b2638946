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
# self time as a share of our non-idle samples (the lab and its workers,
# ksoftirqd, softirqs on idle CPUs: other processes' samples, and the
# softirqs that ran on top of them, are left out), and the difference of
# OTHER against BASE by kernel function, largest change first. cpu-clock
# needs no hardware counters.
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
# Our processes: the lab and its workers, ksoftirqd, and swapper (softirqs
# on idle CPUs).
comms=fluxvm-lab,swapper
for c in $(seq 0 $(( $(nproc) - 1 ))); do comms="$comms,ksoftirqd/$c"; done
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
  # Our samples only: the lab and its workers (comm fluxvm-lab), and the
  # softirqs that ran in ksoftirqd or on idle CPUs (swapper); idle itself
  # left out. Shares are of what is left, in percent.
  perf report -i "$out/$path.data" --no-children --sort sym --stdio -q -g none --percent-limit 0 \
    --comms "$comms" 2>/dev/null |
    awk '$1 ~ /%$/ && $3 !~ /safe_halt|^default_idle|poll_idle|cpu_idle_poll|haltpoll/ {
      v = $1; sub(/%/, "", v); tot += v; n++; pct[n] = v; kind[n] = $2; sym[n] = $3 }
      END { for (i = 1; i <= n; i++) if (kind[i] == "[k]") printf "%7.2f%%  %s\n", 100 * pct[i] / tot, sym[i] }' |
    sort -rn >"$out/$path.kernel.txt"
  echo "== $path: kernel functions by share of our non-idle samples (top 15; $out/$path.kernel.txt)"
  head -15 "$out/$path.kernel.txt"
  grep -E '^(results|  *connections/s|  *conn CPU)' "$out/$path.log" || true
done
base=${paths[0]} other=${paths[1]}
# The difference of the shares, by kernel function, largest first.
awk 'FNR == NR { v = $1; sub(/%/, "", v); a[$2] = v; next }
  { v = $1; sub(/%/, "", v); b[$2] = v }
  END { for (s in a) if (!(s in b)) b[s] = 0
        for (s in b) { d = b[s] - (s in a ? a[s] : 0); printf "%.2f\t%7.2f%%  %7.2f%%  %+7.2f  %s\n", d < 0 ? -d : d, (s in a ? a[s] : 0), b[s], d, s } }' \
  "$out/$base.kernel.txt" "$out/$other.kernel.txt" | sort -rn | cut -f2- >"$out/diff.txt"
echo "== $other against $base: kernel functions by change of share, in points (top 25; $out/diff.txt)"
printf "%8s  %8s  %7s  %s\n" "$base" "$other" "change" "function"
head -25 "$out/diff.txt"
echo "data: $out"
