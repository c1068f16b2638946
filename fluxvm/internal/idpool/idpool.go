package idpool

// Pool hands out small integer ids (datapath service and backend ids)
// from 1 to max-1; 0 means "none" in every map. A released id is
// quarantined until a conntrack GC that began after its release has run
// (QuarantineMark, ReleaseQuarantinedBefore), so that flows still naming
// it are gone before another service or backend can take it over.
//
// Called with the dataplane's lock held; Pool has no lock of its own. The
// zero value has no id to hand out: use New.
type Pool struct {
	used       []bool
	held       []bool        // released and still in quarantine
	quarantine []quarantined // in the order of release
	released   uint64        // ids released so far: the next one's seq
	next       uint32
	free       int
}

// quarantined is a released id and the order of its release.
type quarantined struct {
	id  uint32
	seq uint64
}

// New returns a pool of the ids 1..max-1 (a map of max entries, whose
// entry 0 is never used); max 0 gives a pool with none.
func New(max uint32) *Pool {
	p := &Pool{used: make([]bool, max), held: make([]bool, max), next: 1}
	if max > 0 {
		p.used[0] = true // 0 means "none" in every map
		p.free = int(max) - 1
	}
	return p
}

// Available is how many ids Get can hand out now (quarantined ones are
// not).
func (p *Pool) Available() int { return p.free }

// Stats are how many ids a Pool has, and in what state.
type Stats struct {
	// Capacity is how many ids it hands out at most (1..max-1).
	Capacity int `json:"capacity"`
	// Free can be handed out now; Quarantined wait for a conntrack GC;
	// the rest are in use.
	Free        int `json:"free"`
	Quarantined int `json:"quarantined"`
}

// Stats says how many ids the pool has, free and in quarantine.
func (p *Pool) Stats() Stats {
	return Stats{Capacity: max(len(p.used)-1, 0), Free: p.free, Quarantined: len(p.quarantine)}
}

// Used reports whether id is handed out or in quarantine.
func (p *Pool) Used(id uint32) bool { return int(id) < len(p.used) && p.used[id] }

// Reserve marks id as used (restoring ids from the catalog); false when
// it is out of range or already used.
func (p *Pool) Reserve(id uint32) bool {
	if int(id) >= len(p.used) || p.used[id] {
		return false
	}
	p.used[id] = true
	p.free--
	return true
}

// Get hands out the next free id after the last one handed out (so that
// a released id is taken again as late as possible), or 0 when none is
// left.
func (p *Pool) Get() uint32 {
	if p.free == 0 {
		return 0
	}
	n := uint32(len(p.used))
	for range n {
		id := p.next
		p.next++
		if p.next >= n {
			p.next = 1
		}
		if !p.used[id] {
			p.used[id] = true
			p.free--
			return id
		}
	}
	return 0
}

// Release quarantines id until a GC releases it. Releasing an id twice
// (a retried removal) quarantines it once; 0, an id out of range or one
// not handed out is ignored.
func (p *Pool) Release(id uint32) {
	if id != 0 && int(id) < len(p.used) && p.used[id] && !p.held[id] {
		p.held[id] = true
		p.quarantine = append(p.quarantine, quarantined{id, p.released})
		p.released++
	}
}

// QuarantineMark marks the ids in quarantine now; a conntrack GC takes it
// before its scan begins.
func (p *Pool) QuarantineMark() uint64 { return p.released }

// ReleaseQuarantinedBefore makes available again the ids that were in
// quarantine at mark, and says how many. Ids released since (while the GC
// scanned, so that flows it already passed may still name them) wait for
// the next GC.
func (p *Pool) ReleaseQuarantinedBefore(mark uint64) int {
	n := 0
	for n < len(p.quarantine) && p.quarantine[n].seq < mark {
		q := p.quarantine[n]
		p.used[q.id] = false
		p.held[q.id] = false
		p.free++
		n++
	}
	p.quarantine = append(p.quarantine[:0], p.quarantine[n:]...)
	return n
}
