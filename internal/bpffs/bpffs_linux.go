package bpffs

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

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

// MountNamespace describes the calling thread's mount namespace. It
// compares the namespaces' links when PID 1's is readable, and otherwise
// the mounts both show (/proc/1/mountinfo is readable where its
// namespace link is not, as in some sandboxes): a copied namespace has
// mounts of its own, with ids of their own.
func MountNamespace() Namespace {
	var ns Namespace
	self, err := readMounts("/proc/thread-self/mountinfo")
	if err != nil {
		return ns
	}
	host, err := readMounts("/proc/1/mountinfo")
	if err != nil {
		return ns
	}
	selfNS, err1 := os.Readlink("/proc/thread-self/ns/mnt")
	hostNS, err2 := os.Readlink("/proc/1/ns/mnt")
	if err1 == nil && err2 == nil {
		ns.Private = selfNS != hostNS
	} else {
		ns.Private = self["/"].id != host["/"].id
	}
	if !ns.Private {
		return ns
	}
	ns.IPNetnsExec = self["/sys"].dev != "" && self["/sys"].dev != host["/sys"].dev
	ns.NetNS = netnsName()
	return ns
}

// mount is one line of a mountinfo file: the mount's id and its device
// (major:minor).
type mount struct{ id, dev string }

// readMounts reads the mounts at / and /sys from a mountinfo file (the
// last at each point: the one visible there).
func readMounts(mountinfo string) (map[string]mount, error) {
	data, err := os.ReadFile(mountinfo)
	if err != nil {
		return nil, fmt.Errorf("bpffs: %w", err)
	}
	out := map[string]mount{}
	for _, line := range strings.Split(string(data), "\n") {
		// ID parent major:minor root mount-point options ...
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == "/" || f[4] == "/sys") {
			out[f[4]] = mount{id: f[0], dev: f[2]}
		}
	}
	if out["/"].id == "" {
		return nil, fmt.Errorf("bpffs: %s: no root mount", mountinfo)
	}
	return out, nil
}

// netnsName finds the name under /run/netns (where `ip netns add`
// pins namespaces) of the calling thread's network namespace; "" when
// none names it.
func netnsName() string {
	var self unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &self); err != nil {
		return ""
	}
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		return ""
	}
	for _, e := range entries {
		var st unix.Stat_t
		if unix.Stat(filepath.Join("/run/netns", e.Name()), &st) == nil && st.Dev == self.Dev && st.Ino == self.Ino {
			return e.Name()
		}
	}
	return ""
}
