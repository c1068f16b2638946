package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"
)

// TestParseGroup: -group is NAME=URL, at least two, names unique.
func TestParseGroup(t *testing.T) {
	got, err := parseGroup("e1=http://10.0.0.1:7788/, e2=https://10.0.0.2:7788")
	want := []groupMember{{"e1", "http://10.0.0.1:7788"}, {"e2", "https://10.0.0.2:7788"}}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("parseGroup = %v, %v; want %v", got, err, want)
	}
	for _, bad := range []string{"", "e1=http://a", "e1=http://a,e1=http://b", "e1=http://a,e2", "=http://a,e2=http://b", "e1=a,e2=http://b"} {
		if got, err := parseGroup(bad); err == nil {
			t.Errorf("parseGroup(%q) = %v, want an error", bad, got)
		}
	}
	for _, args := range [][]string{
		{"-group", "e1=http://a,e2=http://b", "-active", "http://a"},
		{"-active", "http://a"},
		{},
	} {
		if err := run(args); err == nil {
			t.Errorf("run(%q): no error", args)
		}
	}
}

// TestLoopPartial: a group round that failed in part (an edge down,
// others replicated) keeps the interval; a failed round backs off.
func TestLoopPartial(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tc := range []struct {
		name     string
		err      error
		min, max int
	}{
		// 20 ms interval over 330 ms: about 16 rounds at the interval;
		// backing off (20, 40, 80, 160 ms) about 5.
		{"partial", partialError{errors.New("ecmp-e2 down")}, 10, 20},
		{"failed", errors.New("refusing to replicate"), 3, 6},
		{"ok", nil, 10, 20},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 330*time.Millisecond)
		n := 0
		err := loop(ctx, log, false, 20*time.Millisecond, func() error { n++; return tc.err })
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || n < tc.min || n > tc.max {
			t.Errorf("%s: %d rounds (%v), want %d..%d", tc.name, n, err, tc.min, tc.max)
		}
	}
}
