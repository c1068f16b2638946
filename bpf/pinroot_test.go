package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestClsBPFAttachmentsAndRemove: with cls_bpf, from_vm and ns_in share
// the ingress slot (priority 1) and to_vm and ns_out the egress one. Each
// filter is listed once, under the hook whose program it runs, and Remove
// (and RemoveRoot, which needs no datapath) deletes each once: listing
// them by direction alone listed every VM-edge filter twice (from_vm also
// as ns_in), and the second removal failed with "not attached".
func TestClsBPFAttachmentsAndRemove(t *testing.T) {
	for _, standalone := range []bool{false, true} {
		name := "Remove"
		if standalone {
			name = "RemoveRoot"
		}
		t.Run(name, func(t *testing.T) {
			root := filepath.Join(testenv.PinRoot(t), "service")
			testenv.InNetNS(t, func() {
				_, vm, err := testenv.VethPair("fvvm-p", "fvvm")
				if err != nil {
					t.Fatal(err)
				}
				_, up, err := testenv.VethPair("fvup-p", "fvup")
				if err != nil {
					t.Fatal(err)
				}
				d := openT(t, Options{PinRoot: root, Tier: TierS, AttachMode: AttachClsBPF})
				want := map[string]bool{}
				for _, a := range []struct {
					link netlink.Link
					hook Hook
				}{{vm, HookFromVM}, {vm, HookToVM}, {up, HookNSIn}, {up, HookNSOut}} {
					if _, err := d.Attach(Interface{Index: a.link.Attrs().Index}, a.hook); err != nil {
						t.Fatal(err)
					}
					want[a.link.Attrs().Name+" "+a.hook.String()] = true
				}
				as, err := d.Attachments()
				if err != nil {
					t.Fatal(err)
				}
				got := map[string]bool{}
				for _, a := range as {
					k := a.Ifname + " " + a.Hook.String()
					if got[k] || !want[k] || a.Mode != AttachClsBPF {
						t.Errorf("attachment %+v: listed twice, not attached or not cls_bpf", a)
					}
					got[k] = true
				}
				if len(got) != len(want) {
					t.Errorf("attachments %+v, want one per hook attached: %v", as, want)
				}
				// Detaching a hook whose direction holds another hook's
				// filter finds it not attached, and leaves that filter.
				if err := d.Detach(Interface{Index: vm.Attrs().Index}, HookNSIn); !errors.Is(err, ErrNotAttached) {
					t.Errorf("detach ns_in from a VM edge: %v, want ErrNotAttached", err)
				}
				// Another program's filter on the uplink's egress: it and
				// its clsact stay; the VM edge's clsact, ours alone, goes.
				foreign, err := ebpf.NewProgram(&ebpf.ProgramSpec{
					Type: ebpf.SchedCLS, License: "GPL",
					Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
				})
				if err != nil {
					t.Fatal(err)
				}
				defer foreign.Close()
				if err := netlink.FilterAdd(&netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{
					LinkIndex: up.Attrs().Index, Parent: netlink.HANDLE_MIN_EGRESS, Priority: 2, Protocol: unix.ETH_P_ALL,
				}, Fd: foreign.FD(), Name: "someone-else", DirectAction: true}); err != nil {
					t.Fatal(err)
				}
				if standalone {
					d.Close()
					err = RemoveRoot(root)
				} else {
					err = d.Remove()
				}
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				for _, l := range []netlink.Link{vm, up} {
					for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
						fs, _ := netlink.FilterList(l, parent)
						for _, f := range fs {
							if bf, ok := f.(*netlink.BpfFilter); ok && strings.HasPrefix(bf.Name, clsPrefix) {
								t.Errorf("%s: filter %s left after %s", l.Attrs().Name, bf.Name, name)
							}
						}
					}
				}
				if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("pin root left: %v", err)
				}
				if hasClsact(t, vm) {
					t.Errorf("%s: the clsact qdisc of our filters left after %s", vm.Attrs().Name, name)
				}
				if !hasClsact(t, up) {
					t.Errorf("%s: the clsact qdisc holding another program's filter removed", up.Attrs().Name)
				}
				if fs, _ := netlink.FilterList(up, netlink.HANDLE_MIN_EGRESS); len(fs) != 1 || fs[0].(*netlink.BpfFilter).Name != "someone-else" {
					t.Errorf("%s egress filters after %s: %+v, want the other program's alone", up.Attrs().Name, name, fs)
				}
			})
		})
	}
}

// hasClsact reports whether l has a clsact qdisc.
func hasClsact(t *testing.T, l netlink.Link) bool {
	t.Helper()
	qs, err := netlink.QdiscList(l)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range qs {
		if q.Type() == "clsact" {
			return true
		}
	}
	return false
}

// TestLockPinRoot: a pin root is held once, within one process too; the
// error names this process; Release lets it go; RemoveRoot removes the
// parents LockPinRoot created (when empty) and only those; bad roots are
// refused.
func TestLockPinRoot(t *testing.T) {
	base := testenv.PinRoot(t)
	// RemoveRoot looks for cls_bpf filters in the namespace it runs in.
	testenv.InNetNS(t, func() {
		root := filepath.Join(base, "made", "fluxvm", "service")
		lk, err := LockPinRoot(Options{PinRoot: root})
		if err != nil {
			t.Fatal(err)
		}
		defer lk.Release()
		_, err = LockPinRoot(Options{PinRoot: root})
		if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "this process") {
			t.Errorf("second lock: %v, want ErrInUse naming this process", err)
		}
		if err := lk.Release(); err != nil {
			t.Fatal(err)
		}
		lk, err = LockPinRoot(Options{PinRoot: root})
		if err != nil {
			t.Fatalf("lock after Release: %v", err)
		}
		// Another pin root beside it is another lock.
		other := filepath.Join(base, "made", "other")
		lk2, err := LockPinRoot(Options{PinRoot: other})
		if err != nil {
			t.Fatalf("lock of another pin root: %v", err)
		}
		lk2.Release()
		if err := RemoveRoot(root); err != nil {
			t.Fatal(err)
		}
		lk.Release()
		// made/fluxvm was LockPinRoot's and is empty: gone; made holds
		// "other": kept.
		if _, err := os.Stat(filepath.Join(base, "made", "fluxvm")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("parent made by LockPinRoot left: %v", err)
		}
		if _, err := os.Stat(other); err != nil {
			t.Errorf("the pin root beside it: %v", err)
		}
		if _, err := os.Stat(base); err != nil {
			t.Errorf("the test's own directory: %v", err)
		}
		// A parent that existed is never removed.
		root = filepath.Join(base, "made", "other", "service")
		if lk, err = LockPinRoot(Options{PinRoot: root}); err != nil {
			t.Fatal(err)
		}
		lk.Release()
		if err := RemoveRoot(root); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(other); err != nil {
			t.Errorf("a parent that existed before was removed: %v", err)
		}
		if err := RemoveRoot("relative/root"); !errors.Is(err, ErrPinRoot) {
			t.Errorf("RemoveRoot of a relative path: %v, want ErrPinRoot", err)
		}
		if err := RemoveRoot("/sys/fs/bpf"); !errors.Is(err, ErrPinRoot) {
			t.Errorf("RemoveRoot of the mount: %v, want ErrPinRoot", err)
		}
	})
}

// TestLockPinRootMarkerFails: when the record of the parents LockPinRoot
// created cannot be made, LockPinRoot fails and removes the pin root and
// those parents again (it used to leave them, with nothing to say they
// were its own). The directory that existed before stays.
func TestLockPinRootMarkerFails(t *testing.T) {
	testenv.RequirePrivileged(t)
	base := testenv.PinRoot(t)
	orig := mkdirMarker
	t.Cleanup(func() { mkdirMarker = orig })
	mkdirMarker = func(string, os.FileMode) error { return unix.ENOSPC }
	root := filepath.Join(base, "a", "b", "service")
	lk, err := LockPinRoot(Options{PinRoot: root})
	if err == nil {
		lk.Release()
		t.Fatal("LockPinRoot succeeded with the record of its parents failing")
	}
	if !errors.Is(err, unix.ENOSPC) {
		t.Errorf("LockPinRoot: %v, want the record's error", err)
	}
	if _, err := os.Stat(filepath.Join(base, "a")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the parents LockPinRoot created are left: %v", err)
	}
	if _, err := os.Stat(base); err != nil {
		t.Errorf("the directory that existed before: %v", err)
	}
	mkdirMarker = orig
	if lk, err = LockPinRoot(Options{PinRoot: root}); err != nil {
		t.Fatalf("LockPinRoot afterwards: %v", err)
	}
	lk.Abandon()
	if _, err := os.Stat(filepath.Join(base, "a")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Abandon left the parents: %v", err)
	}
}
