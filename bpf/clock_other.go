//go:build !linux

package bpf

import (
	"errors"
	"fmt"
	"time"
)

// monotonicCoarse: the datapath's clock exists only where the datapath runs.
func monotonicCoarse() (uint64, error) {
	return 0, fmt.Errorf("clock_gettime(CLOCK_MONOTONIC_COARSE): %w", errors.ErrUnsupported)
}

// Now is the datapath's clock; there is none elsewhere than on Linux.
func Now() (time.Duration, error) {
	ns, err := monotonicCoarse()
	return time.Duration(ns), err
}
