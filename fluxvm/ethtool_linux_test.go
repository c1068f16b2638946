//go:build linux

package fluxvm

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// setTxChecksum turns the transmit checksum offload of an interface of
// the calling thread's namespace on or off (ethtool -K <name> tx on|off),
// without the ethtool binary.
func setTxChecksum(name string, on bool) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	value := struct{ cmd, data uint32 }{cmd: unix.ETHTOOL_STXCSUM}
	if on {
		value.data = 1
	}
	// struct ifreq with ifr_data pointing at the ethtool_value.
	var ifr struct {
		name [unix.IFNAMSIZ]byte
		data unsafe.Pointer
		_    [40 - unix.IFNAMSIZ - unsafe.Sizeof(uintptr(0))]byte
	}
	copy(ifr.name[:], name)
	ifr.data = unsafe.Pointer(&value)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); errno != 0 {
		return fmt.Errorf("ethtool -K %s tx: %w", name, errno)
	}
	return nil
}
