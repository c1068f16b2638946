#!/usr/bin/env bash
# The lab: the demo (VIP traffic through the real datapath in a throwaway
# namespace topology) and the end-to-end tests with real sockets.
#
#   scripts/test-service-fabric-lab.sh [-smoke] [demo flags]   e.g. -connections 2000
#
# -smoke (or SMOKE=1): the demo alone with 500 connections (the tests are
# CI's `go test` run). Needs root. Everything runs in namespaces the lab
# creates and removes.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=${SMOKE:-0}
args=()
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    -smoke|--smoke) smoke=1 ;;
    *) args+=("$a") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
if [ "$(id -u)" != 0 ]; then
  echo "test-service-fabric-lab.sh: needs root (BPF, namespaces)" >&2
  exit 1
fi
if [ "$smoke" = 1 ]; then
  go run ./cmd/fluxvm-lab demo -connections 500 "$@"
  exit 0
fi
go run ./cmd/fluxvm-lab demo "$@"
FLUXVM_REQUIRE_PRIVILEGED=1 go test -count=1 ./cmd/fluxvm-lab/internal/scenario/ ./fluxvm/ ./cmd/fluxvmd/
