package fluxvm

// idPool hands out small integer ids (datapath service and backend ids)
// from 1 to max-1. A released id is quarantined until the next conntrack
// GC has run, so that flows still naming it are gone before another
// service or backend can take it over.
type idPool struct {
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

func newIDPool(max uint32) *idPool {
	p := &idPool{used: make([]bool, max), held: make([]bool, max), next: 1}
	if max > 0 {
		p.used[0] = true // 0 means "none" in every map
		p.free = int(max) - 1
	}
	return p
}

// available is how many ids can be allocated now.
func (p *idPool) available() int { return p.free }

// reserve marks id as used (restoring ids from the catalog).
func (p *idPool) reserve(id uint32) bool {
	if int(id) >= len(p.used) || p.used[id] {
		return false
	}
	p.used[id] = true
	p.free--
	return true
}

// get allocates the next free id, or 0 when none is left.
func (p *idPool) get() uint32 {
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

// release quarantines id until releaseQuarantined.
func (p *idPool) release(id uint32) {
	// Releasing an id twice (a retried removal) must not free it twice.
	if id != 0 && int(id) < len(p.used) && p.used[id] && !p.held[id] {
		p.held[id] = true
		p.quarantine = append(p.quarantine, quarantined{id, p.released})
		p.released++
	}
}

// quarantineMark marks the ids in quarantine now; a conntrack GC takes it
// before its scan begins.
func (p *idPool) quarantineMark() uint64 { return p.released }

// releaseQuarantinedBefore makes available again the ids that were in
// quarantine at mark, and says how many. Ids released since (while the GC
// scanned, so that flows it already passed may still name them) wait for
// the next GC.
func (p *idPool) releaseQuarantinedBefore(mark uint64) int {
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

// releaseQuarantined makes quarantined ids available again.
func (p *idPool) releaseQuarantined() {
	p.releaseQuarantinedBefore(p.released)
}
