package testenv

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"

	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// Suffix returns a short random hex string for names (see nsutil.Suffix).
func Suffix() string { return nsutil.Suffix() }

// InNetNS runs fn on the test goroutine after moving its OS thread into a
// fresh, unnamed network namespace, and moves it back afterwards. The
// namespace disappears with its last reference. fn may call t.Fatal: the
// thread is restored on the way out either way.
//
// Goroutines that fn starts do not inherit the namespace.
func InNetNS(tb testing.TB, fn func()) {
	tb.Helper()
	RequirePrivileged(tb)
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		tb.Fatalf("testenv: current netns: %v", err)
	}
	ns, err := netns.New()
	if err != nil {
		orig.Close()
		runtime.UnlockOSThread()
		tb.Fatalf("testenv: new netns: %v", err)
	}
	defer func() {
		ns.Close()
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: the runtime retires it with the
			// goroutine instead of reusing a thread in the wrong namespace.
			orig.Close()
			tb.Errorf("testenv: restore netns: %v", err)
			return
		}
		orig.Close()
		runtime.UnlockOSThread()
	}()
	fn()
}

// NetNS is a named network namespace that one test created and owns.
type NetNS = nsutil.NS

// NewNetNS creates the named namespace "<prefix>-<suffix>" and deletes it
// when the test ends.
func NewNetNS(tb testing.TB, prefix string) *NetNS {
	tb.Helper()
	RequirePrivileged(tb)
	ns, err := nsutil.Create(prefix + "-" + Suffix())
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(func() {
		if err := ns.Delete(); err != nil {
			tb.Errorf("testenv: %v", err)
		}
	})
	return ns
}

// PinRoot creates a private directory on bpffs for one test's pins and
// removes it, with everything pinned below, when the test ends.
func PinRoot(tb testing.TB) string {
	tb.Helper()
	RequirePrivileged(tb)
	if _, err := bpffs.Ensure(bpffs.DefaultRoot); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	dir := filepath.Join(bpffs.DefaultRoot, "fluxvm-test-"+Suffix())
	if err := os.Mkdir(dir, 0o700); err != nil {
		tb.Fatalf("testenv: pin root: %v", err)
	}
	tb.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			tb.Errorf("testenv: remove pin root %s: %v", dir, err)
		}
	})
	return dir
}

// Thread is an OS thread parked inside a fresh, unnamed network namespace
// (see nsutil.Thread).
type Thread = nsutil.Thread

// NewThread starts a Thread in a new network namespace; it ends with the
// test.
func NewThread(tb testing.TB) *Thread {
	tb.Helper()
	RequirePrivileged(tb)
	th, err := nsutil.NewThread()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(th.Close)
	return th
}
