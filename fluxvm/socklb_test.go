package fluxvm

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
)

// eventually polls cond for up to 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestSockDestroyerCoalesces: the worker runs once at start, then once per
// request; requests made while a run is under way coalesce into one more
// run; destroyed sockets are summed.
func TestSockDestroyerCoalesces(t *testing.T) {
	release := make(chan struct{})
	var runs atomic.Int32
	s := newSockDestroyer(func() (int, error) {
		runs.Add(1)
		<-release
		return 2, nil
	}, -1, slog.New(slog.NewTextHandler(io.Discard, nil)))
	s.start()
	defer s.close()
	eventually(t, "the first run", func() bool { return runs.Load() == 1 })
	// The first run is blocked: ten requests meanwhile make one more run.
	for range 10 {
		s.request()
	}
	release <- struct{}{}
	eventually(t, "the second run", func() bool { return runs.Load() == 2 })
	release <- struct{}{}
	eventually(t, "the second run to be recorded", func() bool { return s.status().Runs == 2 })
	time.Sleep(20 * time.Millisecond)
	if n := runs.Load(); n != 2 {
		t.Fatalf("%d runs after one start and a burst of requests, want 2", n)
	}
	st := s.status()
	if st.Destroyed != 4 || st.LastDestroyed != 2 || st.Supported == nil || !*st.Supported || st.LastRun.IsZero() || st.LastError != "" {
		t.Errorf("status %+v", st)
	}
}

// TestSockDestroyerUnsupported: on a kernel without bpf_sock_destroy the
// worker reports it once and stops trying; another error is reported and
// retried.
func TestSockDestroyerUnsupported(t *testing.T) {
	var runs atomic.Int32
	fail := errors.New("iterator broke")
	s := newSockDestroyer(func() (int, error) {
		if runs.Add(1) == 1 {
			return 0, fail
		}
		return 0, fmt.Errorf("bpf: destroy stale UDP sockets: %w", bpf.ErrSockDestroyUnsupported)
	}, time.Millisecond, slog.New(slog.NewTextHandler(io.Discard, nil)))
	s.start()
	defer s.close()
	eventually(t, "the refusal", func() bool { st := s.status(); return st.Supported != nil && !*st.Supported })
	for range 5 {
		s.request()
		time.Sleep(5 * time.Millisecond)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("%d runs: want the failed one and the refused one, then none", n)
	}
	if st := s.status(); st.Runs != 2 || st.LastError == "" {
		t.Errorf("status %+v", st)
	}
	s.close() // idempotent
	var none *sockDestroyer
	none.request()
	none.close()
	if st := none.status(); st.Runs != 0 || st.Supported != nil {
		t.Errorf("nil worker status %+v", st)
	}
}
