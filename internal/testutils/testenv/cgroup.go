package testenv

import (
	"sync"
	"testing"

	"github.com/fluxvm/servicefabric/internal/cgroup2"
)

var cgroupRoot = sync.OnceValues(cgroup2.Root)

// CgroupV2Root returns the mount point of the cgroup v2 hierarchy for a
// privileged test. Without privileges or without cgroup v2 it skips with
// the reason, or fails when FLUXVM_REQUIRE_PRIVILEGED=1.
func CgroupV2Root(tb testing.TB) string {
	tb.Helper()
	RequirePrivileged(tb)
	root, err := cgroupRoot()
	if err == nil {
		err = cgroup2.Check(root)
	}
	if err != nil {
		gate(tb, err.Error())
		return ""
	}
	return root
}
