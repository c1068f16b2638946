#!/usr/bin/env bash
# Pair our datapath with Katran's XDP balancer, block by block
# (BenchmarkKatranPair in bpf/katran_bench_test.go).
#
#   scripts/katran-pair.sh KATRAN_SRC [NAME=VALUE...] [-- go test flags...]
#
# KATRAN_SRC is the root of a Katran source tree (it holds
# katran/lib/bpf/balancer.bpf.c). The balancer is compiled with Katran's
# default feature flags (IPIP encapsulation) into a temporary directory;
# nothing is written into Katran's tree or this one. NAME=VALUE arguments
# are set in the benchmark's environment, for example
#   FLUXVM_BENCH_HOOK=xdp        our north-south XDP object (default: TC)
#   FLUXVM_PAIR_LOADS=8          fresh loads of both sides (the interval is over them)
#   FLUXVM_PAIR_ROUNDS=20        paired rounds per load
#   FLUXVM_PAIR_CALLS=9000       calls per block (each side, each row)
#   FLUXVM_BENCH_OMIT=all        ours' load-time features left out ("none": every one loaded)
#   FLUXVM_KATRAN_LRU=8000000    Katran's connection table, split over the CPUs
#   FLUXVM_PAIR_XDP_CTX_FLOOR=1  XDP: ours' floor run with ours' context
# Runs as root (BPF_PROG_TEST_RUN); needs clang and the libbpf headers.
# Environment: CLANG (default clang), GO (default go).
set -euo pipefail

usage() { sed -n '2,20p' "$0"; }
[ $# -ge 1 ] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; esac
ksrc=$(cd "$1" && pwd)
shift
src="$ksrc/katran/lib/bpf/balancer.bpf.c"
[ -f "$src" ] || { echo "katran-pair.sh: $src not found (KATRAN_SRC is the root of a Katran tree)" >&2; exit 2; }

envs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    *=*) envs+=("$1"); shift ;;
    *) echo "katran-pair.sh: $1: expected NAME=VALUE or --" >&2; exit 2 ;;
  esac
done

CLANG=${CLANG:-clang}
GO=${GO:-go}
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/katran-pair.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Katran's own build flags (its Makefile-bpf: -DDEBUG -D__KERNEL__ and
# the warnings it silences), no feature defines. Compiled for the BPF
# target directly: that target does not look in the host's multiarch
# include directory (asm/types.h), and glibc's headers then want the
# 32-bit stubs, for which an empty file does.
mkdir -p "$tmp/inc/gnu"
: >"$tmp/inc/gnu/stubs-32.h"
multiarch=$("$CLANG" -print-multiarch 2>/dev/null || true)
"$CLANG" -target bpf -O2 -g -DDEBUG -D__KERNEL__ \
  -Wno-unused-value -Wno-pointer-sign -Wno-compare-distinct-pointer-types \
  -I"$ksrc" -I"$ksrc/katran/lib/linux_includes" \
  ${multiarch:+-idirafter "/usr/include/$multiarch"} -idirafter "$tmp/inc" \
  -c "$src" -o "$tmp/balancer.bpf.o"
echo "katran: $src ($(git -C "$ksrc" log -1 --format=%h 2>/dev/null || echo 'not a git tree'), $("$CLANG" --version | head -1))"
echo "ours: $root ($(git -C "$root" log -1 --format='%h %s' 2>/dev/null || echo 'not a git tree'))"

cd "$root"
env FLUXVM_KATRAN_OBJ="$tmp/balancer.bpf.o" "${envs[@]}" \
  "$GO" test -count=1 -run '^$' -bench '^BenchmarkKatranPair$' -benchtime 1x -v "$@" ./bpf/
