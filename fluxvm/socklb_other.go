//go:build !linux

package fluxvm

import (
	"errors"
	"fmt"
	"runtime"
)

// cgroupPathByID finds a cgroup's directory on Linux; there are no cgroups
// elsewhere.
func cgroupPathByID(root string, id uint64) (string, bool, error) {
	return "", false, fmt.Errorf("find cgroup %d: no cgroups on %s: %w", id, runtime.GOOS, errors.ErrUnsupported)
}
