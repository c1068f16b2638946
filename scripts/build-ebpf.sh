#!/usr/bin/env bash
# Rebuild the FluxVM BPF objects from their C sources, check them against
# the committed ones, or install them for operators.
#
#   scripts/build-ebpf.sh            regenerate bpf/*_bpfel.{o,go} (go generate ./bpf/...)
#   scripts/build-ebpf.sh --check    regenerate and fail if the result differs from git
#   scripts/build-ebpf.sh --install  regenerate, then install the objects under
#                                    $DESTDIR/usr/lib/fluxvm/bpf/ (DESTDIR may be unset)
#
# Needs clang, llvm-strip and the libbpf headers (Debian: clang llvm libbpf-dev).
set -euo pipefail

cd "$(dirname "$0")/.."
mode=build
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  --install) mode=install ;;
  -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
  *) echo "build-ebpf.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
esac

for tool in clang llvm-strip; do
  command -v "$tool" >/dev/null || { echo "build-ebpf.sh: $tool not found (apt-get install clang llvm)" >&2; exit 1; }
done
[ -f /usr/include/bpf/bpf_helpers.h ] || { echo "build-ebpf.sh: libbpf headers not found (apt-get install libbpf-dev)" >&2; exit 1; }

go generate ./bpf/...

if [ "$mode" = check ]; then
  changed=$(git status --porcelain -- bpf/)
  if [ -n "$changed" ]; then
    echo "build-ebpf.sh: the committed BPF objects do not match their C sources:" >&2
    echo "$changed" >&2
    echo "run scripts/build-ebpf.sh and commit the result" >&2
    exit 1
  fi
  echo "build-ebpf.sh: BPF objects match their sources"
fi

if [ "$mode" = install ]; then
  dest="${DESTDIR:-}/usr/lib/fluxvm/bpf"
  install -d -m 0755 "$dest"
  # bpf2go names objects <stem>_bpfel.o; operators know them by the names
  # below (bpf.ObjectName). The default object is tier M.
  while read -r src name; do
    install -m 0644 "bpf/$src" "$dest/$name"
    echo "installed $dest/$name"
  done <<'LIST'
fluxvm_service_bpfel.o fluxvm_service.bpf.o
fluxvm_service_tier_s_bpfel.o fluxvm_service_tier_S.bpf.o
fluxvm_service_bpfel.o fluxvm_service_tier_M.bpf.o
fluxvm_service_tier_l_bpfel.o fluxvm_service_tier_L.bpf.o
fluxvm_service_xdp_tier_s_bpfel.o fluxvm_service_xdp_tier_S.bpf.o
fluxvm_service_xdp_bpfel.o fluxvm_service_xdp_tier_M.bpf.o
fluxvm_service_xdp_tier_l_bpfel.o fluxvm_service_xdp_tier_L.bpf.o
fluxvm_service_connect_tier_s_bpfel.o fluxvm_service_connect_tier_S.bpf.o
fluxvm_service_connect_bpfel.o fluxvm_service_connect_tier_M.bpf.o
fluxvm_service_connect_tier_l_bpfel.o fluxvm_service_connect_tier_L.bpf.o
fluxvm_sock_destroy_bpfel.o fluxvm_sock_destroy.bpf.o
fluxvm_map_count_bpfel.o fluxvm_map_count.bpf.o
LIST
fi
