package fluxvm

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/advert"
)

// VIP advertisements.
//
// The dataplane decides, for every VIP of every service exposed
// north-south (or both), whether the node wants the VIP routed to it, with
// advert.Decide: advertise=true in the intent, the service enabled, and at
// least one backend of the VIP's family whose effective state (intent plus
// the health overlay, effectiveState) is Ready with a weight above 0.
// The decisions are published as one snapshot (package advert) to
// Options.AdvertisementsPath, and served by Advertisements().
//
// The entries are computed under d.mu whenever their inputs may have
// changed: after ApplyService, DeleteService, the catalog restore at Open
// and a health-driven reprogram (healthChanged). Publishing syncs a file
// and its directory, so it never happens under d.mu: the entries are
// handed to one publisher goroutine, which keeps only the latest set not
// yet published (an older pending set is dropped: the snapshot is always
// the complete list). The advert.Publisher writes only when the content
// changed, so recomputing more often than needed costs nothing on disk.
// A failed publish is logged, shown in Status, and retried (1 s, doubling
// up to 30 s) until a publish succeeds. Close publishes the last pending
// set and stops the goroutine; Cleanup publishes an empty snapshot
// (every VIP withdrawn) first.

const (
	advertRetryMin = time.Second
	advertRetryMax = 30 * time.Second
)

// snapshotPublisher is what the advertiser needs from a publisher:
// *advert.Publisher, or memPublisher without a file.
type snapshotPublisher interface {
	Publish(entries []advert.Entry) (advert.Snapshot, bool, error)
	Current() (advert.Snapshot, bool)
}

// advertiser publishes the advertisement entries from its own goroutine.
type advertiser struct {
	pub  snapshotPublisher
	path string // "" when in memory
	node string
	log  *slog.Logger

	// pubMu serializes taking the pending set and publishing it, so that
	// sets reach the file in the order they were computed.
	pubMu sync.Mutex

	mu          sync.Mutex // guards the fields below; taken after d.mu, never before
	pending     []advert.Entry
	hasPending  bool
	latest      []advert.Entry // the last set submitted
	lastErr     error
	lastErrAt   time.Time
	loadErr     error
	stopped     bool
	kick        chan struct{} // capacity 1: "a set is pending"
	stop, done  chan struct{}
	startedLoop bool

	// Tests only, set before the goroutine starts: testRetry replaces
	// the retry timer (a retry happens when it delivers), and
	// testFlushed receives the outcome of every publish the goroutine
	// attempts before Close.
	testRetry   <-chan time.Time
	testFlushed chan<- error
}

// initAdvertiser prepares the publisher; Open calls it before anything
// can submit entries. It fails only when an existing snapshot file cannot
// be read at all (advert.NewPublisher).
func (d *Dataplane) initAdvertiser() error {
	a := &d.adv
	a.log, a.node = d.log, d.opts.NodeName
	a.kick = make(chan struct{}, 1)
	if d.opts.AdvertisementsPath == "" {
		a.pub = &memPublisher{node: d.opts.NodeName}
		return nil
	}
	p, err := advert.NewPublisher(advert.Options{Path: d.opts.AdvertisementsPath, Node: d.opts.NodeName, Logger: d.log})
	if err != nil {
		return fmt.Errorf("fluxvm: open: advertisements: %w", err)
	}
	a.pub, a.path, a.loadErr = p, p.Path(), p.LoadError()
	return nil
}

// startAdvertiser publishes the entries of the restored catalog now (so
// that the first read is right) and starts the publisher goroutine; Open
// calls it once the catalog is restored. A failed first publish does not
// fail Open: it is logged, shown in Status and retried.
func (d *Dataplane) startAdvertiser() {
	d.mu.Lock()
	d.advertise()
	d.mu.Unlock()
	a := &d.adv
	// Take the pending set now: the goroutine then retries it if this
	// fails.
	if err := a.flush(); err != nil {
		a.signal()
	}
	a.stop, a.done = make(chan struct{}), make(chan struct{})
	a.startedLoop = true
	go a.run()
}

// stopAdvertiser publishes the last pending set and stops the goroutine.
// It is idempotent and must be called without d.mu.
func (d *Dataplane) stopAdvertiser() {
	a := &d.adv
	a.mu.Lock()
	if a.stopped || !a.startedLoop {
		a.stopped = true
		a.mu.Unlock()
		return
	}
	a.stopped = true
	a.mu.Unlock()
	close(a.stop)
	<-a.done
}

// advertise computes the entries of every service and hands them to the
// publisher. d.mu must be held; it does not block.
func (d *Dataplane) advertise() {
	d.adv.submit(d.advertEntries())
}

// advertEntries decides every VIP of every service that is exposed
// north-south (or both), or asks to be advertised. d.mu must be held.
func (d *Dataplane) advertEntries() []advert.Entry {
	out := []advert.Entry{}
	for name, s := range d.services {
		svc := &s.intent
		if !svc.IsNorthSouth() && !svc.Advertise {
			continue
		}
		exposure := string(svc.Exposure)
		if exposure == "" {
			exposure = string(ExposureEastWest)
		}
		ports := make([]advert.Port, 0, len(svc.Ports))
		for _, p := range svc.Ports {
			ports = append(ports, advert.Port{Port: p.Port, Protocol: string(p.Protocol)})
		}
		for _, vip := range svc.VIPs {
			vip = vip.Unmap()
			out = append(out, advert.Decide(advert.Input{
				VIP: vip, Service: name, Exposure: exposure, Ports: ports,
				Enabled: svc.IsEnabled(), Advertise: svc.Advertise,
				ReadyBackends: d.readyBackends(svc, vip.Is4()),
			}))
		}
	}
	return out
}

// readyBackends counts the backends of svc of one family that can take
// new flows: enabled, effectively Ready after the health overlay, and
// with a weight above 0 (a weight of 0 takes no new flows). d.mu must be
// held.
func (d *Dataplane) readyBackends(svc *Service, v4 bool) int {
	n := 0
	for i := range svc.Backends {
		b := &svc.Backends[i]
		if b.IsEnabled() && b.Address.Unmap().Is4() == v4 && b.EffectiveWeight() > 0 &&
			d.effectiveState(svc, b) == BackendReady {
			n++
		}
	}
	return n
}

// submit makes entries the set to publish next, replacing one not yet
// published, and wakes the goroutine.
func (a *advertiser) submit(entries []advert.Entry) {
	a.mu.Lock()
	a.pending, a.hasPending, a.latest = entries, true, entries
	a.mu.Unlock()
	a.signal()
}

func (a *advertiser) signal() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// run publishes pending sets until stop, then publishes the last one.
func (a *advertiser) run() {
	defer close(a.done)
	backoff := advertRetryMin
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
			if err := a.flush(); err != nil {
				a.log.Error("fluxvm: advertisements: the last publish before closing failed; the file keeps the previous snapshot",
					"path", a.path, "err", err)
			}
			return
		case <-a.kick:
		case <-retryC:
		}
		err := a.flush()
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
			backoff = min(2*backoff, advertRetryMax)
			continue
		}
		backoff = advertRetryMin
	}
}

// flush publishes the pending set, if any. On failure the set stays
// pending (unless a newer one arrived meanwhile) for the next attempt.
func (a *advertiser) flush() error {
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
func (a *advertiser) logChanges(prev, next advert.Snapshot) {
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

// Advertisements returns the current VIP advertisement snapshot: the
// document the file at Options.AdvertisementsPath holds (GET
// /v1/network/services/advertisements serves it). A set computed but not
// yet written is published first, so the answer reflects every change
// made before the call. When nothing could be published yet (the first
// write failed; Status says why), it returns the computed entries with
// generation 0, which no file ever has. After Close it publishes nothing
// and returns the last snapshot published (after Cleanup, the empty one
// that withdraws every VIP).
func (d *Dataplane) Advertisements() advert.Snapshot {
	// The publisher is what answers; it exists from before the datapath
	// is loaded (initAdvertiser), so ask for it rather than for a
	// datapath.
	if d == nil || d.adv.pub == nil {
		return advert.Snapshot{SchemaVersion: advert.SchemaVersion, Entries: []advert.Entry{}}
	}
	a := &d.adv
	a.mu.Lock()
	stopped := a.stopped
	a.mu.Unlock()
	if !stopped {
		if err := a.flush(); err != nil {
			a.signal() // the goroutine retries
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

// AdvertisementStatus is the state of the advertisement publisher, in
// Status.
type AdvertisementStatus struct {
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

func (a *advertiser) status() AdvertisementStatus {
	st := AdvertisementStatus{Path: a.path}
	if a.pub == nil {
		return st
	}
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
// one with every change of content. The entries advertEntries makes are
// valid by construction (validated intent); only the file publisher checks
// them again.
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
