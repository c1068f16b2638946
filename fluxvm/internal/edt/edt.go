// Package edt is the node side of EDT pacing (edt_enabled and its keys),
// a component of the fluxvm dataplane: the fq qdiscs edt_manage_fq
// installs, adopts and removes (fq.go), the node's entry of fluxvm_edt
// that counts the paced north-south services, the rate entry a paced
// service's frontends get (ValueOf), and how paced packets leave each
// interface (Interfaces).
//
// The datapath's side is bpf/lib/edt.h; what a frontend's entry holds
// and when its departure clock survives a change is the services'
// programming (fluxvm/edt.go), which asks this component for the values.
//
// Pacing's lock guards only its own state (the fq as Start left it, the
// node entry as written, closed). The dataplane may hold its own lock
// while it calls in; Pacing never calls back into the dataplane. The
// qdisc reads of Interfaces run outside the lock.
package edt

import (
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
)

// Config is the EDT settings in force (fluxvm.Options.EDT after
// WithDefaults) and where the interfaces live.
type Config struct {
	// Enabled: services may ask for pacing. False: Start manages no fq
	// (it removes ours from every interface), Interfaces reports none.
	Enabled bool
	// Horizon is edt_horizon: bpf.MinEDTHorizon..bpf.MaxEDTHorizon, or
	// 0 while Enabled is false.
	Horizon time.Duration
	// ManageFQ, Interfaces and HorizonFallback are edt_manage_fq,
	// edt_interfaces and edt_horizon_fallback (fq.go).
	ManageFQ        bool
	Interfaces      []string
	HorizonFallback bool
	// InNamespace runs qdisc operations in the node's network namespace;
	// nil: the calling thread's.
	InNamespace func(func() error) error
	// Logger receives what Start installs, adopts and removes; nil:
	// slog.Default().
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.InNamespace == nil {
		c.InNamespace = func(f func() error) error { return f() }
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Pacing is the component. Its zero value is not usable: call New.
type Pacing struct {
	cfg Config

	mu sync.Mutex
	fq []managedFQ // edt_interfaces as Start left them
	// node is the Rate of the node's fluxvm_edt entry as written, once
	// nodeKnown: the paced north-south services.
	node      uint64
	nodeKnown bool
	closed    bool
}

// New checks cfg and returns the component; it changes nothing.
func New(cfg Config) (*Pacing, error) {
	if cfg.Enabled && (cfg.Horizon < bpf.MinEDTHorizon || cfg.Horizon > bpf.MaxEDTHorizon) {
		return nil, fmt.Errorf("edt: horizon %v is outside %v..%v", cfg.Horizon, bpf.MinEDTHorizon, bpf.MaxEDTHorizon)
	}
	cfg.Interfaces = append([]string(nil), cfg.Interfaces...)
	return &Pacing{cfg: cfg.withDefaults()}, nil
}

// Start installs fq on every interface of edt_interfaces (with Enabled
// and ManageFQ), adopting the fq an earlier start kept, after removing
// ours from every interface no longer to have it: all or nothing (see
// openFQ). A kernel without fq fails with an error wrapping ErrNoFQ
// unless HorizonFallback is set.
func (p *Pacing) Start() error {
	fq, err := p.cfg.openFQ()
	if err != nil {
		return fmt.Errorf("edt: %w", err)
	}
	p.mu.Lock()
	p.fq = fq
	p.mu.Unlock()
	return nil
}

// Rollback deletes the fq Start installed (not the ones it adopted), so
// that the kernel restores each interface's default root qdisc: the undo
// of a failed start.
func (p *Pacing) Rollback() error {
	p.mu.Lock()
	fq := p.fq
	p.fq = nil
	p.mu.Unlock()
	if err := p.cfg.rollbackFQ(fq); err != nil {
		return fmt.Errorf("removing the fq installed by the failed start: %w", err)
	}
	return nil
}

// Close ends the component: the fq stays on its interfaces (the next
// start adopts it, Cleanup removes it), and Interfaces reports none.
// Idempotent.
func (p *Pacing) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	return nil
}

// Horizon is edt_horizon in force.
func (p *Pacing) Horizon() time.Duration { return p.cfg.Horizon }

// Enabled reports edt_enabled.
func (p *Pacing) Enabled() bool { return p.cfg.Enabled }

// ValueOf is the fluxvm_edt entry of each frontend of a service with cap
// mbps: the zero value when mbps is 0 (not paced). Validation keeps
// max_egress_mbps within the bounds bpf.NewEDTValue accepts, so an error
// here means a service that skipped validation.
func (p *Pacing) ValueOf(mbps uint32) (bpf.EDTValue, error) {
	if mbps == 0 {
		return bpf.EDTValue{}, nil
	}
	v, err := bpf.NewEDTValue(bpf.MbpsToEDTRate(mbps), p.cfg.Horizon)
	if err != nil {
		return bpf.EDTValue{}, fmt.Errorf("max_egress_mbps %d: %w", mbps, err)
	}
	return v, nil
}

// SameRate reports whether two fluxvm_edt entries pace alike: rate and
// horizon (the pacer and the clock aside).
func SameRate(a, b bpf.EDTValue) bool {
	return a.Rate == b.Rate && a.NsPerByte == b.NsPerByte && a.HorizonNs == b.HorizonNs
}

// SyncNode writes the node's fluxvm_edt entry (bpf.EDTNodeKey) through
// put when the count of paced north-south services, n, differs from what
// it last wrote, or when it has written nothing yet (the maps may be
// new). fluxvm_ns_out looks sources up only while it is not zero.
func (p *Pacing) SyncNode(n uint64, put func(n uint64) error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.nodeKnown && p.node == n {
		return nil
	}
	if err := put(n); err != nil {
		return fmt.Errorf("edt node entry: %w", err)
	}
	p.node, p.nodeKnown = n, true
	return nil
}

// InterfaceStatus is how paced packets leave one interface.
type InterfaceStatus struct {
	Name string `json:"name"`
	// Mode is "fq" (ModeFQ) when fq holds each paced packet until its
	// departure time: the interface's root qdisc is fq, or it is mq and
	// every one of its classes (TX queues) has fq; else
	// "horizon-policing" (ModeHorizonPolicing).
	Mode string `json:"mode"`
	// Reason says why the mode is horizon-policing.
	Reason string `json:"reason,omitempty"`
	// Qdisc is the kind of the interface's root qdisc, read now.
	Qdisc string `json:"qdisc,omitempty"`
	// Managed: the interface is in edt_interfaces, and FluxVM installed
	// (or adopted) its fq root (on a multi-queue device, an mq with fq
	// under each class). Close keeps it; a later start that no longer
	// lists the interface, and Cleanup, delete it.
	Managed bool `json:"managed"`
	// PreviousQdisc is the kernel's default root qdisc that the managed
	// fq replaced, and which the kernel restores when it goes.
	PreviousQdisc string `json:"previous_qdisc,omitempty"`
}

// Interfaces reports how paced packets leave each interface they may
// leave by: attached (the dataplane's VM-edge and north-south
// interfaces) and edt_interfaces, sorted by name, their root qdiscs read
// now. None while pacing is off or after Close.
func (p *Pacing) Interfaces(attached []string) []InterfaceStatus {
	p.mu.Lock()
	if !p.cfg.Enabled || p.closed {
		p.mu.Unlock()
		return nil
	}
	managed := map[string]managedFQ{}
	names := map[string]bool{}
	for _, m := range p.fq {
		managed[m.name] = m
		names[m.name] = true
	}
	p.mu.Unlock()
	for _, n := range attached {
		names[n] = true
	}
	for _, n := range p.cfg.Interfaces {
		names[n] = true
	}
	var out []InterfaceStatus
	_ = p.cfg.InNamespace(func() error {
		for n := range names {
			qs, err := qdiscsOf(n)
			out = append(out, interfaceStatus(n, managed[n], qs, err))
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// interfaceStatus says how paced packets leave interface n, whose
// qdiscs are qs (or unknown: err), and m its fq as Start left it (the
// zero value: not managed).
func interfaceStatus(n string, m managedFQ, qs []qdiscInfo, err error) InterfaceStatus {
	st := InterfaceStatus{Name: n, Mode: ModeHorizonPolicing, Managed: m.installed, PreviousQdisc: m.previous}
	kind, fq, other := fqInForce(qs)
	st.Qdisc = kind
	switch {
	case err != nil:
		st.Reason = fmt.Sprintf("root qdisc unknown: %v", err)
	case fq:
		st.Mode = ModeFQ
	case m.problem != "":
		st.Reason = m.problem
	case kind == "":
		st.Reason = "no root qdisc: paced packets leave at once, and the horizon polices the rate"
	case kind == "mq":
		st.Reason = fmt.Sprintf("root qdisc is mq, and not every TX queue's is fq (%s): paced packets leave at once, and the horizon polices the rate", strings.Join(other, ", "))
	default:
		st.Reason = fmt.Sprintf("root qdisc is %s, not fq: paced packets leave at once, and the horizon polices the rate", kind)
	}
	return st
}
