// Package cgroup2 finds and checks the cgroup v2 (unified) hierarchy that
// cgroup-attached BPF programs (cgroup/connect4, sendmsg6, ...) hook into.
//
// Root locates the hierarchy from the calling process's mount table; Check
// tells whether a directory is a cgroup on it. Failures wrap ErrNoCgroupV2
// or ErrNotCgroupV2 (test with errors.Is), or the underlying fs error. It
// works on Linux; elsewhere both fail with an error wrapping
// errors.ErrUnsupported.
package cgroup2

import "errors"

var (
	// ErrNoCgroupV2 reports a mount namespace without a cgroup v2 mount.
	ErrNoCgroupV2 = errors.New("cgroup v2 is required but not mounted")
	// ErrNotCgroupV2 reports a directory that is not on a cgroup v2
	// filesystem (for example a cgroup v1 hierarchy, or tmpfs).
	ErrNotCgroupV2 = errors.New("not on a cgroup v2 filesystem")
)

// MountInfoPath is the mount table Root reads.
const MountInfoPath = "/proc/self/mountinfo"
