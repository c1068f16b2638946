#!/usr/bin/env bash
# The lab: the demo (VIP traffic through the real datapath in a throwaway
# namespace topology) and the end-to-end tests with real sockets.
#
#   scripts/test-service-fabric-lab.sh [demo flags]   e.g. -connections 2000
#
# Needs root. Everything runs in namespaces the lab creates and removes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "test-service-fabric-lab.sh: needs root (BPF, namespaces)" >&2
  exit 1
fi
go run ./cmd/fluxvm-lab demo "$@"
FLUXVM_REQUIRE_PRIVILEGED=1 go test -count=1 ./cmd/fluxvm-lab/internal/scenario/ ./fluxvm/ ./cmd/fluxvmd/
