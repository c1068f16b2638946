package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// cancelState is what a cancelled call must leave as it was: the services
// and their frontends, the interfaces the dataplane lists and the
// programs the kernel has on two of them, the HA lease and journals, and
// the pin root.
type cancelState struct {
	Revisions  map[string]uint64
	Frontends  int
	Interfaces []string
	Programs   map[string][]string
	Epoch      ha.Epoch
	Superseded ha.Epoch
	Journals   map[string]ha.JournalStats
	Cursors    map[string]ha.Cursor
	Policies   []string // service and revision of each policy
	IPCache    uint32   // the ipcache's revision
	LastGC     bool     // a GC round is recorded
	PinRoot    bool
}

// TestCancelledContextChangesNothing: every call of the Dataplane that
// does I/O, with a context cancelled before it starts or while it waits
// (for a service's lock, the dataplane's lock or the lease's), returns
// the context's error and leaves the services, the catalog's revisions,
// the frontend map, the interfaces and their programs, the HA lease and
// journals, and the pin root as they were.
func TestCancelledContextChangesNothing(t *testing.T) {
	testenv.RequirePrivileged(t)
	e := newNSEnv(t)
	// The last backend's interface is not attached at Open: the one an
	// AddInterface may attach.
	spare := e.opts.VMEdgeInterfaces[len(e.opts.VMEdgeInterfaces)-1].Name
	client := e.opts.VMEdgeInterfaces[0].Name
	e.opts.VMEdgeInterfaces = e.opts.VMEdgeInterfaces[:len(e.opts.VMEdgeInterfaces)-1]
	e.opts.HA = HAOptions{Epoch: 3, Interval: MinHAInterval}
	d := e.open(t)
	web := e.service(1, 1, 1)
	web.Ports = []ServicePort{{Port: 80, Protocol: TCP}}
	if _, err := d.ApplyService(context.Background(), web); err != nil {
		t.Fatal(err)
	}
	webPolicy := Policy{Service: "web", DefaultAction: PolicyDeny, AllowIdentities: []Identity{7777}}
	if _, err := d.ApplyPolicies(context.Background(), webPolicy); err != nil {
		t.Fatal(err)
	}
	otherPolicy := webPolicy
	otherPolicy.AllowIdentities = []Identity{7777, 8888}
	ipc := IPCache{Entries: []IPCacheEntry{{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Identity: 7777}}}
	snapshot := func() cancelState {
		t.Helper()
		st := cancelState{Revisions: map[string]uint64{}, Programs: map[string][]string{}}
		for _, s := range d.Services() {
			st.Revisions[s.Service.Name] = s.Revision
		}
		status := d.Status()
		st.Frontends, st.LastGC = status.FrontendIndex.Frontends, status.LastGC != nil
		for _, i := range status.Interfaces {
			st.Interfaces = append(st.Interfaces, fmt.Sprintf("%s %s %v", i.Name, i.Kind, i.Hooks))
		}
		slices.Sort(st.Interfaces)
		for _, n := range []string{spare, client} {
			for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				st.Programs[fmt.Sprint(n, at)] = e.tcxPrograms(t, n, at)
			}
		}
		h := d.HA().Status()
		st.Epoch, st.Superseded, st.Journals, st.Cursors = h.Epoch, h.SupersededBy, h.Journals, h.Cursors
		pol, err := d.Policies(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pol.Policies {
			st.Policies = append(st.Policies, fmt.Sprintf("%s %d", p.Service, p.Revision))
		}
		st.IPCache = pol.IPCacheRevision
		_, err = os.Stat(e.opts.Loader.PinRoot)
		st.PinRoot = err == nil
		return st
	}
	want := snapshot()
	if len(want.Journals) != 0 || !want.PinRoot || len(want.Interfaces) != len(e.opts.VMEdgeInterfaces)+1 || len(want.Policies) != 1 {
		t.Fatalf("the state before: %+v; want no journal yet, the pin root, %d interfaces, web's policy", want, len(e.opts.VMEdgeInterfaces)+1)
	}
	changed := web.Clone()
	changed.Ports = append(changed.Ports, ServicePort{Port: 443, Protocol: TCP})
	other := web.Clone()
	other.Name, other.VIPs = "other", []netip.Addr{netip.MustParseAddr("10.96.1.2")}

	// What a call that waits holds it on.
	services := func() func() {
		unlock, unlockOther := d.lockService("web"), d.lockService("other")
		return func() { unlock(); unlockOther() }
	}
	dataplane := func() func() { d.mu.Lock(); return d.mu.Unlock }
	lease := func() func() { return d.ha.HoldLease() }
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []struct {
		name string
		call func(ctx context.Context) error
		hold func() func() // nil: the call waits for nothing before it commits
	}{
		{"apply of a change", func(ctx context.Context) error { return errOf(d.ApplyService(ctx, changed)) }, services},
		{"apply of a new service", func(ctx context.Context) error { return errOf(d.ApplyService(ctx, other)) }, services},
		{"apply unchanged", func(ctx context.Context) error { return errOf(d.ApplyService(ctx, web)) }, services},
		{"delete", func(ctx context.Context) error { return d.DeleteService(ctx, "web") }, services},
		{"add interface", func(ctx context.Context) error {
			return errOf(d.AddInterface(ctx, VMEdgeInterface{Name: spare, VMID: "spare"}))
		}, dataplane},
		{"add north-south interface", func(ctx context.Context) error { return errOf(d.AddNorthSouthInterface(ctx, spare)) }, dataplane},
		{"remove interface", func(ctx context.Context) error { return d.RemoveInterface(ctx, client) }, dataplane},
		{"stats", func(ctx context.Context) error { return errOf(d.Stats(ctx)) }, dataplane},
		{"vm stats", func(ctx context.Context) error { return errOf(d.VMStats(ctx, e.cli.Name)) }, dataplane},
		{"flows", func(ctx context.Context) error { return errOf(d.Flows(ctx, 10, flows.Filter{})) }, dataplane},
		{"pressure", func(ctx context.Context) error { return errOf(d.Pressure(ctx)) }, dataplane},
		{"policies", func(ctx context.Context) error { return errOf(d.Policies(ctx)) }, dataplane},
		{"policy", func(ctx context.Context) error { return errOf(d.Policy(ctx, "web")) }, dataplane},
		// A delta or an ack makes the service's journal when it has none.
		{"flow delta", func(ctx context.Context) error { return errOf(d.HA().FlowDelta(ctx, "web", FlowDeltaRequest{})) }, dataplane},
		{"ack flow delta", func(ctx context.Context) error { return errOf(d.HA().AckFlowDelta(ctx, "web", 0)) }, dataplane},
		{"update lease", func(ctx context.Context) error { return errOf(d.HA().UpdateLease(ctx, HALease{Epoch: 4})) }, lease},
		{"apply policies", func(ctx context.Context) error { return errOf(d.ApplyPolicies(ctx, otherPolicy)) }, dataplane},
		{"set ipcache", func(ctx context.Context) error { return errOf(d.SetIPCache(ctx, ipc)) }, dataplane},
		{"reconcile policies", func(ctx context.Context) error {
			return errOf(d.ReconcilePolicies(ctx, ipc, []Policy{otherPolicy}))
		}, dataplane},
		{"delete policy", func(ctx context.Context) error { return d.DeletePolicy(ctx, "web") }, dataplane},
		{"gc", func(ctx context.Context) error { return errOf(d.GC(ctx)) }, nil},
		{"reconcile health", func(ctx context.Context) error { return errOf(d.ReconcileHealth(ctx)) }, nil},
		{"reconcile pressure", func(ctx context.Context) error { return errOf(d.ReconcilePressure(ctx)) }, nil},
		{"cleanup", func(ctx context.Context) error { return d.Cleanup(ctx) }, nil},
		{"package cleanup", func(ctx context.Context) error {
			return Cleanup(ctx, CleanupOptions{PinRoot: e.opts.Loader.PinRoot, CatalogPath: e.opts.CatalogPath})
		}, nil},
	} {
		t.Run(c.name+"/cancelled before", func(t *testing.T) {
			if err := c.call(cancelled); !errors.Is(err, context.Canceled) {
				t.Fatalf("err %v, want context.Canceled", err)
			}
			if got := snapshot(); !reflect.DeepEqual(got, want) {
				t.Errorf("after a cancelled call:\n%+v\nwant\n%+v", got, want)
			}
		})
		if c.hold == nil {
			continue
		}
		t.Run(c.name+"/cancelled while waiting", func(t *testing.T) {
			// Another call holds what this one needs; the context is
			// cancelled while this one waits for it.
			release := c.hold()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- c.call(ctx) }()
			time.Sleep(20 * time.Millisecond)
			cancel()
			release()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("err %v, want context.Canceled", err)
			}
			if got := snapshot(); !reflect.DeepEqual(got, want) {
				t.Errorf("after a cancelled call:\n%+v\nwant\n%+v", got, want)
			}
		})
	}
	// A cancelled Open makes nothing: no pin root, no attachment.
	t.Run("open/cancelled before", func(t *testing.T) {
		opts := e.opts
		opts.Loader.PinRoot = filepath.Join(testenv.PinRoot(t), "cancelled")
		opts.CatalogPath = filepath.Join(t.TempDir(), "catalog.json")
		opts.VMEdgeInterfaces, opts.NorthSouth.Interfaces, opts.HA = nil, nil, HAOptions{}
		if d2, err := Open(cancelled, opts); !errors.Is(err, context.Canceled) {
			if d2 != nil {
				d2.Close()
			}
			t.Fatalf("err %v, want context.Canceled", err)
		}
		if _, err := os.Stat(opts.Loader.PinRoot); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the pin root of a cancelled Open: %v, want none", err)
		}
	})
	// A live context still works.
	if _, err := d.ApplyService(context.Background(), changed); err != nil {
		t.Fatal(err)
	}
	if _, err := d.HA().UpdateLease(context.Background(), HALease{Epoch: 4}); err != nil {
		t.Fatal(err)
	}
	if err := d.RemoveInterface(context.Background(), client); err != nil {
		t.Fatal(err)
	}
	got := snapshot()
	if got.Revisions["web"] == want.Revisions["web"] || got.Epoch != 4 || reflect.DeepEqual(got.Interfaces, want.Interfaces) {
		t.Errorf("the calls with a live context did not all take effect: %+v", got)
	}
}

// errOf is the error of a call's two results.
func errOf[T any](_ T, err error) error { return err }
