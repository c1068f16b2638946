package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/fluxvm/servicefabric/internal/testutils/cgtest"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// cgroupPrograms lists the programs attached to one hook of a cgroup.
func cgroupPrograms(t *testing.T, path string, h CgroupHook) []ebpf.ProgramID {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: h.attachType()})
	if err != nil {
		t.Fatal(err)
	}
	var ids []ebpf.ProgramID
	for _, p := range r.Programs {
		ids = append(ids, p.ID)
	}
	return ids
}

// TestAttachCgroup: every socket hook attached to the cgroup with a
// pinned link; a restart (a new Datapath) updates the same links in place
// with its programs; another program on the cgroup's hooks stays; a
// path that is not a cgroup v2 directory is refused before anything is
// attached; detach removes only ours; Remove removes them.
func TestAttachCgroup(t *testing.T) {
	cg := cgtest.New(t)
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})

	// Another product's program on one hook.
	other, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.CGroupSockAddr, AttachType: ebpf.AttachCGroupInet4Connect,
		License: "GPL", Instructions: connectAllow()})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	ol, err := link.AttachCgroup(link.CgroupOptions{Path: cg.Path, Attach: ebpf.AttachCGroupInet4Connect, Program: other})
	if err != nil {
		t.Fatal(err)
	}
	defer ol.Close()
	otherID := progID(t, other)

	a, err := d.AttachCgroup(cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.Hooks, CgroupHooks) || !slices.Equal(a.New, CgroupHooks) || a.Reused || a.ID == 0 {
		t.Fatalf("attachment %+v", a)
	}
	linkIDs := map[CgroupHook]link.ID{}
	for _, h := range CgroupHooks {
		ids := cgroupPrograms(t, cg.Path, h)
		if !slices.Contains(ids, progID(t, d.cgroupProgram(h))) {
			t.Errorf("%s runs %v, not ours", h, ids)
		}
		linkIDs[h] = pinnedLinkID(t, d.cgroupPin(a.ID, h))
	}
	if ids := cgroupPrograms(t, cg.Path, HookConnect4); !slices.Contains(ids, otherID) {
		t.Errorf("connect4 runs %v: the other product's program %d is gone", ids, otherID)
	}
	if as, err := d.CgroupAttachments(); err != nil || len(as) != 1 || as[0].ID != a.ID || !slices.Equal(as[0].Hooks, CgroupHooks) {
		t.Errorf("CgroupAttachments %+v, %v", as, err)
	}

	// A restart: the same links, the new programs.
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	a2, err := d.AttachCgroup(cg.Path)
	if err != nil || !a2.Reused || len(a2.New) != 0 {
		t.Fatalf("again: %+v, %v", a2, err)
	}
	for _, h := range CgroupHooks {
		if got := pinnedLinkID(t, d.cgroupPin(a.ID, h)); got != linkIDs[h] {
			t.Errorf("%s: link %d replaced by %d", h, linkIDs[h], got)
		}
		ids := cgroupPrograms(t, cg.Path, h)
		if !slices.Contains(ids, progID(t, d.cgroupProgram(h))) {
			t.Errorf("after the restart %s runs %v, not the new program", h, ids)
		}
	}

	// Not a cgroup v2 directory.
	if _, err := d.AttachCgroup(t.TempDir()); !errors.Is(err, ErrNotCgroupV2) {
		t.Errorf("a tmp directory: %v, want ErrNotCgroupV2", err)
	}

	if err := d.DetachCgroup(cg.Path); err != nil {
		t.Fatal(err)
	}
	for _, h := range CgroupHooks {
		ids := cgroupPrograms(t, cg.Path, h)
		if slices.Contains(ids, progID(t, d.cgroupProgram(h))) {
			t.Errorf("detached: %s still runs ours", h)
		}
	}
	if ids := cgroupPrograms(t, cg.Path, HookConnect4); !slices.Equal(ids, []ebpf.ProgramID{otherID}) {
		t.Errorf("detached: connect4 runs %v, want the other product's %d alone", ids, otherID)
	}
	if err := d.DetachCgroup(cg.Path); !errors.Is(err, ErrNotAttached) {
		t.Errorf("detach again: %v, want ErrNotAttached", err)
	}

	// Remove takes them with everything else.
	if _, err := d.AttachCgroup(cg.Path); err != nil {
		t.Fatal(err)
	}
	testenv.InNetNS(t, func() {
		if err := d.Remove(); err != nil {
			t.Fatal(err)
		}
	})
	if ids := cgroupPrograms(t, cg.Path, HookSendmsg4); len(ids) != 0 {
		t.Errorf("after Remove sendmsg4 runs %v", ids)
	}
}

// connectAllow is a sock_addr program that lets every call go on.
func connectAllow() asm.Instructions {
	return asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}
}

// TestCgroupHookPrograms: every hook names a program of the socket object,
// and every program of it is a hook's (or the iterator's, elsewhere).
func TestCgroupHookPrograms(t *testing.T) {
	spec, err := loadServiceConnect()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, h := range CgroupHooks {
		ps := spec.Programs[h.program()]
		if ps == nil {
			t.Errorf("hook %s: no program %s", h, h.program())
			continue
		}
		if ps.AttachType != h.attachType() {
			t.Errorf("hook %s: program %s attaches as %v, want %v", h, h.program(), ps.AttachType, h.attachType())
		}
		seen[h.program()] = true
	}
	for name := range spec.Programs {
		if !seen[name] {
			t.Errorf("program %s is no hook's", name)
		}
	}
}

// TestAttachCgroupDeadLink: a pinned link detached from outside (bpftool
// link detach) is dropped and attached afresh, not trusted by its name.
func TestAttachCgroupDeadLink(t *testing.T) {
	cg := cgtest.New(t)
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	a, err := d.AttachCgroup(cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	l, err := link.LoadPinnedLink(d.cgroupPin(a.ID, HookConnect4), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Detach(); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if ids := cgroupPrograms(t, cg.Path, HookConnect4); len(ids) != 0 {
		t.Fatalf("detached from outside, connect4 still runs %v", ids)
	}
	a, err = d.AttachCgroup(cg.Path)
	if err != nil || a.Reused {
		t.Fatalf("attach again: %+v, %v; want a fresh attachment", a, err)
	}
	if ids := cgroupPrograms(t, cg.Path, HookConnect4); !slices.Contains(ids, progID(t, d.cgroupProgram(HookConnect4))) {
		t.Errorf("connect4 runs %v after attaching again, not ours", ids)
	}
}

// TestSocketMapsSizedByNeed: without Options.SocketLB the socket maps get
// a token size (an LRU map is preallocated); with it, the tier's; turning
// it on carries what they held over.
func TestSocketMapsSizedByNeed(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	if n := d.Maps().FluxvmSockRev.MaxEntries(); n != socketMapsOff || d.Status().Capacities.Sockets != socketMapsOff {
		t.Errorf("socket LB off: fluxvm_sock_rev %d entries, capacity %d; want %d", n, d.Status().Capacities.Sockets, socketMapsOff)
	}
	k := SockRevKey{Cookie: 9, Addr: [4]uint32{0x0a000001}, Port: Port(53), Proto: 17, Family: FamilyIPv4}
	if err := d.Maps().FluxvmSockRev.Put(k, SockRevValue{ServiceId: 1}); err != nil {
		t.Fatal(err)
	}
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS, SocketLB: true})
	if n := d.Maps().FluxvmSockRev.MaxEntries(); n != 16384 {
		t.Errorf("socket LB on: fluxvm_sock_rev %d entries, want the tier's 16384", n)
	}
	var v SockRevValue
	if err := d.Maps().FluxvmSockRev.Lookup(k, &v); err != nil {
		t.Errorf("the entry held before: %v", err)
	}
}
