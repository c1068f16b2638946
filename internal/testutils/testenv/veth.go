package testenv

import (
	"fmt"
	"os"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/internal/ethtool"
)

// VethPair creates the veth pair a <-> b in the calling thread's network
// namespace (call it inside InNetNS or NetNS.Do), with IPv6 disabled on
// both ends so that the kernel sends nothing on its own, and brings both up.
// It returns once both ends are operationally up: until the kernel's link
// watcher has run, a device still has its no-op qdisc, which silently
// drops what is sent. The pair disappears with its namespace.
func VethPair(a, b string) (netlink.Link, netlink.Link, error) {
	la := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: a}, PeerName: b}
	if err := netlink.LinkAdd(la); err != nil {
		return nil, nil, fmt.Errorf("testenv: add veth %s/%s: %w", a, b, err)
	}
	var links [2]netlink.Link
	for i, name := range []string{a, b} {
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+name+"/disable_ipv6", []byte("1"), 0o644); err != nil {
			return nil, nil, fmt.Errorf("testenv: disable ipv6 on %s: %w", name, err)
		}
		l, err := netlink.LinkByName(name)
		if err != nil {
			return nil, nil, fmt.Errorf("testenv: %w", err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return nil, nil, fmt.Errorf("testenv: set %s up: %w", name, err)
		}
		links[i] = l
	}
	for _, l := range links {
		if err := waitOperUp(l.Attrs().Index); err != nil {
			return nil, nil, err
		}
	}
	return links[0], links[1], nil
}

// waitOperUp waits (at most 5 s) until the link with ifindex is
// operationally up.
func waitOperUp(ifindex int) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		l, err := netlink.LinkByIndex(ifindex)
		if err != nil {
			return fmt.Errorf("testenv: %w", err)
		}
		if l.Attrs().OperState == netlink.OperUp {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testenv: %s not up after 5s (operstate %s)", l.Attrs().Name, l.Attrs().OperState)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// SendPlainFrames turns off the transmit offloads of the interface (in
// the calling thread's namespace) that keep state beside the frames it
// sends: VLAN tag insertion (tx-vlan-hw-insert, tx-vlan-stag-hw-insert:
// a tag is then written into the frame) and checksum offload
// (tx-checksum-ip-generic: checksums are then complete, no
// CHECKSUM_PARTIAL). On a veth, that is what its peer's XDP program
// needs to see every frame as it is (bpf.ErrXDPOffload), so the loader
// attaches XDP to the peer only when they are off. The features it
// depends on (TSO) go off with the checksum offload.
func SendPlainFrames(ifname string) error {
	return ethtool.SetFeatures(ifname, map[string]bool{
		"tx-vlan-hw-insert":      false,
		"tx-vlan-stag-hw-insert": false,
		"tx-checksum-ip-generic": false,
	})
}
