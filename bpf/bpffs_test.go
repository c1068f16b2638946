package bpf

import (
	"errors"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestMountBPFFSIsExplicit: on a machine without a BPF filesystem at
// /sys/fs/bpf, Open refuses a pin root below it with a clear error unless
// Options.MountBPFFS asks it to mount one. The machine is simulated in a
// private mount namespace of one OS thread (an empty tmpfs over
// /sys/fs/bpf), which the thread takes with it when it exits: the
// machine's own mounts are never touched.
func TestMountBPFFSIsExplicit(t *testing.T) {
	testenv.RequirePrivileged(t)
	type result struct {
		refused, mountedErr error
		mounted, isBPFFS    bool
	}
	done := make(chan result, 1)
	go func() {
		// Never unlocked: the thread, with its mount namespace, ends
		// with this goroutine.
		runtime.LockOSThread()
		var r result
		defer func() { done <- r }()
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			r.refused = err
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			r.refused = err
			return
		}
		if err := unix.Mount("tmpfs", bpffs.DefaultRoot, "tmpfs", 0, ""); err != nil {
			r.refused = err
			return
		}
		_, _, r.refused = checkPinRoot(bpffs.DefaultRoot+"/fluxvm-nomount/service", false)
		_, r.mounted, r.mountedErr = checkPinRoot(bpffs.DefaultRoot+"/fluxvm-nomount/service", true)
		r.isBPFFS, _ = bpffs.IsBPFFS(bpffs.DefaultRoot)
	}()
	r := <-done
	if !errors.Is(r.refused, ErrPinRoot) || !strings.Contains(r.refused.Error(), "MountBPFFS") {
		t.Errorf("without MountBPFFS: %v, want ErrPinRoot naming the option", r.refused)
	}
	if r.mountedErr != nil || !r.mounted || !r.isBPFFS {
		t.Errorf("with MountBPFFS: mounted %v, bpffs %v, err %v; want a BPF filesystem mounted", r.mounted, r.isBPFFS, r.mountedErr)
	}
	if ok, err := bpffs.IsBPFFS(bpffs.DefaultRoot); err != nil || !ok {
		t.Fatalf("the machine's %s is no longer bpffs (%v): the test leaked a mount", bpffs.DefaultRoot, err)
	}
}
