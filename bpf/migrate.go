package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/mapscan"
)

// Migration is what became of one lifecycle map's entries when Open had to
// create the map anew (another tier's capacity, or a layout that grew) and
// carried its flows over.
//
// Open copies every entry (Entries) into the new map while the programs
// attached before it still run on the old one; Activate then switches the
// attachments and copies once more what the old programs learned or
// changed meanwhile (CaughtUp). Every entry either arrives (Migrated) or
// is counted with its reason: Evicted when the new map is smaller than the
// flows it was given (the LRU made room by evicting the least recently
// used), Refused when the kernel refused the insert. The counts are exact
// and never negative: Entries = Migrated + Evicted + Refused.
type Migration struct {
	// Map is the lifecycle map's name, for example "fluxvm_fct4".
	Map string `json:"map"`
	// Entries is the number of distinct entries read from the old map.
	Entries int `json:"entries"`
	// Migrated is the number of them in the new map after the copy.
	Migrated int `json:"migrated"`
	// Evicted did not fit: the new map is smaller.
	Evicted int `json:"evicted"`
	// Refused were refused by the kernel (RefusedError says why).
	Refused      int    `json:"refused"`
	RefusedError string `json:"refused_error,omitempty"`
	// CaughtUp is the number of flows the old programs learned or changed
	// between the copy and the switch, copied by Activate. The learned
	// ones count in Entries and Migrated too (a flow learned meanwhile
	// that a full map evicts again is not counted as evicted).
	CaughtUp int `json:"caught_up"`
}

// DidNotFit is the number of entries lost: evicted or refused.
func (m Migration) DidNotFit() int { return m.Evicted + m.Refused }

// migrate copies the entries of old into new, which nothing else writes
// yet (its programs are not attached), and counts what arrived.
//
// Lifecycle values only ever grow at the end, with zero meaning what the
// older layout meant (an east-west flow), so a value shorter than the new
// layout is carried over zero-extended. Keys must match exactly; entries
// of another key layout cannot be carried and count as refused.
func migrate(name string, old, new *ebpf.Map) (Migration, error) {
	mg := Migration{Map: name}
	if old.KeySize() != new.KeySize() || old.ValueSize() > new.ValueSize() {
		n, err := countEntries(old)
		mg.Entries, mg.Refused = n, n
		mg.RefusedError = fmt.Sprintf("layout changed (key %d -> %d bytes, value %d -> %d bytes)",
			old.KeySize(), new.KeySize(), old.ValueSize(), new.ValueSize())
		return mg, err
	}
	k, v := make([]byte, old.KeySize()), make([]byte, old.ValueSize())
	nv := make([]byte, new.ValueSize())
	inserted := 0
	it := old.Iterate()
	for it.Next(&k, &v) {
		copy(nv, v)
		err := new.Update(k, nv, ebpf.UpdateNoExist)
		switch {
		case err == nil:
			inserted++
		case errors.Is(err, ebpf.ErrKeyExist):
			// The old map changed under the iteration, which then
			// returned a key twice: counted once.
		default:
			mg.Refused++
			mg.RefusedError = err.Error()
		}
	}
	if err := it.Err(); err != nil {
		return mg, err
	}
	present, err := countEntries(new)
	if err != nil {
		return mg, err
	}
	if present > inserted {
		return mg, fmt.Errorf("%s: %d entries after inserting %d: the new map was written meanwhile", name, present, inserted)
	}
	mg.Entries = inserted + mg.Refused
	mg.Migrated = present
	mg.Evicted = inserted - present
	return mg, nil
}

// lastSeenOffset is where a lifecycle value keeps its last-seen time, or
// -1 when it keeps none (the socket LB maps).
func lastSeenOffset(name string) int {
	switch {
	case strings.HasPrefix(name, "fluxvm_nat"):
		return int(unsafe.Offsetof(NATValue{}.LastSeenNs))
	case strings.HasPrefix(name, "fluxvm_fct"):
		return int(unsafe.Offsetof(CTValue{}.LastSeenNs))
	}
	return -1
}

// catchUpSlack covers the coarse clock's granularity: an entry written in
// the same tick as the migration began is caught up too.
const catchUpSlack = uint64(20 * time.Millisecond)

// catchUp copies into new the entries of old that were learned or changed
// at or after since (the old programs ran until the switch), unless the
// new programs have a more recent version already. It returns how many
// entries it inserted (flows learned meanwhile) and how many it updated
// (flows whose state changed meanwhile).
//
// Entries the old programs deleted meanwhile (a stale reverse-NAT half, a
// re-pick's superseded half) stay in the new map as copied: the GC finds
// them without their other half and removes them.
func catchUp(name string, old, new *ebpf.Map, since uint64) (inserted, updated int, err error) {
	if old == nil || new == nil || old.KeySize() != new.KeySize() || old.ValueSize() > new.ValueSize() {
		return 0, 0, nil
	}
	if lastSeenOffset(name) < 0 {
		return catchUpAbsent(old, new)
	}
	if since > catchUpSlack {
		since -= catchUpSlack
	}
	// The old map is read in batches (a walk of a million entries one
	// key at a time takes seconds); the few entries seen since are then
	// compared one by one. An old value shorter than the new layout
	// (a generation whose values grew) is read key by key.
	if old.ValueSize() == new.ValueSize() {
		ct := func(v *CTValue) uint64 { return v.LastSeenNs }
		nt := func(v *NATValue) uint64 { return v.LastSeenNs }
		off := lastSeenOffset(name)
		switch {
		case name == "fluxvm_fct4":
			return catchUpOf[Tuple4](old, new, since, off, ct)
		case name == "fluxvm_fct6":
			return catchUpOf[Tuple6](old, new, since, off, ct)
		case name == "fluxvm_nat4":
			return catchUpOf[Tuple4](old, new, since, off, nt)
		case name == "fluxvm_nat6":
			return catchUpOf[Tuple6](old, new, since, off, nt)
		}
	}
	off := lastSeenOffset(name)
	k, v := make([]byte, old.KeySize()), make([]byte, old.ValueSize())
	nv := make([]byte, new.ValueSize())
	it := old.Iterate()
	for it.Next(&k, &v) {
		if len(v) < off+8 {
			continue
		}
		seen := binary.LittleEndian.Uint64(v[off:])
		if seen < since {
			continue
		}
		copy(nv, v)
		ins, upd, err := catchUpEntry(new, k, nv, off, seen)
		inserted, updated = inserted+ins, updated+upd
		if err != nil {
			return inserted, updated, err
		}
	}
	return inserted, updated, it.Err()
}

// catchUpOf is catchUp over a map of key K and value V, read in batches;
// off is where V keeps what lastSeen returns.
func catchUpOf[K, V any](old, new *ebpf.Map, since uint64, off int, lastSeen func(*V) uint64) (inserted, updated int, err error) {
	var mode mapscan.Mode
	err = scanAll(old, &mode, func(ks []K, vs []V) error {
		for i := range ks {
			seen := lastSeen(&vs[i])
			if seen < since {
				continue
			}
			k, _ := binary.Append(nil, binary.NativeEndian, &ks[i])
			v, _ := binary.Append(nil, binary.NativeEndian, &vs[i])
			ins, upd, err := catchUpEntry(new, k, v, off, seen)
			inserted, updated = inserted+ins, updated+upd
			if err != nil {
				return err
			}
		}
		return nil
	})
	return inserted, updated, err
}

// catchUpEntry copies entry k (value nv, last seen at seen, kept at off)
// into new unless new has a version as recent: it returns 1, 0 for an
// insert, 0, 1 for an update.
func catchUpEntry(new *ebpf.Map, k, nv []byte, off int, seen uint64) (inserted, updated int, err error) {
	cur := make([]byte, new.ValueSize())
	err = new.Lookup(k, &cur)
	switch {
	case errors.Is(err, ebpf.ErrKeyNotExist):
		err = new.Update(k, nv, ebpf.UpdateNoExist)
		switch {
		case err == nil:
			return 1, 0, nil
		case errors.Is(err, ebpf.ErrKeyExist):
			return 0, 0, nil // the new programs were quicker
		}
		return 0, 0, err
	case err != nil:
		return 0, 0, err
	case binary.LittleEndian.Uint64(cur[off:]) >= seen:
		return 0, 0, nil // as recent in the new map already
	}
	err = new.Update(k, nv, ebpf.UpdateExist)
	switch {
	case err == nil:
		return 0, 1, nil
	case errors.Is(err, ebpf.ErrKeyNotExist):
		return 0, 0, nil // removed meanwhile (evicted, or the GC)
	}
	return 0, 0, err
}

// catchUpAbsent is catchUp for values without a last-seen time: every
// entry of old that new lacks is copied (their keys are socket cookies,
// unique: an entry in both is the same socket's, and new's is the newer).
// Entries the old programs changed meanwhile keep the value migrate
// copied.
func catchUpAbsent(old, new *ebpf.Map) (inserted, updated int, err error) {
	k, v := make([]byte, old.KeySize()), make([]byte, old.ValueSize())
	nv := make([]byte, new.ValueSize())
	it := old.Iterate()
	for it.Next(&k, &v) {
		copy(nv, v)
		switch err := new.Update(k, nv, ebpf.UpdateNoExist); {
		case err == nil:
			inserted++
		case errors.Is(err, ebpf.ErrKeyExist):
		default:
			return inserted, 0, err
		}
	}
	return inserted, 0, it.Err()
}

// removeStalePins removes the map pins of ours (fluxvm_*) that spec has no
// map for: what an older schema pinned.
func removeStalePins(root string, spec *ebpf.CollectionSpec) error {
	entries, err := os.ReadDir(mapDir(root))
	if err != nil {
		return fmt.Errorf("bpf: activate: %w", err)
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "fluxvm_") || spec.Maps[e.Name()] != nil {
			continue
		}
		if err := os.Remove(filepath.Join(mapDir(root), e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("bpf: activate: remove stale pin %s: %w", e.Name(), err)
		}
	}
	return nil
}
