//go:build !linux

package cgroup2

import (
	"errors"
	"fmt"
	"runtime"
)

var errNoCgroups = fmt.Errorf("cgroup2: there are no cgroups on %s: %w", runtime.GOOS, errors.ErrUnsupported)

// Root finds the cgroup v2 hierarchy on Linux; elsewhere it fails.
func Root() (string, error) { return "", errNoCgroups }

// Check checks a cgroup v2 directory on Linux; elsewhere it fails.
func Check(path string) error { return errNoCgroups }
