package fluxvm

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	"github.com/fluxvm/servicefabric/internal/testutils/qdisctest"
)

// withFQKind sets the qdisc kind edt_manage_fq installs for one test.
func withFQKind(t *testing.T, kind string) {
	t.Helper()
	t.Cleanup(edt.SetQdiscKind(kind))
}

// TestOpenManagesFQ checks edt_manage_fq through Open, Close and Cleanup:
// fq goes on every listed interface, stays at Close (the datapath keeps
// forwarding) and is adopted by the next Open, comes off at an Open that
// no longer lists the interface (or without edt_manage_fq) and at
// Cleanup; an interface that refuses it fails Open with nothing this Open
// installed left behind; a kernel without
// sch_fq fails Open too (ErrNoFQ), unless edt_horizon_fallback, which
// then reports horizon-policing in the status.
func TestOpenManagesFQ(t *testing.T) {
	e := newEnv(t)
	e.opts.EDT.Enabled = true
	e.opts.EDT.ManageFQ = true
	a, b := e.backends[0].NodeIf, e.backends[1].NodeIf
	e.opts.EDT.Interfaces = []string{a, b}
	inNode := func(f func()) {
		t.Helper()
		if err := e.lab.Node.Do(func() error { f(); return nil }); err != nil {
			t.Fatal(err)
		}
	}
	var defKind string
	inNode(func() { defKind, _ = qdisctest.RootOf(t, a) })

	t.Run("installed, kept at Close, adopted, removed", func(t *testing.T) {
		withFQKind(t, "pfifo")
		d, err := Open(context.Background(), e.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		inNode(func() {
			for _, n := range []string{a, b} {
				if kind, h := qdisctest.RootOf(t, n); kind != "pfifo" || h != netlink.MakeHandle(edt.HandleMajor, 0) {
					t.Errorf("%s root %s %#x after Open", n, kind, h)
				}
			}
		})
		st := d.Status().EDT
		if !st.Enabled || st.Horizon.Duration != DefaultEDTHorizon {
			t.Errorf("status %+v", st)
		}
		byName := map[string]EDTInterfaceStatus{}
		for _, i := range st.Interfaces {
			byName[i.Name] = i
		}
		// Every VM edge is listed; pfifo stands for fq here.
		if len(byName) != len(e.lab.VMs) {
			t.Errorf("interfaces %+v, want the %d VM edges", st.Interfaces, len(e.lab.VMs))
		}
		for _, n := range []string{a, b} {
			if i := byName[n]; i.Mode != EDTModeFQ || !i.Managed || i.PreviousQdisc != defKind || i.Qdisc != "pfifo" {
				t.Errorf("%s status %+v", n, i)
			}
		}
		if i := byName[e.cli.NodeIf]; i.Mode != EDTModeHorizonPolicing || i.Managed || !strings.Contains(i.Reason, "not fq") {
			t.Errorf("unmanaged %s status %+v", e.cli.NodeIf, i)
		}
		// Close keeps it, with the rest of the datapath.
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		wantRoots := func(what string, ours ...string) {
			t.Helper()
			inNode(func() {
				for _, n := range []string{a, b} {
					kind, h := qdisctest.RootOf(t, n)
					if slices.Contains(ours, n) {
						if kind != "pfifo" || h != netlink.MakeHandle(edt.HandleMajor, 0) {
							t.Errorf("%s: %s root %s %#x, want ours (pfifo f1d0:)", what, n, kind, h)
						}
					} else if kind != defKind || h != 0 {
						t.Errorf("%s: %s root %s %#x, want the default %s", what, n, kind, h, defKind)
					}
				}
			})
		}
		wantRoots("after Close", a, b)

		// The next start adopts it.
		d, err = Open(context.Background(), e.opts)
		if err != nil {
			t.Fatal(err)
		}
		for _, i := range d.Status().EDT.Interfaces {
			if (i.Name == a || i.Name == b) && (i.Mode != EDTModeFQ || !i.Managed || i.PreviousQdisc != "") {
				t.Errorf("reopened: %s status %+v, want managed fq, adopted", i.Name, i)
			}
		}
		d.Close()
		wantRoots("after the second Close", a, b)

		// A start without b in edt_interfaces removes ours from b; one
		// without edt_manage_fq, from every interface.
		opts := e.opts
		opts.EDT.Interfaces = []string{a}
		if d, err = Open(context.Background(), opts); err != nil {
			t.Fatal(err)
		}
		d.Close()
		wantRoots("b no longer listed", a)
		opts.EDT.ManageFQ, opts.EDT.Interfaces = false, nil
		if d, err = Open(context.Background(), opts); err != nil {
			t.Fatal(err)
		}
		d.Close()
		wantRoots("edt_manage_fq off")

		// Cleanup removes it.
		if d, err = Open(context.Background(), e.opts); err != nil {
			t.Fatal(err)
		}
		wantRoots("installed again", a, b)
		if err := d.Cleanup(context.Background()); err != nil {
			t.Fatal(err)
		}
		wantRoots("after Cleanup")
	})

	t.Run("failed Open keeps the adopted", func(t *testing.T) {
		withFQKind(t, "pfifo")
		// An earlier start left ours on a.
		opts := e.opts
		opts.EDT.Interfaces = []string{a}
		d, err := Open(context.Background(), opts)
		if err != nil {
			t.Fatal(err)
		}
		d.Close()
		inNode(func() { qdisctest.ConfigureRoot(t, b) })
		if d, err := Open(context.Background(), e.opts); err == nil {
			d.Close()
			t.Fatal("Open succeeded over a configured root qdisc")
		}
		inNode(func() {
			if kind, h := qdisctest.RootOf(t, a); kind != "pfifo" || h != netlink.MakeHandle(edt.HandleMajor, 0) {
				t.Errorf("%s root %s %#x after the failed Open, want ours kept", a, kind, h)
			}
			qdisctest.DeleteRoot(t, b)
			qdisctest.DeleteRoot(t, a)
		})
	})

	t.Run("configured root fails Open, nothing left", func(t *testing.T) {
		withFQKind(t, "pfifo")
		inNode(func() { qdisctest.ConfigureRoot(t, b) })
		t.Cleanup(func() {
			inNode(func() {
				qdisctest.DeleteRoot(t, b)
			})
		})
		d, err := Open(context.Background(), e.opts)
		if err == nil {
			d.Close()
			t.Fatal("Open succeeded over a configured root qdisc")
		}
		if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), b) {
			t.Errorf("Open: %v, want ErrConflict naming %s", err, b)
		}
		inNode(func() {
			if kind, h := qdisctest.RootOf(t, a); kind != defKind || h != 0 {
				t.Errorf("%s root %s %#x after the failed Open, want the default", a, kind, h)
			}
		})
	})

	t.Run("missing interface fails Open, nothing left", func(t *testing.T) {
		withFQKind(t, "pfifo")
		opts := e.opts
		opts.EDT.Interfaces = []string{a, "nope0"}
		d, err := Open(context.Background(), opts)
		if err == nil {
			d.Close()
			t.Fatal("Open succeeded with a missing EDT interface")
		}
		if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `interface "nope0"`) {
			t.Errorf("Open: %v, want ErrNotFound naming \"nope0\"", err)
		}
		inNode(func() {
			if kind, h := qdisctest.RootOf(t, a); kind != defKind || h != 0 {
				t.Errorf("%s root %s %#x after the failed Open, want the default", a, kind, h)
			}
		})
	})

	if qdisctest.KernelHasFQ(t) {
		t.Log("this kernel has sch_fq: the ErrNoFQ and fallback paths are not observable here")
		return
	}
	t.Run("no sch_fq fails Open", func(t *testing.T) {
		_, err := Open(context.Background(), e.opts)
		if !errors.Is(err, ErrNoFQ) {
			t.Fatalf("Open: %v, want ErrNoFQ", err)
		}
	})
	t.Run("no sch_fq with fallback", func(t *testing.T) {
		opts := e.opts
		opts.EDT.HorizonFallback = true
		d, err := Open(context.Background(), opts)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		for _, i := range d.Status().EDT.Interfaces {
			if (i.Name == a || i.Name == b) && (i.Mode != EDTModeHorizonPolicing || i.Managed || !strings.Contains(i.Reason, "CONFIG_NET_SCH_FQ")) {
				t.Errorf("%s status %+v, want horizon-policing naming CONFIG_NET_SCH_FQ", i.Name, i)
			}
		}
		// Paced services apply as usual.
		svc := e.service(1, 1, 1)
		svc.MaxEgressMbps = 10
		if _, err := d.ApplyService(context.Background(), svc); err != nil {
			t.Fatal(err)
		}
	})
}
