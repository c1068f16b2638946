package idpool

import (
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestIDs runs scripts of pool operations, one a line:
//
//	get N        Get hands out N (0: none is left)
//	reserve N ok Reserve(N) returns true (fail: false)
//	release N    Release(N)
//	mark A       a GC takes QuarantineMark as A
//	gc A N       that GC's ReleaseQuarantinedBefore(A) frees N ids
//	free N       Available() is N
//	used ...     exactly these ids are Used (0 aside)
func TestIDs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		max    uint32
		script string
	}{
		{"ids from 1 to max-1, then none", 4, `
			free 3
			get 1
			get 2
			get 3
			get 0
			free 0
			used 1 2 3`},
		{"an empty pool", 0, `
			free 0
			get 0
			reserve 0 fail`},
		{"a released id waits for a GC", 4, `
			get 1
			get 2
			release 1
			free 1
			used 1 2
			mark A
			gc A 1
			free 2
			used 2`},
		{"Get goes round: a freed id is taken last", 4, `
			get 1
			release 1
			mark A
			gc A 1
			get 2
			get 3
			get 1
			get 0`},
		{"reserve restores ids from the catalog; Get skips them", 5, `
			reserve 2 ok
			reserve 2 fail
			reserve 5 fail
			reserve 0 fail
			free 3
			get 1
			get 3
			get 4
			get 0
			used 1 2 3 4`},
		// A GC frees only the ids quarantined before its scan began: an
		// id released while it scans may be named by flows the scan
		// already passed, so it waits for the next GC, also when two GCs
		// overlap.
		{"a GC frees only what was quarantined at its mark", 8, `
			get 1
			get 2
			get 3
			get 4
			get 5
			get 6
			release 1
			release 2
			mark A
			release 3
			mark B
			release 4
			gc A 2
			used 3 4 5 6
			gc B 1
			used 4 5 6
			free 4
			mark C
			gc C 1
			used 5 6
			free 5`},
		// Releasing an id again while it is in quarantine (a removal
		// retried after a failure) frees it once, so the pool never
		// counts more free ids than it has; once reused it can be
		// released again.
		{"a double release frees once", 4, `
			get 1
			get 2
			release 1
			release 1
			mark A
			gc A 1
			free 2
			get 3
			get 1
			free 0
			release 1
			mark B
			gc B 1
			free 1`},
		{"releasing ids never handed out changes nothing", 4, `
			get 1
			release 0
			release 2
			release 9
			mark A
			gc A 0
			free 2
			used 1`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := New(tc.max)
			marks := map[string]uint64{}
			for line := range strings.Lines(strings.TrimSpace(tc.script)) {
				f := strings.Fields(line)
				num := func(i int) uint32 {
					n, err := strconv.ParseUint(f[i], 10, 32)
					if err != nil {
						t.Fatalf("%q: %v", line, err)
					}
					return uint32(n)
				}
				switch f[0] {
				case "get":
					if got := p.Get(); got != num(1) {
						t.Fatalf("%q: Get %d", line, got)
					}
				case "reserve":
					if got := p.Reserve(num(1)); got != (f[2] == "ok") {
						t.Fatalf("%q: Reserve %v", line, got)
					}
				case "release":
					p.Release(num(1))
				case "mark":
					marks[f[1]] = p.QuarantineMark()
				case "gc":
					if got := p.ReleaseQuarantinedBefore(marks[f[1]]); got != int(num(2)) {
						t.Fatalf("%q: released %d", line, got)
					}
				case "free":
					if got := p.Available(); got != int(num(1)) {
						t.Fatalf("%q: Available %d", line, got)
					}
				case "used":
					var want, got []uint32
					for i := range f[1:] {
						want = append(want, num(i+1))
					}
					for id := uint32(1); id < tc.max+2; id++ {
						if p.Used(id) {
							got = append(got, id)
						}
					}
					if !slices.Equal(got, want) {
						t.Fatalf("%q: used %v", line, got)
					}
				default:
					t.Fatalf("unknown step %q", line)
				}
			}
		})
	}
}
