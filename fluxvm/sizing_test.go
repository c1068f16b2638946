package fluxvm

import (
	"context"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// ewService4 is an IPv4-only east-west service (NAT mode) on backends that
// need not exist: memory does not depend on traffic.
func ewService4(name string, vip netip.Addr) Service {
	s := Service{Name: name, VIPs: []netip.Addr{vip}, Ports: []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}}}
	for i := range 3 {
		s.Backends = append(s.Backends, Backend{Address: netip.AddrFrom4([4]byte{10, 1, 0, byte(10 + i)}), Port: 8080})
	}
	for i := range s.Ports {
		_ = i
	}
	return s
}

// TestMemlockIPv4EastWestTierM: an IPv4-only east-west node (no north-south
// edge, no IPv6 frontend, socket LB off) at tier M holds at most half the
// locked BPF memory it held before maps were sized by need (164 MiB, of
// which the IPv6 conntrack and NAT maps and the unused IPv4 NAT map were
// most): the figure is the kernel's memlock of every map, as status
// reports it (Status.Memory).
func TestMemlockIPv4EastWestTierM(t *testing.T) {
	opts := Options{
		Loader:      bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierM},
		CatalogPath: filepath.Join(t.TempDir(), "catalog.json"),
		GCInterval:  -1,
	}
	d, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, ewService4("web", netip.MustParseAddr("10.96.0.10"))); err != nil {
		t.Fatal(err)
	}
	mem := d.Status().Memory
	if mem == nil || mem.Error != "" {
		t.Fatalf("memory: %+v", mem)
	}
	names := make([]string, 0, len(mem.Maps))
	for n := range mem.Maps {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		if mem.Maps[n] >= 1<<20 {
			t.Logf("%-22s %8.1f MiB", n, float64(mem.Maps[n])/(1<<20))
		}
	}
	t.Logf("total %.1f MiB (maglev tables %.1f MiB)", float64(mem.Total)/(1<<20), float64(mem.MaglevInner.Bytes)/(1<<20))
	const before = 164 << 20
	if mem.Total > before/2 {
		t.Errorf("IPv4-only east-west node at tier M holds %.1f MiB of BPF memory, more than half of %d MiB", float64(mem.Total)/(1<<20), before>>20)
	}
}

// growForTest grows the flow maps names to their ceiling, as an apply
// that needs them would.
func growForTest(t *testing.T, d *Dataplane, names ...string) {
	t.Helper()
	d.flowMu.Lock()
	defer d.flowMu.Unlock()
	reasons := map[string]string{}
	for _, n := range names {
		reasons[n] = "test"
	}
	if err := d.growMaps("test", names, reasons, time.Now()); err != nil {
		t.Fatal(err)
	}
}
