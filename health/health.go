// Package health runs active TCP health checks and turns their results
// into a backend's observed health.
//
// Two pieces, both independent of the datapath:
//
//   - Status is the threshold state machine of one backend. A backend
//     starts Unknown (which callers treat as healthy: it was put in service
//     by its owner, not by a check), becomes Unhealthy after
//     Thresholds.Unhealthy consecutive failed checks, and Healthy after
//     Thresholds.Healthy consecutive successful ones once it is Unhealthy.
//     From Unknown a single success makes it Healthy: it is in service
//     already, and the healthy threshold only guards a return to service.
//     A success resets the failure count and a failure the success count,
//     so a flapping backend whose runs stay below the thresholds keeps its
//     state.
//
//   - Prober runs TCP connect checks with a timeout through a dial
//     function the caller supplies (so that it can dial inside another
//     network namespace), at most a fixed number at a time however many
//     callers share it.
//
// The package knows nothing about services or maps; package fluxvm applies
// the observed health to the datapath as a runtime overlay.
package health

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"
)

// State is a backend's observed health.
type State string

// Observed health states.
const (
	// Unknown: no threshold reached yet since checking began. Treated as
	// healthy.
	Unknown State = "unknown"
	// Healthy: the last run of successes reached the healthy threshold
	// (or the first check from Unknown succeeded).
	Healthy State = "healthy"
	// Unhealthy: the last run of failures reached the unhealthy
	// threshold.
	Unhealthy State = "unhealthy"
)

// Thresholds are the consecutive check counts that change a backend's
// state. A value below 1 counts as 1.
type Thresholds struct {
	// Unhealthy is the number of consecutive failures that make a backend
	// Unhealthy.
	Unhealthy uint32
	// Healthy is the number of consecutive successes that make an
	// Unhealthy backend Healthy again.
	Healthy uint32
}

// Status is the observed health of one backend and the history the
// thresholds need. The zero value is not ready for use; start with
// NewStatus.
type Status struct {
	State State
	// Successes and Failures are the consecutive counts: one of them is
	// always 0. They saturate instead of wrapping.
	Successes uint32
	Failures  uint32
	// LastError is the error of the most recent failed check, kept after
	// a recovery; empty if no check has failed.
	LastError string
	// LastChange is when State last changed (when checking began, while
	// it is Unknown).
	LastChange time.Time
	// LastCheck is when the most recent check finished; zero before the
	// first.
	LastCheck time.Time
}

// NewStatus returns the status of a backend whose checking begins at now.
func NewStatus(now time.Time) Status {
	return Status{State: Unknown, LastChange: now}
}

// Observe records one check that finished at now: err is nil for a
// success. It returns whether State changed.
func (s *Status) Observe(err error, th Thresholds, now time.Time) (changed bool) {
	unhealthy, healthy := max(th.Unhealthy, 1), max(th.Healthy, 1)
	s.LastCheck = now
	next := s.State
	if err == nil {
		s.Failures = 0
		s.Successes = inc(s.Successes)
		switch {
		case s.State == Unknown:
			next = Healthy
		case s.State == Unhealthy && s.Successes >= healthy:
			next = Healthy
		}
	} else {
		s.Successes = 0
		s.Failures = inc(s.Failures)
		s.LastError = err.Error()
		if s.State != Unhealthy && s.Failures >= unhealthy {
			next = Unhealthy
		}
	}
	if next == s.State {
		return false
	}
	s.State = next
	s.LastChange = now
	return true
}

func inc(n uint32) uint32 {
	if n == ^uint32(0) {
		return n
	}
	return n + 1
}

// DialFunc opens a connection like net.Dialer.DialContext. The prober
// calls it with network "tcp" and a context that carries the check's
// deadline.
type DialFunc func(ctx context.Context, network, address string) (net.Conn, error)

// DefaultConcurrency is the number of checks a Prober runs at once when
// NewProber is given 0.
const DefaultConcurrency = 32

// Prober runs TCP connect checks. It is safe for concurrent use; all
// callers share its concurrency bound.
type Prober struct {
	dial DialFunc
	sem  chan struct{}
}

// NewProber returns a prober that dials with dial (nil: a plain
// net.Dialer in the caller's network namespace) and runs at most
// concurrency checks at once (0: DefaultConcurrency).
func NewProber(dial DialFunc, concurrency int) *Prober {
	if dial == nil {
		var d net.Dialer
		dial = d.DialContext
	}
	if concurrency <= 0 {
		concurrency = DefaultConcurrency
	}
	return &Prober{dial: dial, sem: make(chan struct{}, concurrency)}
}

// Concurrency reports how many checks the prober runs at once.
func (p *Prober) Concurrency() int { return cap(p.sem) }

// Target is one check: a TCP connect to Addr that must complete within
// Timeout.
type Target struct {
	Addr    netip.AddrPort
	Timeout time.Duration
}

// Result is the outcome of one check.
type Result struct {
	Target
	// Err is nil when the connection was established (and then closed).
	Err error
	// At is when the check finished.
	At time.Time
	// Took is how long the connect took, waiting for a slot excluded.
	Took time.Duration
}

// ErrCanceled is the error of a check that did not run, or was cut short,
// because its context ended; it is not a statement about the backend,
// and callers should not count it as a failure.
var ErrCanceled = errors.New("health: check canceled")

// Check runs one check: it waits for a free slot, then connects to t.Addr
// within t.Timeout and closes the connection. When ctx ends first, Err
// wraps ErrCanceled.
func (p *Prober) Check(ctx context.Context, t Target) Result {
	if err := ctx.Err(); err != nil {
		return Result{Target: t, Err: fmt.Errorf("%w: %w", ErrCanceled, err), At: time.Now()}
	}
	select {
	case p.sem <- struct{}{}:
	case <-ctx.Done():
		return Result{Target: t, Err: fmt.Errorf("%w: %w", ErrCanceled, ctx.Err()), At: time.Now()}
	}
	defer func() { <-p.sem }()
	start := time.Now()
	cctx, cancel := context.WithTimeout(ctx, t.Timeout)
	defer cancel()
	c, err := p.dial(cctx, "tcp", t.Addr.String())
	r := Result{Target: t, At: time.Now()}
	r.Took = r.At.Sub(start)
	switch {
	case err == nil:
		c.Close()
	case ctx.Err() != nil:
		r.Err = fmt.Errorf("%w: %w", ErrCanceled, ctx.Err())
	case cctx.Err() != nil || isTimeout(err):
		// The dialer may notice the deadline just before the context does.
		r.Err = fmt.Errorf("tcp connect to %s: no answer within %s", t.Addr, t.Timeout)
	default:
		r.Err = err
	}
	return r
}

// CheckAll runs a check of every target, at most the prober's concurrency
// at a time, and returns the results in the order of targets. It returns
// when every check has finished: within the largest timeout after the
// last slot frees up.
func (p *Prober) CheckAll(ctx context.Context, targets []Target) []Result {
	out := make([]Result, len(targets))
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(len(targets), cap(p.sem)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				out[i] = p.Check(ctx, targets[i])
			}
		}()
	}
	for i := range targets {
		next <- i
	}
	close(next)
	wg.Wait()
	return out
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
