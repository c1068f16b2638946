package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"

	"github.com/fluxvm/servicefabric/internal/bpffs"
)

// Suffix returns a short random hex string for names that must not collide
// with a parallel run or a leftover of an earlier one. Six characters keep
// interface names within the kernel's 15-byte limit.
func Suffix() string {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("testenv: crypto/rand: %v", err))
	}
	return hex.EncodeToString(b)
}

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
type NetNS struct {
	Name   string
	handle netns.NsHandle
}

// NewNetNS creates the named namespace "<prefix>-<suffix>" and deletes it
// when the test ends.
func NewNetNS(tb testing.TB, prefix string) *NetNS {
	tb.Helper()
	RequirePrivileged(tb)
	name := prefix + "-" + Suffix()
	type result struct {
		h   netns.NsHandle
		err error
	}
	done := make(chan result, 1)
	go func() {
		// NewNamed switches the calling thread into the new namespace;
		// this thread is thrown away unless it can be switched back.
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer orig.Close()
		h, err := netns.NewNamed(name)
		if serr := netns.Set(orig); serr != nil {
			done <- result{h: h, err: fmt.Errorf("restore netns: %w", serr)}
			return
		}
		runtime.UnlockOSThread()
		done <- result{h: h, err: err}
	}()
	r := <-done
	n := &NetNS{Name: name, handle: r.h}
	if r.h.IsOpen() || r.err == nil {
		tb.Cleanup(func() {
			n.handle.Close()
			if err := netns.DeleteNamed(name); err != nil && !os.IsNotExist(err) {
				tb.Errorf("testenv: delete netns %s: %v", name, err)
			}
		})
	}
	if r.err != nil {
		tb.Fatalf("testenv: create netns %s: %v", name, r.err)
	}
	return n
}

// Handle is the namespace's file handle, for netlink.NewHandleAt and the like.
func (n *NetNS) Handle() netns.NsHandle { return n.handle }

// Do runs fn on a locked OS thread inside the namespace and returns its
// error. fn runs on another goroutine, so it must not call t.Fatal.
func (n *NetNS) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("testenv: current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(n.handle); err != nil {
			errc <- fmt.Errorf("testenv: enter netns %s: %w", n.Name, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- fmt.Errorf("testenv: leave netns %s: %w", n.Name, err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// PinRoot creates a private directory on bpffs for one test's pins and
// removes it, with everything pinned below, when the test ends.
func PinRoot(tb testing.TB) string {
	tb.Helper()
	RequirePrivileged(tb)
	if err := bpffs.Ensure(bpffs.DefaultRoot); err != nil {
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

// Thread is an OS thread parked inside a fresh, unnamed network namespace.
// Work handed to Do runs there, so subtests on other goroutines can still
// act inside the test's namespace. The thread is retired when the test
// ends and the namespace disappears with it.
type Thread struct {
	work chan func()
}

// NewThread starts a Thread in a new network namespace.
func NewThread(tb testing.TB) *Thread {
	tb.Helper()
	RequirePrivileged(tb)
	th := &Thread{work: make(chan func())}
	ready := make(chan error, 1)
	go func() {
		// Never unlocked: when this goroutine returns, the runtime
		// terminates the thread instead of reusing it elsewhere.
		runtime.LockOSThread()
		ns, err := netns.New()
		if err != nil {
			ready <- fmt.Errorf("testenv: new netns: %w", err)
			return
		}
		defer ns.Close()
		ready <- nil
		for fn := range th.work {
			fn()
		}
	}()
	if err := <-ready; err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { close(th.work) })
	return th
}

// Do runs fn on the thread inside the namespace and waits for it. fn runs
// on another goroutine, so it must not call t.Fatal.
func (th *Thread) Do(fn func()) {
	done := make(chan struct{})
	th.work <- func() {
		defer close(done)
		fn()
	}
	<-done
}
