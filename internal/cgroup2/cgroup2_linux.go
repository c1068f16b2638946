package cgroup2

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Root returns the mount point of the cgroup v2 hierarchy in the calling
// process's mount namespace, read from /proc/self/mountinfo. With several
// cgroup2 mounts it prefers one that shows the whole hierarchy (root "/").
// Without any it fails with an error wrapping ErrNoCgroupV2 that names
// the cgroup v1 mounts it found.
func Root() (string, error) {
	f, err := os.Open(MountInfoPath)
	if err != nil {
		return "", fmt.Errorf("cgroup2: %w", err)
	}
	defer f.Close()
	ms, err := parseMountInfo(f)
	if err != nil {
		return "", err
	}
	return findRoot(ms)
}

// Check returns nil when path is a directory on a cgroup v2 filesystem,
// that is a cgroup a BPF program can be attached to. A path on any other
// filesystem, a cgroup v1 hierarchy included, gives an error wrapping
// ErrNotCgroupV2; a missing path one wrapping fs.ErrNotExist.
func Check(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("cgroup2: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("cgroup2: %s: %w: not a directory", path, ErrNotCgroupV2)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return fmt.Errorf("cgroup2: statfs %s: %w", path, err)
	}
	switch magic := uint32(st.Type); magic {
	case unix.CGROUP2_SUPER_MAGIC:
		return nil
	case unix.CGROUP_SUPER_MAGIC:
		return fmt.Errorf("cgroup2: %s: %w: it is on a cgroup v1 hierarchy", path, ErrNotCgroupV2)
	default:
		return fmt.Errorf("cgroup2: %s: %w: filesystem magic %#x", path, ErrNotCgroupV2, magic)
	}
}
