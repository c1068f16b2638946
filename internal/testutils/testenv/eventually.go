package testenv

import (
	"testing"
	"time"
)

// Eventually polls cond every 2 ms for up to 5 s and fails the test,
// naming what it waited for, when cond never held.
func Eventually(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
