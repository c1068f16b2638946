// Package mapscan streams BPF hash maps in bounded chunks and deletes keys
// in batches, using the kernel's batch commands where it has them and
// falling back to key-by-key iteration where it answers
// ebpf.ErrNotSupported. The conntrack and nat packages share it.
package mapscan

import (
	"errors"
	"fmt"
	"sync/atomic"
	"syscall"

	"github.com/cilium/ebpf"
)

// DefaultChunk is how many entries one chunk holds. It bounds the memory of
// a scan (a few hundred KiB with the decoded entries) and amortises the
// syscall of a batch over enough entries that the per-entry copy dominates.
const DefaultChunk = 4096

// MinChunk keeps a chunk larger than any realistic hash bucket: the batch
// command returns whole buckets and fails with ENOSPC when one does not fit.
const MinChunk = 64

// Mode remembers whether the kernel supports batch map commands. It
// starts optimistic and flips once, on the first ebpf.ErrNotSupported.
type Mode struct{ off atomic.Bool }

// Enabled reports whether batch commands are in use.
func (b *Mode) Enabled() bool { return !b.off.Load() }

// Disable switches to key-by-key iteration for good.
func (b *Mode) Disable() { b.off.Store(true) }

// SetBatch turns batch commands on or off (tests exercise the fallback
// this way; the kernel offers no way to refuse them on demand).
func (b *Mode) SetBatch(on bool) { b.off.Store(!on) }

// Scanner reads a hash map in chunks of up to len(keys) entries.
//
// The caller may delete any key of the chunk it was just given before it
// asks for the next one, without disturbing the scan:
//   - the batch command resumes at a bucket index, which deleting entries of
//     buckets already returned does not move;
//   - the fallback resumes with BPF_MAP_GET_NEXT_KEY from a key it read
//     ahead and never hands out, so that key is still there. (Next-key from
//     a key that has gone restarts at the first key; only a concurrent LRU
//     eviction of exactly that key can cause it, and the visit limit below
//     turns a pathological loop into an error.)
type Scanner[K, V any] struct {
	m     *ebpf.Map
	mode  *Mode
	Keys  []K // the current chunk
	Vals  []V
	batch bool // this scan uses the batch command

	cursor ebpf.MapBatchCursor

	started, done bool
	next          K // fallback: first key of the next chunk, read ahead
	cur           K // fallback: the key being read (a field, so it does not escape per call)
	visited       uint64
}

func NewScanner[K, V any](m *ebpf.Map, mode *Mode, chunk int) *Scanner[K, V] {
	chunk = max(chunk, MinChunk)
	return &Scanner[K, V]{
		m: m, mode: mode, batch: mode.Enabled(),
		Keys: make([]K, chunk), Vals: make([]V, chunk),
	}
}

// chunk returns the number of entries now in s.Keys and s.Vals; 0 means
// the scan is complete.
func (s *Scanner[K, V]) Chunk() (int, error) {
	for !s.done {
		var (
			n   int
			err error
		)
		if s.batch {
			n, err = s.batchChunk()
		} else {
			n, err = s.iterChunk()
		}
		if err != nil || n > 0 {
			return n, err
		}
	}
	return 0, nil
}

func (s *Scanner[K, V]) batchChunk() (int, error) {
	n, err := s.m.BatchLookup(&s.cursor, s.Keys, s.Vals, nil)
	switch {
	case err == nil:
	case errors.Is(err, ebpf.ErrKeyNotExist):
		// The end of the map; n may still hold a last partial chunk.
		s.done = true
	case errors.Is(err, ebpf.ErrNotSupported) && !s.started:
		s.mode.Disable()
		s.batch = false
		return 0, nil
	case errors.Is(err, syscall.ENOSPC) && n == 0 && len(s.Keys) < 1<<20:
		// A bucket larger than the chunk: the cursor did not move, so
		// retry the same bucket with room for it.
		s.Keys = make([]K, 2*len(s.Keys))
		s.Vals = make([]V, 2*len(s.Vals))
		return 0, nil
	default:
		return 0, fmt.Errorf("batch lookup: %w", err)
	}
	s.started = true
	return n, nil
}

func (s *Scanner[K, V]) iterChunk() (int, error) {
	if !s.started {
		s.started = true
		if err := s.m.NextKey(nil, &s.next); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				s.done = true
				return 0, nil
			}
			return 0, fmt.Errorf("first key: %w", err)
		}
	}
	limit := 2*uint64(s.m.MaxEntries()) + uint64(len(s.Keys))
	n := 0
	for n < len(s.Keys) && !s.done {
		if s.visited++; s.visited > limit {
			return 0, fmt.Errorf("iterate: %w", ebpf.ErrIterationAborted)
		}
		s.cur = s.next
		// Read ahead before cur is handed out: the caller may delete it.
		if err := s.m.NextKey(&s.cur, &s.next); err != nil {
			if !errors.Is(err, ebpf.ErrKeyNotExist) {
				return 0, fmt.Errorf("next key: %w", err)
			}
			s.done = true
		}
		if err := s.m.Lookup(&s.cur, &s.Vals[n]); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				continue // removed since next-key returned it
			}
			return 0, fmt.Errorf("lookup: %w", err)
		}
		s.Keys[n] = s.cur
		n++
	}
	return n, nil
}

// DeleteKeys deletes keys from m and returns how many it deleted. Keys
// that are already gone (the LRU evicted them, or someone else deleted
// them) are skipped, and missing is called with their index when non-nil.
//
// The batch delete command stops at the first key that fails and reports
// how many it deleted before it; a missing key is stepped over and the
// batch resumed, so one evicted key does not cost the rest of the batch.
func DeleteKeys[K any](m *ebpf.Map, mode *Mode, keys []K, missing func(int)) (int, error) {
	deleted, i := 0, 0
	for i < len(keys) && mode.Enabled() {
		n, err := m.BatchDelete(keys[i:], nil)
		deleted += n
		i += n
		switch {
		case err == nil:
			return deleted, nil
		case errors.Is(err, ebpf.ErrKeyNotExist):
			if missing != nil {
				missing(i)
			}
			i++
		case errors.Is(err, ebpf.ErrNotSupported):
			mode.Disable()
		default:
			return deleted, fmt.Errorf("batch delete: %w", err)
		}
	}
	for ; i < len(keys); i++ {
		if err := m.Delete(&keys[i]); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				if missing != nil {
					missing(i)
				}
				continue
			}
			return deleted, fmt.Errorf("delete: %w", err)
		}
		deleted++
	}
	return deleted, nil
}

// Each streams the scanner's map chunk by chunk: conv turns each entry into
// an E (false skips it) and fn receives the converted entries of one chunk
// in buf, reused between chunks. An error of the scan itself is wrapped as
// "<what>: <err>"; fn's own errors are returned as they are.
func Each[K, V, E any](s *Scanner[K, V], what string, buf []E, conv func(k *K, v *V) (E, bool), fn func([]E) error) error {
	for {
		n, err := s.Chunk()
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if n == 0 {
			return nil
		}
		buf = buf[:0]
		for i := range n {
			if e, ok := conv(&s.Keys[i], &s.Vals[i]); ok {
				buf = append(buf, e)
			}
		}
		if len(buf) > 0 {
			if err := fn(buf); err != nil {
				return err
			}
		}
	}
}
