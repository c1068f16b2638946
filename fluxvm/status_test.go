package fluxvm

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestStatusMemory checks Status.Memory against the kernel's fdinfo of
// every map, and of every Maglev table found through the service ids the
// frontends report, as services come and go.
func TestStatusMemory(t *testing.T) {
	d := openStatusT(t)
	ctx := context.Background()

	// want computes the memory section from the kernel: each map's fdinfo,
	// and each frontend's table looked up by its service id.
	want := func() MemoryStatus {
		t.Helper()
		var w MemoryStatus
		w.Maps = map[string]uint64{}
		for name := range d.dp.Spec().Maps {
			b := testenv.FdinfoMemlock(t, d.dp.Map(name).FD())
			w.Maps[name] = b
			w.Total += b
		}
		for _, ss := range d.Services() {
			for _, fe := range ss.Frontends {
				var inner *ebpf.Map
				err := d.dp.Map(bpf.MaglevMap).Lookup(fe.ServiceID, &inner)
				if fe.Eligible == 0 {
					if err == nil {
						inner.Close()
						t.Fatalf("%s %v: a table without eligible backends", ss.Service.Name, fe.VIP)
					}
					continue
				}
				if err != nil {
					t.Fatalf("%s %v: table of service id %d: %v", ss.Service.Name, fe.VIP, fe.ServiceID, err)
				}
				b := testenv.FdinfoMemlock(t, inner.FD())
				inner.Close()
				w.MaglevInner.Count++
				w.MaglevInner.Bytes += b
				w.MaglevInner.LargestBytes = max(w.MaglevInner.LargestBytes, b)
				w.Total += b
			}
		}
		return w
	}
	check := func(what string, count int) {
		t.Helper()
		st := d.Status()
		if st.Memory == nil {
			t.Fatalf("%s: no memory section", what)
		}
		got, w := *st.Memory, want()
		if got.Error != "" || got.MaglevInner != w.MaglevInner || got.Total != w.Total || len(got.Maps) != len(w.Maps) {
			t.Errorf("%s: memory %+v inner %+v total %d; the kernel says inner %+v total %d", what, got.Maps, got.MaglevInner, got.Total, w.MaglevInner, w.Total)
		}
		for name, b := range w.Maps {
			if got.Maps[name] != b {
				t.Errorf("%s: %s: %d bytes, fdinfo says %d", what, name, got.Maps[name], b)
			}
		}
		if got.MaglevInner.Count != count {
			t.Errorf("%s: %d Maglev tables, want %d", what, got.MaglevInner.Count, count)
		}
	}
	check("empty", 0)

	be := func(a string, w uint32) Backend {
		return Backend{Address: netip.MustParseAddr(a), Port: 8080, Weight: u32(w)}
	}
	single := Service{Name: "single", VIPs: []netip.Addr{netip.MustParseAddr("10.96.1.1")},
		Ports: []ServicePort{{Port: 80, Protocol: TCP}}, Backends: []Backend{be("10.200.0.1", 1), be("10.200.0.2", 1)}}
	dual := Service{Name: "dual", VIPs: []netip.Addr{netip.MustParseAddr("10.96.1.2"), netip.MustParseAddr("fd00:96::2")},
		Ports:    []ServicePort{{Port: 53, Protocol: TCP}, {Port: 53, Protocol: UDP}},
		Backends: []Backend{be("10.200.0.3", 1), be("fd00:200::3", 1)}}
	// Every backend at weight 0: frontends without a table.
	idle := Service{Name: "idle", VIPs: []netip.Addr{netip.MustParseAddr("10.96.1.3")},
		Ports: []ServicePort{{Port: 80, Protocol: TCP}}, Backends: []Backend{be("10.200.0.4", 0)}}
	for _, s := range []Service{single, dual, idle} {
		if _, err := d.ApplyService(ctx, s); err != nil {
			t.Fatalf("apply %s: %v", s.Name, err)
		}
	}
	check("three services", 1+4)

	// A weight change swaps the tables in; the figures follow.
	dual.Backends[0].Weight = u32(3)
	if _, err := d.ApplyService(ctx, dual); err != nil {
		t.Fatal(err)
	}
	check("after an update", 1+4)
	if err := d.DeleteService(ctx, "dual"); err != nil {
		t.Fatal(err)
	}
	check("after a delete", 1)

	// The JSON names of the section.
	raw, err := json.Marshal(d.Status())
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Memory struct {
			Maps  map[string]uint64 `json:"maps"`
			Inner struct {
				Count   *int    `json:"count"`
				Bytes   *uint64 `json:"bytes"`
				Largest *uint64 `json:"largest_bytes"`
			} `json:"maglev_inner_maps"`
			Total *uint64 `json:"total_bytes"`
		} `json:"memory"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if m := doc.Memory; m.Maps["fluxvm_maglev"] == 0 || m.Inner.Count == nil || *m.Inner.Count != 1 ||
		m.Inner.Bytes == nil || m.Inner.Largest == nil || *m.Inner.Bytes != *m.Inner.Largest || m.Total == nil || *m.Total == 0 {
		t.Errorf("memory section in JSON: %s", raw)
	}

	d.Close()
	if st := d.Status(); st.Memory != nil {
		t.Errorf("memory section after Close: %+v", st.Memory)
	}
}

// TestStatusFrontendIndex: status counts what the IPv4 frontend index
// holds as services come and go, one entry for each IPv4 frontend of
// fluxvm_svc4 (VIP markers included), every one of them answered by its
// slot or counted as sharing one.
func TestStatusFrontendIndex(t *testing.T) {
	testenv.RequirePrivileged(t)
	d := openStatusT(t)
	ctx := context.Background()
	check := func(what string) {
		t.Helper()
		n := 0
		var (
			k bpf.SvcKey4
			v bpf.SvcValue
		)
		it := d.dp.Maps().FluxvmSvc4.Iterate()
		for it.Next(&k, &v) {
			n++
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		st := d.Status().FrontendIndex
		if st.Slots != 4096 || st.Frontends != n || st.One+st.Sharing != n || (st.Shared == 0) != (st.Sharing == 0) {
			t.Errorf("%s: frontend index %+v; fluxvm_svc4 holds %d IPv4 frontends", what, st, n)
		}
	}
	check("empty")
	svc := Service{Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.1.1"), netip.MustParseAddr("fd00:96::1")},
		Ports:    []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}},
		Backends: []Backend{{Address: netip.MustParseAddr("10.200.0.1"), Port: 8080}, {Address: netip.MustParseAddr("fd00:200::1"), Port: 8080}}}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	check("one service")
	if st := d.Status().FrontendIndex; st.Frontends != 4 {
		t.Errorf("frontends %d, want 4 (two ports and two VIP markers of the IPv4 VIP)", st.Frontends)
	}
	// Programmed counts the four (VIP, port, protocol) frontends, their
	// ids, and the backend endpoints listed: each backend for TCP and
	// for UDP.
	if p := d.Status().Programmed; p.Frontends != 4 || p.ServiceIDs.Free != p.ServiceIDs.Capacity-4 ||
		p.BackendIDs.Free != p.BackendIDs.Capacity-4 || p.IndexedEndpoints != 4 || p.RepairPending != 0 {
		t.Errorf("programmed after the apply: %+v", p)
	}
	if err := d.DeleteService(ctx, "web"); err != nil {
		t.Fatal(err)
	}
	check("after the delete")
	// The ids wait in quarantine for a GC, then are free again.
	if p := d.Status().Programmed; p.Frontends != 0 || p.ServiceIDs.Quarantined != 4 || p.BackendIDs.Quarantined != 4 || p.IndexedEndpoints != 0 {
		t.Errorf("programmed after the delete: %+v", p)
	}
	if _, err := d.GC(ctx); err != nil {
		t.Fatal(err)
	}
	if p := d.Status().Programmed; p.ServiceIDs.Quarantined != 0 || p.ServiceIDs.Free != p.ServiceIDs.Capacity {
		t.Errorf("programmed after a GC: %+v", p)
	}
	raw, err := json.Marshal(d.Status())
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		FE map[string]int `json:"frontend_index"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil || doc.FE["slots"] != 4096 {
		t.Errorf("frontend_index in JSON: %s", raw)
	}
}

// openStatusT opens a tier-S dataplane without GC or logs for the status
// tests.
func openStatusT(t *testing.T) *Dataplane {
	t.Helper()
	d, err := Open(context.Background(), Options{
		Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
		ConntrackGCInterval: -1,
		Logger:              slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}
