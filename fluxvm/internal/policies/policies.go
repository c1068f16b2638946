// Package policies is the identity policy component of the dataplane,
// L7 enforce included.
//
// A node's identity policy state is an ipcache (source prefixes to
// identities) and at most one policy per service (intent.Policy: a
// default action, identities allowed or denied, audit only, an optional
// L7 part). The Enforcer compiles that state with the root package
// policy (policy.Compiler: revisions, rules, the L7 proxy interface's
// index) and writes the result to fluxvm_sid4, fluxvm_sid6 and
// fluxvm_spol through a Writer (policy.Writer), so that no packet meets
// half a policy: an ipcache change closes the guards of the services that
// enforce a policy while it is written, a frontend gets its policy's
// header before its flag (bpf.SvcFlagPolicy, bpf.SvcFlagL7), and loses the
// flag before its header goes. A change that cannot be compiled changes
// nothing; one whose writing fails puts back what was written before.
// Every change is recorded through Deps.Journal (the catalog journal);
// Restore compiles the recorded state again at Open.
//
// What it owns: the state compiled last (and the input it was compiled
// from), the compiler and its bounds, the Writer (so the maps' contents),
// and the L7 bookkeeping: which proxy interfaces the policies redirect
// to, whether the index a policy names is still the interface's
// (Stale), and the Envoy document of a service's L7 part. What it needs
// from the rest of the dataplane it declares here: the Services
// (intents, live frontends, their policy flags and guards), the
// Interfaces attached, the Counters, and Journal.
//
// Locks: mu guards the compiled state and is never held while a Deps
// call runs (Status and the other readers take it alone); wmu serialises
// the writes of the maps (Restore, Write, Change, Drop, Attach, Detach)
// and is held across the Deps calls of a write, which therefore must not
// call a writing method of the Enforcer. The facade calls every method
// with its own lock (d.mu) held where the Deps it implements need it: a
// lock of this component is always taken after d.mu, never before, and
// the component never takes d.mu (its Deps run in the caller's
// goroutine, under the caller's locks). The facade serialises whole
// policy changes itself, with the locks of the services they touch.
package policies

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/policy"
)

// ErrUnsaved: a change was applied to the maps, but its record could not
// be appended to the catalog journal (Deps.Journal failed).
var ErrUnsaved = errors.New("applied, but the catalog was not saved")

// State is what the policies are compiled from, as the catalog records
// it: the ipcache, the policies, and the policies' datapath ids.
type State = catalog.Policies

// Edit changes a copy of the current State; an error leaves the state as
// it was.
type Edit func(*State) error

// Writer writes compiled programs to the policy maps: *policy.Writer
// (see there for the order it keeps). It is called under wmu only.
type Writer interface {
	IPCacheChanges(p *policy.Program) bool
	SetIPCache(p *policy.Program) error
	Attach(c *policy.Compiled, sids []uint32) error
	Detach(sids []uint32) error
	Prune(p *policy.Program, keep func(sid uint32) bool) error
}

// Frontend is one live frontend of a service: its entry is written.
type Frontend struct {
	Service string
	SID     uint32 // its datapath service id
	// Flags are its entry's flags now; the policy ones
	// (bpf.SvcFlagPolicy, bpf.SvcFlagL7) are the Enforcer's to change.
	Flags uint32
}

// Services is the view of the services the Enforcer needs. Its methods
// run in the caller's goroutine, under the caller's locks.
type Services interface {
	// Service is the intent of service name; nil when there is none.
	Service(name string) *intent.Service
	// Frontends are the live frontends of every service.
	Frontends() []Frontend
	// SetPolicyFlags writes the entry of frontend sid of service with
	// flags on as its policy flags (the others as they are).
	SetPolicyFlags(service string, sid uint32, on uint32) error
	// CloseGuards closes the guards of the live guarded frontends of
	// services (their new and rechecked packets drop meanwhile) and
	// returns what opens them again. On an error it has opened again
	// what it closed.
	CloseGuards(services []string) (reopen func() error, err error)
}

// Interfaces is the view of the attached interfaces the L7 proxy
// interfaces are resolved against.
type Interfaces interface {
	// VMEdge is the index VM-edge interface name was attached under;
	// ok false when it is not an attached VM-edge interface.
	VMEdge(name string) (index int, ok bool)
}

// Config is the component's configuration.
type Config struct {
	// Services is how many datapath services the object holds (the
	// most policies there can be: one per service); PolicyEntries is
	// fluxvm_spol's size. The rules get what the headers and one
	// policy's second rule set leave (bpf/fluxvm_service_maps.bpf.h).
	// Both must be above 0.
	Services, PolicyEntries int
	// InNamespace runs the proxy interfaces' lookups in the node's
	// network namespace; nil: the calling thread's.
	InNamespace func(func() error) error
	// Logger receives what a change drops or cannot resolve; nil:
	// slog.Default().
	Logger *slog.Logger
}

// Deps is what the component needs from the rest of the dataplane.
// Writer, Services and Interfaces are required.
type Deps struct {
	Writer     Writer
	Services   Services
	Interfaces Interfaces
	// Counters reads the policy counters; nil: Status reports zeros.
	Counters Counters
	// Journal appends the state a change made to the catalog journal
	// and returns the seq to wait for; nil: nothing is recorded (seq 0).
	Journal func(*State) (uint64, error)
	// Device resolves a proxy interface's device in the node's
	// namespace (ProxyDevice, Linux); nil: ProxyDevice in
	// Config.InNamespace.
	Device func(name string) (uint32, error)
}

// Enforcer is the component. Its zero value is not usable: call New.
type Enforcer struct {
	log     *slog.Logger
	comp    policy.Compiler
	svc     Services
	ifaces  Interfaces
	counts  Counters
	journal func(*State) (uint64, error)
	device  func(string) (uint32, error)

	wmu sync.Mutex // serialises the writes: w, and the maps; taken after the facade's lock, before mu
	w   Writer

	mu sync.Mutex // guards the fields below; never held while a Deps call runs
	// in is what prog was compiled from; prog the result (an empty
	// Program until a change or a restore); set whether one ever was
	// (Saved records the state only then).
	in     State
	prog   *policy.Program
	set    bool
	closed bool
}

// New checks cfg and deps and returns the component, with no policy; it
// writes nothing.
func New(cfg Config, deps Deps) (*Enforcer, error) {
	switch {
	case cfg.Services <= 0:
		return nil, fmt.Errorf("policies: %d services: want above 0", cfg.Services)
	case deps.Writer == nil || deps.Services == nil || deps.Interfaces == nil:
		return nil, errors.New("policies: Writer, Services and Interfaces are required")
	}
	// fluxvm_spol holds every rule, a header per datapath service, and
	// room for one policy's second rule set.
	rules := cfg.PolicyEntries - cfg.Services - 2*intent.MaxPolicyIdentities
	if rules <= 0 {
		return nil, fmt.Errorf("policies: fluxvm_spol of %d entries leaves no room for rules beside %d headers", cfg.PolicyEntries, cfg.Services)
	}
	e := &Enforcer{log: cfg.Logger, comp: policy.Compiler{Limits: policy.Limits{Policies: cfg.Services, Rules: rules}},
		svc: deps.Services, ifaces: deps.Interfaces, counts: deps.Counters, journal: deps.Journal, device: deps.Device,
		w: deps.Writer, prog: &policy.Program{}}
	if e.log == nil {
		e.log = slog.Default()
	}
	if e.journal == nil {
		e.journal = func(*State) (uint64, error) { return 0, nil }
	}
	if e.device == nil {
		inNS := cfg.InNamespace
		if inNS == nil {
			inNS = func(f func() error) error { return f() }
		}
		e.device = func(name string) (i uint32, err error) {
			err = inNS(func() error {
				i, err = ProxyDevice(name)
				return err
			})
			return i, err
		}
	}
	return e, nil
}

// Close ends the component: the maps keep what was written (the next
// Open's Writer adopts it); the writing methods fail with errs.ErrClosed
// from then on. Idempotent.
func (e *Enforcer) Close() error {
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
	return nil
}

// current is the compiled state now, and an error once closed.
func (e *Enforcer) current() (State, *policy.Program, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return State{}, nil, fmt.Errorf("policies: %w", errs.ErrClosed)
	}
	return e.in, e.prog, nil
}

// commit makes prog, compiled from in, the current state and returns
// what the catalog records of it.
func (e *Enforcer) commit(in State, prog *policy.Program) *State {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.in, e.prog, e.set = in, prog, true
	return e.savedLocked()
}

// Saved is the state the catalog records: nil until a change or a
// restore set one.
func (e *Enforcer) Saved() *State {
	if e == nil {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.savedLocked()
}

func (e *Enforcer) savedLocked() *State {
	if !e.set {
		return nil
	}
	c := State{IPCache: intent.IPCache{Entries: slices.Clone(e.in.IPCache.Entries)}, IDs: map[string]uint32{}}
	for _, pol := range e.in.Policies {
		c.Policies = append(c.Policies, pol.Clone())
	}
	for _, cp := range e.prog.Policies {
		c.IDs[cp.Service] = cp.ID
	}
	return &c
}

// withIDs is a Program that only names the policy ids of ids, for the
// compiler to keep them.
func withIDs(ids map[string]uint32) *policy.Program {
	p := &policy.Program{}
	for name, id := range ids {
		p.Policies = append(p.Policies, policy.Compiled{Service: name, ID: id})
	}
	slices.SortFunc(p.Policies, func(a, b policy.Compiled) int { return strings.Compare(a.Service, b.Service) })
	return p
}

// Restore compiles the catalog's state st (nil: none was recorded)
// against the services restored, and writes the ipcache, before the
// services are programmed: each frontend then attaches its service's
// policy before its flag (Attach), so that a restored service enforces
// its policy from its first packet. A policy whose service the catalog
// lacks (its delete was recorded, the policy's removal not) is dropped
// with a warning rather than keep the node from starting. The
// interfaces are not attached yet: a proxy interface resolves by its
// device alone (Stale corrects an index once they are); one that cannot
// be used is 0, and new flows of its services drop.
func (e *Enforcer) Restore(st *State) error {
	if st == nil {
		return nil
	}
	e.wmu.Lock()
	defer e.wmu.Unlock()
	if _, _, err := e.current(); err != nil {
		return err
	}
	kept := st.Policies[:0:0]
	for _, pol := range st.Policies {
		if e.svc.Service(pol.Service) == nil {
			e.log.Warn("fluxvm: restore: dropped the identity policy of a service the catalog no longer has", "service", pol.Service)
			continue
		}
		kept = append(kept, pol)
	}
	in := *st
	in.Policies = kept
	prog, err := e.comp.Compile(e.input(in, func(name string) (uint32, error) {
		i, err := e.device(name)
		if err != nil {
			e.log.Warn("fluxvm: restore: L7 enforce: the proxy interface cannot be used; new flows of its services drop until it is attached",
				"interface", name, "err", err)
			return 0, nil
		}
		return i, nil
	}), withIDs(st.IDs))
	if err != nil {
		return err
	}
	if err := e.w.SetIPCache(prog); err != nil {
		return err
	}
	e.commit(in, prog)
	return nil
}

// Write writes the current state again: once the restored services are
// programmed, what a previous process left in the maps and nothing uses
// now goes.
func (e *Enforcer) Write() error {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	_, prog, err := e.current()
	if err != nil {
		return err
	}
	return e.write(prog, prog)
}

// Involved is the state edit would make of the current one, and the
// services whose policy it may change (sorted, once each): those with a
// policy now or after it. The facade locks their applies before Change.
func (e *Enforcer) Involved(edit Edit) ([]string, error) {
	next, err := e.next(edit)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	var names []string
	for _, s := range [][]intent.Policy{e.in.Policies, next.Policies} {
		for _, p := range s {
			names = append(names, p.Service)
		}
	}
	e.mu.Unlock()
	slices.Sort(names)
	return slices.Compact(names), nil
}

// Change compiles the state edit makes of the current one, writes it and
// records it (Deps.Journal), returning the seq to wait for. The proxy
// interfaces of the policies of the services named, and of the enforce
// policies the edit adds or alters, must resolve (strictProxies); those
// of the others resolve as they can. An error of the edit, the compiler
// or the writing changes nothing (what was written is put back); one
// wrapping ErrUnsaved says the change is in force but not recorded.
func (e *Enforcer) Change(edit Edit, named []string) (uint64, error) {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	cur, old, err := e.current()
	if err != nil {
		return 0, err
	}
	next, err := e.next(edit)
	if err != nil {
		return 0, err
	}
	strict := strictProxies(cur.Policies, next.Policies, named)
	prog, err := e.comp.Compile(e.input(next, e.resolver(strict)), old)
	if err != nil {
		return 0, err
	}
	if err := e.write(old, prog); err != nil {
		// Put back what was there, so that maps and catalog agree.
		if rerr := e.write(old, old); rerr != nil {
			e.log.Error("fluxvm: identity policy rollback failed; reconcile again", "err", rerr)
		}
		return 0, err
	}
	return e.record(next, prog)
}

// record commits prog, compiled from in, and journals it.
func (e *Enforcer) record(in State, prog *policy.Program) (uint64, error) {
	seq, err := e.journal(e.commit(in, prog))
	if err != nil {
		return seq, fmt.Errorf("%w: %w", ErrUnsaved, err)
	}
	return seq, nil
}

// Has reports whether service has a policy.
func (e *Enforcer) Has(service string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.prog.Policy(service) != nil
}

// Drop removes the policy of service, deleted with its frontends, from
// the state and the maps, and records the state (the seq to wait for).
func (e *Enforcer) Drop(service string) (uint64, error) {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	_, old, err := e.current()
	if err != nil {
		return 0, err
	}
	next, err := e.next(func(st *State) error {
		st.Policies = slices.DeleteFunc(st.Policies, func(p intent.Policy) bool { return p.Service == service })
		return nil
	})
	if err != nil {
		return 0, err
	}
	prog, err := e.comp.Compile(e.input(next, e.resolver(nil)), old)
	if err != nil {
		return 0, fmt.Errorf("identity policies without %s: %w", service, err)
	}
	if err := e.write(old, prog); err != nil {
		return 0, err
	}
	return e.record(next, prog)
}

// next is the state edit makes of the current one, sorted, sharing
// nothing with the caller's input.
func (e *Enforcer) next(edit Edit) (State, error) {
	var next State
	if cur := e.Saved(); cur != nil {
		next = *cur
	}
	if err := edit(&next); err != nil {
		return State{}, err
	}
	next.IPCache.Entries = slices.Clone(next.IPCache.Entries)
	for i := range next.Policies {
		next.Policies[i] = next.Policies[i].Clone()
	}
	slices.SortFunc(next.Policies, func(a, b intent.Policy) int { return strings.Compare(a.Service, b.Service) })
	return next, nil
}

// Flags are the frontend flags that turn policy c on (none for nil or a
// disabled policy).
func Flags(c *policy.Compiled) uint32 {
	switch {
	case c == nil || !c.Enabled:
		return 0
	case c.Redirects():
		return bpf.SvcFlagPolicy | bpf.SvcFlagL7
	}
	return bpf.SvcFlagPolicy
}

// Attach writes the header of service's enforced policy, if it has one,
// for its frontend sid, and returns the flags that turn it on: the caller
// puts them in the frontend's entry after this.
func (e *Enforcer) Attach(service string, sid uint32) (uint32, error) {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	_, prog, err := e.current()
	if err != nil {
		return 0, err
	}
	c := prog.Policy(service)
	on := Flags(c)
	if on == 0 {
		return 0, nil
	}
	if err := e.w.Attach(c, []uint32{sid}); err != nil {
		return 0, err
	}
	return on, nil
}

// Detach removes the policy header of frontend sid, once its entry no
// longer has bpf.SvcFlagPolicy (or is gone).
func (e *Enforcer) Detach(sid uint32) error {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	if _, _, err := e.current(); err != nil {
		return err
	}
	return e.w.Detach([]uint32{sid})
}

// Check says whether svc, about to be applied, still fits its policy
// (L7 enforce: NAT, TCP only).
func (e *Enforcer) Check(svc *intent.Service) error {
	e.mu.Lock()
	c := e.prog.Policy(svc.Name)
	e.mu.Unlock()
	if c == nil {
		return nil
	}
	return intent.ValidatePolicyFor(c.Policy, svc)
}

// IPCacheSizes are the entries of fluxvm_sid4 and fluxvm_sid6: only the
// Enforcer writes them, so what it wrote is what they hold.
func (e *Enforcer) IPCacheSizes() (v4, v6 int) {
	if e == nil {
		return 0, 0
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.prog.IPv4), len(e.prog.IPv6)
}
