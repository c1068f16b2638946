package edt

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/internal/testutils/qdisctest"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// withFQKind sets the qdisc kind edt_manage_fq installs for one test.
func withFQKind(t *testing.T, kind string) {
	t.Helper()
	t.Cleanup(SetQdiscKind(kind))
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
		defKind, defHandle = qdisctest.RootOf(t, "edt-a")
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
			if kind, h := qdisctest.RootOf(t, "edt-a"); kind != "pfifo" || h != netlink.MakeHandle(HandleMajor, 0) {
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
			if kind, h := qdisctest.RootOf(t, "edt-a"); kind != defKind || h != 0 {
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
			qdisctest.ConfigureRoot(t, "edt-c")
			m, err := installFQ("edt-c")
			if !errors.Is(err, intent.ErrConflict) || !strings.Contains(err.Error(), "pfifo, handle 1:") {
				t.Errorf("install over a configured root: %v, want ErrConflict naming pfifo 1:", err)
			}
			if kind, h := qdisctest.RootOf(t, "edt-c"); kind != "pfifo" || h != netlink.MakeHandle(1, 0) {
				t.Errorf("configured root changed to %s %#x", kind, h)
			}
			if err := removeFQ(m); err != nil {
				t.Error(err)
			}
			if _, h := qdisctest.RootOf(t, "edt-c"); h != netlink.MakeHandle(1, 0) {
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
					if q.kind != "mq" || q.handle != netlink.MakeHandle(HandleMajor, 0) {
						t.Errorf("root %+v, want mq f1d0:", q)
					}
				case q.parent>>16 == HandleMajor:
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
			if !errors.Is(err, intent.ErrConflict) || !strings.Contains(err.Error(), "mq, handle 1:") {
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
			if kind, h := qdisctest.RootOf(t, "edt-b"); kind != defKind || h != 0 {
				t.Errorf("after the failure: root %s %#x", kind, h)
			}
		})
		if skip {
			t.Skip("this kernel has sch_fq: the ErrNoFQ path cannot be observed here")
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
