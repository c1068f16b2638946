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
//   - [github.com/fluxvm/servicefabric/fluxvm]: the node Service Fabric:
//     the Dataplane that an embedder opens, its Options and the TOML
//     configuration; [github.com/fluxvm/servicefabric/fluxvm/api] serves
//     it over REST.
//   - [github.com/fluxvm/servicefabric/intent]: the service intent (types,
//     decoding, validation) in pure Go, for a control plane on any OS.
//   - [github.com/fluxvm/servicefabric/advert] and
//     [github.com/fluxvm/servicefabric/health]: VIP advertisement
//     snapshots and TCP health checks, pure Go.
//   - [github.com/fluxvm/servicefabric/conntrack] and
//     [github.com/fluxvm/servicefabric/nat]: typed views of the flow maps
//     and their garbage collector.
//   - [github.com/fluxvm/servicefabric/maglev]: weighted, deterministic
//     Maglev lookup tables in pure Go; usable on its own.
//   - [github.com/fluxvm/servicefabric/bpf]: the eBPF C sources, the
//     objects compiled from them (embedded, so users need no clang), the Go
//     mirrors of their layouts, the loader and attach/detach.
//   - internal/: runtime helpers of the library packages; test helpers
//     in internal/testutils. The lab application lives with its command,
//     cmd/fluxvm-lab.
//
// # Using it
//
// `go get github.com/fluxvm/servicefabric`, then:
//
//	cfg := fluxvm.DefaultConfig()
//	d, err := fluxvm.Open(fluxvm.OptionsFrom(cfg))
//	d.AddInterface(fluxvm.VMEdgeInterface{Name: "tap-vm1", VMID: "vm-1"})
//	d.ApplyService(ctx, svc)
//
// Options.Logger takes an slog.Logger, and Options.TracerProvider an
// OpenTelemetry TracerProvider for spans of the control-plane work
// (applies, GC rounds, the restore; api.Options.TracerProvider adds the
// REST requests).
//
// Loading the datapath needs root (or CAP_BPF and CAP_NET_ADMIN) at run
// time, not a compiler. The README lists what works today.
package servicefabric
