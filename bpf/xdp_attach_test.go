package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// xdpOn returns the id and mode of the XDP program on the interface.
func xdpOn(t *testing.T, index int) (ebpf.ProgramID, XDPMode) {
	t.Helper()
	id, mode, err := xdpOnInterface(index)
	if err != nil {
		t.Fatal(err)
	}
	return ebpf.ProgramID(id), mode
}

// xdpVethPair is testenv.VethPair with the transmit offloads of tx that
// hide state from XDP off (testenv.SendPlainFrames), so that AttachXDP
// takes rx.
func xdpVethPair(tx, rx string) (netlink.Link, netlink.Link, error) {
	a, b, err := testenv.VethPair(tx, rx)
	if err == nil {
		err = testenv.SendPlainFrames(tx)
	}
	return a, b, err
}

// pinnedLinkID is the id of the link pinned at path.
func pinnedLinkID(t *testing.T, path string) link.ID {
	t.Helper()
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		t.Fatal(err)
	}
	return info.ID
}

// foreignXDPProgram loads a trivial XDP program (XDP_PASS) named
// "not_fluxvm", as another product's program would be.
func foreignXDPProgram(t *testing.T) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "not_fluxvm", Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2), asm.Return()},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TestAttachXDP: the XDP program on a veth in each mode; attaching again
// updates our link in place; a restart (Close, Open) keeps the pinned link
// and mode and puts the new program in it (the same link id, no gap);
// DetachXDP and Remove leave nothing attached.
func TestAttachXDP(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := xdpVethPair("fvxtx", "fvxrx")
		if err != nil {
			t.Fatal(err)
		}
		idx := rx.Attrs().Index
		pin := filepath.Join(root, "links", fmt.Sprintf("xdp_%d", idx))
		d := openT(t, Options{PinRoot: root, Tier: TierS})

		for _, tc := range []struct{ ask, want XDPMode }{
			{XDPNative, XDPNative}, {XDPGeneric, XDPGeneric}, {XDPAuto, XDPGeneric}, {XDPNative, XDPNative}, {XDPAuto, XDPNative},
		} {
			a, err := d.AttachXDP(Interface{Name: "fvxrx"}, tc.ask)
			if err != nil {
				t.Fatalf("attach %s: %v", tc.ask, err)
			}
			id, mode := xdpOn(t, idx)
			if a.Mode != tc.want || mode != tc.want || id != progID(t, d.XDPPrograms().FluxvmXdpNs) || a.Ifindex != idx {
				t.Fatalf("attach %s: %+v; interface runs %d in %s; want %s, program %d", tc.ask, a, id, mode, tc.want, progID(t, d.XDPPrograms().FluxvmXdpNs))
			}
			if got, _ := d.XDPMode(Interface{Index: idx}); got != tc.want {
				t.Errorf("XDPMode %s, want %s", got, tc.want)
			}
		}
		// Auto keeps the mode in force, on the same link.
		before := pinnedLinkID(t, pin)
		if a, err := d.AttachXDP(Interface{Index: idx}, XDPAuto); err != nil || !a.Reused || a.Mode != XDPNative {
			t.Fatalf("attach auto again: %+v, %v", a, err)
		}
		if got := pinnedLinkID(t, pin); got != before {
			t.Errorf("link %d replaced by %d: want the same link updated", before, got)
		}

		// A restart keeps the link and its mode; the new program runs in it.
		old := progID(t, d.XDPPrograms().FluxvmXdpNs)
		d.Close()
		if id, mode := xdpOn(t, idx); id != old || mode != XDPNative {
			t.Fatalf("after Close the interface runs %d in %s, want %d native", id, mode, old)
		}
		d = openT(t, Options{PinRoot: root, Tier: TierS})
		id, mode := xdpOn(t, idx)
		if nid := progID(t, d.XDPPrograms().FluxvmXdpNs); id != nid || id == old || mode != XDPNative {
			t.Errorf("after Open the interface runs %d in %s, want the new program %d native", id, mode, nid)
		}
		if got := pinnedLinkID(t, pin); got != before {
			t.Errorf("link %d replaced by %d across the restart", before, got)
		}
		found := false
		for _, l := range d.Status().Links {
			found = found || l == filepath.Base(pin)
		}
		if !found {
			t.Errorf("Status.Links %v lacks %s", d.Status().Links, filepath.Base(pin))
		}

		if err := d.DetachXDP(Interface{Index: idx}); err != nil {
			t.Fatal(err)
		}
		if id, _ := xdpOn(t, idx); id != 0 {
			t.Errorf("program %d still attached after DetachXDP", id)
		}
		if err := d.DetachXDP(Interface{Index: idx}); !errors.Is(err, ErrNotAttached) {
			t.Errorf("second DetachXDP: %v, want ErrNotAttached", err)
		}

		// Remove detaches it too.
		if _, err := d.AttachXDP(Interface{Index: idx}, XDPGeneric); err != nil {
			t.Fatal(err)
		}
		if err := d.Remove(); err != nil {
			t.Fatal(err)
		}
		if id, _ := xdpOn(t, idx); id != 0 {
			t.Errorf("program %d still attached after Remove", id)
		}
	})
}

// TestAttachXDPAutoFallsBack: a driver without native XDP (a bridge; the
// dummy driver is not in every kernel) gets generic under auto, and
// native fails.
func TestAttachXDPAutoFallsBack(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "fvxbr"}}); err != nil {
			t.Fatal(err)
		}
		l, err := netlink.LinkByName("fvxbr")
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		if _, err := d.AttachXDP(Interface{Name: "fvxbr"}, XDPNative); err == nil {
			t.Fatal("native XDP on a bridge succeeded; want the driver's refusal")
		}
		if id, _ := xdpOn(t, l.Attrs().Index); id != 0 {
			t.Fatalf("failed native attach left program %d", id)
		}
		a, err := d.AttachXDP(Interface{Name: "fvxbr"}, XDPAuto)
		if err != nil || a.Mode != XDPGeneric {
			t.Fatalf("auto: %+v, %v; want generic", a, err)
		}
		if _, mode := xdpOn(t, l.Attrs().Index); mode != XDPGeneric {
			t.Errorf("interface runs XDP in %s, want generic", mode)
		}
	})
}

// TestAttachXDPRefusesForeign: an XDP program of someone else's on the
// interface, attached by a link or the old netlink way, is named in the
// error and stays attached; DetachXDP does not remove it.
func TestAttachXDPRefusesForeign(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := xdpVethPair("fvxtx", "fvxrx")
		if err != nil {
			t.Fatal(err)
		}
		idx := rx.Attrs().Index
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		foreign := foreignXDPProgram(t)
		fid := progID(t, foreign)

		for _, how := range []string{"link", "netlink"} {
			t.Run(how, func(t *testing.T) {
				var undo func()
				switch how {
				case "link":
					l, err := link.AttachXDP(link.XDPOptions{Program: foreign, Interface: idx, Flags: link.XDPGenericMode})
					if err != nil {
						t.Fatal(err)
					}
					undo = func() { l.Close() }
				case "netlink":
					if err := netlink.LinkSetXdpFdWithFlags(rx, foreign.FD(), 1<<1 /* XDP_FLAGS_SKB_MODE */); err != nil {
						t.Fatal(err)
					}
					undo = func() { netlink.LinkSetXdpFdWithFlags(rx, -1, 1<<1) }
				}
				defer undo()
				for _, mode := range []XDPMode{XDPNative, XDPGeneric, XDPAuto} {
					_, err := d.AttachXDP(Interface{Index: idx}, mode)
					if !errors.Is(err, ErrForeignProgram) || !strings.Contains(err.Error(), "not_fluxvm") || !strings.Contains(err.Error(), fmt.Sprintf("id %d", fid)) {
						t.Fatalf("attach %s over a foreign program: %v; want ErrForeignProgram naming not_fluxvm, id %d", mode, err, fid)
					}
					if id, _ := xdpOn(t, idx); id != fid {
						t.Fatalf("the interface runs %d, want the foreign program %d still", id, fid)
					}
				}
				if err := d.DetachXDP(Interface{Index: idx}); !errors.Is(err, ErrNotAttached) {
					t.Errorf("DetachXDP: %v, want ErrNotAttached", err)
				}
				if got, _ := d.XDPMode(Interface{Index: idx}); got != XDPOff {
					t.Errorf("XDPMode %s over a foreign program, want off", got)
				}
				if id, _ := xdpOn(t, idx); id != fid {
					t.Fatalf("the interface runs %d after DetachXDP, want the foreign program %d", id, fid)
				}
				if _, err := os.Stat(filepath.Join(root, "links", fmt.Sprintf("xdp_%d", idx))); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("a link pin exists for a refused attach: %v", err)
				}
			})
		}
	})
}

// TestStagedTierChangeXDP: a tier change loads the XDP program of the new
// tier on the new maps; the attached link keeps running the old program
// until Activate, which puts the new one in the same link.
func TestStagedTierChangeXDP(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, rx, err := xdpVethPair("fvxtx", "fvxrx")
		if err != nil {
			t.Fatal(err)
		}
		idx := rx.Attrs().Index
		pin := filepath.Join(root, "links", fmt.Sprintf("xdp_%d", idx))
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		if _, err := d.AttachXDP(Interface{Index: idx}, XDPNative); err != nil {
			t.Fatal(err)
		}
		old, linkID := progID(t, d.XDPPrograms().FluxvmXdpNs), pinnedLinkID(t, pin)
		d.Close()

		d = openT(t, Options{PinRoot: root, Tier: TierM, Staged: true})
		xp := d.XDPPrograms().FluxvmXdpNs
		info, err := xp.Info()
		if err != nil {
			t.Fatal(err)
		}
		ids, _ := info.MapIDs()
		svc, err := d.Maps().FluxvmSvc4.Info()
		if err != nil {
			t.Fatal(err)
		}
		svcID, _ := svc.ID()
		found := false
		for _, id := range ids {
			found = found || id == svcID
		}
		if !found {
			t.Errorf("the XDP program uses maps %v, not the datapath's fluxvm_svc4 (%d)", ids, svcID)
		}
		if id, _ := xdpOn(t, idx); id != old {
			t.Fatalf("before Activate the interface runs %d, want the old program %d", id, old)
		}
		// Attaching again before Activate leaves the pinned link to it.
		if a, err := d.AttachXDP(Interface{Index: idx}, XDPNative); err != nil || a.Mode != XDPNative {
			t.Fatalf("AttachXDP before Activate: %+v, %v", a, err)
		}
		if id, _ := xdpOn(t, idx); id != old {
			t.Fatalf("AttachXDP before Activate: the interface runs %d, want the old program %d until Activate", id, old)
		}
		if err := d.Activate(); err != nil {
			t.Fatal(err)
		}
		if id, mode := xdpOn(t, idx); id != progID(t, xp) || mode != XDPNative {
			t.Errorf("after Activate the interface runs %d in %s, want %d native", id, mode, progID(t, xp))
		}
		if got := pinnedLinkID(t, pin); got != linkID {
			t.Errorf("link %d replaced by %d", linkID, got)
		}
	})
}

// TestOpenAfterXDPInterfaceDeleted: the pin of an XDP link whose
// interface was deleted while no process ran is dropped at Open.
func TestOpenAfterXDPInterfaceDeleted(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	testenv.InNetNS(t, func() {
		_, gone, err := xdpVethPair("fvxgone-p", "fvxgone")
		if err != nil {
			t.Fatal(err)
		}
		d := openT(t, Options{PinRoot: root, Tier: TierS})
		if _, err := d.AttachXDP(Interface{Index: gone.Attrs().Index}, XDPNative); err != nil {
			t.Fatal(err)
		}
		d.Close()
		if err := netlink.LinkDel(gone); err != nil {
			t.Fatal(err)
		}
		d = openT(t, Options{PinRoot: root, Tier: TierS})
		want := fmt.Sprintf("xdp_%d", gone.Attrs().Index)
		if got := d.Status().SeveredLinks; len(got) != 1 || got[0] != want {
			t.Errorf("severed links %v, want [%s]", got, want)
		}
		if _, err := os.Stat(filepath.Join(root, "links", want)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pin of the severed link: %v", err)
		}
	})
}
