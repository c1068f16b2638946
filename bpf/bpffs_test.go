package bpf

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
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

// pinRootChildEnv makes the test binary the child of
// TestPinRootUnderIPNetnsExec (TestMain): its value is the mode.
const pinRootChildEnv = "FLUXVM_TEST_PINROOT_CHILD"

// pinRootChild opens a datapath under /sys/fs/bpf as an embedder would,
// without MountBPFFS (mode "refuse") or with it ("mount"), prints the
// error or the MountWarning, and exits 0 when Open did what the mode
// expects: refused with ErrPinRoot, or mounted.
func pinRootChild(mode string) int {
	root := filepath.Join(bpffs.DefaultRoot, "fluxvm-ipnetns", "service")
	switch mode {
	case "refuse":
		d, err := Open(Options{PinRoot: root, Tier: TierS})
		if err == nil {
			d.Remove()
			fmt.Println("Open succeeded")
			return 1
		}
		fmt.Println(err)
		if !errors.Is(err, ErrPinRoot) {
			return 1
		}
		return 0
	case "mount":
		// The BPF filesystem, and the pins, go with this process's
		// mount namespace.
		d, err := Open(Options{PinRoot: root, Tier: TierS, MountBPFFS: true})
		if err != nil {
			fmt.Println(err)
			return 1
		}
		st := d.Status()
		d.Close()
		fmt.Println(st.MountWarning)
		if !st.MountedBPFFS {
			return 1
		}
		return 0
	}
	return 2
}

// TestPinRootUnderIPNetnsExec: a process started with `ip netns exec`
// has a private /sys, without the host's BPF filesystem. Open refuses
// its pin root with advice to run under `nsenter --net` with the
// namespace's path (mounting bpffs there would lose the pins at exit),
// not to set MountBPFFS; with MountBPFFS it mounts, and Status says the
// pins will vanish, with the same advice.
func TestPinRootUnderIPNetnsExec(t *testing.T) {
	testenv.RequirePrivileged(t)
	ns := testenv.NewNetNS(t, "fvipx")
	run := func(mode string) string {
		t.Helper()
		cmd := exec.Command("ip", "netns", "exec", ns.Name, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), pinRootChildEnv+"="+mode)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child (%s) under ip netns exec: %v\n%s", mode, err, out)
		}
		return string(out)
	}
	advice := "nsenter --net=/run/netns/" + ns.Name
	if out := run("refuse"); !strings.Contains(out, "ip netns exec") || !strings.Contains(out, advice) || !strings.Contains(out, "vanish") {
		t.Errorf("Open under ip netns exec: %s; want the advice to run under %q, as pins would vanish", out, advice)
	}
	if out := run("mount"); !strings.Contains(out, "vanish") || !strings.Contains(out, advice) {
		t.Errorf("MountWarning of an Open that mounted bpffs under ip netns exec: %q; want it to say the pins vanish and %q", out, advice)
	}
	if ok, err := bpffs.IsBPFFS(bpffs.DefaultRoot); err != nil || !ok {
		t.Fatalf("the machine's %s is no longer bpffs (%v)", bpffs.DefaultRoot, err)
	}
	if _, err := os.Stat(filepath.Join(bpffs.DefaultRoot, "fluxvm-ipnetns")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the child's pin root reached the host's BPF filesystem: %v", err)
	}
}

// TestNoBPFFSAdvice: the advice of a missing BPF filesystem names the
// option by both its spellings on a plain host, says not to mount in a
// private mount namespace, and under `ip netns exec` to enter the
// network namespace alone (by its path when the namespace is named).
func TestNoBPFFSAdvice(t *testing.T) {
	for _, c := range []struct {
		ns        bpffs.Namespace
		want, not []string
	}{
		{bpffs.Namespace{}, []string{"mount -t bpf bpf /sys/fs/bpf", "bpf.Options.MountBPFFS", "fluxvm.Options.Loader.MountBPFFS"}, []string{"vanish", "nsenter"}},
		{bpffs.Namespace{Private: true}, []string{"not the host's", "vanishes", "fluxvm.Options.Loader.MountBPFFS"}, []string{"nsenter"}},
		{bpffs.Namespace{Private: true, IPNetnsExec: true, NetNS: "blue"}, []string{"ip netns exec", "nsenter --net=/run/netns/blue", "vanishes"}, nil},
		{bpffs.Namespace{Private: true, IPNetnsExec: true}, []string{"nsenter --net=/run/netns/NAME"}, nil},
	} {
		got := noBPFFS(c.ns)
		for _, w := range c.want {
			if !strings.Contains(got, w) {
				t.Errorf("%+v: %q lacks %q", c.ns, got, w)
			}
		}
		for _, w := range c.not {
			if strings.Contains(got, w) {
				t.Errorf("%+v: %q says %q", c.ns, got, w)
			}
		}
	}
	if w := privateMountWarning(bpffs.Namespace{}); w != "" {
		t.Errorf("a mount in the host's namespace warns %q", w)
	}
}
