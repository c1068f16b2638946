package bpf

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Hook is a place on an interface where a FluxVM program runs.
type Hook uint8

// Hooks. Names are from the VM's point of view.
const (
	// HookFromVM is TC ingress of the host side of a VM interface:
	// packets the VM sends. East-west VIPs are translated here.
	HookFromVM Hook = 1
	// HookToVM is TC egress of the same interface: packets delivered to
	// the VM. Replies get their VIP back here.
	HookToVM Hook = 2
	// HookNSIn is TC ingress of a north-south interface: clients outside
	// the node reach north-south VIPs here, and remote backends' replies
	// to the SNAT address are translated back.
	HookNSIn Hook = 3
	// HookNSOut is TC egress of a north-south interface: the reverse path
	// for replies to the SNAT address that met no ingress hook of ours.
	HookNSOut Hook = 4
)

// Hooks lists every hook.
var Hooks = []Hook{HookFromVM, HookToVM, HookNSIn, HookNSOut}

func (h Hook) String() string {
	switch h {
	case HookFromVM:
		return "from_vm"
	case HookToVM:
		return "to_vm"
	case HookNSIn:
		return "ns_in"
	case HookNSOut:
		return "ns_out"
	}
	return fmt.Sprintf("hook(%d)", uint8(h))
}

func (h Hook) program() (string, error) {
	switch h {
	case HookFromVM:
		return "fluxvm_from_vm", nil
	case HookToVM:
		return "fluxvm_to_vm", nil
	case HookNSIn:
		return "fluxvm_ns_in", nil
	case HookNSOut:
		return "fluxvm_ns_out", nil
	}
	return "", fmt.Errorf("bpf: %s: %w", h, ErrHook)
}

// hookProgram is the loaded program that runs on hook h (nil after Close).
func (d *Datapath) hookProgram(h Hook) *ebpf.Program {
	switch h {
	case HookFromVM:
		return d.progs.FluxvmFromVm
	case HookToVM:
		return d.progs.FluxvmToVm
	case HookNSIn:
		return d.progs.FluxvmNsIn
	case HookNSOut:
		return d.progs.FluxvmNsOut
	}
	return nil
}

func (h Hook) ingress() bool { return h == HookFromVM || h == HookNSIn }

// AttachMode is how a program is attached to TC.
type AttachMode string

// Attach modes.
const (
	// AttachTCX uses TCX links (Linux 6.6+): ordered, owned, atomic.
	AttachTCX AttachMode = "tcx"
	// AttachClsBPF uses a clsact qdisc with a direct-action cls_bpf
	// filter at priority 1, for kernels without TCX.
	AttachClsBPF AttachMode = "cls_bpf"
)

// Errors of attach and detach, checkable with errors.Is.
var (
	ErrHook           = errors.New("unknown hook")
	ErrAttachMode     = errors.New("unknown attach mode")
	ErrForeignProgram = errors.New("a program that FluxVM does not own is in the way")
	ErrNotAttached    = errors.New("not attached")
	// ErrNoInterface: the network namespace the call runs in has no
	// interface by that name (or index).
	ErrNoInterface = errors.New("no such network interface")
)

// clsName marks our cls_bpf filters; anything else at our priority is
// someone else's and is never replaced or removed.
const clsPrefix = "fluxvm:"

// Attachment is one program on one hook of one interface.
type Attachment struct {
	Ifname  string
	Ifindex int
	Hook    Hook
	Mode    AttachMode
	Program string
	// Reused: ours was attached there already (a pinned TCX link, or our
	// cls_bpf filter) and was kept, running the new program (after
	// Activate when the datapath is staged); false: this call attached
	// it. A caller undoing a failed step detaches only what it attached.
	Reused bool
}

// Interface names an interface by name or by index (one is enough).
type Interface struct {
	Name  string
	Index int
}

// String names the interface as errors do: its quoted name, its index,
// or both.
func (i Interface) String() string {
	switch {
	case i.Name != "" && i.Index > 0:
		return fmt.Sprintf("%q (index %d)", i.Name, i.Index)
	case i.Index > 0:
		return fmt.Sprintf("index %d", i.Index)
	}
	return strconv.Quote(i.Name)
}

// resolve finds the interface in the calling thread's network namespace:
// ErrNoInterface when it has none by that name or index.
func (i Interface) resolve() (string, int, error) {
	if i.Name == "" && i.Index <= 0 {
		return "", 0, fmt.Errorf("bpf: interface: neither a name nor an index given: %w", ErrNoInterface)
	}
	// The whole table, as net.InterfaceByName reads it too: a miss is
	// then ErrNoInterface, not an error of the net package's own.
	ifs, err := net.Interfaces()
	if err != nil {
		return "", 0, fmt.Errorf("bpf: interface %s: %w", i, err)
	}
	for _, ifc := range ifs {
		if i.Index > 0 && ifc.Index != i.Index || i.Index <= 0 && ifc.Name != i.Name {
			continue
		}
		if i.Name != "" && i.Index > 0 && ifc.Name != i.Name {
			return "", 0, fmt.Errorf("bpf: interface index %d is %q, not %q: %w", i.Index, ifc.Name, i.Name, ErrNoInterface)
		}
		return ifc.Name, ifc.Index, nil
	}
	return "", 0, fmt.Errorf("bpf: interface %s: %w", i, ErrNoInterface)
}

// Attach puts the hook's program first on the interface, in the calling
// thread's network namespace. It is idempotent: attaching again updates the
// program in place. TCX links are pinned under the pin root so that the
// program stays attached after this process exits.
func (d *Datapath) Attach(ifc Interface, hook Hook) (Attachment, error) {
	if d.coll == nil {
		return Attachment{}, ErrClosed
	}
	progName, err := hook.program()
	if err != nil {
		return Attachment{}, err
	}
	name, index, err := ifc.resolve()
	if err != nil {
		return Attachment{}, err
	}
	prog := d.hookProgram(hook)
	a := Attachment{Ifname: name, Ifindex: index, Hook: hook, Program: progName}

	mode := d.opts.AttachMode
	if mode == "" || mode == AttachTCX {
		reused, err := d.attachTCX(index, hook, prog)
		if err == nil {
			a.Mode, a.Reused = AttachTCX, reused
			return a, nil
		}
		if mode == AttachTCX || !errors.Is(err, ebpf.ErrNotSupported) {
			return a, err
		}
	}
	if d.staged != nil {
		// Staged: our filter of this hook keeps the old program until
		// Activate replaces it, as a TCX link keeps it until Activate
		// switches it.
		ours, err := ourClsFilterOf(index, hook, progName)
		if err != nil {
			return a, err
		}
		if ours {
			if d.staged.cls == nil {
				d.staged.cls = map[clsHook]bool{}
			}
			d.staged.cls[clsHook{index, hook}] = true
			d.clsAttached = true
			a.Mode, a.Reused = AttachClsBPF, true
			return a, nil
		}
	}
	reused, err := attachClsBPF(index, hook, prog, progName)
	if err != nil {
		return a, err
	}
	d.clsAttached = true
	a.Mode, a.Reused = AttachClsBPF, reused
	return a, nil
}

func (d *Datapath) linkPin(index int, hook Hook) string {
	return filepath.Join(linkDir(d.opts.PinRoot), fmt.Sprintf("tcx_%d_%s", index, hook))
}

// attachTCX attaches prog to the hook with a pinned link; reused: our
// pinned link was there already and was kept.
func (d *Datapath) attachTCX(index int, hook Hook, prog *ebpf.Program) (reused bool, err error) {
	pin := d.linkPin(index, hook)
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		defer l.Close()
		if info, err := l.Info(); err == nil && info.TCX() != nil && int(info.TCX().Ifindex) == index {
			// Staged: the link keeps the old program until Activate
			// points every pinned link at the new ones.
			if d.staged != nil {
				return true, nil
			}
			if err := l.Update(prog); err != nil {
				return false, fmt.Errorf("bpf: attach %s on %d: update link: %w", hook, index, err)
			}
			return true, nil
		}
		// The interface behind that pin is gone (its index now names
		// another one): the stale pin is ours to drop.
		l.Unpin()
	}
	at := ebpf.AttachTCXEgress
	if hook.ingress() {
		at = ebpf.AttachTCXIngress
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: index, Program: prog, Attach: at, Anchor: link.Head()})
	if err != nil {
		return false, fmt.Errorf("bpf: attach %s on %d (tcx): %w", hook, index, err)
	}
	defer l.Close()
	if err := l.Pin(pin); err != nil {
		return false, fmt.Errorf("bpf: attach %s on %d: pin link: %w", hook, index, err)
	}
	return false, nil
}

// Detach removes our program from the hook of the interface. A program
// that is not ours is never removed; detaching what is not attached is
// ErrNotAttached.
func (d *Datapath) Detach(ifc Interface, hook Hook) error {
	if _, err := hook.program(); err != nil {
		return err
	}
	name, index, err := ifc.resolve()
	if err != nil {
		return err
	}
	pin := d.linkPin(index, hook)
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		defer l.Close()
		if err := l.Unpin(); err != nil {
			return fmt.Errorf("bpf: detach %s from %s: %w", hook, name, err)
		}
		// Closing the last reference to an unpinned link detaches it.
		return nil
	}
	if d.staged != nil {
		delete(d.staged.cls, clsHook{index, hook})
	}
	return detachClsBPF(index, hook, name)
}

// Attachments lists our attachments visible in the calling thread's
// network namespace: pinned TCX links and our cls_bpf filters.
func (d *Datapath) Attachments() ([]Attachment, error) {
	var out []Attachment
	entries, err := os.ReadDir(linkDir(d.opts.PinRoot))
	if err != nil {
		return nil, fmt.Errorf("bpf: attachments: %w", err)
	}
	for _, e := range entries {
		index, hook, ok := parseLinkPin(e.Name())
		if !ok {
			continue
		}
		a := Attachment{Ifindex: index, Hook: hook, Mode: AttachTCX}
		a.Program, _ = hook.program()
		if ifc, err := net.InterfaceByIndex(index); err == nil {
			a.Ifname = ifc.Name
		}
		out = append(out, a)
	}
	cls, err := clsBPFAttachments()
	if err != nil {
		return nil, fmt.Errorf("bpf: attachments: %w", err)
	}
	return append(out, cls...), nil
}

func parseLinkPin(name string) (int, Hook, bool) {
	rest, ok := strings.CutPrefix(name, "tcx_")
	if !ok {
		return 0, 0, false
	}
	idx, hookName, ok := strings.Cut(rest, "_")
	if !ok {
		return 0, 0, false
	}
	index, err := strconv.Atoi(idx)
	if err != nil {
		return 0, 0, false
	}
	for _, h := range Hooks {
		if h.String() == hookName {
			return index, h, true
		}
	}
	return 0, 0, false
}

// updateLinks points every pinned link at the freshly loaded program of
// its hook (a TC hook, or the north-south XDP program for an xdp_<ifindex>
// link) and returns the names of the links it updated.
func (d *Datapath) updateLinks() (updated, severed []string, err error) {
	entries, err := os.ReadDir(linkDir(d.opts.PinRoot))
	if err != nil {
		return nil, nil, fmt.Errorf("bpf: open: %w", err)
	}
	for _, e := range entries {
		var prog *ebpf.Program
		if _, hook, ok := parseLinkPin(e.Name()); ok {
			prog = d.hookProgram(hook)
		} else if _, ok := parseXDPPin(e.Name()); ok {
			prog = d.xprogs.FluxvmXdpNs
		} else if _, h, ok := parseCgroupPin(e.Name()); ok {
			prog = d.cgroupProgram(h)
		} else {
			continue
		}
		pin := filepath.Join(linkDir(d.opts.PinRoot), e.Name())
		l, err := link.LoadPinnedLink(pin, nil)
		if err != nil {
			return updated, severed, fmt.Errorf("bpf: open: pinned link %s: %w", e.Name(), err)
		}
		err = l.Update(prog)
		if errors.Is(err, unix.ENOLINK) {
			// The interface went away (the kernel severs a TCX or
			// XDP link when its device is deleted): nothing to update, and the
			// pin only keeps a dead link alive.
			err = l.Unpin()
			l.Close()
			if err != nil {
				return updated, severed, fmt.Errorf("bpf: open: unpin severed link %s: %w", e.Name(), err)
			}
			severed = append(severed, e.Name())
			continue
		}
		l.Close()
		if err != nil {
			return updated, severed, fmt.Errorf("bpf: open: update link %s: %w", e.Name(), err)
		}
		updated = append(updated, e.Name())
	}
	return updated, severed, nil
}

// Remove detaches every attachment of ours in the calling thread's network
// namespace, removes the pin root with everything pinned in it, and closes
// the datapath (RemoveRoot after Close). Nothing outside the pin root is
// touched, but the parents of the pin root that LockPinRoot created, when
// they are empty.
func (d *Datapath) Remove() error {
	d.Close()
	return RemoveRoot(d.opts.PinRoot)
}
