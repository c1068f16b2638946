// Package nsutil creates, enters and deletes network namespaces. Go
// goroutines move between OS threads, so every operation that enters a
// namespace runs on a locked thread and switches back before unlocking; a
// thread that cannot switch back is left locked, and the runtime retires it
// with its goroutine instead of reusing it in the wrong namespace.
package nsutil

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"

	"github.com/vishvananda/netns"
)

// Suffix returns a short random hex string for names that must not collide
// with a parallel run or a leftover of an earlier one. Six characters keep
// interface names within the kernel's 15-byte limit.
func Suffix() string {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("nsutil: crypto/rand: %v", err))
	}
	return hex.EncodeToString(b)
}

// NS is a named network namespace (visible in `ip netns list`).
type NS struct {
	Name   string
	handle netns.NsHandle
}

// Create makes the named namespace name.
func Create(name string) (*NS, error) {
	type result struct {
		h   netns.NsHandle
		err error
	}
	done := make(chan result, 1)
	go func() {
		// NewNamed switches the calling thread into the new namespace.
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer orig.Close()
		h, err := netns.NewNamed(name)
		if serr := netns.Set(orig); serr != nil {
			if h.IsOpen() {
				h.Close()
			}
			netns.DeleteNamed(name)
			done <- result{err: fmt.Errorf("restore netns: %w", serr)}
			return
		}
		runtime.UnlockOSThread()
		done <- result{h: h, err: err}
	}()
	r := <-done
	if r.err != nil {
		return nil, fmt.Errorf("nsutil: create netns %s: %w", name, r.err)
	}
	return &NS{Name: name, handle: r.h}, nil
}

// Handle is the namespace's file handle, for netlink.NewHandleAt and the like.
func (n *NS) Handle() netns.NsHandle { return n.handle }

// Do runs fn on a locked OS thread inside the namespace and returns its
// error. fn runs on another goroutine.
func (n *NS) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("nsutil: current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(n.handle); err != nil {
			errc <- fmt.Errorf("nsutil: enter netns %s: %w", n.Name, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- fmt.Errorf("nsutil: leave netns %s: %w", n.Name, err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// DialContext dials from inside the namespace (a net.Dialer's, for an
// http.Transport whose client lives outside it); the connection keeps
// the namespace of its socket.
func (n *NS) DialContext(ctx context.Context, network, addr string) (c net.Conn, err error) {
	err = n.Do(func() error {
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// Delete closes the handle and removes the name; the namespace disappears
// once nothing else holds it.
func (n *NS) Delete() error {
	n.handle.Close()
	if err := netns.DeleteNamed(n.Name); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("nsutil: delete netns %s: %w", n.Name, err)
	}
	return nil
}

// Thread is an OS thread parked inside a fresh, unnamed network namespace.
// Work handed to Do runs there.
type Thread struct {
	work chan func()
}

// NewThread starts a Thread in a new network namespace. Stop it with Close.
func NewThread() (*Thread, error) {
	th := &Thread{work: make(chan func())}
	ready := make(chan error, 1)
	go func() {
		// Never unlocked: when this goroutine returns, the runtime
		// terminates the thread instead of reusing it elsewhere.
		runtime.LockOSThread()
		ns, err := netns.New()
		if err != nil {
			ready <- fmt.Errorf("nsutil: new netns: %w", err)
			return
		}
		defer ns.Close()
		ready <- nil
		for fn := range th.work {
			fn()
		}
	}()
	if err := <-ready; err != nil {
		return nil, err
	}
	return th, nil
}

// Do runs fn on the thread inside the namespace and waits for it.
func (th *Thread) Do(fn func()) {
	done := make(chan struct{})
	th.work <- func() {
		defer close(done)
		fn()
	}
	<-done
}

// Close ends the thread and with it the namespace.
func (th *Thread) Close() { close(th.work) }
