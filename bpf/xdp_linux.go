//go:build linux

package bpf

import (
	"fmt"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
)

// xdpOnInterface returns the id of the XDP program attached to the
// interface (0: none) and its mode, as the kernel reports them over
// netlink.
func xdpOnInterface(index int) (uint32, XDPMode, error) {
	l, err := netlink.LinkByIndex(index)
	if err != nil {
		return 0, XDPOff, fmt.Errorf("interface %d: %w", index, err)
	}
	x := l.Attrs().Xdp
	if x == nil || !x.Attached || x.ProgId == 0 {
		return 0, XDPOff, nil
	}
	switch x.AttachMode {
	case nl.XDP_ATTACHED_DRV:
		return x.ProgId, XDPNative, nil
	case nl.XDP_ATTACHED_SKB:
		return x.ProgId, XDPGeneric, nil
	case nl.XDP_ATTACHED_HW:
		return x.ProgId, "offload", nil
	}
	return x.ProgId, "multi", nil
}
