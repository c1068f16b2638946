package policies

import (
	"fmt"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/intent"
)

// ProxyDevice resolves an L7 enforce policy's proxy interface in the
// calling thread's network namespace. The datapath hands flows over with
// bpf_redirect_peer, which only a device whose peer is in another
// namespace takes (a veth or netkit pair): anything else is refused here
// rather than dropped in silence by the kernel later.
func ProxyDevice(name string) (uint32, error) {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return 0, fmt.Errorf("interface %q: %w", name, err)
	}
	switch t := link.Type(); {
	case t != "veth" && t != "netkit":
		return 0, fmt.Errorf("interface %q is a %s device: %w: L7 enforce hands flows to the proxy's namespace through a veth (or netkit) pair",
			name, t, intent.ErrUnsupported)
	case link.Attrs().NetNsID < 0:
		return 0, fmt.Errorf("interface %q: its peer is in the same namespace: %w: the proxy's end of the pair must be in the proxy's namespace",
			name, intent.ErrUnsupported)
	}
	return uint32(link.Attrs().Index), nil
}
