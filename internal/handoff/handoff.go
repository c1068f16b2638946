// Package handoff holds a value that users borrow and that can be replaced
// while they run: after Swap, its wait returns once no user holds the old
// value any more, so that its owner can release it (close the map handles
// it names).
//
// A borrow is two atomic operations and never blocks, and borrows nest (a
// scan whose callback deletes borrows twice on one goroutine), which a
// sync.RWMutex does not allow while a writer waits.
package handoff

import (
	"sync/atomic"
	"time"
)

// Value is a value of type T to borrow and swap. The zero Value holds the
// zero T.
type Value[T any] struct {
	cur atomic.Pointer[slot[T]]
}

type slot[T any] struct {
	v     T
	users atomic.Int64
}

// New returns a Value holding v.
func New[T any](v T) *Value[T] {
	h := &Value[T]{}
	h.cur.Store(&slot[T]{v: v})
	return h
}

// Borrow returns the current value and the function that gives it back;
// until then Swap does not return the value to its owner.
func (h *Value[T]) Borrow() (T, func()) {
	for {
		s := h.cur.Load()
		if s == nil {
			var zero T
			s = &slot[T]{v: zero}
			if !h.cur.CompareAndSwap(nil, s) {
				continue
			}
		}
		s.users.Add(1)
		// Still current: a Swap from here on waits for this user. Not
		// current: the Swap may have found no users already; borrow the
		// new value instead.
		if h.cur.Load() == s {
			return s.v, func() { s.users.Add(-1) }
		}
		s.users.Add(-1)
	}
}

// Load returns the current value without borrowing it: for reads that
// use no resource the value names (sizes, names).
func (h *Value[T]) Load() T {
	if s := h.cur.Load(); s != nil {
		return s.v
	}
	var zero T
	return zero
}

// Swap makes v the value new borrows get and returns the function that
// waits until every borrower of the old value gave it back, and returns
// it. The swap takes effect at once; the wait may be long (a borrower
// scanning a large map), so a caller holding locks releases them first.
func (h *Value[T]) Swap(v T) (wait func() T) {
	old := h.cur.Swap(&slot[T]{v: v})
	return func() T {
		if old == nil {
			var zero T
			return zero
		}
		for d := 10 * time.Microsecond; old.users.Load() != 0; d = min(2*d, 10*time.Millisecond) {
			time.Sleep(d)
		}
		return old.v
	}
}
