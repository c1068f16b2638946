package fluxvm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// withFQKind sets the qdisc kind edt_manage_fq installs for one test.
func withFQKind(t *testing.T, kind string) {
	t.Helper()
	prev := fqKind
	fqKind = kind
	t.Cleanup(func() { fqKind = prev })
}

// rootOf returns the kind and handle of the interface's root qdisc.
func rootOf(t *testing.T, name string) (string, uint32) {
	t.Helper()
	link, err := netlink.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	q, err := rootQdisc(link)
	if err != nil {
		t.Fatal(err)
	}
	if q == nil {
		return "", 0
	}
	return q.Type(), q.Attrs().Handle
}

// configureRoot installs a root qdisc as an operator would
// (tc qdisc add dev name root handle 1: pfifo).
func configureRoot(t *testing.T, name string) {
	t.Helper()
	link, err := netlink.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Parent: netlink.HANDLE_ROOT, Handle: netlink.MakeHandle(1, 0)}, QdiscType: "pfifo"}
	if err := netlink.QdiscAdd(q); err != nil {
		t.Fatalf("configure root of %s: %v", name, err)
	}
}

// TestInstallFQ checks the qdisc mechanics of edt_manage_fq in a network
// namespace of the test's own: a default root is replaced and restored,
// a configured root is refused, and on a kernel without sch_fq the real
// attempt fails with ErrNoFQ. pfifo, which every kernel has, stands in
// for fq where the mechanics are tested.
func TestInstallFQ(t *testing.T) {
	ns := testenv.NewNetNS(t, "fluxvm-edtfq")
	// in runs f on a thread in the test's namespace (subtests run on
	// goroutines of their own).
	in := func(t *testing.T, f func()) {
		t.Helper()
		if err := ns.Do(func() error { f(); return nil }); err != nil {
			t.Fatal(err)
		}
	}
	var defKind string
	in(t, func() {
		if _, _, err := testenv.VethPair("edt-a", "edt-b"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := testenv.VethPair("edt-c", "edt-d"); err != nil {
			t.Fatal(err)
		}
		var defHandle uint32
		defKind, defHandle = rootOf(t, "edt-a")
		if defHandle != 0 {
			t.Fatalf("veth default root %s handle %#x, want the kernel's default (0:)", defKind, defHandle)
		}
	})

	t.Run("default root replaced and restored", func(t *testing.T) {
		withFQKind(t, "pfifo")
		in(t, func() {
			m, err := installFQ("edt-a")
			if err != nil {
				t.Fatal(err)
			}
			if !m.installed || m.previous != defKind {
				t.Errorf("installed %+v, want installed over %s", m, defKind)
			}
			if kind, h := rootOf(t, "edt-a"); kind != "pfifo" || h != netlink.MakeHandle(fqHandleMajor, 0) {
				t.Errorf("root %s %#x, want pfifo f1d0:", kind, h)
			}
			// A second start adopts it.
			again, err := installFQ("edt-a")
			if err != nil || !again.installed || again.previous != "" {
				t.Errorf("second install %+v, %v: want adopted", again, err)
			}
			if err := removeFQ(m); err != nil {
				t.Fatal(err)
			}
			if kind, h := rootOf(t, "edt-a"); kind != defKind || h != 0 {
				t.Errorf("after remove: root %s %#x, want the default %s 0:", kind, h, defKind)
			}
			// Removing again, or from a root no longer ours, does nothing.
			if err := removeFQ(m); err != nil {
				t.Error(err)
			}
		})
	})

	t.Run("configured root refused", func(t *testing.T) {
		withFQKind(t, "pfifo")
		in(t, func() {
			configureRoot(t, "edt-c")
			m, err := installFQ("edt-c")
			if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "pfifo, handle 1:") {
				t.Errorf("install over a configured root: %v, want ErrConflict naming pfifo 1:", err)
			}
			if kind, h := rootOf(t, "edt-c"); kind != "pfifo" || h != netlink.MakeHandle(1, 0) {
				t.Errorf("configured root changed to %s %#x", kind, h)
			}
			if err := removeFQ(m); err != nil {
				t.Error(err)
			}
			if _, h := rootOf(t, "edt-c"); h != netlink.MakeHandle(1, 0) {
				t.Errorf("remove took the configured root away")
			}
		})
	})

	t.Run("multi-queue default mq", func(t *testing.T) {
		withFQKind(t, "pfifo")
		skip := ""
		in(t, func() {
			// A multi-queue tap is a device whose default root is mq
			// (veth and dummy devices have noqueue).
			tap := &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: "edt-mq"}, Mode: netlink.TUNTAP_MODE_TAP, Queues: 4, Flags: netlink.TUNTAP_MULTI_QUEUE_DEFAULTS}
			if err := netlink.LinkAdd(tap); err != nil {
				skip = fmt.Sprintf("no multi-queue tap (/dev/net/tun) to give a device the kernel's default mq: %v", err)
				return
			}
			t.Cleanup(func() {
				for _, f := range tap.Fds {
					f.Close()
				}
			})
			l, err := netlink.LinkByName("edt-mq")
			if err != nil {
				t.Fatal(err)
			}
			if err := netlink.LinkSetUp(l); err != nil {
				t.Fatal(err)
			}
			before, err := qdiscsOf("edt-mq")
			if err != nil {
				t.Fatal(err)
			}
			if r, _, other := fqInForce(before); r != "mq" || len(other) == 0 {
				skip = fmt.Sprintf("the multi-queue tap's default root is not mq with default children here: %+v", before)
				return
			}
			m, err := installFQ("edt-mq")
			if err != nil {
				t.Fatal(err)
			}
			if !m.installed || m.adopted || m.previous != "mq" {
				t.Errorf("installed %+v, want installed over mq", m)
			}
			// Our mq at the root, a pfifo (fq) under each of its 4 classes.
			qs, err := qdiscsOf("edt-mq")
			if err != nil {
				t.Fatal(err)
			}
			var classes []uint32
			for _, q := range qs {
				switch {
				case q.parent == handleRoot:
					if q.kind != "mq" || q.handle != netlink.MakeHandle(fqHandleMajor, 0) {
						t.Errorf("root %+v, want mq f1d0:", q)
					}
				case q.parent>>16 == fqHandleMajor:
					if q.kind != "pfifo" {
						t.Errorf("class %s: %s, want pfifo", netlink.HandleStr(q.parent), q.kind)
					}
					classes = append(classes, q.parent)
				}
			}
			if len(classes) != 4 {
				t.Errorf("children of our mq %v, want one per TX queue (4): %+v", classes, qs)
			}
			if r, fq, other := fqInForce(qs); r != "mq" || !fq {
				t.Errorf("mode: root %s fq %v (%v), want mq with fq", r, fq, other)
			}
			// A second start adopts it.
			if again, err := installFQ("edt-mq"); err != nil || !again.installed || !again.adopted {
				t.Errorf("second install %+v, %v: want adopted", again, err)
			}
			// Removal: the kernel puts its default mq back, with a
			// default child on every queue (none left with noop).
			if err := removeFQ(m); err != nil {
				t.Fatal(err)
			}
			after, err := qdiscsOf("edt-mq")
			if err != nil {
				t.Fatal(err)
			}
			slices.SortFunc(before, func(a, b qdiscInfo) int { return cmp.Compare(a.parent, b.parent) })
			slices.SortFunc(after, func(a, b qdiscInfo) int { return cmp.Compare(a.parent, b.parent) })
			if !slices.Equal(before, after) {
				t.Errorf("after remove: %+v, want the defaults %+v", after, before)
			}
			// With the real fq on a kernel without sch_fq: ErrNoFQ, and
			// the default mq is back.
			fqKind = "fq"
			m, err = installFQ("edt-mq")
			if err == nil {
				removeFQ(m)
				return
			}
			if !errors.Is(err, ErrNoFQ) {
				t.Errorf("install fq under mq: %v, want ErrNoFQ", err)
			}
			after, _ = qdiscsOf("edt-mq")
			slices.SortFunc(after, func(a, b qdiscInfo) int { return cmp.Compare(a.parent, b.parent) })
			if !slices.Equal(before, after) {
				t.Errorf("after the failed install: %+v, want the defaults %+v", after, before)
			}
		})
		if skip != "" {
			t.Skip(skip)
		}
	})

	t.Run("configured mq refused", func(t *testing.T) {
		withFQKind(t, "pfifo")
		in(t, func() {
			va := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "edt-mqa", NumTxQueues: 4, NumRxQueues: 4}, PeerName: "edt-mqb"}
			if err := netlink.LinkAdd(va); err != nil {
				t.Fatal(err)
			}
			l, err := netlink.LinkByName("edt-mqa")
			if err != nil {
				t.Fatal(err)
			}
			// tc qdisc replace dev edt-mqa root handle 1: mq
			mq := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_ROOT, Handle: netlink.MakeHandle(1, 0)}, QdiscType: "mq"}
			if err := netlink.QdiscReplace(mq); err != nil {
				t.Fatalf("mq on a 4-queue veth: %v", err)
			}
			_, err = installFQ("edt-mqa")
			if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "mq, handle 1:") {
				t.Errorf("install over a configured mq: %v, want ErrConflict naming mq 1:", err)
			}
			qs, err := qdiscsOf("edt-mqa")
			if err != nil {
				t.Fatal(err)
			}
			if r, fq, other := fqInForce(qs); r != "mq" || fq || len(other) == 0 {
				t.Errorf("mode with default children: root %s fq %v (%v), want mq, not fq", r, fq, other)
			}
			// The operator puts fq (pfifo) under every class: fq mode.
			for i := uint16(1); i <= 4; i++ {
				c := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.MakeHandle(1, i)}, QdiscType: "pfifo"}
				if err := netlink.QdiscReplace(c); err != nil {
					t.Fatal(err)
				}
				if qs, err = qdiscsOf("edt-mqa"); err != nil {
					t.Fatal(err)
				}
				if _, fq, _ := fqInForce(qs); fq != (i == 4) {
					t.Errorf("fq under %d of 4 classes: fq mode %v", i, fq)
				}
			}
		})
	})

	t.Run("no sch_fq", func(t *testing.T) {
		skip := false
		in(t, func() {
			m, err := installFQ("edt-b")
			if err == nil {
				removeFQ(m)
				skip = true
				return
			}
			if !errors.Is(err, ErrNoFQ) || !strings.Contains(err.Error(), "CONFIG_NET_SCH_FQ") {
				t.Errorf("install fq: %v, want ErrNoFQ naming CONFIG_NET_SCH_FQ", err)
			}
			if kind, h := rootOf(t, "edt-b"); kind != defKind || h != 0 {
				t.Errorf("after the failure: root %s %#x", kind, h)
			}
		})
		if skip {
			t.Skip("this kernel has sch_fq: the ErrNoFQ path cannot be observed here")
		}
	})
}

// kernelHasFQ reports whether fq can be installed (in a namespace of the
// test's own).
func kernelHasFQ(t *testing.T) bool {
	has := false
	testenv.InNetNS(t, func() {
		if _, _, err := testenv.VethPair("fqp-a", "fqp-b"); err != nil {
			t.Fatal(err)
		}
		m, err := installFQ("fqp-a")
		has = err == nil
		removeFQ(m)
	})
	return has
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
	e.opts.EDTEnabled = true
	e.opts.EDTManageFQ = true
	a, b := e.backends[0].NodeIf, e.backends[1].NodeIf
	e.opts.EDTInterfaces = []string{a, b}
	inNode := func(f func()) {
		t.Helper()
		if err := e.lab.Node.Do(func() error { f(); return nil }); err != nil {
			t.Fatal(err)
		}
	}
	var defKind string
	inNode(func() { defKind, _ = rootOf(t, a) })

	t.Run("installed, kept at Close, adopted, removed", func(t *testing.T) {
		withFQKind(t, "pfifo")
		d, err := Open(context.Background(), e.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		inNode(func() {
			for _, n := range []string{a, b} {
				if kind, h := rootOf(t, n); kind != "pfifo" || h != netlink.MakeHandle(fqHandleMajor, 0) {
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
					kind, h := rootOf(t, n)
					if slices.Contains(ours, n) {
						if kind != "pfifo" || h != netlink.MakeHandle(fqHandleMajor, 0) {
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
		opts.EDTInterfaces = []string{a}
		if d, err = Open(context.Background(), opts); err != nil {
			t.Fatal(err)
		}
		d.Close()
		wantRoots("b no longer listed", a)
		opts.EDTManageFQ, opts.EDTInterfaces = false, nil
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
		opts.EDTInterfaces = []string{a}
		d, err := Open(context.Background(), opts)
		if err != nil {
			t.Fatal(err)
		}
		d.Close()
		inNode(func() { configureRoot(t, b) })
		if d, err := Open(context.Background(), e.opts); err == nil {
			d.Close()
			t.Fatal("Open succeeded over a configured root qdisc")
		}
		inNode(func() {
			if kind, h := rootOf(t, a); kind != "pfifo" || h != netlink.MakeHandle(fqHandleMajor, 0) {
				t.Errorf("%s root %s %#x after the failed Open, want ours kept", a, kind, h)
			}
			link, _ := netlink.LinkByName(b)
			if q, _ := rootQdisc(link); q != nil {
				netlink.QdiscDel(q)
			}
			if _, err := removeOurRoot(a); err != nil {
				t.Fatal(err)
			}
		})
	})

	t.Run("configured root fails Open, nothing left", func(t *testing.T) {
		withFQKind(t, "pfifo")
		inNode(func() { configureRoot(t, b) })
		t.Cleanup(func() {
			inNode(func() {
				link, _ := netlink.LinkByName(b)
				q, _ := rootQdisc(link)
				if q != nil {
					netlink.QdiscDel(q)
				}
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
			if kind, h := rootOf(t, a); kind != defKind || h != 0 {
				t.Errorf("%s root %s %#x after the failed Open, want the default", a, kind, h)
			}
		})
	})

	t.Run("missing interface fails Open, nothing left", func(t *testing.T) {
		withFQKind(t, "pfifo")
		opts := e.opts
		opts.EDTInterfaces = []string{a, "nope0"}
		d, err := Open(context.Background(), opts)
		if err == nil {
			d.Close()
			t.Fatal("Open succeeded with a missing EDT interface")
		}
		if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `interface "nope0"`) {
			t.Errorf("Open: %v, want ErrNotFound naming \"nope0\"", err)
		}
		inNode(func() {
			if kind, h := rootOf(t, a); kind != defKind || h != 0 {
				t.Errorf("%s root %s %#x after the failed Open, want the default", a, kind, h)
			}
		})
	})

	if kernelHasFQ(t) {
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
		opts.EDTHorizonFallback = true
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

// TestFQAddError: only the kernel's "unknown qdisc kind" (ENOENT) is
// ErrNoFQ, which edt_horizon_fallback accepts; any other failure to
// create fq fails as itself.
func TestFQAddError(t *testing.T) {
	for _, c := range []struct {
		err  error
		noFQ bool
	}{
		{unix.ENOENT, true},
		{unix.EOPNOTSUPP, false},
		{unix.EINVAL, false},
		{unix.EPERM, false},
		{unix.ENOMEM, false},
	} {
		err := fqAddError("eth0", c.err)
		if errors.Is(err, ErrNoFQ) != c.noFQ || !errors.Is(err, c.err) || !strings.Contains(err.Error(), "eth0") {
			t.Errorf("%v: %v, want ErrNoFQ %v, wrapping the errno, naming the interface", c.err, err, c.noFQ)
		}
	}
}
