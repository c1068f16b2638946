// Package servicefabric is the FluxVM Service Fabric: the node-local
// service dataplane of the FluxVM VMM, as a Go SDK with eBPF programs
// inside.
//
// It load-balances virtual IPs (VIPs) for virtual machines: TC (and later
// XDP) programs at the VM edge and at the node's north-south interfaces
// pick a backend with weighted Maglev, rewrite packets (NAT, routed DSR,
// SNAT with reverse NAT) and keep established flows on their backend while
// membership changes. Zyvor Fabric, the distributed control plane, embeds
// the SDK; other VMMs use it with `go get`; standalone nodes run the
// reference daemon.
//
// # Packages
//
// Imports point down only:
//
//   - [github.com/fluxvm/servicefabric/maglev]: weighted, deterministic
//     Maglev lookup tables in pure Go; usable on its own.
//   - [github.com/fluxvm/servicefabric/bpf]: the eBPF C sources, the
//     objects compiled from them (embedded, so users need no clang), the Go
//     mirrors of their shared layouts and the packet counters.
//   - internal/testenv, internal/pkt, internal/bpffs: privilege gating,
//     throwaway network namespaces and pin roots for tests, and packet
//     builders.
//
// # Using it
//
// `go get github.com/fluxvm/servicefabric` is all an embedder needs: the BPF
// objects are embedded in the bpf package, and loading them needs root (or
// CAP_BPF and CAP_NET_ADMIN) at run time, not a compiler. The README lists
// what works today and how it is tested.
package servicefabric
