//go:build linux

package bpf

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// monotonicCoarse is the datapath's clock (bpf_ktime_get_coarse_ns).
func monotonicCoarse() (uint64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
		return 0, fmt.Errorf("clock_gettime(CLOCK_MONOTONIC_COARSE): %w", err)
	}
	return uint64(ts.Nano()), nil
}

// Now is the datapath's clock: CLOCK_MONOTONIC_COARSE, time since boot in
// the resolution of the kernel tick, what bpf_ktime_get_coarse_ns returns
// and what every time in the lifecycle maps is stamped on. Wall-clock time
// (time.Now) is a different clock and cannot be compared with them.
func Now() (time.Duration, error) {
	ns, err := monotonicCoarse()
	return time.Duration(ns), err
}
