#!/usr/bin/env bash
# The SLO gate: short TCP connections from a client VM to a backend VM
# through our VIP and direct (the backend's address, datapath attached),
# interleaved in the same rounds; exits non-zero and prints the failed
# figure(s) when the VIP misses a threshold below.
#
#   scripts/test-service-fabric-slo.sh [-smoke] [slo flags]
#
# -smoke (or SMOKE=1): 2 rounds of 500 ms, about 10 s, for CI. Without it:
# 5 rounds of 2 s, about 50 s (the checks of each path run first). Later
# flags override the defaults (see `go run ./cmd/fluxvm-lab slo -h`).
# Needs root and nft. Everything runs in namespaces the lab creates and
# removes, also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

# Thresholds, judged on the medians over the rounds (docs/lab-perf.md,
# "Gates"); `fluxvm-lab slo`'s flag defaults are the same values. Each
# latency figure has its own bound, vip <= direct × FACTOR + SLACK.
# Measured on the 2-vCPU lab machine while other test runs loaded it
# (load average 2.5-8), 5 default runs and 5 smoke runs: connect p50 92-128
# µs (vip) against 91-118 µs (direct); connection (connect to close) p50
# 405-734 against 487-645 µs; the p99s are the scheduler's, not the
# datapath's: connect p99 5.0-16.3 ms (vip) against 4.4-10.9 ms (direct),
# connection p99 10.5-37.9 against 9.1-26.3 ms, up to 2.5x apart between
# the two paths of one run; vip/direct connections/s 0.80-1.28 paired.
# The p50 bounds are tight (a datapath that adds 100-200 µs to a handshake
# or a connection fails); the p99 bounds only catch stalls of several ms.
CONNECT_P50=1.5+100us   # measured vip/direct 0.93-1.41
CONNECT_P99=2+5ms       # measured up to 2.47x (smoke: ~10 samples make the p99)
CONN_P50=1.5+200us      # measured 0.83-1.14
CONN_P99=2+10ms         # measured up to 1.63x
MIN_RATE_RATIO=0.75     # vip conn/s >= 0.75 × direct (measured 0.80-1.28)
MAX_ERRORS=0            # no failed connection, on either path

smoke=${SMOKE:-0}
args=()
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -smoke|--smoke) smoke=1 ;;
    *) args+=("$a") ;;
  esac
done
if [ "$(id -u)" != 0 ]; then
  echo "test-service-fabric-slo.sh: needs root (BPF, namespaces, nftables)" >&2
  exit 1
fi
if ! command -v nft >/dev/null; then
  echo "test-service-fabric-slo.sh: nft not found (apt-get install nftables)" >&2
  exit 1
fi
if [ "$smoke" = 1 ]; then
  run=(-rounds 2 -duration 500ms)
else
  run=(-rounds 5 -duration 2s)
fi
bin="$(mktemp -d)/fluxvm-lab"
trap 'rm -rf "$(dirname "$bin")"' EXIT
go build -o "$bin" ./cmd/fluxvm-lab
# run_lab (scripts/lab-lib.sh): the lab in the background, signals passed on.
. scripts/lab-lib.sh
run_lab "$bin" slo "${run[@]}" -workers 4 \
  -connect-p50 "$CONNECT_P50" -connect-p99 "$CONNECT_P99" -conn-p50 "$CONN_P50" -conn-p99 "$CONN_P99" \
  -min-rate-ratio "$MIN_RATE_RATIO" -max-errors "$MAX_ERRORS" ${args[@]+"${args[@]}"}
