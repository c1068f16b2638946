package main

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// transparent marks a listening socket IP_TRANSPARENT (both families): it
// accepts connections addressed to the VIP, which is no address of the
// proxy's namespace, and answers from it (as Envoy's transparent
// listeners do). It needs CAP_NET_ADMIN.
func transparent(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		if serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1); serr != nil {
			return
		}
		serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
	})
	if err != nil {
		return err
	}
	return serr
}
