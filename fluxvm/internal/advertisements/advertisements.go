// Package advertisements is the VIP advertisement component of the
// dataplane.
//
// It decides, for every VIP of every service exposed north-south (or
// both), whether the node wants the VIP routed to it, with advert.Decide:
// advertise=true in the intent, the service enabled, and at least one
// backend of the VIP's family whose effective state (the intent plus the
// health overlay) is Ready with a weight above 0. The decisions are
// published as one snapshot (package advert) to Config.Path, or kept in
// memory when it is empty, and served by Snapshot.
//
// What it owns: the publisher, its worker goroutine, the pending set of
// entries and the publish errors, under its own lock (and a second one
// that orders publishes). What it needs from the dataplane is a View of
// the services and of each backend's effective state, which it reads only
// inside Update, in the caller's goroutine.
//
// Update computes the entries whenever their inputs may have changed
// (after an apply, a delete, the catalog restore at Open and a
// health-driven reprogram) and hands them to the worker without
// blocking: publishing syncs a file and its directory, so it never
// happens in the caller's goroutine. The worker keeps only the latest
// set not yet published (an older pending set is dropped: the snapshot is
// always the complete list). The advert.Publisher writes only when the
// content changed, so recomputing more often than needed costs nothing on
// disk. A failed publish is logged, shown in Status, and retried (1 s,
// doubling up to 30 s) until a publish succeeds. Close publishes the last
// pending set and stops the worker.
//
// Lock order: the facade calls Update with its own lock (d.mu) held, so
// that the View is consistent; this component's locks are taken after it,
// never before, and it never calls the facade (the View is read only
// inside Update, and the worker calls nothing but the publisher).
package advertisements

import (
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/intent"
)

// View is the read-only view of the services the advertisements are
// computed from. Update calls it in its caller's goroutine only: the
// caller holds whatever keeps it consistent.
type View interface {
	// Services yields the intent of every service.
	Services() iter.Seq[*intent.Service]
	// EffectiveState is the state the datapath has for backend b of svc:
	// its intent state with the health overlay.
	EffectiveState(svc *intent.Service, b *intent.Backend) intent.BackendState
	// SNAT is what the node wants routed to it of SNAT addresses.
	SNAT() SNAT
	// Hold, when not empty, withdraws every entry that would be
	// advertised, with this reason (advert.ReasonGroupJoining).
	Hold() advert.Reason
}

// SNAT is the node's SNAT addresses as the advertisements see them.
type SNAT struct {
	// Own are the node's own SNAT addresses (one a family at most), and
	// TakenOver those of gone edges of its group it took over
	// (SetSNATPeers' Announce).
	Own, TakenOver []netip.Addr
	// Advertise is advertise_snat: the entries are advertised. Without
	// it the node's own addresses are not listed (they are routed by
	// other means), and the taken-over ones are listed withdrawn, so
	// that the snapshot shows what the node was asked for.
	Advertise bool
}

// Publisher is what the component needs from a publisher:
// *advert.Publisher, or an in-memory one without a file.
type Publisher interface {
	Publish(entries []advert.Entry) (advert.Snapshot, bool, error)
	Current() (advert.Snapshot, bool)
}

// Config is the component's configuration.
type Config struct {
	// Path is the snapshot file; "" keeps the snapshot in memory.
	Path string
	// Node is the node's name, written in every snapshot ("" writes
	// none).
	Node string
	// Logger receives the changes of decision and the publish errors;
	// nil discards them.
	Logger *slog.Logger
}

// Deps is what the component needs from the rest of the dataplane.
type Deps struct {
	// View is read by Update (required).
	View View
	// Publisher replaces the one Config.Path names when set (nil: an
	// advert.Publisher on Path, or the in-memory one when Path is "").
	Publisher Publisher
}

// Retry delays of a failed publish.
const (
	RetryMin = time.Second
	RetryMax = 30 * time.Second
)

// Advertiser publishes the advertisement entries from its own goroutine.
type Advertiser struct {
	view View
	pub  Publisher
	path string // "" when in memory
	node string
	log  *slog.Logger

	// pubMu serializes taking the pending set and publishing it, so that
	// sets reach the file in the order they were computed.
	pubMu sync.Mutex

	mu         sync.Mutex // guards the fields below; taken after the facade's lock, never before
	pending    []advert.Entry
	hasPending bool
	latest     []advert.Entry // the last set submitted
	lastErr    error
	lastErrAt  time.Time
	loadErr    error
	stopped    bool
	started    bool
	kick       chan struct{} // capacity 1: "a set is pending"
	stop, done chan struct{}

	// Tests only, set before Start: testRetry replaces the retry timer (a
	// retry happens when it delivers), and testFlushed receives the
	// outcome of every publish the worker attempts before Close.
	testRetry   <-chan time.Time
	testFlushed chan<- error
}

// New makes the component; it starts nothing. It fails when deps.View is
// nil, or when an existing snapshot file cannot be read at all
// (advert.NewPublisher).
func New(cfg Config, deps Deps) (*Advertiser, error) {
	if deps.View == nil {
		return nil, errors.New("advertisements: no view of the services")
	}
	a := &Advertiser{view: deps.View, pub: deps.Publisher, path: cfg.Path, node: cfg.Node, log: cfg.Logger,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	switch {
	case a.pub != nil:
	case cfg.Path == "":
		a.pub = &memPublisher{node: cfg.Node}
	default:
		p, err := advert.NewPublisher(advert.Options{Path: cfg.Path, Node: cfg.Node, Logger: a.log})
		if err != nil {
			return nil, fmt.Errorf("advertisements: %w", err)
		}
		a.pub, a.path, a.loadErr = p, p.Path(), p.LoadError()
	}
	return a, nil
}

// Start publishes the pending set now, if any (so that the first read is
// right: call Update first), and starts the worker. A failed first
// publish is logged, shown in Status and retried by the worker. Start
// after Close does nothing.
func (a *Advertiser) Start() {
	a.mu.Lock()
	if a.stopped || a.started {
		a.mu.Unlock()
		return
	}
	a.started = true
	a.mu.Unlock()
	// Take the pending set now: the worker then retries it if this
	// fails.
	if err := a.Flush(); err != nil {
		a.signal()
	}
	go a.run()
}

// Close publishes the last pending set and stops the worker, waiting for
// it to end. It is idempotent; its error is always nil (a failed last
// publish is logged: Flush says it).
func (a *Advertiser) Close() error {
	a.mu.Lock()
	if a.stopped {
		a.mu.Unlock()
		return nil
	}
	a.stopped = true
	started := a.started
	a.mu.Unlock()
	if started {
		close(a.stop)
		<-a.done
	}
	return nil
}

// Done is closed when the worker has ended (after Close); it is never
// closed when Start was not called.
func (a *Advertiser) Done() <-chan struct{} { return a.done }

// Update computes the entries of every service from the View and hands
// them to the worker without blocking. The caller holds what keeps the
// View consistent (the facade's lock).
func (a *Advertiser) Update() { a.Submit(Entries(a.view)) }

// Submit makes entries the set to publish next, replacing one not yet
// published, and wakes the worker. Cleanup submits an empty set: every
// VIP withdrawn.
func (a *Advertiser) Submit(entries []advert.Entry) {
	a.mu.Lock()
	a.pending, a.hasPending, a.latest = entries, true, entries
	a.mu.Unlock()
	a.signal()
}

// Entries decides every VIP of every service of v that is exposed
// north-south (or both), or asks to be advertised, and the SNAT addresses
// (SNAT).
func Entries(v View) []advert.Entry {
	out := entries(v)
	if hold := v.Hold(); hold != "" {
		for i := range out {
			if out[i].Advertised {
				out[i].Advertised, out[i].Reason = false, hold
			}
		}
	}
	return out
}

func entries(v View) []advert.Entry {
	out := []advert.Entry{}
	snat := v.SNAT()
	if snat.Advertise {
		for _, a := range snat.Own {
			out = append(out, advert.DecideSNAT(a.Unmap(), advert.KindSNAT, true))
		}
	}
	for _, a := range snat.TakenOver {
		out = append(out, advert.DecideSNAT(a.Unmap(), advert.KindSNATPeer, snat.Advertise))
	}
	for svc := range v.Services() {
		if !svc.IsNorthSouth() && !svc.Advertise {
			continue
		}
		exposure := string(svc.Exposure)
		if exposure == "" {
			exposure = string(intent.ExposureEastWest)
		}
		ports := make([]advert.Port, 0, len(svc.Ports))
		for _, p := range svc.Ports {
			ports = append(ports, advert.Port{Port: p.Port, Protocol: string(p.Protocol)})
		}
		for _, vip := range svc.VIPs {
			vip = vip.Unmap()
			out = append(out, advert.Decide(advert.Input{
				VIP: vip, Service: svc.Name, Exposure: exposure, Ports: ports,
				Enabled: svc.IsEnabled(), Advertise: svc.Advertise,
				ReadyBackends: readyBackends(v, svc, vip.Is4()),
			}))
		}
	}
	return out
}

// readyBackends counts the backends of svc of one family that can take
// new flows: enabled, effectively Ready after the health overlay, and
// with a weight above 0 (a weight of 0 takes no new flows).
func readyBackends(v View, svc *intent.Service, v4 bool) int {
	n := 0
	for i := range svc.Backends {
		b := &svc.Backends[i]
		if b.IsEnabled() && b.Address.Unmap().Is4() == v4 && b.EffectiveWeight() > 0 &&
			v.EffectiveState(svc, b) == intent.BackendReady {
			n++
		}
	}
	return n
}

func (a *Advertiser) signal() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// run publishes pending sets until stop, then publishes the last one.
func (a *Advertiser) run() {
	defer close(a.done)
	backoff := RetryMin
	var retry *time.Timer
	var retryC <-chan time.Time
	defer func() {
		if retry != nil {
			retry.Stop()
		}
	}()
	for {
		select {
		case <-a.stop:
			if err := a.Flush(); err != nil {
				a.log.Error("fluxvm: advertisements: the last publish before closing failed; the file keeps the previous snapshot",
					"path", a.path, "err", err)
			}
			return
		case <-a.kick:
		case <-retryC:
		}
		err := a.Flush()
		if a.testFlushed != nil {
			select {
			case a.testFlushed <- err:
			case <-a.stop:
			}
		}
		if retry != nil {
			retry.Stop()
		}
		retry, retryC = nil, nil
		if err != nil {
			if a.testRetry != nil {
				retryC = a.testRetry
			} else {
				retry = time.NewTimer(backoff)
				retryC = retry.C
			}
			backoff = min(2*backoff, RetryMax)
			continue
		}
		backoff = RetryMin
	}
}

// Flush publishes the pending set, if any, in the caller's goroutine. On
// failure the set stays pending (unless a newer one arrived meanwhile)
// for the next attempt. Cleanup calls it after Close, so that a failure
// to publish the empty set is returned rather than only logged.
func (a *Advertiser) Flush() error {
	a.pubMu.Lock()
	defer a.pubMu.Unlock()
	a.mu.Lock()
	entries, ok := a.pending, a.hasPending
	a.pending, a.hasPending = nil, false
	a.mu.Unlock()
	if !ok {
		return nil
	}
	prev, _ := a.pub.Current()
	s, changed, err := a.pub.Publish(entries)
	a.mu.Lock()
	if err != nil {
		if !a.hasPending {
			a.pending, a.hasPending = entries, true
		}
		a.lastErr, a.lastErrAt = err, time.Now().UTC()
	} else {
		a.lastErr = nil
	}
	a.mu.Unlock()
	if err != nil {
		a.log.Error("fluxvm: advertisements not published; retrying", "path", a.path, "err", err)
		if !changed {
			return err
		}
	}
	if changed {
		a.logChanges(prev, s)
	}
	return err
}

// logChanges logs each entry whose decision changed between two
// snapshots, and the new generation.
func (a *Advertiser) logChanges(prev, next advert.Snapshot) {
	type key struct {
		vip     string
		service string
	}
	old := map[key]advert.Entry{}
	for _, e := range prev.Entries {
		old[key{e.VIP.String(), e.Service}] = e
	}
	advertised := 0
	for _, e := range next.Entries {
		k := key{e.VIP.String(), e.Service}
		o, had := old[k]
		delete(old, k)
		if e.Advertised {
			advertised++
		}
		if had && o.Advertised == e.Advertised && o.Reason == e.Reason {
			continue
		}
		if e.Advertised {
			a.log.Info("fluxvm: VIP advertised", "vip", e.VIP, "service", e.Service)
		} else {
			a.log.Info("fluxvm: VIP withdrawn", "vip", e.VIP, "service", e.Service, "reason", e.Reason)
		}
	}
	for _, e := range old {
		if e.Advertised {
			a.log.Info("fluxvm: VIP withdrawn", "vip", e.VIP, "service", e.Service, "reason", "service removed")
		}
	}
	a.log.Info("fluxvm: advertisements published", "path", a.path, "generation", next.Generation,
		"entries", len(next.Entries), "advertised", advertised)
}

// Snapshot returns the current snapshot: the document the file holds. A
// set computed but not yet written is published first, so the answer
// reflects every Update made before the call. When nothing could be
// published yet (the first write failed; Status says why), it returns the
// computed entries with generation 0, which no file ever has. After Close
// it publishes nothing and returns the last snapshot published.
func (a *Advertiser) Snapshot() advert.Snapshot {
	a.mu.Lock()
	stopped := a.stopped
	a.mu.Unlock()
	if !stopped {
		if err := a.Flush(); err != nil {
			a.signal() // the worker retries
		}
	}
	if s, ok := a.pub.Current(); ok {
		return s
	}
	a.mu.Lock()
	entries := a.latest
	a.mu.Unlock()
	return advert.Snapshot{
		SchemaVersion: advert.SchemaVersion, Timestamp: time.Now().UTC(), Node: a.node,
		Entries: advert.Normalize(entries),
	}
}

// Status is the state of the advertisement publisher (the facade's
// Status.Advertisements).
type Status struct {
	// Path is the snapshot file; absent when advertisements are kept in
	// memory only (Options.AdvertisementsPath empty).
	Path string `json:"path,omitempty"`
	// Generation is that of the current snapshot; 0 before the first
	// successful publish.
	Generation uint64 `json:"generation"`
	// Timestamp is when the current snapshot was written; absent before
	// the first.
	Timestamp *time.Time `json:"timestamp,omitempty"`
	// Advertised and Withdrawn count the entries of the current
	// snapshot.
	Advertised int `json:"advertised"`
	Withdrawn  int `json:"withdrawn"`
	// LastError is why the last publish failed; absent once one
	// succeeds. The file then keeps the previous snapshot and the
	// publish is retried.
	LastError   string     `json:"last_error,omitempty"`
	LastErrorAt *time.Time `json:"last_error_at,omitempty"`
	// LoadError is why the file found at start was not a valid snapshot
	// (it was, or will be, replaced with generation 1).
	LoadError string `json:"load_error,omitempty"`
}

// Status reports the publisher's state. It takes only the component's
// own lock.
func (a *Advertiser) Status() Status {
	st := Status{Path: a.path}
	if s, ok := a.pub.Current(); ok {
		st.Generation = s.Generation
		ts := s.Timestamp
		st.Timestamp = &ts
		for _, e := range s.Entries {
			if e.Advertised {
				st.Advertised++
			} else {
				st.Withdrawn++
			}
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.lastErr != nil {
		st.LastError = a.lastErr.Error()
		at := a.lastErrAt
		st.LastErrorAt = &at
	}
	if a.loadErr != nil {
		st.LoadError = a.loadErr.Error()
	}
	return st
}

// memPublisher keeps the snapshot in memory, with advert.Publisher's
// canonical form (advert.Normalize) and rules for generations: it grows by
// one with every change of content. The entries Entries makes are valid
// by construction (validated intent); only the file publisher checks them
// again.
type memPublisher struct {
	node string
	mu   sync.Mutex
	cur  *advert.Snapshot
}

func (m *memPublisher) Publish(entries []advert.Entry) (advert.Snapshot, bool, error) {
	norm := advert.Normalize(entries)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cur != nil && advert.EqualEntries(m.cur.Entries, norm) {
		return m.cur.Clone(), false, nil
	}
	next := advert.Snapshot{
		SchemaVersion: advert.SchemaVersion, Generation: 1, Timestamp: time.Now().UTC(),
		Node: m.node, Entries: norm,
	}
	if m.cur != nil {
		next.Generation = m.cur.Generation + 1
	}
	m.cur = &next
	return next.Clone(), true, nil
}

func (m *memPublisher) Current() (advert.Snapshot, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cur == nil {
		return advert.Snapshot{}, false
	}
	return m.cur.Clone(), true
}
