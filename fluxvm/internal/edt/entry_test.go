package edt

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
)

// entryMap is fluxvm_edt in memory, counting writes.
type entryMap struct {
	m      map[uint32]bpf.EDTValue
	writes int
}

func (e *entryMap) LookupEDT(sid uint32) (bpf.EDTValue, error) {
	v, ok := e.m[sid]
	if !ok {
		return v, ebpf.ErrKeyNotExist
	}
	return v, nil
}

func (e *entryMap) PutEDT(sid uint32, v bpf.EDTValue) error {
	e.m[sid] = v
	e.writes++
	return nil
}

// TestEntryPut checks the departure clock rules of Entry.Put: an entry
// kept from an earlier start is not rewritten, a pacer change keeps the
// later clock, a rate change starts it empty.
func TestEntryPut(t *testing.T) {
	rate := func(r uint64, pacer uint32, clock uint64) bpf.EDTValue {
		return bpf.EDTValue{Rate: r, NsPerByte: 1e9 / r, HorizonNs: 2e9, Pacer: pacer, LastDeparture: clock}
	}
	for _, tt := range []struct {
		name      string
		inMap     *bpf.EDTValue // the entry before the first Put (nil: none)
		put       bpf.EDTValue
		wantClock uint64
		writes    int
	}{
		{"kept by a restart", &bpf.EDTValue{Rate: 1000, NsPerByte: 1e6, HorizonNs: 2e9, Pacer: 3, LastDeparture: 77}, rate(1000, 3, 0), 77, 0},
		{"pacer changes: the later clock", &bpf.EDTValue{Rate: 1000, NsPerByte: 1e6, HorizonNs: 2e9, Pacer: 3, LastDeparture: 77}, rate(1000, 2, 50), 77, 1},
		{"pacer changes: the old pacer's later clock", &bpf.EDTValue{Rate: 1000, NsPerByte: 1e6, HorizonNs: 2e9, Pacer: 3, LastDeparture: 77}, rate(1000, 2, 90), 90, 1},
		{"rate changes: empty", &bpf.EDTValue{Rate: 1000, NsPerByte: 1e6, HorizonNs: 2e9, Pacer: 3, LastDeparture: 77}, rate(2000, 3, 0), 0, 1},
		{"new entry", nil, rate(1000, 3, 0), 0, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			m := &entryMap{m: map[uint32]bpf.EDTValue{}}
			if tt.inMap != nil {
				m.m[3] = *tt.inMap
			}
			var e Entry
			if err := e.Put(m, 3, tt.put); err != nil {
				t.Fatal(err)
			}
			if m.writes != tt.writes || m.m[3].LastDeparture != tt.wantClock {
				t.Errorf("%d writes, clock %d; want %d, %d", m.writes, m.m[3].LastDeparture, tt.writes, tt.wantClock)
			}
			// The same value again writes nothing.
			if err := e.Put(m, 3, tt.put); err != nil || m.writes != tt.writes {
				t.Errorf("a second Put of the same value wrote (%d writes, %v)", m.writes, err)
			}
		})
	}
}

// TestClockFrom checks the clock handed on to a new pacer: the old
// pacer's, only when the pacer changes and the rate stays.
func TestClockFrom(t *testing.T) {
	m := &entryMap{m: map[uint32]bpf.EDTValue{5: {Rate: 1000, NsPerByte: 1e6, HorizonNs: 2e9, Pacer: 5, LastDeparture: 123}}}
	old := &Entry{v: bpf.EDTValue{Rate: 1000, NsPerByte: 1e6, HorizonNs: 2e9, Pacer: 5}, known: true}
	same := bpf.EDTValue{Rate: 1000, NsPerByte: 1e6, HorizonNs: 2e9}
	for _, tt := range []struct {
		name  string
		want  bpf.EDTValue
		old   *Entry
		pacer uint32
		clock uint64
	}{
		{"new pacer, same rate", same, old, 2, 123},
		{"same pacer", same, old, 5, 0},
		{"rate changes", bpf.EDTValue{Rate: 2000, NsPerByte: 5e5, HorizonNs: 2e9}, old, 2, 0},
		{"not paced now", bpf.EDTValue{}, old, 2, 0},
		{"nothing paced before", same, nil, 2, 0},
		{"unknown entry", same, &Entry{}, 2, 0},
	} {
		if got := ClockFrom(m, tt.want, tt.old, tt.pacer); got != tt.clock {
			t.Errorf("%s: clock %d, want %d", tt.name, got, tt.clock)
		}
	}
}
