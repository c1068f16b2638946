package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/fluxvm/servicefabric/bpf"
)

// Interface kinds, as InterfaceStatus.Kind reports them.
const (
	InterfaceVMEdge     = "vm-edge"
	InterfaceNorthSouth = "north-south"
)

// hooksOf returns the hooks of an interface kind.
func hooksOf(kind string) []bpf.Hook {
	if kind == InterfaceNorthSouth {
		return []bpf.Hook{bpf.HookNSIn, bpf.HookNSOut}
	}
	return []bpf.Hook{bpf.HookFromVM, bpf.HookToVM}
}

// AddInterface attaches the VM-edge programs to a VM's host-side
// interface. It is idempotent. An interface that is attached as a
// north-south interface is a conflict (ErrConflict); one the node's
// namespace does not have is ErrNotFound (and bpf.ErrNoInterface). A call
// that fails leaves the interface as it found it: the hooks it attached
// are detached, those attached before it stay. An L7 proxy interface
// attached again with another index (its veth recreated) is what the
// policies that redirect to it name from then on.
//
// A ctx that ended before the hooks are attached (on entry, or while the
// call waited for the dataplane's lock) attaches nothing and fails with
// an error wrapping ctx's; once attaching, the call finishes.
func (d *Dataplane) AddInterface(ctx context.Context, vi VMEdgeInterface) (InterfaceStatus, error) {
	if err := d.begin(ctx, "add interface"); err != nil {
		return InterfaceStatus{}, err
	}
	st, err := d.addInterface(ctx, vi)
	if err != nil {
		return st, err
	}
	if err := d.refreshProxies(vi.Name); err != nil {
		return st, fmt.Errorf("fluxvm: add interface %s: attached, but the L7 policies that redirect to it were not updated: %w", vi.Name, err)
	}
	return st, nil
}

func (d *Dataplane) addInterface(ctx context.Context, vi VMEdgeInterface) (InterfaceStatus, error) {
	if vi.Name == "" || vi.VMID == "" {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface: %w", &ValidationError{Field: "interface", Reason: "name and vm_id are required"})
	}
	if why := ifnameProblem(vi.Name); why != "" {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface: %w", verr(ErrInvalid, "name", "%s", why))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("add interface"); err != nil {
		return InterfaceStatus{}, err
	}
	if err := ctxErr(ctx, "add interface "+vi.Name); err != nil {
		return InterfaceStatus{}, err
	}
	if other, ok := d.ifaces[vi.Name]; ok {
		switch {
		case other.kind != InterfaceVMEdge:
			return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface %s: it is a %s interface: %w", vi.Name, other.kind, ErrConflict)
		case other.VMID != vi.VMID:
			return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface %s: belongs to VM %s: %w", vi.Name, other.VMID, ErrConflict)
		}
	}
	ifc := &iface{VMEdgeInterface: vi, kind: InterfaceVMEdge}
	if err := d.attach(ifc); err != nil {
		return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add interface %s: %w", vi.Name, err))
	}
	old := d.ifaces[vi.Name]
	if old != nil {
		ifc.slot = old.slot
	} else if err := d.registerEdge(ifc); err != nil {
		if uerr := d.detachMade(ifc); uerr != nil {
			err = errors.Join(err, uerr)
		}
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add interface %s: statistics: %w", vi.Name, err)
	}
	ifc.keepMade(old)
	d.ifaces[vi.Name] = ifc
	d.allowXDPEgress(vi.Name)
	d.log.Info("fluxvm: VM interface attached", "interface", vi.Name, "vm", vi.VMID, "mode", ifc.hooks[0].Mode)
	return ifc.status(), nil
}

// AddNorthSouthInterface attaches the north-south programs to one of the
// node's uplinks: ns_in on TC ingress (clients outside the node reach
// north-south VIPs; replies of remote backends to the SNAT address are
// translated back) and ns_out on TC egress (replies to the SNAT address
// that met no ingress hook of ours). It is idempotent. An interface that
// is attached as a VM edge is a conflict (ErrConflict); one the node's
// namespace does not have is ErrNotFound (and bpf.ErrNoInterface).
//
// With NorthSouth.XDPMode (xdp_mode) other than off, the north-south XDP
// program is attached too, after the TC hooks, in that mode (auto: native,
// else generic); InterfaceStatus.XDP says which mode is in force. An XDP
// program of another product on the interface fails the call with an
// error naming it (bpf.ErrForeignProgram) before anything is attached,
// and stays attached. An offload that hides VLAN tags or checksum state
// from XDP (bpf.ErrXDPOffload: the driver strips tags on receive, or a
// veth's peer keeps them beside its frames or leaves checksums to the
// receiver) fails the call as well, before anything is attached, when
// xdp_mode is native or generic (the error names the offload and the
// ethtool command that turns it off); with auto the interface gets the TC
// hooks alone, InterfaceStatus.XDP is "off" and XDPProblem says why. In
// both cases an XDP program of ours left there by an earlier start is
// detached. Should the XDP attach fail otherwise, the TC hooks
// this call attached are detached again (those attached before it, by
// this Dataplane or an earlier start, stay). With
// xdp_mode off, an XDP program of ours left by an earlier start is
// detached.
//
// The name then counts as configured in north_south_interfaces for the
// validation of services (exposure north-south or both) for the rest of
// the dataplane's life, also after RemoveInterface.
// North-south interfaces have no per-VM statistics slot.
//
// A ctx that ended before the hooks are attached (on entry, while the
// call waited for the dataplane's lock, or during the XDP checks) attaches
// nothing and fails with an error wrapping ctx's; once attaching, the
// call finishes.
func (d *Dataplane) AddNorthSouthInterface(ctx context.Context, name string) (InterfaceStatus, error) {
	if err := d.begin(ctx, "add north-south interface"); err != nil {
		return InterfaceStatus{}, err
	}
	if why := ifnameProblem(name); why != "" {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add north-south interface: %w", verr(ErrInvalid, "name", "%s", why))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("add north-south interface"); err != nil {
		return InterfaceStatus{}, err
	}
	if err := ctxErr(ctx, "add north-south interface "+name); err != nil {
		return InterfaceStatus{}, err
	}
	if other, ok := d.ifaces[name]; ok && other.kind != InterfaceNorthSouth {
		return InterfaceStatus{}, fmt.Errorf("fluxvm: add north-south interface %s: it is the VM-edge interface of VM %s: %w", name, other.VMID, ErrConflict)
	}
	ifc := &iface{VMEdgeInterface: VMEdgeInterface{Name: name}, kind: InterfaceNorthSouth}
	// A foreign XDP program, and offloads that XDP would misread under
	// an explicit mode, are refused before anything is attached (auto
	// falls back to TC alone in attachXDP).
	if mode := d.xdpMode(); mode != bpf.XDPOff {
		err := d.opts.InNamespace(func() error {
			err := d.dp.CheckXDP(bpf.Interface{Name: name})
			if errors.Is(err, bpf.ErrXDPOffload) {
				if mode == bpf.XDPAuto {
					return nil
				}
				// Ours from an earlier start would misread them too.
				if derr := d.dp.DetachXDP(bpf.Interface{Name: name}); derr != nil && !errors.Is(derr, bpf.ErrNotAttached) {
					err = errors.Join(err, fmt.Errorf("detach our earlier XDP program: %w", derr))
				} else if known, ok := d.ifaces[name]; ok {
					known.xdp = bpf.XDPOff
				}
			}
			return err
		})
		if err != nil {
			return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add north-south interface %s: %w", name, err))
		}
	}
	if err := ctxErr(ctx, "add north-south interface "+name); err != nil {
		return InterfaceStatus{}, err
	}
	if err := d.attach(ifc); err != nil {
		return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add north-south interface %s: %w", name, err))
	}
	if err := d.attachXDP(ifc); err != nil {
		// An uplink is attached whole or not at all: the TC hooks this
		// call attached go again (those attached before it stay).
		if uerr := d.detachMade(ifc); uerr != nil {
			err = errors.Join(err, fmt.Errorf("undo the TC hooks: %w", uerr))
		}
		return InterfaceStatus{}, ifaceError(fmt.Errorf("fluxvm: add north-south interface %s: %w", name, err))
	}
	ifc.keepMade(d.ifaces[name])
	d.ifaces[name] = ifc
	if !slices.Contains(d.opts.NorthSouth.Interfaces, name) {
		d.opts.NorthSouth.Interfaces = append(slices.Clip(d.opts.NorthSouth.Interfaces), name)
	}
	if ifc.xdpProblem != "" {
		d.log.Warn("fluxvm: north-south interface attached without XDP (xdp_mode auto)", "interface", name, "mode", ifc.hooks[0].Mode, "reason", ifc.xdpProblem)
	} else {
		d.log.Info("fluxvm: north-south interface attached", "interface", name, "mode", ifc.hooks[0].Mode, "xdp", string(ifc.xdp))
	}
	return ifc.status(), nil
}

// allowXDPEgress lists the configured xdp_egress_interfaces that exist
// now as devices the XDP program may send to; one that does not exist yet
// (a VM edge that comes later) is listed when it is added. d.mu held.
func (d *Dataplane) allowXDPEgress(only string) {
	if d.xdpMode() == bpf.XDPOff {
		return
	}
	for _, n := range d.opts.NorthSouth.XDPEgress {
		if only != "" && n != only {
			continue
		}
		if err := d.opts.InNamespace(func() error { return d.dp.AllowXDPEgress(bpf.Interface{Name: n}) }); err != nil {
			d.log.Warn("fluxvm: XDP egress interface not listed (yet)", "interface", n, "err", err)
		}
	}
}

// xdpMode is the configured xdp_mode (empty: off).
func (d *Dataplane) xdpMode() bpf.XDPMode {
	if d.opts.NorthSouth.XDPMode == "" {
		return bpf.XDPOff
	}
	return d.opts.NorthSouth.XDPMode
}

// attachXDP puts the north-south XDP program on ifc in the configured
// mode and records the mode in force; with xdp_mode off it removes ours,
// if an earlier start left it there. With auto, an interface whose
// offloads XDP would misread (bpf.ErrXDPOffload) keeps TC alone: XDP off,
// the reason in ifc.xdpProblem (AttachXDP detached ours).
func (d *Dataplane) attachXDP(ifc *iface) error {
	return d.opts.InNamespace(func() error {
		mode := d.xdpMode()
		ifc.xdpProblem = ""
		if mode == bpf.XDPOff {
			ifc.xdp = bpf.XDPOff
			if err := d.dp.DetachXDP(bpf.Interface{Index: ifc.index}); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				return err
			}
			return nil
		}
		a, err := d.dp.AttachXDP(bpf.Interface{Index: ifc.index}, mode)
		if mode == bpf.XDPAuto && errors.Is(err, bpf.ErrXDPOffload) {
			ifc.xdp, ifc.xdpProblem = bpf.XDPOff, err.Error()
			return nil
		}
		if err != nil {
			return err
		}
		ifc.xdp, ifc.madeXDP = a.Mode, !a.Reused
		return nil
	})
}

// detachHooks removes the TC programs of ifc's kind (and the XDP program
// of a north-south interface).
func (d *Dataplane) detachHooks(ifc *iface) error {
	return d.opts.InNamespace(func() error {
		var errs []error
		for _, h := range hooksOf(ifc.kind) {
			if err := d.dp.Detach(bpf.Interface{Index: ifc.index}, h); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				errs = append(errs, err)
			}
		}
		if ifc.kind == InterfaceNorthSouth {
			if err := d.dp.DetachXDP(bpf.Interface{Index: ifc.index}); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	})
}

// attach puts the programs of ifc's kind on its hooks and records them,
// and in ifc.made those it attached itself (not found attached already).
func (d *Dataplane) attach(ifc *iface) error {
	return d.opts.InNamespace(func() error {
		for _, h := range hooksOf(ifc.kind) {
			a, err := d.dp.Attach(bpf.Interface{Name: ifc.Name}, h)
			if err != nil {
				// Both hooks or none: a VM edge that translates on
				// the way out but not back (or the reverse) would
				// break every flow through it. What was attached
				// before this call (an earlier start's) stays.
				for _, u := range ifc.made {
					if derr := d.dp.Detach(bpf.Interface{Index: ifc.index}, u); derr != nil {
						err = errors.Join(err, fmt.Errorf("undo %s: %w", u, derr))
					}
				}
				ifc.hooks, ifc.made = nil, nil
				return err
			}
			ifc.index = a.Ifindex
			ifc.hooks = append(ifc.hooks, HookStatus{Hook: h.String(), Mode: string(a.Mode)})
			if !a.Reused {
				ifc.made = append(ifc.made, h)
			}
		}
		return nil
	})
}

// RemoveInterface detaches the programs from a VM-edge or north-south
// interface (on a north-south one, the TC hooks and our XDP program). The
// L7 policies that redirect to it then fail closed (their new flows drop)
// until it is attached again.
//
// A ctx that ended before the hooks are detached (on entry, or while the
// call waited for the dataplane's lock) detaches nothing and fails with
// an error wrapping ctx's; once detaching, the call finishes.
func (d *Dataplane) RemoveInterface(ctx context.Context, name string) error {
	if err := d.begin(ctx, "remove interface"); err != nil {
		return err
	}
	if err := d.removeInterface(ctx, name); err != nil {
		return err
	}
	if err := d.refreshProxies(name); err != nil {
		return fmt.Errorf("fluxvm: remove interface %s: detached, but the L7 policies that redirect to it were not updated: %w", name, err)
	}
	return nil
}

func (d *Dataplane) removeInterface(ctx context.Context, name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("remove interface"); err != nil {
		return err
	}
	if err := ctxErr(ctx, "remove interface "+name); err != nil {
		return err
	}
	ifc, ok := d.ifaces[name]
	if !ok {
		return fmt.Errorf("fluxvm: remove interface %s: %w", name, ErrNotFound)
	}
	if err := d.detachHooks(ifc); err != nil {
		return fmt.Errorf("fluxvm: remove interface %s: %w", name, err)
	}
	if err := d.unregisterEdge(ifc); err != nil {
		return fmt.Errorf("fluxvm: remove interface %s: statistics: %w", name, err)
	}
	delete(d.ifaces, name)
	return nil
}

func (i *iface) status() InterfaceStatus {
	st := InterfaceStatus{Name: i.Name, Kind: i.kind, Index: i.index, VMID: i.VMID, Hooks: slices.Clone(i.hooks), Problem: i.problem}
	if i.kind == InterfaceNorthSouth {
		st.XDP, st.XDPProblem = string(i.xdp), i.xdpProblem
		if st.XDP == "" {
			st.XDP = string(bpf.XDPOff)
		}
	}
	return st
}
