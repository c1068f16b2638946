package edt

import (
	"errors"
	"fmt"
	"slices"
)

// fq management (edt_manage_fq): the fq qdisc releases each packet at
// its skb->tstamp, which is what turns the datapath's departure times
// into pacing. Without it, a paced packet leaves at once and the horizon
// polices the rate instead (lib/edt.h).

// ErrNoFQ is returned (wrapped) by Start when edt_manage_fq cannot install
// fq because the kernel has no fq qdisc (rtnetlink answers ENOENT: an
// unknown qdisc kind), unless edt_horizon_fallback is set: the interface
// then runs in horizon-policing mode, and its status says why. Any other
// failure to install fq fails Start, fallback or not.
var ErrNoFQ = errors.New("the kernel has no sch_fq (CONFIG_NET_SCH_FQ)")

// EDT modes of an interface, as InterfaceStatus.Mode reports them.
const (
	// ModeFQ: the interface's root qdisc is fq, which holds each
	// paced packet until its departure time; the horizon bounds how long.
	ModeFQ = "fq"
	// ModeHorizonPolicing: no fq holds the packets, they leave at
	// once; a paced service's packets beyond its horizon are dropped,
	// which bounds its rate to max_egress_mbps plus a burst of a
	// horizon's worth.
	ModeHorizonPolicing = "horizon-policing"
)

// fqKind is the qdisc kind edt_manage_fq installs: "fq". Tests set a kind
// every kernel has ("pfifo") to exercise install and restore on a kernel
// without sch_fq (SetQdiscKind).
var fqKind = "fq"

// SetQdiscKind makes edt_manage_fq install kind instead of fq until the
// returned func restores it. For tests, on kernels without sch_fq; not
// safe while a dataplane opens or reports its status.
func SetQdiscKind(kind string) (restore func()) {
	prev := fqKind
	fqKind = kind
	return func() { fqKind = prev }
}

// HandleMajor is the major number of the handle of the root qdisc
// edt_manage_fq installs (0xf1d0:): fq, or on a multi-queue device an mq
// with fq under each of its classes. By it a later start recognises the
// root as FluxVM's, to adopt it, or to remove it from an interface no
// longer managed.
const HandleMajor = 0xf1d0

// managedFQ is one interface of edt_interfaces as Start left it.
type managedFQ struct {
	name string
	// installed: our root is in place (we installed it, or adopted the
	// one an earlier start left); Close keeps it, Cleanup deletes it.
	installed bool
	// adopted: an earlier start installed it; a failed Open leaves it.
	adopted bool
	// previous is the kind of the kernel's default root qdisc that fq
	// replaced ("noqueue", "mq", ...); empty when adopted.
	previous string
	// problem says why fq is not installed (edt_horizon_fallback).
	problem string
}

// qdiscInfo is what mode detection needs of a qdisc.
type qdiscInfo struct {
	kind           string
	handle, parent uint32
}

// handleRoot is TC_H_ROOT, the parent of a root qdisc.
const handleRoot = 0xffffffff

// fqInForce reads an interface's qdiscs: the kind of its root ("" when
// none is listed), and whether fq (fqKind) holds the packets of every TX
// queue: the root is fq, or it is mq and every one of its classes has fq
// as its child (net.core.default_qdisc=fq on a multi-queue device, or
// edt_manage_fq there). other lists the kinds of mq children that are
// not fq.
func fqInForce(qs []qdiscInfo) (root string, fq bool, other []string) {
	var r *qdiscInfo
	for i := range qs {
		if qs[i].parent == handleRoot {
			r = &qs[i]
			break
		}
	}
	if r == nil {
		return "", false, nil
	}
	switch r.kind {
	case fqKind:
		return r.kind, true, nil
	case "mq":
	default:
		return r.kind, false, nil
	}
	// mq's children hang off its classes: parent <mq major>:<queue>.
	// (A default mq has handle 0:, its children parent :1, :2, ...)
	children := 0
	for _, q := range qs {
		if q.parent == handleRoot || q.parent>>16 != r.handle>>16 || q.parent&0xffff == 0 {
			continue
		}
		children++
		if q.kind != fqKind && !slices.Contains(other, q.kind) {
			other = append(other, q.kind)
		}
	}
	return r.kind, children > 0 && len(other) == 0, other
}

// openFQ installs fq on every interface of edt_interfaces (when
// edt_enabled and edt_manage_fq), in the node's namespace, adopting the
// fq an earlier start kept (Close keeps it). First it removes our fq
// (handle f1d0:) from every interface that is no longer to have it: not
// in edt_interfaces, or every interface when edt_manage_fq (or
// edt_enabled) is off; a failure there is logged, not fatal. All or
// nothing: on an error, the fq this call installed on earlier interfaces
// is removed again (an adopted one stays). A kernel without fq (ErrNoFQ)
// is an error unless edt_horizon_fallback is set; the interface is then
// listed with the reason.
func (c Config) openFQ() ([]managedFQ, error) {
	keep := map[string]bool{}
	if c.Enabled && c.ManageFQ {
		for _, n := range c.Interfaces {
			keep[n] = true
		}
	}
	_ = c.InNamespace(func() error {
		removed, err := removeStrayFQ(keep)
		for _, n := range removed {
			c.Logger.Info("edt: fq of an earlier start removed: the interface is no longer managed (edt_manage_fq, edt_interfaces)", "interface", n)
		}
		if err != nil {
			c.Logger.Error("edt: removing the fq of an earlier start from interfaces no longer managed failed", "err", err)
		}
		return nil
	})
	if len(keep) == 0 {
		return nil, nil
	}
	var out []managedFQ
	err := c.InNamespace(func() error {
		for _, name := range c.Interfaces {
			m, err := installFQ(name)
			if err != nil {
				if !errors.Is(err, ErrNoFQ) || !c.HorizonFallback {
					return err
				}
				m.problem = err.Error()
				c.Logger.Warn("edt: fq could not be installed; the interface runs in horizon-policing mode (edt_horizon_fallback)", "interface", name, "err", err)
			} else if m.adopted {
				c.Logger.Info("edt: fq of an earlier start adopted", "interface", name, "kind", fqKind)
			} else {
				c.Logger.Info("edt: fq installed", "interface", name, "kind", fqKind, "replaced", m.previous)
			}
			out = append(out, m)
		}
		return nil
	})
	if err != nil {
		if rerr := c.rollbackFQ(out); rerr != nil {
			c.Logger.Error("edt: removing the fq installed before the failure failed", "err", rerr)
		}
		return nil, err
	}
	return out, nil
}

// rollbackFQ deletes the fq that a failed Open installed (not the ones
// it adopted), so that the kernel restores each interface's default root
// qdisc.
func (c Config) rollbackFQ(fq []managedFQ) error {
	var errs []error
	err := c.InNamespace(func() error {
		for _, m := range fq {
			if m.adopted {
				continue
			}
			if err := removeFQ(m); err != nil {
				errs = append(errs, err)
			}
		}
		return nil
	})
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("edt: restore root qdiscs: %w", err)
	}
	return nil
}

// RemoveAll deletes our root qdisc (handle f1d0:) from every interface
// of the node's namespace (c.InNamespace; the dataplane's Cleanup): the
// kernel restores each one's default root. Only c.InNamespace and
// c.Logger are used.
func RemoveAll(c Config) error {
	c = c.withDefaults()
	err := c.InNamespace(func() error {
		removed, err := removeStrayFQ(nil)
		for _, n := range removed {
			c.Logger.Info("edt: fq removed", "interface", n)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("edt: restore root qdiscs: %w", err)
	}
	return nil
}
