//go:build !linux

package testenv

import (
	"errors"
	"testing"
)

// RawSocket sends whole Ethernet frames out of one interface: Linux only.
type RawSocket struct{}

// NewRawSocket skips the test: packet sockets are Linux's.
func NewRawSocket(tb testing.TB, ifindex int) *RawSocket {
	tb.Helper()
	tb.Skip("testenv: packet sockets need Linux")
	return nil
}

// Send is never reached (NewRawSocket skipped the test).
func (s *RawSocket) Send(frame []byte) error { return errors.ErrUnsupported }
