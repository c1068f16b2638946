package api_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/ha"
)

// fakeHA is the flow-state replication state of the fake dataplane. Its
// snapshots are real package ha streams (written with ha.NewWriter, read
// with ha.NewReader), and its cursor a real ha.Cursor, so that the
// errors the handler maps are those of the package.
type fakeHA struct {
	// off: replication off, as fluxvm does it: the snapshots work (epoch
	// 0, no journal cursor), deltas, acks and leases wrap
	// ErrPrerequisite naming ha_epoch.
	off bool
	// noNS: no north-south edge: the snapshots wrap ErrPrerequisite
	// naming north_south_interfaces.
	noNS   bool
	err    error // when set, returned by every method but HAStatus
	status fluxvm.HAStatus

	// Source side: a journal of one-op batches 1..lastSeq.
	journal string
	lastSeq uint64
	acked   uint64

	// exportFlows is how many flows ExportFlows writes; exportErrAfter,
	// when set, fails it after them, before the end record.
	exportFlows    int
	exportErrAfter error
	// exportGate, when set, makes ExportFlows wait for it to close once
	// it has written exportGateAt bytes.
	exportGate   chan struct{}
	exportGateAt int64
	exported     int64 // bytes ExportFlows wrote in its last call, set when it returns
	// importRead is what the running ImportFlows has read so far.
	importRead atomic.Int64

	// Target side.
	cursor ha.Cursor

	// Calls.
	imports      []fakeImport
	deltaReads   []deltaRead
	deltaImports []ha.Delta
	acks         []uint64
	leases       []fluxvm.HALease
	joins        int
	joinErr      error
}

type fakeImport struct {
	service string
	prune   bool
	read    int64 // bytes read from the body
	flows   uint64
}

type deltaRead struct {
	journal string
	seq     uint64
	maxOps  int
}

// haOff is fluxvm's error of a method that needs replication.
func haOff(what string) error {
	return fmt.Errorf("fluxvm: %w", &fluxvm.ValidationError{Field: "ha_epoch", Kind: fluxvm.ErrPrerequisite,
		Reason: what + ": needs flow-state replication, which keeps the journals, cursors and leases: set ha_epoch (snapshots, ExportFlows and ImportFlows, need only the north-south edge)"})
}

// haCheck is the error of an HA method for service: a snapshot needs
// the north-south edge, the others replication. f.mu held.
func (f *fakeDataplane) haCheck(what, service string) error {
	switch snapshot := what == "export flows of" || what == "import flows of"; {
	case snapshot && f.ha.noNS:
		return fmt.Errorf("fluxvm: %w", &fluxvm.ValidationError{Field: "north_south_interfaces", Kind: fluxvm.ErrPrerequisite,
			Reason: what + " " + service + ": snapshots of a service's flows need the north-south edge: set north_south_interfaces"})
	case !snapshot && f.ha.off:
		return haOff(what + " " + service)
	}
	if f.ha.err != nil {
		return f.ha.err
	}
	if _, ok := f.services[service]; !ok {
		return fmt.Errorf("fluxvm: %s %q: no such service: %w", what, service, fluxvm.ErrNotFound)
	}
	return nil
}

// fakeReplication is the Replication role of a fake dataplane: its
// journal, cursor and lease in f.ha, its services those of f.
type fakeReplication struct{ *fakeDataplane }

// fakeFlow is the i-th flow of a fake snapshot.
func fakeFlow(i int) ha.Flow {
	return ha.Flow{
		Client:  netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), uint16(1024+i%60000)),
		VIP:     netip.MustParseAddrPort("10.96.0.10:80"),
		Proto:   conntrack.ProtoTCP,
		Backend: netip.MustParseAddrPort("10.40.1.21:8080"),
		Kind:    conntrack.DSR,
		State:   bpf.CTTCPEstablished,
		Age:     time.Second, Idle: time.Millisecond, TTL: time.Minute,
	}
}

// gatedWriter counts what goes through it and waits for the gate once
// at bytes have.
type gatedWriter struct {
	w    io.Writer
	n    int64
	at   int64
	gate chan struct{}
}

func (g *gatedWriter) Write(p []byte) (int, error) {
	n, err := g.w.Write(p)
	g.n += int64(n)
	if g.gate != nil && g.n >= g.at {
		<-g.gate
		g.gate = nil
	}
	return n, err
}

func (f *fakeDataplane) ExportFlows(ctx context.Context, service string, w io.Writer) (ha.ExportResult, error) {
	f.mu.Lock()
	if err := f.haCheck("export flows of", service); err != nil {
		f.mu.Unlock()
		return ha.ExportResult{}, err
	}
	n, errAfter, gate, at := f.ha.exportFlows, f.ha.exportErrAfter, f.ha.exportGate, f.ha.exportGateAt
	hdr := ha.Header{Node: "node-a", Service: service, Epoch: max(f.ha.status.Epoch, 1), Journal: f.ha.journal, Seq: f.ha.lastSeq, Seeds: &ha.Seeds{}}
	if f.ha.off {
		hdr = ha.Header{Node: "node-a", Service: service, Seeds: &ha.Seeds{}} // no lease, no journal
	}
	f.mu.Unlock()

	gw := &gatedWriter{w: w, at: at, gate: gate}
	defer func() {
		f.mu.Lock()
		f.ha.exported = gw.n
		f.mu.Unlock()
	}()
	sw, err := ha.NewWriter(gw, hdr)
	if err != nil {
		return ha.ExportResult{}, err
	}
	var res ha.ExportResult
	for i := range n {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		fl := fakeFlow(i)
		if err := sw.Write(&fl); err != nil {
			return res, err
		}
		res.Flows++
	}
	if errAfter != nil {
		return res, errAfter
	}
	res.Expired, res.NoBackend = 2, 1
	return res, sw.Close()
}

// countingReader counts the bytes read through it, also in progress.
type countingReader struct {
	r        io.Reader
	n        int64
	progress *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	c.progress.Store(c.n)
	return n, err
}

func (f *fakeDataplane) ImportFlows(ctx context.Context, service string, r io.Reader, prune bool) (ha.ImportResult, error) {
	f.mu.Lock()
	err := f.haCheck("import flows of", service)
	f.mu.Unlock()
	if err != nil {
		return ha.ImportResult{}, err
	}
	f.ha.importRead.Store(0)
	cr := &countingReader{r: r, progress: &f.ha.importRead}
	var res ha.ImportResult
	defer func() {
		f.mu.Lock()
		f.ha.imports = append(f.ha.imports, fakeImport{service: service, prune: prune, read: cr.n, flows: res.Flows})
		f.mu.Unlock()
	}()
	sr, err := ha.NewReader(cr)
	if err != nil {
		return res, fmt.Errorf("fluxvm: ha: import into %s: %w", service, err)
	}
	res.Header = sr.Header()
	if res.Header.Service != service {
		return res, fmt.Errorf("fluxvm: ha: import into %s: %w: the snapshot is of %q", service, ha.ErrService, res.Header.Service)
	}
	for {
		fl, err := sr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return res, fmt.Errorf("fluxvm: ha: import into %s: %w", service, err)
		}
		res.Flows += uint64(len(fl))
		res.Written += uint64(len(fl))
	}
	if prune {
		res.Pruned = 1
	}
	return res, nil
}

func (f fakeReplication) FlowDelta(_ context.Context, service string, req fluxvm.FlowDeltaRequest) (ha.Delta, error) {
	journal, seq, maxOps := req.Journal, req.Seq, req.MaxOps
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ha.deltaReads = append(f.ha.deltaReads, deltaRead{journal, seq, maxOps})
	if err := f.haCheck("flow delta of", service); err != nil {
		return ha.Delta{}, err
	}
	d := ha.Delta{Service: service, Journal: f.ha.journal, Epoch: max(f.ha.status.Epoch, 1), From: seq, To: seq}
	if journal != f.ha.journal || seq < f.ha.acked {
		d.ResetRequired = true
		return d, nil
	}
	if seq > f.ha.lastSeq {
		return ha.Delta{}, fmt.Errorf("fluxvm: flow delta of %s: since %d: last seq %d: %w", service, seq, f.ha.lastSeq, ha.ErrCursorAhead)
	}
	for s := seq + 1; s <= f.ha.lastSeq && (len(d.Batches) == 0 || len(d.Batches) < maxOps); s++ {
		fl := fakeFlow(int(s))
		d.Batches = append(d.Batches, ha.Batch{Seq: s, Epoch: d.Epoch, Ops: []ha.Op{{Kind: ha.OpUpsert, Flow: &fl, Key: fl.Key()}}})
		d.To = s
	}
	return d, nil
}

func (f fakeReplication) ImportFlowDelta(_ context.Context, service string, d ha.Delta) (fluxvm.HADeltaResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ha.deltaImports = append(f.ha.deltaImports, d)
	if err := f.haCheck("import flow delta of", service); err != nil {
		return fluxvm.HADeltaResult{}, err
	}
	c := f.ha.cursor
	if err := c.Check(d); err != nil {
		return fluxvm.HADeltaResult{Cursor: c}, fmt.Errorf("fluxvm: import flow delta of %s: %w", service, err)
	}
	var res ha.ImportResult
	for _, b := range d.Batches {
		res.Flows += uint64(len(b.Ops))
		res.Written += uint64(len(b.Ops))
	}
	c.Advance(d)
	f.ha.cursor = c
	return fluxvm.HADeltaResult{Cursor: c, Applied: res}, nil
}

func (f fakeReplication) AckFlowDelta(_ context.Context, service string, seq uint64) (ha.JournalStats, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.haCheck("ack flow delta of", service); err != nil {
		return ha.JournalStats{}, err
	}
	st := ha.JournalStats{Journal: f.ha.journal, Epoch: max(f.ha.status.Epoch, 1), LastSeq: f.ha.lastSeq, Acked: f.ha.acked}
	if seq > f.ha.lastSeq {
		return st, fmt.Errorf("fluxvm: ack flow delta of %s: ack %d: last seq %d: %w", service, seq, f.ha.lastSeq, ha.ErrCursorAhead)
	}
	f.ha.acks = append(f.ha.acks, seq)
	f.ha.acked = max(f.ha.acked, seq)
	st.Acked = f.ha.acked
	if f.ha.acked < f.ha.lastSeq {
		st.FirstSeq = f.ha.acked + 1
	}
	return st, nil
}

func (f fakeReplication) UpdateLease(_ context.Context, l fluxvm.HALease) (fluxvm.HAStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ha.leases = append(f.ha.leases, l)
	if f.ha.off {
		return fluxvm.HAStatus{}, haOff("update lease")
	}
	if l.Epoch == 0 && l.SupersededBy == 0 {
		return fluxvm.HAStatus{}, &fluxvm.ValidationError{Field: "lease", Reason: "neither an epoch nor a superseding epoch", Kind: fluxvm.ErrInvalid}
	}
	if l.Epoch != 0 && l.Epoch < f.ha.status.Epoch {
		return fluxvm.HAStatus{}, fmt.Errorf("fluxvm: update lease: epoch %d, this edge holds %d: %w", l.Epoch, f.ha.status.Epoch, ha.ErrStaleEpoch)
	}
	if l.Epoch != 0 {
		f.ha.status.Epoch = l.Epoch
		if l.Epoch > f.ha.status.SupersededBy {
			f.ha.status.SupersededBy = 0
		}
	}
	if l.SupersededBy > f.ha.status.Epoch {
		f.ha.status.SupersededBy = max(f.ha.status.SupersededBy, l.SupersededBy)
	}
	return f.haStatusLocked(), nil
}

func (f fakeReplication) Join(context.Context) (fluxvm.HAStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ha.off {
		return fluxvm.HAStatus{}, haOff("join the group")
	}
	if f.ha.joinErr != nil {
		return fluxvm.HAStatus{}, f.ha.joinErr
	}
	f.ha.joins++
	f.ha.status.Joined = true
	return f.haStatusLocked(), nil
}

func (f fakeReplication) Status() fluxvm.HAStatus {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.haStatusLocked()
}

func (f *fakeDataplane) haStatusLocked() fluxvm.HAStatus {
	if f.ha.off {
		return fluxvm.HAStatus{}
	}
	st := f.ha.status
	st.Enabled = true
	return st
}
