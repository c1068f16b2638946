package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/internal/flock"
)

// ErrInUse reports a pin root that another owner holds (LockPinRoot): a
// dataplane open on it, in this process or another.
var ErrInUse = errors.New("pin root in use")

// madeParents prefixes the directory, inside the pin root, that records how
// many of the pin root's parents LockPinRoot created (madeParents + "2":
// the parent and the grandparent). bpffs holds no regular files, so the
// record is a directory; Open and the loader never look at it, RemoveRoot
// removes those parents again when they are empty.
const madeParents = "made_parents_"

// mkdirMarker creates the madeParents record (os.Mkdir; a test makes it
// fail).
var mkdirMarker = os.Mkdir

// PinRootLock is the exclusive hold of a pin root (LockPinRoot). Release
// lets it go; so does the end of the process.
type PinRootLock struct {
	root    string
	f       *os.File
	mounted bool
	warning string // Status.MountWarning of that mount
	made    int    // directories LockPinRoot created: the root and its parents
}

// LockPinRoot checks opts.PinRoot as Open does (absolute, strictly below a
// bpffs mount; with opts.MountBPFFS it mounts bpffs at /sys/fs/bpf on a
// machine without one), creates it when missing, and takes an exclusive,
// non-blocking flock(2) on the directory. Each call opens the directory
// anew, so a second hold conflicts within one process as across
// processes. A pin root held already fails with an error matching
// ErrInUse that names the holder where /proc/locks tells it (a process
// id and its command, or this process).
//
// The lock is on the directory itself: the loader never removes it
// (schema rebuilds and reloads replace what is inside), and a pin root
// that RemoveRoot removed and someone recreated meanwhile is noticed (the
// path no longer names the directory locked) and locked afresh.
//
// When LockPinRoot creates parents of the pin root too, it records how
// many inside the pin root, so that RemoveRoot (also in another process,
// fluxvmd cleanup) removes them again when they are empty.
func LockPinRoot(opts Options) (*PinRootLock, error) {
	root := opts.PinRoot
	if root == "" {
		root = DefaultPinRoot
	}
	root, mounted, err := checkPinRoot(root, opts.MountBPFFS)
	if err != nil {
		return nil, err
	}
	for range 3 {
		made, err := mkdirCounting(root)
		if err != nil {
			return nil, fmt.Errorf("bpf: pin root %s: %w", root, err)
		}
		f, err := os.Open(root)
		if err != nil {
			return nil, fmt.Errorf("bpf: pin root %s: %w", root, err)
		}
		if err := flock.Try(f); err != nil {
			f.Close()
			if errors.Is(err, flock.ErrHeld) {
				return nil, fmt.Errorf("bpf: pin root %s is %w: %w", root, err, ErrInUse)
			}
			return nil, fmt.Errorf("bpf: pin root %s: lock: %w", root, err)
		}
		if !flock.Same(f, root) {
			// Removed (and perhaps recreated) between the open and the
			// lock: lock what the path names now.
			f.Close()
			continue
		}
		if made > 1 {
			if err := mkdirMarker(filepath.Join(root, madeParents+strconv.Itoa(made-1)), 0o700); err != nil && !errors.Is(err, os.ErrExist) {
				// Nothing recorded them: remove what was just made.
				if os.Remove(root) == nil {
					removeParents(root, made-1)
				}
				f.Close()
				return nil, fmt.Errorf("bpf: pin root %s: recording the parents it created: %w", root, err)
			}
		}
		lk := &PinRootLock{root: root, f: f, mounted: mounted, made: made}
		if mounted {
			lk.warning = privateMountWarning(bpffs.MountNamespace())
		}
		return lk, nil
	}
	return nil, fmt.Errorf("bpf: pin root %s: removed and recreated while being locked, three times: %w", root, ErrInUse)
}

// Root is the pin root held (cleaned, absolute).
func (l *PinRootLock) Root() string { return l.root }

// MountedBPFFS reports whether LockPinRoot mounted bpffs at /sys/fs/bpf.
func (l *PinRootLock) MountedBPFFS() bool { return l.mounted }

// MountWarning is Status.MountWarning for the mount LockPinRoot made:
// empty when it mounted nothing or mounted in the host's mount namespace.
func (l *PinRootLock) MountWarning() string { return l.warning }

// Open is Open on the pin root held (opts.PinRoot is the lock's). When
// LockPinRoot mounted bpffs, the Status says so (MountedBPFFS,
// MountWarning), as it does when Open mounts: Open itself finds the
// mount made and mounts nothing.
func (l *PinRootLock) Open(opts Options) (*Datapath, error) {
	opts.PinRoot = l.root
	d, err := Open(opts)
	if err != nil {
		return nil, err
	}
	if l.mounted {
		d.status.MountedBPFFS = true
		if d.status.MountWarning == "" {
			d.status.MountWarning = l.warning
		}
	}
	return d, nil
}

// Release lets the pin root go. A second Release does nothing.
func (l *PinRootLock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// Abandon undoes LockPinRoot for a start that failed: when LockPinRoot
// created the pin root and nothing was pinned in it since (only the empty
// directories a datapath makes are there), it removes the pin root and
// the parents it created, when they are empty; then it releases. A pin
// root that holds pins, or that existed before, is left as it is.
func (l *PinRootLock) Abandon() error {
	if l == nil || l.f == nil {
		return nil
	}
	if l.made > 0 {
		for _, dir := range []string{mapDir(l.root), linkDir(l.root), filepath.Join(l.root, madeParents+strconv.Itoa(l.made-1))} {
			os.Remove(dir) // fails when not empty: then so does the root's
		}
		if os.Remove(l.root) == nil {
			removeParents(l.root, l.made-1)
		}
	}
	return l.Release()
}

// mkdirCounting creates dir and its missing parents and returns how many
// directories it created (0: dir existed).
func mkdirCounting(dir string) (int, error) {
	missing := 0
	for p := dir; ; p = filepath.Dir(p) {
		if _, err := os.Stat(p); err == nil || p == filepath.Dir(p) {
			break
		}
		missing++
	}
	if missing == 0 {
		return 0, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return 0, err
	}
	return missing, nil
}

// RemoveRoot tears down what a datapath recorded under the pin root root,
// without loading anything and without a Datapath: RemovePins, then
// RemoveRootDir. A missing pin root is not an error (the cls_bpf filters
// are still looked for). Nothing else under the bpffs mount is touched;
// the caller holds the pin root (LockPinRoot) so that no datapath runs on
// it. A caller that removes more state next to the pin root (a catalog,
// qdiscs) while it holds the lock calls the two halves itself, with its
// own work between them: once the pin root directory is gone, another
// Open can create and lock a new one.
func RemoveRoot(root string) error {
	err := RemovePins(root)
	if errors.Is(err, ErrPinRoot) {
		return err
	}
	return errors.Join(err, RemoveRootDir(root))
}

// RemovePins detaches every attachment recorded under the pin root root
// (TCX, XDP and socket-hook links: unpinned and closed, which detaches
// them before RemovePins returns), deletes our cls_bpf filters (name
// prefix "fluxvm:") from every interface of the calling thread's network
// namespace, and removes every pin with the directories that held them.
// The pin root directory itself stays, empty but for the record of the
// parents LockPinRoot made: the directory a holder of LockPinRoot has
// locked, so that no other Open takes the path over while the holder
// finishes (RemoveRootDir removes it last).
func RemovePins(root string) error {
	root, err := removableRoot(root)
	if err != nil {
		return err
	}
	var errs []error
	// Links first: closing the last descriptor of an unpinned link
	// detaches it before Close returns; merely removing the pin would
	// leave the kernel to release it later, so RemovePins could return
	// with the programs still running.
	links, err := os.ReadDir(linkDir(root))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, e := range links {
		pin := filepath.Join(linkDir(root), e.Name())
		if l, err := link.LoadPinnedLink(pin, nil); err == nil {
			errs = append(errs, l.Unpin(), l.Close())
		} else if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, removeClsBPF())
	// Unpinning the maps drops the kernel's last references.
	for _, dir := range []string{linkDir(root), mapDir(root)} {
		entries, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		for _, e := range entries {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
		if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("bpf: remove %s: %w", root, err)
	}
	return nil
}

// RemoveRootDir removes the pin root directory root, after RemovePins,
// and the parents of it that LockPinRoot created, while they are empty
// (another pin root may live beside it) and below the mount. A pin root
// that still holds something not ours is left, and the error says so; a
// missing one is not an error.
func RemoveRootDir(root string) error {
	root, err := removableRoot(root)
	if err != nil {
		return err
	}
	entries, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("bpf: remove %s: %w", root, err)
	}
	var made int
	for _, e := range entries {
		n, ok := strings.CutPrefix(e.Name(), madeParents)
		if !ok {
			continue // not ours: os.Remove(root) below says so
		}
		made, _ = strconv.Atoi(n)
		if err := os.Remove(filepath.Join(root, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("bpf: remove %s: %w", root, err)
		}
	}
	if err := os.Remove(root); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("bpf: remove %s (not empty: something else lives there?): %w", root, err)
	}
	removeParents(root, made)
	return nil
}

// removeParents removes up to n parents of dir, nearest first, while they
// are empty and below the mount.
func removeParents(dir string, n int) {
	for range n {
		dir = filepath.Dir(dir)
		if dir == bpffs.DefaultRoot || dir == "/" || os.Remove(dir) != nil {
			return
		}
	}
}

// removableRoot checks root for RemovePins and RemoveRootDir: absolute, a
// directory of its own below the mount, on bpffs when it exists.
func removableRoot(root string) (string, error) {
	if !filepath.IsAbs(root) {
		return "", fmt.Errorf("bpf: remove %q: %w: not absolute", root, ErrPinRoot)
	}
	root = filepath.Clean(root)
	if root == "/" || root == bpffs.DefaultRoot {
		return "", fmt.Errorf("bpf: remove %q: %w: must be a directory of its own below the mount", root, ErrPinRoot)
	}
	if fi, err := os.Stat(root); err == nil {
		if !fi.IsDir() {
			return "", fmt.Errorf("bpf: remove %s: %w: not a directory", root, ErrPinRoot)
		}
		if ok, err := bpffs.IsBPFFS(root); err != nil || !ok {
			return "", fmt.Errorf("bpf: remove %s: %w: not on bpffs", root, ErrPinRoot)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("bpf: remove %s: %w", root, err)
	}
	return root, nil
}

// CheckPinRootVisible tells whether a pin root that this process does not
// see could exist on the node all the same, hidden from it, as a cleanup
// must know before it removes a dataplane's other state (its catalog,
// qdiscs, filters) without holding the pin root. It returns nil when this
// process runs in the host's (PID 1's) mount namespace, or in another
// that shows the host's filesystem at the pin root's nearest existing
// directory and where the host does not see the pin root either: then a
// pin root missing here is missing on the node, and no dataplane runs on
// it. Otherwise (a private /sys under `ip netns exec`, a mount namespace
// with a BPF filesystem of its own, or the host's view unreadable) it
// returns an error matching ErrPinRoot that says so and how to run
// instead (`nsenter --net=/run/netns/NAME`, which enters the network
// namespace only).
func CheckPinRootVisible(root string) error {
	if !filepath.IsAbs(root) {
		return fmt.Errorf("bpf: pin root %q: %w: not absolute", root, ErrPinRoot)
	}
	root = filepath.Clean(root)
	ns := bpffs.MountNamespace()
	if !ns.Private {
		return nil
	}
	p := root
	for {
		if _, err := os.Stat(p); err == nil || p == "/" {
			break
		}
		p = filepath.Dir(p)
	}
	host := "/proc/1/root"
	var here, there unix.Stat_t
	if unix.Stat(p, &here) == nil && unix.Stat(host+p, &there) == nil && here.Dev == there.Dev {
		if _, err := os.Stat(host + root); errors.Is(err, os.ErrNotExist) {
			return nil
		}
	}
	return fmt.Errorf("bpf: pin root %s: %w: %s", root, ErrPinRoot, hiddenPinRoot(root, ns))
}

// hiddenPinRoot says why a pin root missing in the mount namespace ns may
// exist on the node, and what to do.
func hiddenPinRoot(root string, ns bpffs.Namespace) string {
	netns := "/run/netns/NAME"
	if ns.NetNS != "" {
		netns = "/run/netns/" + ns.NetNS
	}
	if ns.IPNetnsExec {
		return fmt.Sprintf("this process does not see the node's BPF filesystem: it runs under `ip netns exec`, which gives it a private /sys that hides the host's %s, so a dataplane's pin root there can be neither seen nor held; run it under `nsenter --net=%s` instead, which enters the network namespace only",
			bpffs.DefaultRoot, netns)
	}
	return fmt.Sprintf("this process's mount namespace is not the host's and does not show the node's %s as the host does (or the host's view, /proc/1/root, is unreadable), so a dataplane's pin root %s there can be neither seen nor held; run it in the host's mount namespace (for a network namespace: `nsenter --net=%s`)",
		bpffs.DefaultRoot, root, netns)
}
