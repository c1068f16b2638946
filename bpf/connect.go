package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/cgroup2"
)

// ConnectPrograms are the programs of the socket load-balancing object
// (fluxvm_service_connect.bpf.c), one field each, as bpf2go generates them.
type ConnectPrograms = serviceConnectPrograms

// ConnectPrograms returns the loaded socket load-balancing programs, which
// run on the datapath's own maps. After Close every field is nil.
func (d *Datapath) ConnectPrograms() *ConnectPrograms {
	d.live.RLock()
	defer d.live.RUnlock()
	p := d.cprogs
	return &p
}

// ConnectObjectName is the file name of the socket load-balancing object
// of tier t as operators install it (scripts/build-ebpf.sh --install).
func ConnectObjectName(t Tier) string {
	return "fluxvm_service_connect_tier_" + t.String() + ".bpf.o"
}

// SpecConnect returns the collection spec of the embedded socket
// load-balancing object of tier t. It declares the TC object's maps, which
// the loader replaces with the datapath's own. Each call returns a fresh
// copy.
func SpecConnect(t Tier) (*ebpf.CollectionSpec, error) {
	return embeddedSpec(t, "socket LB", loadServiceConnectTierS, loadServiceConnect, loadServiceConnectTierL)
}

func loadConnect(opts Options, coll *ebpf.Collection) (*ebpf.Collection, error) {
	return loadSide(opts, coll, "socket LB", SpecConnect, ConnectObjectName)
}

// CgroupHook is one socket hook of the socket load-balancing object.
type CgroupHook string

// The socket hooks, each a cgroup sock_addr attach point.
const (
	HookConnect4     CgroupHook = "connect4"     // TCP and UDP connect, IPv4
	HookConnect6     CgroupHook = "connect6"     // and IPv6 (IPv4-mapped too)
	HookSendmsg4     CgroupHook = "sendmsg4"     // UDP sends with an address
	HookSendmsg6     CgroupHook = "sendmsg6"     //
	HookRecvmsg4     CgroupHook = "recvmsg4"     // UDP receives: the VIP as the source
	HookRecvmsg6     CgroupHook = "recvmsg6"     //
	HookGetpeername4 CgroupHook = "getpeername4" // the VIP as the peer
	HookGetpeername6 CgroupHook = "getpeername6" //
	HookSockRelease  CgroupHook = "sock_release" // a connected socket's association forgotten at close
)

// CgroupHooks lists every socket hook, in attach order.
var CgroupHooks = []CgroupHook{
	HookConnect4, HookConnect6, HookSendmsg4, HookSendmsg6,
	HookRecvmsg4, HookRecvmsg6, HookGetpeername4, HookGetpeername6, HookSockRelease,
}

func (h CgroupHook) attachType() ebpf.AttachType {
	return map[CgroupHook]ebpf.AttachType{
		HookConnect4: ebpf.AttachCGroupInet4Connect, HookConnect6: ebpf.AttachCGroupInet6Connect,
		HookSendmsg4: ebpf.AttachCGroupUDP4Sendmsg, HookSendmsg6: ebpf.AttachCGroupUDP6Sendmsg,
		HookRecvmsg4: ebpf.AttachCGroupUDP4Recvmsg, HookRecvmsg6: ebpf.AttachCGroupUDP6Recvmsg,
		HookGetpeername4: ebpf.AttachCgroupInet4GetPeername, HookGetpeername6: ebpf.AttachCgroupInet6GetPeername,
		HookSockRelease: ebpf.AttachCgroupInetSockRelease,
	}[h]
}

// program is the name of the hook's program in the socket object.
func (h CgroupHook) program() string {
	if h == HookSockRelease {
		return "fluxvm_sock_release"
	}
	return "fluxvm_sock_" + string(h)
}

// cgroupProgram is the hook's program in d's socket object.
func (d *Datapath) cgroupProgram(h CgroupHook) *ebpf.Program {
	p := d.cprogs
	return map[CgroupHook]*ebpf.Program{
		HookConnect4: p.FluxvmSockConnect4, HookConnect6: p.FluxvmSockConnect6,
		HookSendmsg4: p.FluxvmSockSendmsg4, HookSendmsg6: p.FluxvmSockSendmsg6,
		HookRecvmsg4: p.FluxvmSockRecvmsg4, HookRecvmsg6: p.FluxvmSockRecvmsg6,
		HookGetpeername4: p.FluxvmSockGetpeername4, HookGetpeername6: p.FluxvmSockGetpeername6,
		HookSockRelease: p.FluxvmSockRelease,
	}[h]
}

// CgroupAttachment is the socket load-balancing programs on one cgroup.
type CgroupAttachment struct {
	// Path is the cgroup's directory on the cgroup v2 filesystem, and ID
	// its cgroup id (the directory's inode number).
	Path string
	ID   uint64
	// Hooks are the hooks attached, in CgroupHooks order.
	Hooks []CgroupHook
	// Reused: our pinned links were already there and now run this
	// datapath's programs (link.Update, no gap), or will at Activate when
	// the datapath was opened staged.
	Reused bool
	// New are the hooks this call attached (the others were pinned
	// already and kept); all of Hooks when nothing was there.
	New []CgroupHook
}

// ErrNotCgroupV2 reports a cgroup path that is not a directory of a
// cgroup v2 filesystem: the socket hooks attach to cgroup v2 only.
var ErrNotCgroupV2 = cgroup2.ErrNotCgroupV2

// cgroupID is the id of the cgroup at path (its inode on cgroup2), after
// checking that path is a cgroup v2 directory.
func cgroupID(path string) (uint64, error) {
	if err := cgroup2.Check(path); err != nil {
		return 0, err
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("cgroup %s: %w", path, err)
	}
	return st.Ino, nil
}

func (d *Datapath) cgroupPin(id uint64, h CgroupHook) string {
	return filepath.Join(linkDir(d.opts.PinRoot), fmt.Sprintf("cgroup_%d_%s", id, h))
}

func parseCgroupPin(name string) (uint64, CgroupHook, bool) {
	rest, ok := strings.CutPrefix(name, "cgroup_")
	if !ok {
		return 0, "", false
	}
	ids, hook, ok := strings.Cut(rest, "_")
	if !ok {
		return 0, "", false
	}
	id, err := strconv.ParseUint(ids, 10, 64)
	if err != nil || CgroupHook(hook).attachType() == 0 {
		return 0, "", false
	}
	return id, CgroupHook(hook), true
}

// AttachCgroup attaches every socket hook of the socket load-balancing
// object to the cgroup v2 directory path, so that it serves the sockets
// of every process in that cgroup and below it, with BPF links pinned
// under the pin root (links/cgroup_<id>_<hook>): they stay attached after
// this process exits, and a restart or upgrade replaces the programs in
// them atomically, with no gap. Other programs attached to the cgroup's
// hooks, ours or another product's, are left alone: cgroup hooks run
// every program attached. A path that is not a cgroup v2 directory is
// ErrNotCgroupV2; on failure, the hooks this call attached are detached
// again.
func (d *Datapath) AttachCgroup(path string) (CgroupAttachment, error) {
	if d.coll == nil {
		return CgroupAttachment{}, ErrClosed
	}
	id, err := cgroupID(path)
	if err != nil {
		return CgroupAttachment{}, fmt.Errorf("bpf: attach socket hooks: %w", err)
	}
	a := CgroupAttachment{Path: path, ID: id, Reused: true}
	var made []string
	undo := func(err error) (CgroupAttachment, error) {
		for _, pin := range made {
			if l, lerr := link.LoadPinnedLink(pin, nil); lerr == nil {
				err = errors.Join(err, l.Unpin(), l.Close())
			}
		}
		return CgroupAttachment{}, err
	}
	for _, h := range CgroupHooks {
		pin := d.cgroupPin(id, h)
		prog := d.cgroupProgram(h)
		if l, err := link.LoadPinnedLink(pin, nil); err == nil {
			if !cgroupLinkServes(l, id, h) {
				// Detached from outside, or its cgroup gone: the pin
				// is all that is left of it.
				err = errors.Join(l.Unpin(), l.Close())
				if err != nil {
					return undo(fmt.Errorf("bpf: attach %s on cgroup %s: drop a dead link: %w", h, path, err))
				}
			} else {
				// Staged: the link keeps the old program until Activate
				// points every pinned link at the new ones.
				if d.staged == nil {
					err = l.Update(prog)
				}
				l.Close()
				if err != nil {
					return undo(fmt.Errorf("bpf: attach %s on cgroup %s: update link: %w", h, path, err))
				}
				a.Hooks = append(a.Hooks, h)
				continue
			}
		}
		a.Reused = false
		l, err := link.AttachCgroup(link.CgroupOptions{Path: path, Attach: h.attachType(), Program: prog})
		if err != nil {
			return undo(fmt.Errorf("bpf: attach %s on cgroup %s: %w", h, path, err))
		}
		err = l.Pin(pin)
		if err == nil {
			made = append(made, pin)
		}
		l.Close()
		if err != nil {
			return undo(fmt.Errorf("bpf: attach %s on cgroup %s: pin link: %w", h, path, err))
		}
		a.Hooks = append(a.Hooks, h)
		a.New = append(a.New, h)
	}
	return a, nil
}

// cgroupLinkServes: the pinned link l is still attached to cgroup id at
// hook h.
func cgroupLinkServes(l link.Link, id uint64, h CgroupHook) bool {
	info, err := l.Info()
	if err != nil {
		return false
	}
	c := info.Cgroup()
	return c != nil && c.CgroupId == id && ebpf.AttachType(c.AttachType) == h.attachType()
}

// DetachCgroup removes our socket hooks from the cgroup at path (only our
// pinned links; other programs stay). Detaching what is not attached is
// ErrNotAttached.
func (d *Datapath) DetachCgroup(path string) error {
	id, err := cgroupID(path)
	if err != nil {
		return fmt.Errorf("bpf: detach socket hooks: %w", err)
	}
	return d.detachCgroupID(id, path)
}

// DetachCgroupID removes our socket hooks from the cgroup with id (as
// CgroupAttachments lists them), also when that cgroup no longer exists:
// its pins are then all that is left. Detaching what is not attached is
// ErrNotAttached.
func (d *Datapath) DetachCgroupID(id uint64) error {
	return d.detachCgroupID(id, strconv.FormatUint(id, 10))
}

func (d *Datapath) detachCgroupID(id uint64, what string) error {
	var errs []error
	found := false
	for _, h := range CgroupHooks {
		l, err := link.LoadPinnedLink(d.cgroupPin(id, h), nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", h, err))
			continue
		}
		found = true
		// Closing the last reference to an unpinned link detaches it.
		errs = append(errs, l.Unpin(), l.Close())
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("bpf: detach socket hooks from cgroup %s: %w", what, err)
	}
	if !found {
		return fmt.Errorf("bpf: detach socket hooks from cgroup %s: %w", what, ErrNotAttached)
	}
	return nil
}

// CgroupAttachments lists the cgroups our socket hooks are pinned on, by
// cgroup id (Path is empty: a cgroup id does not name its directory).
func (d *Datapath) CgroupAttachments() ([]CgroupAttachment, error) {
	entries, err := os.ReadDir(linkDir(d.opts.PinRoot))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("bpf: socket hook attachments: %w", err)
	}
	byID := map[uint64]*CgroupAttachment{}
	for _, e := range entries {
		id, h, ok := parseCgroupPin(e.Name())
		if !ok {
			continue
		}
		if byID[id] == nil {
			byID[id] = &CgroupAttachment{ID: id}
		}
		byID[id].Hooks = append(byID[id].Hooks, h)
	}
	out := make([]CgroupAttachment, 0, len(byID))
	for _, a := range byID {
		sort.Slice(a.Hooks, func(i, j int) bool { return hookIndex(a.Hooks[i]) < hookIndex(a.Hooks[j]) })
		out = append(out, *a)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

func hookIndex(h CgroupHook) int {
	for i, c := range CgroupHooks {
		if c == h {
			return i
		}
	}
	return len(CgroupHooks)
}
