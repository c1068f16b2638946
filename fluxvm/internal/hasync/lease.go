package hasync

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/internal/atomicfile"
)

var errLeaseZero = fmt.Errorf("%w: neither an epoch nor a superseding epoch", intent.ErrInvalid)

// saveLease keeps a lease in Config.LeasePath. A failure to sync the
// directory after the rename is only logged: the new file is in place.
func (s *Sync) saveLease(lf leaseFile) error {
	if s.cfg.LeasePath == "" {
		return nil
	}
	data, _ := json.Marshal(lf)
	err := atomicfile.Write(s.cfg.LeasePath, data, 0o600)
	if dse := (*atomicfile.DirSyncError)(nil); errors.As(err, &dse) {
		s.log.Warn("fluxvm: HA lease written, but its directory was not synced: a power loss may bring back the previous lease", "err", err)
		return nil
	}
	return err
}

// Status reports the lease, the queue, the journals and the cursors. It
// reads no kernel state but the drainer's counters.
func (s *Sync) Status() Status {
	s.mu.Lock()
	dr := s.drainer
	s.mu.Unlock()
	st := Status{Interval: s.cfg.Interval}
	if dr != nil {
		st.Queue.Read, st.Queue.Skipped, st.Queue.Dropped, _ = dr.Stats()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st.Epoch, st.SupersededBy, st.GCDeletes = s.epoch, s.fencedBy, s.gcDeletes
	st.Queue.Skipped += s.unresolved // records of flows no service has
	if len(s.journals) > 0 {
		st.Journals = make(map[string]ha.JournalStats, len(s.journals))
		for name, j := range s.journals {
			st.Journals[name] = j.Stats()
		}
	}
	st.Group, st.Node, st.Joined = s.cfg.Group, s.cfg.Node, s.joined
	for src, c := range s.cursors {
		if !s.cfg.Group {
			if st.Cursors == nil {
				st.Cursors = map[string]ha.Cursor{}
			}
			st.Cursors[src.service] = c
			continue
		}
		if st.Sources == nil {
			st.Sources = map[string]map[string]ha.Cursor{}
		}
		if st.Sources[src.service] == nil {
			st.Sources[src.service] = map[string]ha.Cursor{}
		}
		st.Sources[src.service][src.node] = c
	}
	return st
}

// HoldLease keeps lease updates waiting until release is called: what
// a caller does that must read the lease and act on it unchanged (and
// the facade's tests, to hold an update at its wait).
func (s *Sync) HoldLease() (release func()) {
	s.leaseMu.Lock()
	return s.leaseMu.Unlock
}
