//go:build !linux

package cgtest

import (
	"testing"

	"github.com/vishvananda/netns"
)

// Cgroup is a cgroup v2 directory that one test owns: Linux only.
type Cgroup struct{ Path, Name string }

// New skips the test: cgroups are Linux's.
func New(tb testing.TB) *Cgroup {
	tb.Helper()
	tb.Skip("cgtest: cgroups need Linux")
	return nil
}

// Child is a helper process in a cgroup and network namespace: Linux only.
type Child struct{}

// Start skips the test: cgroups are Linux's.
func Start(tb testing.TB, cg *Cgroup, ns netns.NsHandle) *Child {
	tb.Helper()
	tb.Skip("cgtest: cgroups need Linux")
	return nil
}

func runChild() int { return 2 }
