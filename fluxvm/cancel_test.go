package fluxvm

import (
	"context"
	"errors"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestCancelledContextChangesNothing: an apply or delete whose context is
// cancelled, before it starts or while it waits for its service's lock,
// returns the context's error and leaves the service, the catalog's
// revisions and the frontend map as they were.
func TestCancelledContextChangesNothing(t *testing.T) {
	testenv.RequirePrivileged(t)
	d := openStatusT(t)
	be := func(a string) Backend { return Backend{Address: netip.MustParseAddr(a), Port: 8080} }
	web := Service{Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.1.1")},
		Ports: []ServicePort{{Port: 80, Protocol: TCP}}, Backends: []Backend{be("10.200.0.1"), be("10.200.0.2")}}
	if _, err := d.ApplyService(context.Background(), web); err != nil {
		t.Fatal(err)
	}
	// What must not change: the services as listed, and every IPv4
	// frontend entry.
	snapshot := func() (map[string]uint64, int) {
		t.Helper()
		revs := map[string]uint64{}
		for _, s := range d.Services() {
			revs[s.Service.Name] = s.Revision
		}
		return revs, d.Status().FrontendIndex.Frontends
	}
	wantRevs, wantFEs := snapshot()
	changed := web.Clone()
	changed.Ports = append(changed.Ports, ServicePort{Port: 443, Protocol: TCP})
	other := web.Clone()
	other.Name, other.VIPs = "other", []netip.Addr{netip.MustParseAddr("10.96.1.2")}

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []struct {
		name string
		call func(ctx context.Context) error
	}{
		{"apply of a change", func(ctx context.Context) error { _, err := d.ApplyService(ctx, changed); return err }},
		{"apply of a new service", func(ctx context.Context) error { _, err := d.ApplyService(ctx, other); return err }},
		{"apply unchanged", func(ctx context.Context) error { _, err := d.ApplyService(ctx, web); return err }},
		{"delete", func(ctx context.Context) error { return d.DeleteService(ctx, "web") }},
	} {
		t.Run(c.name+"/cancelled before", func(t *testing.T) {
			if err := c.call(cancelled); !errors.Is(err, context.Canceled) {
				t.Fatalf("err %v, want context.Canceled", err)
			}
			if revs, fes := snapshot(); !reflect.DeepEqual(revs, wantRevs) || fes != wantFEs {
				t.Errorf("after a cancelled call: services %v, %d IPv4 frontends; want %v, %d", revs, fes, wantRevs, wantFEs)
			}
		})
		t.Run(c.name+"/cancelled while waiting", func(t *testing.T) {
			// Another call holds the service's lock; the context is
			// cancelled while this one waits for it.
			unlock := d.lockService("web")
			unlockOther := d.lockService("other")
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- c.call(ctx) }()
			time.Sleep(20 * time.Millisecond)
			cancel()
			unlock()
			unlockOther()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("err %v, want context.Canceled", err)
			}
			if revs, fes := snapshot(); !reflect.DeepEqual(revs, wantRevs) || fes != wantFEs {
				t.Errorf("after a cancelled call: services %v, %d IPv4 frontends; want %v, %d", revs, fes, wantRevs, wantFEs)
			}
		})
	}
	// A live context still works.
	if _, err := d.ApplyService(context.Background(), changed); err != nil {
		t.Fatal(err)
	}
	if revs, _ := snapshot(); revs["web"] == wantRevs["web"] {
		t.Errorf("the change with a live context did not apply: %v", revs)
	}
}
