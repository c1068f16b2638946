// Package qdisctest reads and sets root qdiscs for tests of EDT pacing's
// fq management (fluxvm/internal/edt and fluxvm's Open). Call its
// functions in the network namespace of the interface.
package qdisctest

import (
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// Root returns the interface's root qdisc, or nil when none is listed.
func Root(t testing.TB, name string) netlink.Qdisc {
	t.Helper()
	link, err := netlink.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	qs, err := netlink.QdiscList(link)
	if err != nil {
		t.Fatalf("qdiscs of %s: %v", name, err)
	}
	for _, q := range qs {
		if q.Attrs().Parent == netlink.HANDLE_ROOT {
			return q
		}
	}
	return nil
}

// RootOf returns the kind and handle of the interface's root qdisc ("",
// 0 when none is listed).
func RootOf(t testing.TB, name string) (string, uint32) {
	t.Helper()
	q := Root(t, name)
	if q == nil {
		return "", 0
	}
	return q.Type(), q.Attrs().Handle
}

// ConfigureRoot installs a root qdisc as an operator would
// (tc qdisc add dev name root handle 1: pfifo).
func ConfigureRoot(t testing.TB, name string) {
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

// DeleteRoot deletes the interface's root qdisc, whoever installed it,
// so that the kernel restores its default; none is no error.
func DeleteRoot(t testing.TB, name string) {
	t.Helper()
	if q := Root(t, name); q != nil {
		if err := netlink.QdiscDel(q); err != nil {
			t.Errorf("delete the root qdisc of %s: %v", name, err)
		}
	}
}

// KernelHasFQ reports whether the kernel has the fq qdisc: it installs
// one as the root of a veth in a network namespace of the test's own.
func KernelHasFQ(t *testing.T) bool {
	t.Helper()
	has := false
	testenv.InNetNS(t, func() {
		if _, _, err := testenv.VethPair("fqp-a", "fqp-b"); err != nil {
			t.Fatal(err)
		}
		link, err := netlink.LinkByName("fqp-a")
		if err != nil {
			t.Fatal(err)
		}
		q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Parent: netlink.HANDLE_ROOT, Handle: netlink.MakeHandle(1, 0)}, QdiscType: "fq"}
		has = netlink.QdiscAdd(q) == nil
	})
	return has
}
