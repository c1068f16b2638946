package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// XDPMode is how the north-south XDP program is attached to an uplink.
type XDPMode string

// XDP modes. Off, Native and Generic are also what an interface reports
// as the mode in force; Auto is only asked for.
const (
	// XDPOff attaches nothing (the default).
	XDPOff XDPMode = "off"
	// XDPNative runs the program in the driver's receive path.
	XDPNative XDPMode = "native"
	// XDPGeneric runs it after the kernel built the skb (any driver;
	// slower, but the same program and verdicts).
	XDPGeneric XDPMode = "generic"
	// XDPAuto attaches native, and generic where the driver refuses
	// native.
	XDPAuto XDPMode = "auto"
)

// ErrXDPMode reports a mode other than off, native, generic or auto.
var ErrXDPMode = errors.New("unknown XDP mode (want off, native, generic or auto)")

// ErrXDPOffload reports an interface whose offloads hide from XDP what
// the program must see: a VLAN tag kept beside the frame (the driver
// took it out on receive, or a veth's peer never put it in), which makes
// a tagged frame read as an untagged one, or a checksum left to the
// receiver (CHECKSUM_PARTIAL frames from a veth's peer), which the
// program would patch as a full one. The error names the offload and
// the ethtool command that turns it off.
var ErrXDPOffload = errors.New("an offload of the interface hides from XDP what it must see")

// ParseXDPMode accepts "off", "native", "generic" or "auto" in either
// case; empty is off.
func ParseXDPMode(s string) (XDPMode, error) {
	switch m := XDPMode(strings.ToLower(strings.TrimSpace(s))); m {
	case "":
		return XDPOff, nil
	case XDPOff, XDPNative, XDPGeneric, XDPAuto:
		return m, nil
	}
	return "", fmt.Errorf("bpf: xdp mode %q: %w", s, ErrXDPMode)
}

// XDPPrograms are the programs of the north-south XDP object, one field
// each, as bpf2go generates them (FluxvmXdpNs is fluxvm_xdp_ns).
type XDPPrograms = serviceXdpPrograms

// XDPPrograms returns the loaded XDP programs, which run on the
// datapath's own maps. After Close every field is nil.
func (d *Datapath) XDPPrograms() *XDPPrograms {
	d.live.RLock()
	defer d.live.RUnlock()
	p := d.xprogs
	return &p
}

// XDPObjectName is the file name of the north-south XDP object of tier t
// as operators install it (scripts/build-ebpf.sh --install).
func XDPObjectName(t Tier) string {
	return "fluxvm_service_xdp_tier_" + t.String() + ".bpf.o"
}

// SpecXDP returns the collection spec of the embedded north-south XDP
// object of tier t. It declares the TC object's maps, which the loader
// replaces with the datapath's own. Each call returns a fresh copy.
func SpecXDP(t Tier) (*ebpf.CollectionSpec, error) {
	return embeddedSpec(t, "XDP", loadServiceXdpTierS, loadServiceXdp, loadServiceXdpTierL)
}

// loadXDP loads the XDP object (XDPObjectName of the tier from ObjectDir
// when that directory has it, else the embedded one) on the maps of coll,
// the loaded TC object.
func loadXDP(opts Options, coll *ebpf.Collection) (*ebpf.Collection, error) {
	return loadSide(opts, coll, "XDP", SpecXDP, XDPObjectName)
}

// XDPAttachment is the north-south XDP program on one interface.
type XDPAttachment struct {
	Ifname  string
	Ifindex int
	// Mode is the mode in force: XDPNative or XDPGeneric.
	Mode    XDPMode
	Program string
	// Reused: our pinned link was already there and now runs this
	// datapath's program (link.Update, no gap).
	Reused bool
}

func (d *Datapath) xdpPin(index int) string {
	return filepath.Join(linkDir(d.opts.PinRoot), fmt.Sprintf("xdp_%d", index))
}

func parseXDPPin(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, "xdp_")
	if !ok {
		return 0, false
	}
	index, err := strconv.Atoi(rest)
	return index, err == nil
}

// AttachXDP attaches the north-south XDP program (fluxvm_xdp_ns) to the
// interface, in the calling thread's network namespace, with a BPF link
// pinned under the pin root next to the TC links (links/xdp_<ifindex>),
// so that it stays attached after this process exits. mode is
// XDPNative, XDPGeneric or XDPAuto (native, and generic where the driver
// refuses native).
//
// The interface's offloads are checked first: where a VLAN tag or a
// checksum state would be hidden from XDP (see ErrXDPOffload: on a
// physical NIC rx-vlan-hw-parse or rx-vlan-stag-hw-parse, on a veth its
// peer's tx-vlan-hw-insert, tx-vlan-stag-hw-insert or transmit checksum
// offload), AttachXDP fails with ErrXDPOffload naming the offload and
// the way out, attaches nothing, and detaches our own link if an earlier
// attach left one there (it would misread those frames too).
//
// When our pinned link is already on the interface, its program is
// replaced in place (link.Update): no packet meets a gap. Only asking for
// another explicit mode than the one in force detaches and attaches
// again. An XDP program on the interface that is not ours is never
// replaced: AttachXDP fails with ErrForeignProgram naming it and leaves
// it attached.
func (d *Datapath) AttachXDP(ifc Interface, mode XDPMode) (XDPAttachment, error) {
	if d.coll == nil {
		return XDPAttachment{}, ErrClosed
	}
	switch mode {
	case XDPNative, XDPGeneric, XDPAuto:
	default:
		return XDPAttachment{}, fmt.Errorf("bpf: attach xdp: mode %q: %w", mode, ErrXDPMode)
	}
	name, index, err := ifc.resolve()
	if err != nil {
		return XDPAttachment{}, err
	}
	if err := d.CheckXDP(Interface{Index: index}); err != nil {
		if !errors.Is(err, ErrXDPOffload) {
			return XDPAttachment{Ifname: name, Ifindex: index}, err
		}
		if derr := d.DetachXDP(Interface{Index: index}); derr != nil && !errors.Is(derr, ErrNotAttached) {
			err = errors.Join(err, fmt.Errorf("bpf: detach our earlier xdp link from %s: %w", name, derr))
		}
		return XDPAttachment{Ifname: name, Ifindex: index}, err
	}
	prog := d.xprogs.FluxvmXdpNs
	a := XDPAttachment{Ifname: name, Ifindex: index, Program: "fluxvm_xdp_ns"}
	pin := d.xdpPin(index)

	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		ours, inForce := d.pinnedXDP(l, index)
		switch {
		case ours && (mode == XDPAuto || mode == inForce):
			// Staged: the link keeps the old program until Activate
			// points every pinned link at the new ones.
			var err error
			if d.staged == nil {
				err = l.Update(prog)
			}
			l.Close()
			if err != nil {
				return a, fmt.Errorf("bpf: attach xdp on %s: update link: %w", name, err)
			}
			a.Mode, a.Reused = inForce, true
			return a, d.allowXDPTx(name, index)
		case ours:
			// Another explicit mode: the kernel changes a link's mode
			// only by a new attachment.
			err := errors.Join(l.Unpin(), l.Close())
			if err != nil {
				return a, fmt.Errorf("bpf: attach xdp on %s: detach the %s link to attach %s: %w", name, inForce, mode, err)
			}
		default:
			// The interface behind that pin is gone (its index now
			// names another one), or the link was detached: the stale
			// pin is ours to drop.
			l.Unpin()
			l.Close()
		}
	}
	if err := foreignXDP(name, index); err != nil {
		return a, err
	}
	var l link.Link
	switch mode {
	case XDPNative, XDPGeneric:
		l, err = attachXDPLink(prog, index, mode)
		a.Mode = mode
	case XDPAuto:
		a.Mode = XDPNative
		l, err = attachXDPLink(prog, index, XDPNative)
		if err != nil {
			var gerr error
			if l, gerr = attachXDPLink(prog, index, XDPGeneric); gerr != nil {
				err = fmt.Errorf("native: %w; generic: %w", err, gerr)
			} else {
				err, a.Mode = nil, XDPGeneric
			}
		}
	}
	if err != nil {
		return a, fmt.Errorf("bpf: attach xdp on %s (%s): %w", name, mode, err)
	}
	defer l.Close()
	if err := l.Pin(pin); err != nil {
		// Closing the unpinned link detaches it again.
		return a, fmt.Errorf("bpf: attach xdp on %s: pin link: %w", name, err)
	}
	return a, d.allowXDPTx(name, index)
}

// AllowXDPEgress lets the XDP program send translated packets to ifc as
// well (fluxvm_xdp_tx): a device that takes XDP frames, besides the ones
// the program is attached to (AttachXDP lists those itself). A device
// that refuses them drops redirected frames silently, so list only
// physical NICs whose driver implements XDP transmit, or veths whose peer
// runs an XDP program. The entry goes with the XDP object's maps: call it
// again after a reload, as for AttachXDP.
func (d *Datapath) AllowXDPEgress(ifc Interface) error {
	if d.coll == nil {
		return ErrClosed
	}
	name, index, err := ifc.resolve()
	if err != nil {
		return err
	}
	return d.allowXDPTx(name, index)
}

// allowXDPTx lists the interface in the XDP object's fluxvm_xdp_tx, the
// devices the program may send on: an uplink with our XDP program takes
// XDP frames (XDP_TX back out of it, a redirect from another uplink).
// Routes out of any other interface leave the packet to the stack (the
// device may refuse XDP frames, and would drop them silently).
func (d *Datapath) allowXDPTx(name string, index int) error {
	m := d.xcoll.Maps["fluxvm_xdp_tx"]
	if m == nil {
		return nil
	}
	if err := m.Put(uint32(index), uint32(index)); err != nil {
		return fmt.Errorf("bpf: attach xdp on %s: fluxvm_xdp_tx: %w", name, err)
	}
	return nil
}

func attachXDPLink(prog *ebpf.Program, index int, mode XDPMode) (link.Link, error) {
	flags := link.XDPDriverMode
	if mode == XDPGeneric {
		flags = link.XDPGenericMode
	}
	return link.AttachXDP(link.XDPOptions{Program: prog, Interface: index, Flags: flags})
}

// pinnedXDP reports whether the pinned link l is attached to the
// interface index and is what runs there, and in which mode.
func (d *Datapath) pinnedXDP(l link.Link, index int) (bool, XDPMode) {
	info, err := l.Info()
	if err != nil || info.XDP() == nil || int(info.XDP().Ifindex) != index {
		return false, XDPOff
	}
	id, mode, err := xdpOnInterface(index)
	if err != nil || id != uint32(info.Program) || mode == XDPOff {
		return false, XDPOff
	}
	return true, mode
}

// CheckXDP fails as AttachXDP would refuse the interface, and changes
// nothing: with ErrForeignProgram, naming the program, when it runs an
// XDP program that is not ours; with ErrXDPOffload, naming the offload,
// when its offloads hide a VLAN tag or a checksum state from XDP. nil
// when AttachXDP would attach. A caller attaching several programs to an
// interface checks first, so that it attaches none of them where XDP
// will be refused.
func (d *Datapath) CheckXDP(ifc Interface) error {
	name, index, err := ifc.resolve()
	if err != nil {
		return err
	}
	if l, err := link.LoadPinnedLink(d.xdpPin(index), nil); err == nil {
		ours, _ := d.pinnedXDP(l, index)
		l.Close()
		if ours {
			return xdpOffloadProblem(name, index)
		}
	}
	if err := foreignXDP(name, index); err != nil {
		return err
	}
	return xdpOffloadProblem(name, index)
}

// XDPMode reports the mode our XDP link runs in on the interface:
// XDPNative, XDPGeneric, or XDPOff when none of ours is attached there
// (a foreign program does not count).
func (d *Datapath) XDPMode(ifc Interface) (XDPMode, error) {
	_, index, err := ifc.resolve()
	if err != nil {
		return XDPOff, err
	}
	l, err := link.LoadPinnedLink(d.xdpPin(index), nil)
	if err != nil {
		return XDPOff, nil
	}
	defer l.Close()
	_, mode := d.pinnedXDP(l, index)
	return mode, nil
}

// DetachXDP removes our XDP link from the interface. A program that is not
// ours is never removed; detaching what is not attached is
// ErrNotAttached.
func (d *Datapath) DetachXDP(ifc Interface) error {
	name, index, err := ifc.resolve()
	if err != nil {
		return err
	}
	l, err := link.LoadPinnedLink(d.xdpPin(index), nil)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("bpf: detach xdp from %s: %w", name, ErrNotAttached)
		}
		return fmt.Errorf("bpf: detach xdp from %s: %w", name, err)
	}
	// Closing the last reference to an unpinned link detaches it before
	// Close returns.
	if err := errors.Join(l.Unpin(), l.Close()); err != nil {
		return fmt.Errorf("bpf: detach xdp from %s: %w", name, err)
	}
	if m := d.xcoll.Maps["fluxvm_xdp_tx"]; m != nil {
		if err := m.Delete(uint32(index)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("bpf: detach xdp from %s: fluxvm_xdp_tx: %w", name, err)
		}
		// Cached routes out of it must not outlive the entry.
		if err := d.InvalidateXDPRoutes(); err != nil {
			return fmt.Errorf("bpf: detach xdp from %s: %w", name, err)
		}
	}
	return nil
}

// foreignXDP fails with ErrForeignProgram when an XDP program is attached
// to the interface (we have no link of ours there at this point).
func foreignXDP(name string, index int) error {
	id, mode, err := xdpOnInterface(index)
	if err != nil {
		return fmt.Errorf("bpf: attach xdp on %s: %w", name, err)
	}
	if id == 0 {
		return nil
	}
	what := fmt.Sprintf("id %d", id)
	if p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id)); err == nil {
		if info, err := p.Info(); err == nil && info.Name != "" {
			what = fmt.Sprintf("id %d, name %q", id, info.Name)
		}
		p.Close()
	}
	return fmt.Errorf("bpf: attach xdp on %s: XDP program %s (%s) is attached and is not FluxVM's; it stays attached (remove it, or set xdp_mode off): %w",
		name, what, mode, ErrForeignProgram)
}
