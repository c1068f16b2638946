// Package lab builds throwaway network topologies for end-to-end tests: a
// node namespace that runs the datapath and VM namespaces wired to it with
// veth pairs, dual-stack, all created by the test and removed with it.
//
// Addressing: VM i has 10.200.i.2/24 and fd00:200:i::2/64 on its "eth0";
// the node side of its veth, "vm<i>" in the node namespace, has .1 / ::1
// and is the VM's default gateway. The node forwards between VMs. Nothing
// is created, attached or sent in the root namespace.
package lab

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testenv"
)

// Node is the namespace where the datapath runs.
type Node struct {
	NS  *testenv.NetNS
	nl  *netlink.Handle
	vms []*VM
}

// VM is one guest namespace, connected to the node by a veth pair.
type VM struct {
	Name         string
	NS           *testenv.NetNS
	Addr4, Addr6 netip.Addr
	// NodeIf is the node-side veth: its ingress carries what the VM
	// sends, its egress what the VM receives.
	NodeIf      string
	NodeIfIndex int
}

// NewNode creates the node namespace with forwarding on.
func NewNode(tb testing.TB) *Node {
	tb.Helper()
	ns := testenv.NewNetNS(tb, "fvnode")
	h, err := netlink.NewHandleAt(ns.Handle())
	if err != nil {
		tb.Fatalf("lab: netlink in node: %v", err)
	}
	tb.Cleanup(h.Close)
	err = ns.Do(func() error {
		return writeSysctls(map[string]string{
			"net/ipv4/ip_forward":                 "1",
			"net/ipv6/conf/all/forwarding":        "1",
			"net/ipv6/conf/default/accept_dad":    "0",
			"net/ipv6/conf/default/accept_ra":     "0",
			"net/ipv4/conf/all/rp_filter":         "0",
			"net/ipv4/conf/default/rp_filter":     "0",
			"net/ipv6/conf/all/keep_addr_on_down": "1",
		})
	})
	if err != nil {
		tb.Fatalf("lab: node sysctls: %v", err)
	}
	return &Node{NS: ns, nl: h}
}

// AddVM creates VM number idx (1..250) and wires it to the node.
func (n *Node) AddVM(tb testing.TB, idx int) *VM {
	tb.Helper()
	if idx < 1 || idx > 250 {
		tb.Fatalf("lab: VM index %d out of range", idx)
	}
	name := fmt.Sprintf("vm%d", idx)
	vns := testenv.NewNetNS(tb, "fv"+name)
	vm := &VM{
		Name:   name,
		NS:     vns,
		Addr4:  netip.MustParseAddr(fmt.Sprintf("10.200.%d.2", idx)),
		Addr6:  netip.MustParseAddr(fmt.Sprintf("fd00:200:%x::2", idx)),
		NodeIf: name,
	}
	gw4 := netip.MustParseAddr(fmt.Sprintf("10.200.%d.1", idx))
	gw6 := netip.MustParseAddr(fmt.Sprintf("fd00:200:%x::1", idx))

	// Create the pair in the node, then move the VM end into the VM.
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: vm.NodeIf}, PeerName: "eth0",
		PeerNamespace: netlink.NsFd(int(vns.Handle()))}
	if err := n.nl.LinkAdd(veth); err != nil {
		tb.Fatalf("lab: veth for %s: %v", name, err)
	}
	err := vns.Do(func() error {
		return writeSysctls(map[string]string{
			"net/ipv6/conf/default/accept_dad": "0",
			"net/ipv6/conf/eth0/accept_dad":    "0",
			"net/ipv6/conf/eth0/accept_ra":     "0",
		})
	})
	if err != nil {
		tb.Fatalf("lab: %s sysctls: %v", name, err)
	}
	vh, err := netlink.NewHandleAt(vns.Handle())
	if err != nil {
		tb.Fatalf("lab: netlink in %s: %v", name, err)
	}
	defer vh.Close()

	if err := configure(n.nl, vm.NodeIf, gw4, 24, gw6, 64, nil, nil); err != nil {
		tb.Fatalf("lab: node side of %s: %v", name, err)
	}
	if err := configure(vh, "eth0", vm.Addr4, 24, vm.Addr6, 64, &gw4, &gw6); err != nil {
		tb.Fatalf("lab: %s: %v", name, err)
	}
	if err := configure(vh, "lo", netip.Addr{}, 0, netip.Addr{}, 0, nil, nil); err != nil {
		tb.Fatalf("lab: %s lo: %v", name, err)
	}
	l, err := n.nl.LinkByName(vm.NodeIf)
	if err != nil {
		tb.Fatalf("lab: %v", err)
	}
	vm.NodeIfIndex = l.Attrs().Index
	n.vms = append(n.vms, vm)
	return vm
}

// configure brings link up with the given addresses and default routes.
func configure(h *netlink.Handle, ifname string, a4 netip.Addr, bits4 int, a6 netip.Addr, bits6 int, gw4, gw6 *netip.Addr) error {
	l, err := h.LinkByName(ifname)
	if err != nil {
		return err
	}
	for _, p := range []struct {
		a    netip.Addr
		bits int
	}{{a4, bits4}, {a6, bits6}} {
		if !p.a.IsValid() {
			continue
		}
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: p.a.AsSlice(), Mask: net.CIDRMask(p.bits, p.a.BitLen())}, Flags: unix.IFA_F_NODAD}
		if err := h.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("add %s: %w", p.a, err)
		}
	}
	if err := h.LinkSetUp(l); err != nil {
		return err
	}
	for _, gw := range []*netip.Addr{gw4, gw6} {
		if gw == nil {
			continue
		}
		r := &netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw.AsSlice()}
		if err := h.RouteAdd(r); err != nil {
			return fmt.Errorf("default route via %s: %w", gw, err)
		}
	}
	return nil
}

func writeSysctls(kv map[string]string) error {
	var errs []error
	for k, v := range kv {
		if err := os.WriteFile("/proc/sys/"+k, []byte(v), 0o644); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// SetChecksumOffload turns transmit and receive checksum offload of ifname
// in ns on or off. With offload on, sockets hand the kernel
// CHECKSUM_PARTIAL packets; with it off, checksums are computed and, on
// receive, verified in software, which is what makes a wrong checksum
// visible in a veth-only lab.
func SetChecksumOffload(ns *testenv.NetNS, ifname string, tx, rx bool) error {
	return ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		for _, c := range []struct {
			cmd uint32
			on  bool
		}{{unix.ETHTOOL_STXCSUM, tx}, {unix.ETHTOOL_SRXCSUM, rx}} {
			val := struct{ cmd, data uint32 }{c.cmd, 0}
			if c.on {
				val.data = 1
			}
			// data is an unsafe.Pointer, not a uintptr, so the
			// garbage collector keeps val alive and in place.
			var ifr struct {
				name [unix.IFNAMSIZ]byte
				data unsafe.Pointer
				_    [16]byte
			}
			copy(ifr.name[:], ifname)
			ifr.data = unsafe.Pointer(&val)
			if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); e != 0 {
				return fmt.Errorf("lab: ethtool %#x on %s: %w", c.cmd, ifname, e)
			}
		}
		return nil
	})
}
