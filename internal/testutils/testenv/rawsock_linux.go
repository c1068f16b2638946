//go:build linux

package testenv

import (
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// RawSocket is an AF_PACKET socket that sends whole Ethernet frames, as they
// are, out of one interface.
type RawSocket struct {
	fd      int
	ifindex int
}

// NewRawSocket opens a raw packet socket on ifindex in the calling thread's
// namespace; it is closed when the test ends.
func NewRawSocket(tb testing.TB, ifindex int) *RawSocket {
	tb.Helper()
	// Protocol 0: send only, nothing is queued for reading.
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		tb.Fatalf("testenv: packet socket: %v", err)
	}
	tb.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: ifindex}); err != nil {
		tb.Fatalf("testenv: bind packet socket: %v", err)
	}
	return &RawSocket{fd: fd, ifindex: ifindex}
}

// Send transmits frame unchanged.
func (s *RawSocket) Send(frame []byte) error {
	if err := unix.Sendto(s.fd, frame, 0, &unix.SockaddrLinklayer{Ifindex: s.ifindex, Halen: 6}); err != nil {
		return fmt.Errorf("testenv: send %d bytes: %w", len(frame), err)
	}
	return nil
}
