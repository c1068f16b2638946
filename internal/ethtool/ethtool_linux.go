package ethtool

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	ethSSFeatures = 4  // ETH_SS_FEATURES, the string set of feature names
	gstringLen    = 32 // ETH_GSTRING_LEN
)

// Features reports every feature of the interface (in the calling
// thread's network namespace) by its kernel name: ETHTOOL_GSSET_INFO
// for their number, ETHTOOL_GSTRINGS for their names, ETHTOOL_GFEATURES
// for their state.
func Features(ifname string) (map[string]Feature, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("ethtool: features of %s: %w", ifname, err)
	}
	defer unix.Close(fd)
	names, err := featureNames(fd, ifname)
	if err != nil {
		return nil, fmt.Errorf("ethtool: features of %s: %w", ifname, err)
	}
	blocks := (len(names) + 31) / 32
	// struct ethtool_gfeatures: cmd, size, then per 32 features the
	// words available, requested, active, never_changed.
	buf := make([]uint32, 2+4*blocks)
	buf[0], buf[1] = unix.ETHTOOL_GFEATURES, uint32(blocks)
	if err := ioctl(fd, ifname, unsafe.Pointer(&buf[0])); err != nil {
		return nil, fmt.Errorf("ethtool: features of %s: ETHTOOL_GFEATURES: %w", ifname, err)
	}
	out := make(map[string]Feature, len(names))
	for i, name := range names {
		b, bit := buf[2+4*(i/32):], uint32(1)<<(i%32)
		out[name] = Feature{
			Requested: b[1]&bit != 0,
			Active:    b[2]&bit != 0,
			Fixed:     b[0]&bit == 0 || b[3]&bit != 0,
		}
	}
	return out, nil
}

// SetFeatures turns the named features of the interface on (true) or off
// (false), as ethtool -K does (ETHTOOL_SFEATURES). A name the kernel does
// not know is ErrUnknownFeature and changes nothing. The kernel may keep a
// feature from following (a fixed one, or one whose dependency is off):
// read Features to see what is in force.
func SetFeatures(ifname string, want map[string]bool) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("ethtool: set features of %s: %w", ifname, err)
	}
	defer unix.Close(fd)
	names, err := featureNames(fd, ifname)
	if err != nil {
		return fmt.Errorf("ethtool: set features of %s: %w", ifname, err)
	}
	blocks := (len(names) + 31) / 32
	// struct ethtool_sfeatures: cmd, size, then per 32 features the
	// words valid and requested.
	buf := make([]uint32, 2+2*blocks)
	buf[0], buf[1] = unix.ETHTOOL_SFEATURES, uint32(blocks)
	for name, on := range want {
		i := slices.Index(names, name)
		if i < 0 {
			return fmt.Errorf("ethtool: set features of %s: %q: %w", ifname, name, ErrUnknownFeature)
		}
		b, bit := buf[2+2*(i/32):], uint32(1)<<(i%32)
		b[0] |= bit
		if on {
			b[1] |= bit
		}
	}
	if err := ioctl(fd, ifname, unsafe.Pointer(&buf[0])); err != nil {
		return fmt.Errorf("ethtool: set features of %s: ETHTOOL_SFEATURES: %w", ifname, err)
	}
	return nil
}

// featureNames returns the interface's feature names in bit order.
func featureNames(fd int, ifname string) ([]string, error) {
	// struct ethtool_sset_info: cmd, reserved, sset_mask, then one
	// count per set asked for.
	info := struct {
		cmd, reserved uint32
		mask          uint64
		count         uint32
	}{cmd: unix.ETHTOOL_GSSET_INFO, mask: 1 << ethSSFeatures}
	if err := ioctl(fd, ifname, unsafe.Pointer(&info)); err != nil {
		return nil, fmt.Errorf("ETHTOOL_GSSET_INFO: %w", err)
	}
	if info.mask&(1<<ethSSFeatures) == 0 || info.count == 0 || info.count > 4096 {
		return nil, fmt.Errorf("ETHTOOL_GSSET_INFO: %d feature names", info.count)
	}
	n := int(info.count)
	// struct ethtool_gstrings: cmd, string_set, len, then the strings.
	buf := make([]byte, 12+n*gstringLen)
	binary.NativeEndian.PutUint32(buf[0:], unix.ETHTOOL_GSTRINGS)
	binary.NativeEndian.PutUint32(buf[4:], ethSSFeatures)
	binary.NativeEndian.PutUint32(buf[8:], uint32(n))
	if err := ioctl(fd, ifname, unsafe.Pointer(&buf[0])); err != nil {
		return nil, fmt.Errorf("ETHTOOL_GSTRINGS: %w", err)
	}
	names := make([]string, n)
	for i := range names {
		s := buf[12+i*gstringLen : 12+(i+1)*gstringLen]
		if j := bytes.IndexByte(s, 0); j >= 0 {
			s = s[:j]
		}
		names[i] = string(s)
	}
	return names, nil
}

// ioctl issues SIOCETHTOOL on the interface with data as ifr_data. data
// is an unsafe.Pointer in the request, not a uintptr, so the garbage
// collector keeps what it points to alive and in place.
func ioctl(fd int, ifname string, data unsafe.Pointer) error {
	if len(ifname) >= unix.IFNAMSIZ {
		return fmt.Errorf("interface name %q too long", ifname)
	}
	var ifr struct {
		name [unix.IFNAMSIZ]byte
		data unsafe.Pointer
		_    [24 - unsafe.Sizeof(uintptr(0))]byte
	}
	copy(ifr.name[:], ifname)
	ifr.data = data
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); e != 0 {
		return e
	}
	return nil
}
