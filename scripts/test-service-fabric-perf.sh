#!/usr/bin/env bash
# The side-by-side benchmark: the same short-connection and bulk workloads
# from a client VM to one backend VM, direct, through our VIP (Maglev in the
# TC programs) and through a kube-proxy style nftables DNAT load balancer,
# interleaved in rounds, with medians and ratios; with -paths north-south
# (or all), an external client through the uplink: direct, the VIP in TC,
# the VIP in XDP. See docs/lab-perf.md for recorded results.
#
#   scripts/test-service-fabric-perf.sh [perf flags]   e.g. -rounds 7 -duration 3s
#
# Flags: -paths -rounds -duration -workers -streams -max-conns -bare
# -max-others -bpf-stats (see
# `go run ./cmd/fluxvm-lab perf -h`); later flags override the defaults.
# Needs root and nft. Everything runs in namespaces the lab creates and
# removes, also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
esac
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
# exec-free so that the trap runs; SIGINT reaches the benchmark, which
# tears everything down before it exits.
"$bin" perf -rounds 5 -duration 2s -workers 4 -streams 2 "$@"
