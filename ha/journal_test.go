package ha

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
)

var testVIP = netip.MustParseAddrPort("203.0.113.10:443")

// testKey is the key of client 198.51.100.x:port to testVIP over TCP.
func testKey(i int) conntrack.Key {
	return conntrack.Key{
		Client: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 51, byte(100 + i/60000), byte(i % 250)}), uint16(1024+i%60000)),
		VIP:    testVIP,
		Proto:  6,
	}
}

// testFlow is a flow of key i pinned to backend b.
func journalFlow(i, b int) Flow {
	k := testKey(i)
	return Flow{
		Client:  k.Client,
		VIP:     k.VIP,
		Proto:   k.Proto,
		Backend: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, byte(1 + b%200)}), 8443),
		Kind:    conntrack.SNAT,
		SNAT:    netip.AddrPortFrom(netip.MustParseAddr("192.0.2.1"), uint16(20000+i%40000)),
		State:   bpf.CTTCPEstablished,
		Age:     time.Duration(b) * time.Second,
		Idle:    time.Second,
		TTL:     time.Hour,
		NAT:     &NATHalf{Idle: time.Duration(b) * time.Millisecond},
	}
}

func upsert(i, b int) Op {
	f := journalFlow(i, b)
	return Op{Kind: OpUpsert, Flow: &f}
}

func del(i int) Op { return Op{Kind: OpDelete, Key: testKey(i)} }

func newTestJournal(t *testing.T, epoch Epoch, opts JournalOptions) *Journal {
	t.Helper()
	j, err := NewJournal("web", epoch, opts)
	if err != nil {
		t.Fatalf("NewJournal: %v", err)
	}
	return j
}

func mustRecord(t *testing.T, j *Journal, ops ...Op) {
	t.Helper()
	if err := j.Record(ops...); err != nil {
		t.Fatalf("Record: %v", err)
	}
}

func mustSince(t *testing.T, j *Journal, cursor uint64, id string, maxOps int) Delta {
	t.Helper()
	d, err := j.Since(cursor, id, maxOps)
	if err != nil {
		t.Fatalf("Since(%d, %q, %d): %v", cursor, id, maxOps, err)
	}
	return d
}

func seqs(d Delta) []uint64 {
	var s []uint64
	for _, b := range d.Batches {
		s = append(s, b.Seq)
	}
	return s
}

// apply applies ops to a target's flows as a standby would.
func apply(m map[conntrack.Key]Flow, ops []Op) {
	for _, op := range ops {
		switch op.Kind {
		case OpUpsert:
			f := *op.Flow
			if f.NAT != nil {
				nat := *f.NAT
				f.NAT = &nat
			}
			m[f.Key()] = f
		case OpDelete:
			delete(m, op.Key)
		}
	}
}

func TestNewJournal(t *testing.T) {
	for _, tc := range []struct {
		name    string
		service string
		epoch   Epoch
		opts    JournalOptions
		wantIs  error
		wantErr bool
		maxOps  int
		maxB    int
	}{
		{name: "defaults", service: "web", epoch: 1, maxOps: DefaultMaxOps, maxB: DefaultMaxBatchOps},
		{name: "small history caps batch", service: "web", epoch: 1, opts: JournalOptions{MaxOps: 100}, maxOps: 100, maxB: 100},
		{name: "explicit", service: "web", epoch: 7, opts: JournalOptions{MaxOps: 10, MaxBatchOps: 3}, maxOps: 10, maxB: 3},
		{name: "no epoch", service: "web", epoch: 0, wantErr: true, wantIs: ErrNoEpoch},
		{name: "no service", service: "", epoch: 1, wantErr: true},
		{name: "negative max ops", service: "web", epoch: 1, opts: JournalOptions{MaxOps: -1}, wantErr: true},
		{name: "negative batch ops", service: "web", epoch: 1, opts: JournalOptions{MaxBatchOps: -1}, wantErr: true},
		{name: "batch beyond history", service: "web", epoch: 1, opts: JournalOptions{MaxOps: 10, MaxBatchOps: 11}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j, err := NewJournal(tc.service, tc.epoch, tc.opts)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("NewJournal succeeded, want an error")
				}
				if tc.wantIs != nil && !errors.Is(err, tc.wantIs) {
					t.Fatalf("NewJournal: %v, want %v", err, tc.wantIs)
				}
				return
			}
			if err != nil {
				t.Fatalf("NewJournal: %v", err)
			}
			if j.maxOps != tc.maxOps || j.maxBatchOps != tc.maxB {
				t.Errorf("bounds %d/%d, want %d/%d", j.maxOps, j.maxBatchOps, tc.maxOps, tc.maxB)
			}
			if s := j.Stats(); s.Epoch != tc.epoch || s.LastSeq != 0 || s.Fenced {
				t.Errorf("stats %+v", s)
			}
		})
	}
	a, b := newTestJournal(t, 1, JournalOptions{}), newTestJournal(t, 1, JournalOptions{})
	if !regexp.MustCompile(`^[0-9a-f]{16}$`).MatchString(a.ID()) {
		t.Errorf("ID %q is not 16 hex digits", a.ID())
	}
	if a.ID() == b.ID() {
		t.Errorf("two incarnations share ID %q", a.ID())
	}
}

func TestRecordSealSince(t *testing.T) {
	j := newTestJournal(t, 3, JournalOptions{MaxOps: 100, MaxBatchOps: 4})
	mustRecord(t, j, upsert(1, 1), upsert(2, 1), del(3))
	if d := mustSince(t, j, 0, j.ID(), 0); len(d.Batches) != 0 || d.To != 0 || d.ResetRequired {
		t.Fatalf("unsealed ops served: %+v", d)
	}
	j.Seal()
	j.Seal() // nothing open: no empty batch
	d := mustSince(t, j, 0, j.ID(), 0)
	if d.Service != "web" || d.Journal != j.ID() || d.Epoch != 3 || d.From != 0 || d.To != 1 {
		t.Fatalf("delta %+v", d)
	}
	if len(d.Batches) != 1 || d.Batches[0].Seq != 1 || d.Batches[0].Epoch != 3 {
		t.Fatalf("batches %+v", d.Batches)
	}
	want := []Op{upsert(1, 1), upsert(2, 1), del(3)}
	want[0].Key, want[1].Key = testKey(1), testKey(2)
	if !reflect.DeepEqual(d.Batches[0].Ops, want) {
		t.Fatalf("ops %+v, want %+v", d.Batches[0].Ops, want)
	}

	// A full batch seals itself: 4 + 4 sealed, 1 open.
	ops := make([]Op, 9)
	for i := range ops {
		ops[i] = upsert(10+i, 2)
	}
	mustRecord(t, j, ops...)
	s := j.Stats()
	if s.LastSeq != 3 || s.Batches != 3 || s.Ops != 11 || s.OpenOps != 1 || s.FirstSeq != 1 {
		t.Fatalf("stats %+v", s)
	}
	d = mustSince(t, j, 1, j.ID(), 0)
	if !reflect.DeepEqual(seqs(d), []uint64{2, 3}) || d.From != 1 || d.To != 3 {
		t.Fatalf("delta %d..%d seqs %v", d.From, d.To, seqs(d))
	}
	for bi, b := range d.Batches {
		for oi, op := range b.Ops {
			if op.Flow.Client != testKey(10+bi*4+oi).Client {
				t.Errorf("batch %d op %d is flow %s", b.Seq, oi, op.Flow)
			}
		}
	}
	// Nothing new after the last seq.
	if d := mustSince(t, j, 3, j.ID(), 0); len(d.Batches) != 0 || d.From != 3 || d.To != 3 || d.ResetRequired {
		t.Fatalf("delta at the end %+v", d)
	}
}

func TestRecordInvalid(t *testing.T) {
	nat := journalFlow(1, 1)
	nat.Client = netip.AddrPort{}
	for _, tc := range []struct {
		name string
		op   Op
	}{
		{"unknown kind", Op{Kind: 9, Key: testKey(1)}},
		{"zero kind", Op{Key: testKey(1)}},
		{"upsert without flow", Op{Kind: OpUpsert, Key: testKey(1)}},
		{"upsert without client", Op{Kind: OpUpsert, Flow: &nat}},
		{"delete without key", Op{Kind: OpDelete}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := newTestJournal(t, 1, JournalOptions{MaxOps: 10, MaxBatchOps: 1})
			err := j.Record(upsert(1, 1), tc.op)
			if !errors.Is(err, ErrInvalidOp) {
				t.Fatalf("Record: %v, want ErrInvalidOp", err)
			}
			if s := j.Stats(); s.OpenOps != 0 || s.LastSeq != 0 {
				t.Fatalf("something was recorded: %+v", s)
			}
		})
	}
}

func TestRecordCopiesFlow(t *testing.T) {
	j := newTestJournal(t, 1, JournalOptions{})
	f := journalFlow(1, 1)
	mustRecord(t, j, Op{Kind: OpUpsert, Flow: &f})
	f.Backend = netip.MustParseAddrPort("10.9.9.9:1")
	f.NAT.Idle = time.Hour
	j.Seal()
	d := mustSince(t, j, 0, j.ID(), 0)
	if got := d.Batches[0].Ops[0].Flow; !reflect.DeepEqual(*got, journalFlow(1, 1)) {
		t.Fatalf("recorded flow follows the caller's: %+v", got)
	}
	// A target rewriting its delta does not rewrite the history.
	d.Batches[0].Ops[0] = del(5)
	if d := mustSince(t, j, 0, j.ID(), 0); d.Batches[0].Ops[0].Kind != OpUpsert {
		t.Fatalf("history rewritten through a delta: %+v", d.Batches[0].Ops[0])
	}
}

// journalWithBatches returns a journal with sealed batches of the given
// sizes, seqs 1..len(sizes).
func journalWithBatches(t *testing.T, opts JournalOptions, sizes ...int) *Journal {
	t.Helper()
	j := newTestJournal(t, 1, opts)
	n := 0
	for _, size := range sizes {
		for range size {
			mustRecord(t, j, upsert(n, n))
			n++
		}
		j.Seal()
	}
	return j
}

func TestSinceMaxOps(t *testing.T) {
	j := journalWithBatches(t, JournalOptions{}, 3, 1, 4, 2)
	for _, tc := range []struct {
		cursor uint64
		maxOps int
		want   []uint64
	}{
		{0, 0, []uint64{1, 2, 3, 4}},
		{0, -1, []uint64{1, 2, 3, 4}},
		{0, 4, []uint64{1, 2}},
		{0, 3, []uint64{1}},
		{0, 1, []uint64{1}}, // one batch even beyond maxOps
		{1, 1, []uint64{2}},
		{1, 5, []uint64{2, 3}},
		{2, 3, []uint64{3}},
		{2, 6, []uint64{3, 4}},
		{3, 100, []uint64{4}},
		{4, 1, nil},
	} {
		t.Run(fmt.Sprintf("%d/%d", tc.cursor, tc.maxOps), func(t *testing.T) {
			d := mustSince(t, j, tc.cursor, j.ID(), tc.maxOps)
			if !reflect.DeepEqual(seqs(d), tc.want) {
				t.Fatalf("seqs %v, want %v", seqs(d), tc.want)
			}
			wantTo := tc.cursor
			if len(tc.want) > 0 {
				wantTo = tc.want[len(tc.want)-1]
			}
			if d.From != tc.cursor || d.To != wantTo || d.ResetRequired {
				t.Fatalf("delta %d..%d reset %v", d.From, d.To, d.ResetRequired)
			}
		})
	}
}

func TestSinceReset(t *testing.T) {
	j := journalWithBatches(t, JournalOptions{}, 2, 2, 2)
	other := newTestJournal(t, 1, JournalOptions{})
	for _, tc := range []struct {
		name   string
		cursor uint64
		id     string
		reset  bool
		is     error
	}{
		{name: "fresh target: a snapshot first", cursor: 0, id: "", reset: true},
		{name: "from the journal's start", cursor: 0, id: j.ID()},
		{name: "own cursor", cursor: 2, id: j.ID()},
		{name: "earlier incarnation", cursor: 2, id: other.ID(), reset: true},
		{name: "earlier incarnation at 0", cursor: 0, id: other.ID(), reset: true},
		{name: "seq without journal", cursor: 2, id: "", reset: true},
		{name: "foreign cursor ahead", cursor: 99, id: other.ID(), reset: true},
		{name: "cursor ahead", cursor: 4, id: j.ID(), is: ErrCursorAhead},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := j.Since(tc.cursor, tc.id, 0)
			if tc.is != nil {
				if !errors.Is(err, tc.is) {
					t.Fatalf("Since: %v, want %v", err, tc.is)
				}
				return
			}
			if err != nil {
				t.Fatalf("Since: %v", err)
			}
			if d.ResetRequired != tc.reset {
				t.Fatalf("reset %v, want %v", d.ResetRequired, tc.reset)
			}
			if tc.reset && (len(d.Batches) != 0 || d.To != d.From || d.Journal != j.ID()) {
				t.Fatalf("reset delta %+v", d)
			}
		})
	}
}

func TestAck(t *testing.T) {
	j := journalWithBatches(t, JournalOptions{}, 2, 3, 1, 4)
	if err := j.Ack(2); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	s := j.Stats()
	if s.FirstSeq != 3 || s.LastSeq != 4 || s.Acked != 2 || s.Batches != 2 || s.Ops != 5 || s.DroppedBatches != 0 {
		t.Fatalf("after ack 2: %+v", s)
	}
	if d := mustSince(t, j, 2, j.ID(), 0); !reflect.DeepEqual(seqs(d), []uint64{3, 4}) {
		t.Fatalf("after ack 2 seqs %v", seqs(d))
	}
	// A cursor behind the ack lost its batches.
	if d := mustSince(t, j, 1, j.ID(), 0); !d.ResetRequired {
		t.Fatalf("cursor behind the ack served: %+v", d)
	}
	if d := mustSince(t, j, 0, j.ID(), 0); !d.ResetRequired {
		t.Fatalf("fresh target served without seq 1: %+v", d)
	}
	// Backwards is a no-op.
	if err := j.Ack(1); err != nil {
		t.Fatalf("Ack backwards: %v", err)
	}
	if s := j.Stats(); s.Acked != 2 || s.Batches != 2 {
		t.Fatalf("after ack backwards: %+v", s)
	}
	if err := j.Ack(5); !errors.Is(err, ErrCursorAhead) {
		t.Fatalf("Ack ahead: %v", err)
	}
	// The open batch has no seq yet: acking into it is ahead too.
	mustRecord(t, j, upsert(100, 1))
	if err := j.Ack(5); !errors.Is(err, ErrCursorAhead) {
		t.Fatalf("Ack into the open batch: %v", err)
	}
	if err := j.Ack(4); err != nil {
		t.Fatalf("Ack all: %v", err)
	}
	s = j.Stats()
	if s.FirstSeq != 0 || s.Batches != 0 || s.Ops != 0 || s.OpenOps != 1 || s.Acked != 4 {
		t.Fatalf("after ack all: %+v", s)
	}
	if d := mustSince(t, j, 4, j.ID(), 0); d.ResetRequired || len(d.Batches) != 0 {
		t.Fatalf("up-to-date target after ack all: %+v", d)
	}
	j.Seal()
	if d := mustSince(t, j, 4, j.ID(), 0); !reflect.DeepEqual(seqs(d), []uint64{5}) {
		t.Fatalf("after ack all and a seal: %v", seqs(d))
	}
}

func TestHistoryBound(t *testing.T) {
	// 10 ops of history; batches of 4, 4, 4 -> the first is dropped.
	j := journalWithBatches(t, JournalOptions{MaxOps: 10, MaxBatchOps: 4}, 4, 4)
	if s := j.Stats(); s.Ops != 8 || s.DroppedBatches != 0 {
		t.Fatalf("within the bound: %+v", s)
	}
	for i := range 4 {
		mustRecord(t, j, upsert(50+i, 1))
	}
	s := j.Stats()
	if s.FirstSeq != 2 || s.LastSeq != 3 || s.Ops != 8 || s.DroppedBatches != 1 || s.DroppedOps != 4 {
		t.Fatalf("over the bound: %+v", s)
	}
	if d := mustSince(t, j, 0, j.ID(), 0); !d.ResetRequired {
		t.Fatalf("target behind a dropped batch served: %+v", d)
	}
	if d := mustSince(t, j, 1, j.ID(), 0); !reflect.DeepEqual(seqs(d), []uint64{2, 3}) || d.ResetRequired {
		t.Fatalf("target at the drop: %+v", d)
	}
	// Ack below the dropped history is accepted and trims nothing.
	if err := j.Ack(1); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	if s := j.Stats(); s.Batches != 2 || s.Acked != 1 {
		t.Fatalf("after ack 1: %+v", s)
	}
}

func TestFencing(t *testing.T) {
	j := journalWithBatches(t, JournalOptions{}, 1, 1)
	oldID := j.ID()
	mustRecord(t, j, upsert(9, 9)) // open when fenced

	j.Fence(1) // our own epoch: a stale notice
	if s := j.Stats(); s.Fenced {
		t.Fatalf("fenced by its own epoch")
	}
	j.Fence(3)
	if s := j.Stats(); !s.Fenced {
		t.Fatalf("not fenced by a newer epoch")
	}
	if err := j.Record(upsert(1, 1)); !errors.Is(err, ErrFenced) {
		t.Fatalf("fenced Record: %v", err)
	}
	if _, err := j.Since(0, "", 0); !errors.Is(err, ErrFenced) {
		t.Fatalf("fenced Since: %v", err)
	}
	if _, err := j.Checkpoint(); !errors.Is(err, ErrFenced) {
		t.Fatalf("fenced Checkpoint: %v", err)
	}
	if err := j.Renew(0); !errors.Is(err, ErrNoEpoch) {
		t.Fatalf("Renew(0): %v", err)
	}
	// The fenced edge learns of a lease between its own and the fence:
	// still fenced.
	if err := j.Renew(3); err != nil {
		t.Fatalf("Renew(3): %v", err)
	}
	if _, err := j.Since(0, "", 0); !errors.Is(err, ErrFenced) {
		t.Fatalf("Since after Renew to the fencing epoch: %v", err)
	}
	if err := j.Renew(2); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("Renew older: %v", err)
	}
	// A lease newer than the fence: serving again, as a new incarnation.
	if err := j.Renew(4); err != nil {
		t.Fatalf("Renew(4): %v", err)
	}
	s := j.Stats()
	if s.Fenced || s.Epoch != 4 || s.Journal == oldID || s.Batches != 0 || s.OpenOps != 0 || s.LastSeq != 3 || s.Acked != 3 { // the open op was sealed by Renew(3)
		t.Fatalf("after unfencing: %+v", s)
	}
	// Old cursors, even an up-to-date one, must resync.
	if d := mustSince(t, j, 2, oldID, 0); !d.ResetRequired {
		t.Fatalf("old incarnation's cursor served: %+v", d)
	}
	cp, err := j.Checkpoint()
	if err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	if cp.Journal != j.ID() || cp.Epoch != 4 || cp.Seq != 3 {
		t.Fatalf("checkpoint %+v", cp)
	}
	// An ack computed from old cursors cannot trim the new history.
	mustRecord(t, j, upsert(1, 1))
	j.Seal()
	if err := j.Ack(2); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	d := mustSince(t, j, cp.Seq, cp.Journal, 0)
	if len(d.Batches) != 1 || d.Batches[0].Epoch != 4 {
		t.Fatalf("after unfencing: %+v", d)
	}
}

func TestRenewSealsUnderOldEpoch(t *testing.T) {
	j := newTestJournal(t, 1, JournalOptions{})
	mustRecord(t, j, upsert(1, 1))
	if err := j.Renew(1); err != nil { // same lease: nothing sealed
		t.Fatalf("Renew(1): %v", err)
	}
	if s := j.Stats(); s.OpenOps != 1 {
		t.Fatalf("renewal of the same epoch sealed: %+v", s)
	}
	if err := j.Renew(2); err != nil {
		t.Fatalf("Renew(2): %v", err)
	}
	mustRecord(t, j, upsert(2, 1))
	j.Seal()
	d := mustSince(t, j, 0, j.ID(), 0)
	if len(d.Batches) != 2 || d.Batches[0].Epoch != 1 || d.Batches[1].Epoch != 2 || d.Epoch != 2 {
		t.Fatalf("epochs: %+v", d)
	}
	c := Cursor{Journal: j.ID()} // as Reset to the journal's start
	if err := c.Check(d); err != nil {
		t.Fatalf("Check: %v", err)
	}
	c.Advance(d)
	if c.Epoch != 2 || c.Seq != 2 || c.Journal != j.ID() {
		t.Fatalf("cursor %+v", c)
	}
}

func TestCursorCheck(t *testing.T) {
	b := func(seq uint64, e Epoch) Batch { return Batch{Seq: seq, Epoch: e, Ops: []Op{del(int(seq))}} }
	cur := Cursor{Journal: "j1", Seq: 5, Epoch: 2}
	for _, tc := range []struct {
		name string
		c    Cursor
		d    Delta
		want error
	}{
		{"happy", cur, Delta{Journal: "j1", Epoch: 3, From: 5, To: 7, Batches: []Batch{b(6, 2), b(7, 3)}}, nil},
		{"nothing new", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 5}, nil},
		// A target with no state loads a snapshot first, whatever the delta.
		{"fresh cursor", Cursor{}, Delta{Journal: "j1", Epoch: 1, From: 0, To: 1, Batches: []Batch{b(1, 1)}}, ErrResetRequired},
		{"stale delta epoch", cur, Delta{Journal: "j1", Epoch: 1, From: 5, To: 6, Batches: []Batch{b(6, 1)}}, ErrStaleEpoch},
		// A page of history recorded under an older lease than one the
		// cursor saw on an earlier page (the journal was renewed between):
		// the envelope is the fence, the batch is history.
		{"older batch of the same history", cur, Delta{Journal: "j1", Epoch: 3, From: 5, To: 6, Batches: []Batch{b(6, 1)}}, nil},
		{"decreasing batch epochs", cur, Delta{Journal: "j1", Epoch: 4, From: 5, To: 7, Batches: []Batch{b(6, 4), b(7, 3)}}, ErrStaleEpoch},
		{"batch newer than delta", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 6, Batches: []Batch{b(6, 3)}}, ErrStaleEpoch},
		{"stale beats reset", cur, Delta{Journal: "j1", Epoch: 1, From: 5, To: 5, ResetRequired: true}, ErrStaleEpoch},
		{"no epoch", Cursor{}, Delta{Journal: "j1", From: 0, To: 0}, ErrNoEpoch},
		{"batch without epoch", Cursor{Journal: "j1"}, Delta{Journal: "j1", Epoch: 1, From: 0, To: 1, Batches: []Batch{b(1, 0)}}, ErrNoEpoch},
		{"reset required", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 5, ResetRequired: true}, ErrResetRequired},
		{"other journal", cur, Delta{Journal: "j2", Epoch: 2, From: 5, To: 6, Batches: []Batch{b(6, 2)}}, ErrResetRequired},
		{"no journal", cur, Delta{Epoch: 2, From: 5, To: 5}, ErrResetRequired},
		{"from behind", cur, Delta{Journal: "j1", Epoch: 2, From: 4, To: 6, Batches: []Batch{b(5, 2), b(6, 2)}}, ErrGap},
		{"from ahead", cur, Delta{Journal: "j1", Epoch: 2, From: 6, To: 7, Batches: []Batch{b(7, 2)}}, ErrGap},
		{"missing batch", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 8, Batches: []Batch{b(6, 2), b(8, 2)}}, ErrGap},
		{"first batch skipped", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 7, Batches: []Batch{b(7, 2)}}, ErrGap},
		{"to beyond batches", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 7, Batches: []Batch{b(6, 2)}}, ErrGap},
		{"to without batches", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 6}, ErrGap},
		{"invalid op", cur, Delta{Journal: "j1", Epoch: 2, From: 5, To: 6, Batches: []Batch{{Seq: 6, Epoch: 2, Ops: []Op{{Kind: OpUpsert}}}}}, ErrInvalidOp},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.c
			err := c.Check(tc.d)
			if tc.want == nil && err != nil {
				t.Fatalf("Check: %v", err)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("Check: %v, want %v", err, tc.want)
			}
			if c != tc.c {
				t.Fatalf("Check changed the cursor: %+v", c)
			}
		})
	}
}

func TestCursorAdvanceReset(t *testing.T) {
	c := Cursor{Journal: "j1", Seq: 5, Epoch: 3}
	c.Advance(Delta{Journal: "j1", Epoch: 3, From: 5, To: 9})
	if c != (Cursor{Journal: "j1", Seq: 9, Epoch: 3}) {
		t.Fatalf("advanced to %+v", c)
	}
	if err := c.Reset("j2", 4, 2); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("Reset to an older epoch: %v", err)
	}
	if err := c.Reset("j2", 4, 0); !errors.Is(err, ErrNoEpoch) {
		t.Fatalf("Reset without epoch: %v", err)
	}
	if err := c.Reset("", 4, 3); err == nil {
		t.Fatalf("Reset without journal accepted")
	}
	if c != (Cursor{Journal: "j1", Seq: 9, Epoch: 3}) {
		t.Fatalf("refused resets changed the cursor: %+v", c)
	}
	if err := c.Reset("j2", 4, 5); err != nil {
		t.Fatalf("Reset: %v", err)
	}
	if c != (Cursor{Journal: "j2", Seq: 4, Epoch: 5}) {
		t.Fatalf("reset to %+v", c)
	}
}

func TestDeltaJSON(t *testing.T) {
	f := journalFlow(1, 2)
	d := Delta{Service: "web", Journal: "abc", Epoch: 2, From: 1, To: 2, Batches: []Batch{{Seq: 2, Epoch: 2, Ops: []Op{{Kind: OpUpsert, Flow: &f, Key: f.Key()}, del(3)}}}}
	raw, err := json.Marshal(d)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	for _, k := range []string{"service", "journal", "epoch", "from", "to", "batches"} {
		if _, ok := m[k]; !ok {
			t.Errorf("no %q in %s", k, raw)
		}
	}
	var back Delta
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	if !reflect.DeepEqual(back, d) {
		t.Fatalf("round trip:\n%+v\nwant\n%+v", back, d)
	}
	c, _ := json.Marshal(Cursor{Journal: "abc", Seq: 2, Epoch: 3})
	if string(c) != `{"journal":"abc","seq":2,"epoch":3}` {
		t.Fatalf("cursor JSON %s", c)
	}
}

// target is a standby replicating one journal.
type target struct {
	cur   Cursor
	flows map[conntrack.Key]Flow
	// pulls, resets count what happened.
	pulls, resets int
}

// pull pulls once and applies; it reports whether the delta was empty.
// snapshot is called when the journal says to resync.
func (tg *target) pull(t *testing.T, j *Journal, maxOps int, snapshot func() (Cursor, map[conntrack.Key]Flow)) bool {
	t.Helper()
	d := mustSince(t, j, tg.cur.Seq, tg.cur.Journal, maxOps)
	if err := tg.cur.Check(d); err != nil {
		if !errors.Is(err, ErrResetRequired) || snapshot == nil {
			t.Fatalf("Check: %v", err)
		}
		cp, flows := snapshot()
		if err := tg.cur.Reset(cp.Journal, cp.Seq, cp.Epoch); err != nil {
			t.Fatalf("Reset: %v", err)
		}
		tg.flows = flows
		tg.resets++
		return false
	}
	for _, b := range d.Batches {
		apply(tg.flows, b.Ops)
	}
	tg.cur.Advance(d)
	tg.pulls++
	return len(d.Batches) == 0
}

func TestReplicationLoop(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts JournalOptions
		lazy bool // the target skips pulls and falls behind the bound
	}{
		{"keeps up", JournalOptions{MaxOps: 1 << 16, MaxBatchOps: 16}, false},
		{"falls behind", JournalOptions{MaxOps: 64, MaxBatchOps: 8}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, 2))
			j := newTestJournal(t, 1, tc.opts)
			model := map[conntrack.Key]Flow{}
			tg := &target{flows: map[conntrack.Key]Flow{}}
			snapshot := func() (Cursor, map[conntrack.Key]Flow) {
				cp, err := j.Checkpoint() // before the copy: replay over it is exact
				if err != nil {
					t.Fatalf("Checkpoint: %v", err)
				}
				return cp, maps.Clone(model)
			}
			for round := range 300 {
				n := rng.IntN(20)
				ops := make([]Op, 0, n)
				for range n {
					i := rng.IntN(200)
					var op Op
					if rng.IntN(4) == 0 {
						op = del(i)
					} else {
						op = upsert(i, round)
					}
					ops = append(ops, op)
				}
				mustRecord(t, j, ops...)
				apply(model, ops)
				if round%3 == 0 {
					// Recording in pieces too.
					op := upsert(rng.IntN(200), round+1000)
					mustRecord(t, j, op)
					apply(model, []Op{op})
				}
				j.Seal()
				if tc.lazy && round%10 < 7 {
					continue
				}
				for range 1 + rng.IntN(3) {
					tg.pull(t, j, 5, snapshot)
				}
				if err := j.Ack(tg.cur.Seq); err != nil {
					t.Fatalf("Ack: %v", err)
				}
			}
			for !tg.pull(t, j, 5, snapshot) {
			}
			if !reflect.DeepEqual(tg.flows, model) {
				t.Fatalf("target has %d flows, source %d: they differ", len(tg.flows), len(model))
			}
			s := j.Stats()
			if tg.cur.Seq != s.LastSeq || tg.cur.Journal != j.ID() {
				t.Fatalf("target cursor %+v, journal %+v", tg.cur, s)
			}
			if tc.lazy && (tg.resets == 0 || s.DroppedBatches == 0) {
				t.Fatalf("the lazy target never resynced (resets %d, dropped %d)", tg.resets, s.DroppedBatches)
			}
			// A target with no state loads a snapshot first: the eager
			// one once, never again.
			if !tc.lazy && (tg.resets != 1 || s.DroppedBatches != 0) {
				t.Fatalf("the eager target resynced (resets %d, dropped %d)", tg.resets, s.DroppedBatches)
			}
			if tg.pulls < 100 {
				t.Fatalf("only %d pulls", tg.pulls)
			}
			t.Logf("%d flows, %d pulls, %d resets, stats %+v", len(model), tg.pulls, tg.resets, s)
		})
	}
}

func TestConcurrent(t *testing.T) {
	const writers, perWriter = 4, 500
	j := newTestJournal(t, 1, JournalOptions{MaxOps: 1 << 16, MaxBatchOps: 7})
	var writing, others sync.WaitGroup
	models := make([]map[conntrack.Key]Flow, writers)
	for w := range writers {
		models[w] = map[conntrack.Key]Flow{}
		// Each writer owns its keys, so its own order decides their
		// final state.
		writing.Go(func() {
			for n := range perWriter {
				i := w*1000 + n%50
				ops := []Op{upsert(i, n)}
				if n%3 == 2 {
					ops = append(ops, del(i+1))
				}
				if err := j.Record(ops...); err != nil {
					t.Errorf("Record: %v", err)
					return
				}
				apply(models[w], ops)
			}
		})
	}
	done := make(chan struct{})
	others.Go(func() { // the replication interval
		for {
			select {
			case <-done:
				return
			default:
				j.Seal()
				_ = j.Stats()
				time.Sleep(50 * time.Microsecond)
			}
		}
	})
	// The target starts at the journal's own start (it holds no flow
	// older than the journal: there are none).
	tg := &target{cur: Cursor{Journal: j.ID()}, flows: map[conntrack.Key]Flow{}}
	pulled := make(chan struct{})
	go func() {
		defer close(pulled)
		for {
			select {
			case <-done:
				return
			default:
			}
			d, err := j.Since(tg.cur.Seq, tg.cur.Journal, 10)
			if err != nil {
				t.Errorf("Since: %v", err)
				return
			}
			if err := tg.cur.Check(d); err != nil {
				t.Errorf("Check: %v", err)
				return
			}
			for _, b := range d.Batches {
				apply(tg.flows, b.Ops)
			}
			tg.cur.Advance(d)
			if err := j.Ack(tg.cur.Seq); err != nil {
				t.Errorf("Ack: %v", err)
				return
			}
		}
	}()
	writing.Wait()
	close(done)
	others.Wait()
	<-pulled
	if t.Failed() {
		return
	}
	j.Seal()
	for !tg.pull(t, j, 10, nil) {
	}
	want := map[conntrack.Key]Flow{}
	for _, m := range models {
		maps.Copy(want, m)
	}
	if !reflect.DeepEqual(tg.flows, want) {
		t.Fatalf("target has %d flows, writers %d: they differ", len(tg.flows), len(want))
	}
	s := j.Stats()
	if s.LastSeq == 0 || s.DroppedBatches != 0 || s.OpenOps != 0 || tg.cur.Seq != s.LastSeq {
		t.Fatalf("stats %+v, cursor %+v", s, tg.cur)
	}
	if err := j.Ack(s.LastSeq); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	if s := j.Stats(); s.Batches != 0 || s.Ops != 0 {
		t.Fatalf("history kept after the last ack: %+v", s)
	}
}
