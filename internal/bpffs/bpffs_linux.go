package bpffs

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// IsBPFFS reports whether path lies on a mounted BPF filesystem.
func IsBPFFS(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, fmt.Errorf("bpffs: statfs %s: %w", path, err)
	}
	return uint32(st.Type) == unix.BPF_FS_MAGIC, nil
}

// Ensure makes sure that root is a mounted BPF filesystem, mounting one
// there when root is an empty mount point on another filesystem, and
// reports whether it mounted. It never mounts over a directory that already
// has contents.
//
// A mount made here lives in this process's mount namespace: when that is
// not the host's (for example under `ip netns exec`, which remounts /sys),
// pins made below it disappear with the process.
func Ensure(root string) (mounted bool, err error) {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return false, fmt.Errorf("bpffs: %w", err)
	}
	ok, err := IsBPFFS(root)
	if err != nil || ok {
		return false, err
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		return false, fmt.Errorf("bpffs: %w", err)
	}
	if len(entries) != 0 {
		return false, fmt.Errorf("bpffs: %s: %w and not empty; refusing to mount over it", root, ErrNotBPFFS)
	}
	if err := unix.Mount("bpffs", root, "bpf", 0, "mode=0700"); err != nil {
		return false, fmt.Errorf("bpffs: mount at %s: %w", root, err)
	}
	return true, nil
}
