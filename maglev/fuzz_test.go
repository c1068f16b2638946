package maglev

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// fuzzSizes are the table sizes the fuzzer picks from: small enough that
// every invariant can be checked exhaustively on each input.
var fuzzSizes = [...]uint32{3, 5, 7, 13, 31, 101, 257, 1009, 4099}

// decodeBackends turns fuzz bytes into backends, 5 bytes each: address
// selector, port selector, protocol/flags, weight, ID. Addresses and ports
// come from small ranges so that duplicates and IPv4/IPv6 overlaps occur.
func decodeBackends(data []byte) []Backend {
	var bs []Backend
	for len(data) >= 5 {
		a, p, f, w, id := data[0], data[1], data[2], data[3], data[4]
		data = data[5:]
		var addr netip.Addr
		switch a >> 6 {
		case 0:
			addr = netip.AddrFrom4([4]byte{10, 0, 0, a & 63})
		case 1:
			addr = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: a & 63})
		case 2:
			addr = netip.AddrFrom16(netip.AddrFrom4([4]byte{10, 0, 0, a & 63}).As16()) // 4-in-6 alias
		default:
			addr = netip.Addr{} // invalid
			if a&1 == 1 {
				addr = netip.AddrFrom4([4]byte{10, 0, 0, a & 63})
			}
		}
		proto := [...]uint8{6, 17, 132, 0}[f&3]
		weight := uint32(w & 15)
		if w&16 != 0 {
			weight = uint32(w) * 0x01010101 // large weights
		}
		bs = append(bs, Backend{
			ID:     uint32(id),
			Addr:   addr,
			Port:   uint16(p & 7),
			Proto:  proto,
			Weight: weight,
			Ready:  f&4 == 0,
		})
	}
	return bs
}

func FuzzTable(f *testing.F) {
	f.Add(uint8(2), uint64(0), []byte{1, 1, 0, 1, 1, 2, 1, 0, 1, 2, 3, 1, 0, 2, 3})
	f.Add(uint8(5), uint64(7), []byte{1, 1, 0, 1, 1, 65, 1, 1, 3, 2, 130, 2, 4, 1, 3})
	f.Add(uint8(8), uint64(1<<63), []byte{1, 1, 0, 17, 1, 2, 1, 0, 200, 2, 3, 1, 0, 2, 3, 4, 4, 4, 4, 4})
	f.Add(uint8(0), uint64(3), []byte{1, 1, 0, 1, 1, 2, 1, 0, 1, 2, 3, 1, 0, 2, 3, 4, 1, 0, 1, 4})
	f.Fuzz(func(t *testing.T, sizeSel uint8, seed uint64, data []byte) {
		m := fuzzSizes[int(sizeSel)%len(fuzzSizes)]
		bs := decodeBackends(data)
		tab, err := New(Config{Size: m, Seed: seed}, bs)
		if err != nil {
			for _, want := range []error{ErrInvalidBackend, ErrDuplicateBackend, ErrTooManyBackends} {
				if errors.Is(err, want) {
					// A table that exists must survive the same bad input.
					prev := mustNew(t, m, seed, testBackends(2, equalWeights))
					before := slices.Clone(prev.Entries())
					if err := prev.Rebuild(bs); err == nil || !slices.Equal(prev.Entries(), before) {
						t.Fatalf("Rebuild with bad input: err %v, table changed: %v", err, !slices.Equal(prev.Entries(), before))
					}
					return
				}
			}
			t.Fatalf("unexpected error: %v", err)
		}
		checkInvariants(t, tab, bs)
		if !tab.Empty() && !slices.Equal(tab.Entries(), specFill(tab)) {
			t.Fatal("table differs from the documented fill rule")
		}

		// Any order, and any history of the table, gives the same table.
		want := slices.Clone(tab.Entries())
		rng := rand.New(rand.NewPCG(seed, uint64(len(data))))
		shuffled := slices.Clone(bs)
		rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		other, err := New(Config{Size: m, Seed: seed}, testBackends(int(m/2), mixedWeights))
		if err != nil {
			t.Fatal(err)
		}
		if err := other.Rebuild(shuffled); err != nil {
			t.Fatalf("Rebuild of a shuffled valid input: %v", err)
		}
		if !slices.Equal(other.Entries(), want) {
			t.Fatal("shuffled input gave a different table")
		}
		// Measuring a table against itself moves nothing.
		if d := Measure(tab, other); d.MovedSlots != 0 || d.MinMovedSlots != 0 {
			t.Fatalf("Measure of equal tables: %+v", d)
		}
	})
}
