package bpf

import (
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// ErrSockDestroyUnsupported reports a kernel that cannot terminate sockets
// from BPF (bpf_sock_destroy, Linux 6.5): connected UDP sockets of socket
// load balancing then keep a backend that went away until their
// application connects again.
var ErrSockDestroyUnsupported = errors.New("the kernel cannot terminate sockets from BPF (bpf_sock_destroy needs Linux 6.5)")

// SockDestroyObjectName is the file name of the socket iterator object as
// operators install it (one build for every tier).
const SockDestroyObjectName = "fluxvm_sock_destroy.bpf.o"

// DestroyStaleUDPSockets terminates the connected UDP sockets of the
// calling thread's network namespace that socket load balancing connected
// to a backend that may no longer serve them (Unhealthy, removed, past its
// drain deadline), and returns how many. Each is disconnected with
// ECONNABORTED as its pending error (its next send fails with
// EDESTADDRREQ), and its application connects again, to a fresh pick. A connected socket's
// sends carry no address, so no socket hook can re-pick for it: this is
// the only way off a dead backend. Call it after backends change state or
// go away. On a kernel before 6.5 it fails with ErrSockDestroyUnsupported
// and changes nothing.
//
// The iterator is loaded at the first call (not at Open: the socket hooks
// must load on kernels without it) and kept until Close.
func (d *Datapath) DestroyStaleUDPSockets() (int, error) {
	d.live.RLock()
	defer d.live.RUnlock()
	if d.coll == nil {
		return 0, ErrClosed
	}
	d.sd.Lock()
	defer d.sd.Unlock()
	if d.sd.prog == nil {
		c, err := loadSide(d.opts, d.coll, "socket iterator",
			func(Tier) (*ebpf.CollectionSpec, error) { return loadSockDestroy() },
			func(Tier) string { return SockDestroyObjectName })
		if err != nil {
			// cilium/ebpf reports a kfunc the kernel lacks as not
			// supported.
			if errors.Is(err, ebpf.ErrNotSupported) {
				return 0, fmt.Errorf("bpf: destroy stale UDP sockets: %w (%v)", ErrSockDestroyUnsupported, err)
			}
			return 0, fmt.Errorf("bpf: destroy stale UDP sockets: %w", err)
		}
		d.sd.coll, d.sd.prog = c, c.Programs["fluxvm_sock_destroy_udp"]
	}
	l, err := link.AttachIter(link.IterOptions{Program: d.sd.prog})
	if err != nil {
		return 0, fmt.Errorf("bpf: destroy stale UDP sockets: attach the iterator: %w", err)
	}
	defer l.Close()
	r, err := l.Open()
	if err != nil {
		return 0, fmt.Errorf("bpf: destroy stale UDP sockets: open the iterator: %w", err)
	}
	defer r.Close()
	// One byte per socket destroyed.
	n, err := io.Copy(io.Discard, r)
	if err != nil {
		return int(n), fmt.Errorf("bpf: destroy stale UDP sockets: %w", err)
	}
	return int(n), nil
}

// sockDestroy is the socket iterator, loaded at first use.
type sockDestroy = sideProgram

// sideProgram is a program of a side object (side.go) the datapath loads
// at its first use and keeps until Close.
type sideProgram struct {
	sync.Mutex
	coll *ebpf.Collection
	prog *ebpf.Program
	err  error // a load the kernel cannot do, not retried
}

func (s *sideProgram) close() {
	s.Lock()
	defer s.Unlock()
	if s.coll != nil {
		s.coll.Close()
		s.coll, s.prog = nil, nil
	}
}
