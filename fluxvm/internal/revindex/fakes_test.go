package revindex

import (
	"maps"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
)

// fakeMap is fluxvm_be2fe in memory: its entries, how many writes it
// took, and the error its next write returns (fail), if any.
type fakeMap struct {
	entries map[bpf.Be2feKey]bpf.Be2feValue
	writes  int
	fail    error
}

func (m *fakeMap) Put(key, value any) error {
	if err := m.failed(); err != nil {
		return err
	}
	m.entries[key.(bpf.Be2feKey)] = value.(bpf.Be2feValue)
	return nil
}

func (m *fakeMap) Delete(key any) error {
	if err := m.failed(); err != nil {
		return err
	}
	k := key.(bpf.Be2feKey)
	if _, ok := m.entries[k]; !ok {
		return ebpf.ErrKeyNotExist
	}
	delete(m.entries, k)
	return nil
}

func (m *fakeMap) failed() error {
	m.writes++
	err := m.fail
	m.fail = nil
	return err
}

func (m *fakeMap) MaxEntries() uint32 { return 64 }

// fakeFrontends are the frontend entries in memory, and the writes they
// took in order.
type fakeFrontends struct {
	entries map[Key]bpf.SvcValue
	puts    []Key
	fail    error
}

func (f *fakeFrontends) Lookup(k Key) (bpf.SvcValue, bool, error) {
	v, ok := f.entries[k]
	return v, ok, nil
}

func (f *fakeFrontends) Put(k Key, v bpf.SvcValue) error {
	if f.fail != nil {
		return f.fail
	}
	f.entries[k] = v
	f.puts = append(f.puts, k)
	return nil
}

// newTestIndex is an index over fresh fakes.
func newTestIndex(t *testing.T, catalog bool) (*Index, *fakeMap, *fakeFrontends) {
	t.Helper()
	m := &fakeMap{entries: map[bpf.Be2feKey]bpf.Be2feValue{}}
	fes := &fakeFrontends{entries: map[Key]bpf.SvcValue{}}
	x, err := New(Config{Catalog: catalog}, Deps{
		Map:       func() Map { return m },
		Tier:      func() bpf.Tier { return bpf.TierS },
		Frontends: fes,
	})
	if err != nil {
		t.Fatal(err)
	}
	return x, m, fes
}

// Frontends and backend endpoints of the tests: fe(n) is 10.96.0.n:80/tcp
// with service id n; the backend id of fe(n) for ep(m) is 10n+m.
func fe(n byte) Key { return Key{netip.AddrFrom4([4]byte{10, 96, 0, n}), 80, 6} }
func ep(m byte) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 200, 0, m}), 8080)
}
func bidOf(f, e byte) uint32 { return uint32(10*f + e) }

// listed is a want: backend endpoint ep(m) (TCP) -> the numbers of the
// frontends listing it, in slot order.
type listed map[byte][]byte

// checkListed checks the model and the map against want: the model's
// lists name exactly those frontends in that order, with their ids, and
// seeded only if listed in seeded; the map has exactly one entry per endpoint, with the first
// Be2feSlots of them, the count, and the overflow flag past them.
func checkListed(t *testing.T, x *Index, m *fakeMap, want listed, seeded ...byte) {
	t.Helper()
	got := map[bpf.Be2feKey][]Slot{}
	maps.Insert(got, x.All())
	if len(got) != len(want) || x.Len() != len(want) {
		t.Errorf("model lists %d endpoints (Len %d), want %d: %v", len(got), x.Len(), len(want), got)
	}
	if len(m.entries) != len(want) {
		t.Errorf("map holds %d entries, want %d: %v", len(m.entries), len(want), m.entries)
	}
	for e, fs := range want {
		k := bpf.MakeBe2feKey(ep(e), 6)
		list := got[k]
		if len(list) != len(fs) {
			t.Errorf("ep%d: model %v, want frontends %v", e, list, fs)
			continue
		}
		for i, f := range fs {
			if w := (Slot{Key: fe(f), ServiceID: uint32(f), BackendID: bidOf(f, e), Seeded: slices.Contains(seeded, f)}); list[i] != w {
				t.Errorf("ep%d: model slot %d %+v, want %+v", e, i, list[i], w)
			}
		}
		v, ok := m.entries[k]
		if !ok {
			t.Errorf("ep%d: no map entry", e)
			continue
		}
		if n := min(len(fs), bpf.Be2feSlots); int(v.Count) != n {
			t.Errorf("ep%d: count %d, want %d", e, v.Count, n)
		}
		if over := v.Flags&bpf.Be2feFlagOverflow != 0; over != (len(fs) > bpf.Be2feSlots) {
			t.Errorf("ep%d: overflow %v with %d frontends", e, over, len(fs))
		}
		for i, s := range v.Slots {
			var w bpf.Be2feSlot
			if i < len(fs) {
				f := fs[i]
				w = bpf.Be2feSlot{Vip: bpf.AddrWords(fe(f).VIP), Vport: bpf.Port(80), ServiceId: uint32(f), BackendId: bidOf(f, e)}
			}
			if s != w {
				t.Errorf("ep%d: map slot %d %+v, want %+v", e, i, s, w)
			}
		}
	}
}

// value is a map value written independently of ValueOf: endpoint ep(e)
// listing frontends fs, all in slots (the caller keeps them at most
// Be2feSlots).
func value(e byte, fs ...byte) bpf.Be2feValue {
	v := bpf.Be2feValue{Count: uint8(len(fs))}
	for i, f := range fs {
		v.Slots[i] = bpf.Be2feSlot{Vip: bpf.AddrWords(fe(f).VIP), Vport: bpf.Port(80), ServiceId: uint32(f), BackendId: bidOf(f, e)}
	}
	return v
}

// key is the map key of ep(e), TCP.
func key(e byte) bpf.Be2feKey { return bpf.MakeBe2feKey(ep(e), 6) }
