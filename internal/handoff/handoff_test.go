package handoff

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestSwapWaitsForBorrowers: Swap returns only once the borrower of the
// old value gave it back, and borrows after it get the new value.
func TestSwapWaitsForBorrowers(t *testing.T) {
	h := New(1)
	v, done := h.Borrow()
	if v != 1 {
		t.Fatalf("borrowed %d", v)
	}
	var returned atomic.Bool
	swapped := make(chan int)
	go func() {
		old := h.Swap(2)()
		returned.Store(true)
		swapped <- old
	}()
	time.Sleep(20 * time.Millisecond)
	if returned.Load() {
		t.Fatal("Swap returned while the old value was borrowed")
	}
	// A nested borrow while the swap waits gets the new value, and does
	// not block.
	if v2, done2 := h.Borrow(); v2 != 2 {
		t.Errorf("borrow during the swap: %d, want 2", v2)
	} else {
		done2()
	}
	done()
	if old := <-swapped; old != 1 {
		t.Errorf("Swap returned %d, want 1", old)
	}
}

// TestNoUseAfterRelease: under concurrent borrows and swaps, no borrower
// ever holds a value its owner released.
func TestNoUseAfterRelease(t *testing.T) {
	type res struct{ released atomic.Bool }
	h := New(&res{})
	stop := make(chan struct{})
	var bad atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, done := h.Borrow()
				if r.released.Load() {
					bad.Add(1)
				}
				done()
			}
		})
	}
	for range 300 {
		old := h.Swap(&res{})()
		old.released.Store(true)
	}
	close(stop)
	wg.Wait()
	if n := bad.Load(); n != 0 {
		t.Fatalf("%d borrows saw a released value", n)
	}
}

func TestZeroValue(t *testing.T) {
	var h Value[int]
	if v, done := h.Borrow(); v != 0 {
		t.Errorf("zero Value borrowed %d", v)
	} else {
		done()
	}
	if old := h.Swap(3)(); old != 0 || h.Load() != 3 {
		t.Errorf("swap on the zero Value: %d, then %d", old, h.Load())
	}
}
