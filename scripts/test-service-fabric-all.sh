#!/usr/bin/env bash
# Every lab script in sequence: the lab (demo and end-to-end tests), the
# perf benchmark, the gates (SLO, RSS, RSS-affinity) and the production
# readiness check of the node's running daemon (scripts/
# test-production-readiness.sh, skipped when no node is there: no
# FLUXVM_ADDR and no configuration, $FLUXVM_CONFIG or else
# /etc/fluxvm/fluxvmd.toml, as the readiness script reads). One summary
# line per script (PASS/FAIL/SKIP and its time); exits non-zero when any
# failed.
#
#   scripts/test-service-fabric-all.sh [-smoke]
#
# -smoke (or SMOKE=1): each script in its smoke mode (SMOKE=1 in its
# environment), about a minute in all. Without it: the full runs, about
# 5-10 minutes. Needs root and nft. Each script creates and removes its
# own namespaces; Ctrl-C or SIGTERM is passed on to the running one
# (which tears its lab down), the rest are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=${SMOKE:-0}
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -smoke|--smoke) smoke=1 ;;
    *) echo "test-service-fabric-all.sh: unknown argument $a (try -h)" >&2; exit 2 ;;
  esac
done
if [ "$(id -u)" != 0 ]; then
  echo "test-service-fabric-all.sh: needs root (BPF, namespaces, nftables)" >&2
  exit 1
fi

scripts=(
  scripts/test-service-fabric-lab.sh
  scripts/test-service-fabric-perf.sh
  scripts/test-service-fabric-slo.sh
  scripts/test-service-fabric-rss.sh
  scripts/test-service-fabric-rss-affinity.sh
  scripts/test-production-readiness.sh
)
# A signal stops the running script (passed on to it as SIGTERM; the
# scripts pass it on to their lab, which tears everything down) and skips
# the rest.
interrupted=0 child=""
on_signal() {
  interrupted=1
  [ -z "$child" ] || kill -TERM "$child" 2>/dev/null || true
}
trap on_signal INT TERM HUP
summary=()
failed=0
for s in "${scripts[@]}"; do
  name=$(basename "$s")
  if [ "$interrupted" = 1 ]; then
    summary+=("$(printf 'SKIP  %-40s interrupted' "$name")")
    continue
  fi
  if [ ! -x "$s" ]; then
    summary+=("$(printf 'SKIP  %-40s not present (or not executable)' "$name")")
    continue
  fi
  # The readiness check inspects a running node: only when there is one
  # to look at (FLUXVM_ADDR, or the configuration the readiness script
  # reads: $FLUXVM_CONFIG, else the daemon's default).
  node_config="${FLUXVM_CONFIG:-/etc/fluxvm/fluxvmd.toml}"
  if [ "$name" = test-production-readiness.sh ] && [ -z "${FLUXVM_ADDR:-}" ] && [ ! -f "$node_config" ]; then
    summary+=("$(printf 'SKIP  %-40s no running node (set FLUXVM_ADDR, or FLUXVM_CONFIG or install %s)' "$name" "$node_config")")
    continue
  fi
  echo "==> $s$([ "$smoke" = 1 ] && echo ' (smoke)')"
  start=$(date +%s)
  rc=0
  SMOKE=$smoke "$s" &
  child=$!
  wait "$child" || rc=$?
  # A trapped signal ends the wait early: wait again until the script
  # has torn its lab down.
  while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done
  child=""
  secs=$(( $(date +%s) - start ))
  if [ "$rc" = 0 ]; then
    summary+=("$(printf 'PASS  %-40s %4ds' "$name" "$secs")")
  else
    failed=$((failed + 1))
    summary+=("$(printf 'FAIL  %-40s %4ds  exit %d' "$name" "$secs" "$rc")")
  fi
  echo
done
echo "==> summary$([ "$smoke" = 1 ] && echo ' (smoke)')"
printf '%s\n' "${summary[@]}"
if [ "$interrupted" = 1 ]; then
  exit 130
fi
if [ "$failed" -gt 0 ]; then
  echo "test-service-fabric-all.sh: $failed script(s) failed" >&2
  exit 1
fi
