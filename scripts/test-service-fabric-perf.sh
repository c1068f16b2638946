#!/usr/bin/env bash
# The side-by-side benchmark: the same short-connection and bulk workloads
# from a client VM to one backend VM, direct, through our VIP (Maglev in the
# TC programs) and through a kube-proxy style nftables DNAT load balancer,
# interleaved in rounds, with medians and ratios; with -paths north-south
# (or all), an external client through the uplink: direct, the VIP in TC,
# the VIP in XDP. See docs/lab-perf.md for recorded results.
#
#   scripts/test-service-fabric-perf.sh [-smoke] [perf flags]   e.g. -rounds 7 -duration 3s
#
# -smoke (or SMOKE=1): one round of 500 ms per path and workload.
# Flags: -paths -rounds -duration -workers -streams -max-conns -bare
# -max-others -bpf-stats -goal (see
# `go run ./cmd/fluxvm-lab perf -h`); later flags override the defaults.
# Needs root and nft. Everything runs in namespaces the lab creates and
# removes, also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=${SMOKE:-0}
args=()
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -smoke|--smoke) smoke=1 ;;
    *) args+=("$a") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
if [ "$(id -u)" != 0 ]; then
  echo "test-service-fabric-perf.sh: needs root (BPF, namespaces, nftables)" >&2
  exit 1
fi
if ! command -v nft >/dev/null; then
  echo "test-service-fabric-perf.sh: nft not found (apt-get install nftables)" >&2
  exit 1
fi
bin="$(mktemp -d)/fluxvm-lab"
trap 'rm -rf "$(dirname "$bin")"' EXIT
go build -o "$bin" ./cmd/fluxvm-lab
run=(-rounds 5 -duration 2s)
if [ "$smoke" = 1 ]; then
  run=(-rounds 1 -duration 500ms)
fi
# run_lab (scripts/lab-lib.sh): the lab in the background, signals passed on.
. scripts/lab-lib.sh
run_lab "$bin" perf "${run[@]}" -workers 4 -streams 2 "$@"
