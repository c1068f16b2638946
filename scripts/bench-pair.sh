#!/usr/bin/env bash
# Time one Go benchmark at two revisions, in turn, pair by pair.
#
#   scripts/bench-pair.sh REV_A REV_B PACKAGE BENCH [ROUNDS] [-- test flags...]
#
# Builds the test binary of PACKAGE (e.g. ./fluxvm) at REV_A and at REV_B
# (git worktrees in a temporary directory; the checkout is not touched),
# then runs BENCH (a -test.bench pattern, e.g. 'BenchmarkApply$') ROUNDS
# times (default 10), A then B, B then A in alternate rounds, so that a
# machine whose speed drifts weighs on both alike. Each round's ratio is
# B's ns/op over A's for each sub-benchmark; the report gives per
# sub-benchmark the geometric mean of the ratios with its 95% confidence
# interval (Student's t over the log ratios) and A's and B's median ns/op.
# A ratio below 1 means B is faster. Extra flags after -- go to both
# binaries (default: -test.benchtime 100x). Privileged benchmarks need
# root and FLUXVM_REQUIRE_PRIVILEGED=1 in the environment.
# Environment: GO (default go).
set -euo pipefail

usage() { sed -n '2,17p' "$0"; }
[ $# -ge 4 ] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; esac
reva=$1 revb=$2 pkg=$3 bench=$4
shift 4
rounds=10
if [ $# -gt 0 ] && [ "$1" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] && shift
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(-test.benchtime 100x)
[ "$rounds" -ge 2 ] || { echo "bench-pair.sh: at least 2 rounds for an interval" >&2; exit 2; }

GO=${GO:-go}
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-pair.XXXXXX")
cleanup() {
  for s in a b; do git -C "$root" worktree remove --force "$tmp/src-$s" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

for s in a b; do
  rev=$reva; [ $s = b ] && rev=$revb
  git -C "$root" worktree add -q --detach "$tmp/src-$s" "$rev"
  (cd "$tmp/src-$s" && "$GO" test -c -o "$tmp/$s.test" "$pkg")
  echo "$s: $(git -C "$root" log -1 --format='%h %s' "$rev" | cut -c1-100)"
done

# run SIDE ROUND: one run of a side's binary, "name ns/op" per line.
run() {
  (cd "$tmp/src-$1/$pkg" && "$tmp/$1.test" -test.run '^$' -test.bench "$bench" "${flags[@]}" 2>/dev/null) |
    awk -v side="$1" -v round="$2" '/ns\/op/ { n=$1; sub(/-[0-9]+$/, "", n); for (i=2; i<=NF; i++) if ($i=="ns/op") print round, side, n, $(i-1) }'
}

for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then order="a b"; else order="b a"; fi
  for s in $order; do run "$s" "$r" >>"$tmp/results"; done
  echo "round $r/$rounds done" >&2
done

# Student's t, two-sided 95%, by degrees of freedom (1..30; 1.96 beyond).
awk '
BEGIN { split("12.706 4.303 3.182 2.776 2.571 2.447 2.365 2.306 2.262 2.228 2.201 2.179 2.160 2.145 2.131 2.120 2.110 2.101 2.093 2.086 2.080 2.074 2.069 2.064 2.060 2.056 2.052 2.048 2.045 2.042", t, " ") }
{ v[$3, $1, $2] = $4; names[$3] = 1; rounds[$1] = 1 }
function median(arr, n,   i, j, x) {
  for (i = 2; i <= n; i++) { x = arr[i]; for (j = i - 1; j >= 1 && arr[j] > x; j--) arr[j+1] = arr[j]; arr[j+1] = x }
  return n % 2 ? arr[(n+1)/2] : (arr[n/2] + arr[n/2+1]) / 2
}
END {
  printf "%-48s %8s %18s %12s %12s\n", "benchmark", "B/A", "95% interval", "A ns/op", "B ns/op"
  for (n in names) {
    k = 0; s = 0; ss = 0; delete av; delete bv
    for (r in rounds) {
      if (!(((n, r, "a") in v) && ((n, r, "b") in v))) continue
      k++; l = log(v[n, r, "b"] / v[n, r, "a"]); s += l; ss += l * l
      av[k] = v[n, r, "a"]; bv[k] = v[n, r, "b"]
    }
    if (k < 2) continue
    m = s / k; sd = sqrt((ss - k * m * m) / (k - 1)); q = (k - 1 <= 30) ? t[k - 1] : 1.96
    h = q * sd / sqrt(k)
    printf "%-48s %8.3f   [%6.3f, %6.3f] %12.0f %12.0f\n", n, exp(m), exp(m - h), exp(m + h), median(av, k), median(bv, k)
  }
}' "$tmp/results"
