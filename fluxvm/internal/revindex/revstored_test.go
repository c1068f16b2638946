package revindex

import (
	"maps"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
)

// TestRevStored: MarkRevStored (before a table naming a backend past the
// slots goes in) and RefreshRevStored (after slots moved) write
// SvcFlagRevStored into the frontend entry only when it must change, and
// return the flags the facade then knows the entry to have.
func TestRevStored(t *testing.T) {
	const (
		rs    = bpf.SvcFlagRevStored
		other = bpf.SvcFlagDSR // a flag of the entry that must be kept
	)
	live := func(flags uint32) Entry {
		return Entry{Key: fe(5), ServiceID: 5, Revision: 7, Flags: flags, Live: true}
	}
	notLive := Entry{Key: fe(5), ServiceID: 5, Revision: 7, Flags: other}
	stored := func(flags uint32) *bpf.SvcValue { return &bpf.SvcValue{ServiceId: 5, Flags: flags, Revision: 3} }
	for _, tc := range []struct {
		name    string
		mark    bool // MarkRevStored, else RefreshRevStored
		e       Entry
		past    bool          // fe(5) is past the slots of ep(1)
		stored  *bpf.SvcValue // the entry in the map before (an earlier process's)
		fail    bool          // the frontend write fails
		want    uint32        // the flags returned
		put     *bpf.SvcValue // the entry written, if any
		wantErr bool
	}{
		{name: "mark: a live entry gets the flag", mark: true, e: live(other),
			want: other | rs, put: &bpf.SvcValue{ServiceId: 5, Flags: other | rs, Revision: 7}},
		{name: "mark: a live entry that has it is not written", mark: true, e: live(other | rs), want: other | rs},
		{name: "mark: a failed write keeps the flags", mark: true, e: live(other), fail: true, want: other, wantErr: true},
		{name: "mark: no entry yet, nothing to write", mark: true, e: notLive, want: other},
		{name: "mark: an earlier process's entry gets the flag, as it was otherwise", mark: true, e: notLive,
			stored: stored(0), want: other, put: &bpf.SvcValue{ServiceId: 5, Flags: rs, Revision: 3}},
		{name: "mark: an earlier process's entry that has it is not written", mark: true, e: notLive,
			stored: stored(rs), want: other},
		{name: "refresh: past the slots, the live entry gets the flag", e: live(other), past: true,
			want: other | rs, put: &bpf.SvcValue{ServiceId: 5, Flags: other | rs, Revision: 7}},
		{name: "refresh: in the slots again, the live entry loses it", e: live(other | rs),
			want: other, put: &bpf.SvcValue{ServiceId: 5, Flags: other, Revision: 7}},
		{name: "refresh: already right, nothing is written", e: live(other | rs), past: true, want: other | rs},
		{name: "refresh: in the slots, without it, nothing is written", e: live(other), want: other},
		{name: "refresh: an entry not live is left to its first write", e: notLive, past: true, stored: stored(0), want: other},
		{name: "refresh: a failed write keeps the flags", e: live(other | rs), fail: true, want: other | rs, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, _, fes := newTestIndex(t, true)
			for f := byte(1); f <= 4; f++ {
				if err := x.Add(fe(f), uint32(f), ep(1), bidOf(f, 1), true); err != nil {
					t.Fatal(err)
				}
			}
			if err := x.Add(fe(5), 5, ep(2), bidOf(5, 2), true); err != nil {
				t.Fatal(err)
			}
			if tc.past {
				if err := x.Add(fe(5), 5, ep(1), bidOf(5, 1), true); err != nil {
					t.Fatal(err)
				}
			}
			if tc.stored != nil {
				fes.entries[fe(5)] = *tc.stored
			}
			before := maps.Clone(fes.entries)
			if tc.fail {
				fes.fail = syscall.EIO
			}
			var (
				got uint32
				err error
			)
			if tc.mark {
				got, err = x.MarkRevStored(tc.e)
			} else {
				got, err = x.RefreshRevStored(tc.e, slices.Values([]netip.AddrPort{ep(1), ep(2)}))
			}
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v", err)
			}
			if err != nil && !tc.mark && !strings.Contains(err.Error(), "frontend 10.96.0.5:80/tcp") {
				t.Errorf("error %q does not name the frontend", err)
			}
			if got != tc.want {
				t.Errorf("flags %#x, want %#x", got, tc.want)
			}
			want, puts := before, 0
			if tc.put != nil {
				want, puts = maps.Clone(before), 1
				want[fe(5)] = *tc.put
			}
			if !maps.Equal(fes.entries, want) || len(fes.puts) != puts {
				t.Errorf("entries %+v after %d writes, want %+v", fes.entries, len(fes.puts), want)
			}
		})
	}
}
