//go:build !linux

package main

import (
	"errors"
	"syscall"
)

// transparent: the proxy takes flows addressed to the VIP with Linux's
// IP_TRANSPARENT.
func transparent(_, _ string, _ syscall.RawConn) error {
	return errors.New("l7proxy: transparent listeners need Linux")
}
