package fluxvm

import (
	"errors"
	"fmt"
)

// fq management (edt_manage_fq): the fq qdisc releases each packet at
// its skb->tstamp, which is what turns the datapath's departure times
// into pacing. Without it, a paced packet leaves at once and the horizon
// polices the rate instead (lib/edt.h).

// ErrNoFQ is returned (wrapped) by Open when edt_manage_fq cannot install
// fq because the kernel has no fq qdisc (rtnetlink answers ENOENT: an
// unknown qdisc kind), unless edt_horizon_fallback is set: the interface
// then runs in horizon-policing mode, and Status.EDT says why. Any other
// failure to install fq fails Open, fallback or not.
var ErrNoFQ = errors.New("the kernel has no sch_fq (CONFIG_NET_SCH_FQ)")

// EDT modes of an interface, as EDTInterfaceStatus.Mode reports them.
const (
	// EDTModeFQ: the interface's root qdisc is fq, which holds each
	// paced packet until its departure time; the horizon bounds how long.
	EDTModeFQ = "fq"
	// EDTModeHorizonPolicing: no fq holds the packets, they leave at
	// once; a paced service's packets beyond its horizon are dropped,
	// which bounds its rate to max_egress_mbps plus a burst of a
	// horizon's worth.
	EDTModeHorizonPolicing = "horizon-policing"
)

// fqKind is the qdisc kind edt_manage_fq installs: "fq". Tests set a kind
// every kernel has ("pfifo") to exercise install and restore on a kernel
// without sch_fq.
var fqKind = "fq"

// fqHandle is the handle of the root qdisc edt_manage_fq installs
// (0xf1d0:), by which a later start and Close recognise it as FluxVM's.
const fqHandleMajor = 0xf1d0

// managedFQ is one interface of edt_interfaces as Open left it.
type managedFQ struct {
	name string
	// installed: our fq is the root (we installed it, or adopted the one
	// an earlier start left); Close deletes it.
	installed bool
	// previous is the kind of the kernel's default root qdisc that fq
	// replaced ("noqueue", "mq", ...); empty when adopted.
	previous string
	// problem says why fq is not installed (edt_horizon_fallback).
	problem string
}

// openFQ installs fq on every interface of edt_interfaces (when
// edt_enabled and edt_manage_fq), in the node's namespace. All or
// nothing: on an error, the fq installed on earlier interfaces is
// removed again. A kernel without fq (ErrNoFQ) is an error unless
// edt_horizon_fallback is set; the interface is then listed with the
// reason.
func openFQ(opts Options) ([]managedFQ, error) {
	if !opts.EDTEnabled || !opts.EDTManageFQ {
		return nil, nil
	}
	var out []managedFQ
	err := opts.InNamespace(func() error {
		for _, name := range opts.EDTInterfaces {
			m, err := installFQ(name)
			if err != nil {
				if !errors.Is(err, ErrNoFQ) || !opts.EDTHorizonFallback {
					return err
				}
				m.problem = err.Error()
				opts.Logger.Warn("fluxvm: EDT: fq could not be installed; the interface runs in horizon-policing mode (edt_horizon_fallback)", "interface", name, "err", err)
			} else if m.previous != "" {
				opts.Logger.Info("fluxvm: EDT: fq installed as root qdisc", "interface", name, "kind", fqKind, "replaced", m.previous)
			} else {
				opts.Logger.Info("fluxvm: EDT: fq of an earlier start adopted", "interface", name, "kind", fqKind)
			}
			out = append(out, m)
		}
		return nil
	})
	if err != nil {
		if rerr := closeFQ(opts, out); rerr != nil {
			opts.Logger.Error("fluxvm: EDT: removing the fq installed before the failure failed", "err", rerr)
		}
		return nil, err
	}
	return out, nil
}

// closeFQ deletes the fq that openFQ installed, so that the kernel
// restores each interface's default root qdisc.
func closeFQ(opts Options, fq []managedFQ) error {
	if len(fq) == 0 {
		return nil
	}
	var errs []error
	err := opts.InNamespace(func() error {
		for _, m := range fq {
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
