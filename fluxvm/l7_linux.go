package fluxvm

import (
	"fmt"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/intent"
)

// proxyIfindex resolves an L7 enforce policy's proxy interface. The
// datapath hands flows over with bpf_redirect_peer, which only a device
// with a peer in another namespace (veth, netkit) takes: anything else is
// refused here rather than dropped in silence by the kernel later.
func proxyIfindex(name string) (uint32, error) {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return 0, fmt.Errorf("interface %q: %w", name, err)
	}
	switch t := link.Type(); t {
	case "veth", "netkit":
		return uint32(link.Attrs().Index), nil
	default:
		return 0, fmt.Errorf("interface %q is a %s device: %w: L7 enforce hands flows to the proxy's namespace through a veth (or netkit) pair",
			name, t, intent.ErrUnsupported)
	}
}
