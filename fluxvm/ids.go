package fluxvm

// idPool hands out small integer ids (datapath service and backend ids)
// from 1 to max-1. A released id is quarantined until the next conntrack
// GC has run, so that flows still naming it are gone before another
// service or backend can take it over.
type idPool struct {
	used       []bool
	quarantine []uint32
	next       uint32
	free       int
}

func newIDPool(max uint32) *idPool {
	p := &idPool{used: make([]bool, max), next: 1}
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
	if id != 0 && int(id) < len(p.used) && p.used[id] {
		p.quarantine = append(p.quarantine, id)
	}
}

// releaseQuarantined makes quarantined ids available again.
func (p *idPool) releaseQuarantined() {
	for _, id := range p.quarantine {
		p.used[id] = false
		p.free++
	}
	p.quarantine = p.quarantine[:0]
}
