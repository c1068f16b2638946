package revindex

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
)

// op is one step of a TestReverseIndex case: Add (listNew, or not) or
// Remove of frontend f for endpoint e, the error the map's next write
// returns (fail), and what the step returns.
type op struct {
	remove  bool
	f, e    byte
	listNew bool
	bid     uint32 // Add: 0 means bidOf(f, e)
	fail    error
	wantErr error
	recheck []byte // Remove: the frontends it returns
	writes  int    // the map writes the step takes
}

func add(f, e byte) op  { return op{f: f, e: e, listNew: true, writes: 1} }
func keep(f, e byte) op { return op{f: f, e: e} }
func noWrite(o op) op   { o.writes = 0; return o }
func rm(f, e byte, recheck ...byte) op {
	return op{remove: true, f: f, e: e, recheck: recheck, writes: 1}
}

// five lists fe(1)..fe(5) for ep(1) in that order: one past the slots.
var five = []op{add(1, 1), add(2, 1), add(3, 1), add(4, 1), add(5, 1)}

func TestReverseIndex(t *testing.T) {
	if bpf.Be2feSlots != 4 {
		t.Fatalf("the cases are written for 4 slots, the map has %d", bpf.Be2feSlots)
	}
	full := errors.Join(syscall.E2BIG)
	for _, tc := range []struct {
		name string
		ops  []op
		want listed
		past []byte // the frontends PastSlots of ep(1) and ep(2)
	}{
		{name: "appended in order", ops: []op{add(2, 1), add(1, 1), add(1, 2)},
			want: listed{1: {2, 1}, 2: {1}}},
		{name: "a frontend past the slots: overflow, and it is past them", ops: five,
			want: listed{1: {1, 2, 3, 4, 5}}, past: []byte{5}},
		{name: "a sixth past the slots changes no map value: no write",
			ops:  append(slices.Clone(five), noWrite(add(6, 1))),
			want: listed{1: {1, 2, 3, 4, 5, 6}}, past: []byte{5, 6}},
		{name: "adding a listed frontend again writes nothing",
			ops:  []op{add(1, 1), add(2, 1), noWrite(add(1, 1))},
			want: listed{1: {1, 2}}},
		{name: "a new backend id is written in place",
			ops:  []op{add(1, 1), add(2, 1), {f: 1, e: 1, listNew: true, bid: 99, writes: 1}, add(1, 1)},
			want: listed{1: {1, 2}}},
		{name: "a frontend that takes no slot (listNew false) is not appended",
			ops:  []op{add(1, 1), noWrite(keep(2, 1))},
			want: listed{1: {1}}},
		{name: "but keeps the slot it has",
			ops:  []op{add(1, 1), add(2, 1), noWrite(keep(1, 1))},
			want: listed{1: {1, 2}}},
		{name: "removing one in the slots moves the later ones down; the one now in the last slot and the removed one are rechecked",
			ops:  append(slices.Clone(five), rm(2, 1, 5, 2)),
			want: listed{1: {1, 3, 4, 5}}},
		{name: "removing one past the slots changes no map value; only it is rechecked",
			ops:  append(slices.Clone(five), noWrite(add(6, 1)), op{remove: true, f: 5, e: 1, recheck: []byte{5}}),
			want: listed{1: {1, 2, 3, 4, 6}}, past: []byte{6}},
		{name: "removing one when nothing overflows rechecks only it",
			ops:  []op{add(1, 1), add(2, 1), rm(1, 1, 1)},
			want: listed{1: {2}}},
		{name: "removing the last deletes the entry",
			ops:  []op{add(1, 1), add(1, 2), rm(1, 1, 1)},
			want: listed{2: {1}}},
		{name: "removing a frontend not listed does nothing",
			ops:  []op{add(1, 1), {remove: true, f: 2, e: 1}, {remove: true, f: 1, e: 2}},
			want: listed{1: {1}}},
		{name: "endpoints of each protocol are apart",
			ops:  []op{add(1, 1), {f: 1, e: 2, listNew: true, bid: bidOf(1, 2), writes: 1}},
			want: listed{1: {1}, 2: {1}}},
		{name: "a failed write leaves the model as it was",
			ops: []op{add(1, 1), add(2, 1),
				{f: 3, e: 1, listNew: true, fail: syscall.EIO, wantErr: syscall.EIO, writes: 1},
				{remove: true, f: 1, e: 1, fail: syscall.EIO, wantErr: syscall.EIO, writes: 1}},
			want: listed{1: {1, 2}}},
		{name: "a full map is ErrLimit",
			ops:  []op{add(1, 1), {f: 2, e: 2, listNew: true, fail: full, wantErr: intent.ErrLimit, writes: 1}},
			want: listed{1: {1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, m, _ := newTestIndex(t, true)
			for i, o := range tc.ops {
				m.fail, m.writes = o.fail, 0
				var (
					err     error
					recheck []Key
				)
				if o.remove {
					recheck, err = x.Remove(fe(o.f), ep(o.e))
				} else {
					bid := o.bid
					if bid == 0 {
						bid = bidOf(o.f, o.e)
					}
					err = x.Add(fe(o.f), uint32(o.f), ep(o.e), bid, o.listNew)
				}
				if !errors.Is(err, o.wantErr) || (err == nil) != (o.wantErr == nil) {
					t.Fatalf("step %d: %v, want %v", i, err, o.wantErr)
				}
				var want []Key
				for _, f := range o.recheck {
					want = append(want, fe(f))
				}
				if !slices.Equal(recheck, want) {
					t.Errorf("step %d: recheck %v, want %v", i, recheck, want)
				}
				if m.writes != o.writes {
					t.Errorf("step %d: %d map writes, want %d", i, m.writes, o.writes)
				}
			}
			checkListed(t, x, m, tc.want)
			for f := byte(1); f <= 6; f++ {
				eps := slices.Values([]netip.AddrPort{ep(1), ep(2)})
				if got, want := x.PastSlots(fe(f), eps), slices.Contains(tc.past, f); got != want {
					t.Errorf("fe%d: PastSlots %v, want %v", f, got, want)
				}
			}
		})
	}
}

// TestReverseIndexFull: a write the map refuses as full is ErrLimit,
// naming the map, its capacity and the tier.
func TestReverseIndexFull(t *testing.T) {
	x, m, _ := newTestIndex(t, true)
	m.fail = syscall.E2BIG
	err := x.Add(fe(1), 1, ep(1), 11, true)
	if !errors.Is(err, intent.ErrLimit) || !strings.Contains(err.Error(), "fluxvm_be2fe is full (64 backend endpoints in tier S)") {
		t.Fatalf("%v", err)
	}
}

// TestIndexed: east-west NAT frontends are listed; north-south-only and
// DSR ones are not.
func TestIndexed(t *testing.T) {
	for _, tc := range []struct {
		flags uint32
		want  bool
	}{
		{0, true},
		{bpf.SvcFlagRevStored, true},
		{bpf.SvcFlagNoEastWest, false},
		{bpf.SvcFlagDSR, false},
		{bpf.SvcFlagDSR | bpf.SvcFlagNoEastWest, false},
	} {
		if got := Indexed(tc.flags); got != tc.want {
			t.Errorf("Indexed(%#x) = %v, want %v", tc.flags, got, tc.want)
		}
	}
}
