//go:build linux

package lab

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// Lab is one topology: a node namespace and the VMs wired to it. Close
// removes everything it created, in reverse order.
type Lab struct {
	Node *nsutil.NS
	VMs  []*VM
	// External is the client outside the node, behind the north-south
	// interface "uplink" (nil until AddExternal).
	External *VM
	// Remote is a host outside the node behind a second north-south
	// interface, "uplink2" (nil until AddRemote): a backend that is not a
	// VM of this node.
	Remote *VM
	suffix string
	nl     *netlink.Handle
}

// VM is one guest namespace, connected to the node by a veth pair.
type VM struct {
	Name         string
	NS           *nsutil.NS
	Addr4, Addr6 netip.Addr
	// NodeIf is the node-side veth: its ingress carries what the VM
	// sends, its egress what the VM receives.
	NodeIf      string
	NodeIfIndex int
}

// New creates the node namespace ("fvnode-<suffix>") with forwarding on.
func New() (*Lab, error) {
	l := &Lab{suffix: nsutil.Suffix()}
	ns, err := nsutil.Create("fvnode-" + l.suffix)
	if err != nil {
		return nil, fmt.Errorf("lab: %w", err)
	}
	l.Node = ns
	if l.nl, err = netlink.NewHandleAt(ns.Handle()); err != nil {
		l.Close()
		return nil, fmt.Errorf("lab: netlink in node: %w", err)
	}
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
		l.Close()
		return nil, fmt.Errorf("lab: node sysctls: %w", err)
	}
	if err := configure(l.nl, "lo", netip.Addr{}, 0, netip.Addr{}, 0, nil, nil); err != nil {
		l.Close()
		return nil, fmt.Errorf("lab: node lo: %w", err)
	}
	return l, nil
}

// NewForTest is New for a test: it skips (or fails) without privileges and
// closes the lab when the test ends.
func NewForTest(tb testing.TB) *Lab {
	tb.Helper()
	testenv.RequirePrivileged(tb)
	l, err := New()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := l.Close(); err != nil {
			tb.Errorf("lab: %v", err)
		}
	})
	return l
}

// Close deletes every namespace of the lab (the veths go with them).
func (l *Lab) Close() error {
	var errs []error
	if l.External != nil {
		errs = append(errs, l.External.NS.Delete())
		l.External = nil
	}
	if l.Remote != nil {
		errs = append(errs, l.Remote.NS.Delete())
		l.Remote = nil
	}
	for i := len(l.VMs) - 1; i >= 0; i-- {
		errs = append(errs, l.VMs[i].NS.Delete())
	}
	l.VMs = nil
	if l.nl != nil {
		l.nl.Close()
		l.nl = nil
	}
	if l.Node != nil {
		errs = append(errs, l.Node.Delete())
		l.Node = nil
	}
	return errors.Join(errs...)
}

// AddVM creates VM number idx (1..250) and wires it to the node.
func (l *Lab) AddVM(idx int) (*VM, error) {
	if idx < 1 || idx > 250 {
		return nil, fmt.Errorf("lab: VM index %d out of range", idx)
	}
	name := fmt.Sprintf("vm%d", idx)
	vm, err := l.wire(name, name,
		netip.MustParseAddr(fmt.Sprintf("10.200.%d.2", idx)), netip.MustParseAddr(fmt.Sprintf("10.200.%d.1", idx)),
		netip.MustParseAddr(fmt.Sprintf("fd00:200:%x::2", idx)), netip.MustParseAddr(fmt.Sprintf("fd00:200:%x::1", idx)))
	if vm != nil {
		l.VMs = append(l.VMs, vm)
	}
	return vm, err
}

// AddExternal creates the external client "ext" behind the node's
// north-south interface "uplink" (10.250.0.2 / fd00:250::2).
func (l *Lab) AddExternal() (*VM, error) {
	vm, err := l.wire("ext", "uplink",
		netip.MustParseAddr("10.250.0.2"), netip.MustParseAddr("10.250.0.1"),
		netip.MustParseAddr("fd00:250::2"), netip.MustParseAddr("fd00:250::1"))
	if vm != nil {
		l.External = vm
	}
	return vm, err
}

// AddRemote creates the host "far" behind the node's second north-south
// interface "uplink2" (10.251.0.2 / fd00:251::2), for backends that are not
// VMs of this node: their replies reach the node through uplink2.
func (l *Lab) AddRemote() (*VM, error) {
	vm, err := l.wire("far", "uplink2",
		netip.MustParseAddr("10.251.0.2"), netip.MustParseAddr("10.251.0.1"),
		netip.MustParseAddr("fd00:251::2"), netip.MustParseAddr("fd00:251::1"))
	if vm != nil {
		l.Remote = vm
	}
	return vm, err
}

// wire creates the namespace of a guest and its veth pair to the node:
// nodeIf in the node, eth0 in the guest, with addresses and default routes.
// On error the namespace is returned too, so that Close removes it.
func (l *Lab) wire(name, nodeIf string, addr4, gw4, addr6, gw6 netip.Addr) (*VM, error) {
	vns, err := nsutil.Create(fmt.Sprintf("fv%s-%s", name, l.suffix))
	if err != nil {
		return nil, fmt.Errorf("lab: %w", err)
	}
	vm := &VM{Name: name, NS: vns, Addr4: addr4, Addr6: addr6, NodeIf: nodeIf}

	// Create the pair in the node, with the guest end born in the guest.
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: nodeIf}, PeerName: "eth0",
		PeerNamespace: netlink.NsFd(int(vns.Handle()))}
	if err := l.nl.LinkAdd(veth); err != nil {
		return vm, fmt.Errorf("lab: veth for %s: %w", name, err)
	}
	err = vns.Do(func() error {
		return writeSysctls(map[string]string{
			"net/ipv6/conf/default/accept_dad": "0",
			"net/ipv6/conf/eth0/accept_dad":    "0",
			"net/ipv6/conf/eth0/accept_ra":     "0",
		})
	})
	if err != nil {
		return vm, fmt.Errorf("lab: %s sysctls: %w", name, err)
	}
	vh, err := netlink.NewHandleAt(vns.Handle())
	if err != nil {
		return vm, fmt.Errorf("lab: netlink in %s: %w", name, err)
	}
	defer vh.Close()

	if err := configure(l.nl, nodeIf, gw4, 24, gw6, 64, nil, nil); err != nil {
		return vm, fmt.Errorf("lab: node side of %s: %w", name, err)
	}
	if err := configure(vh, "eth0", addr4, 24, addr6, 64, &gw4, &gw6); err != nil {
		return vm, fmt.Errorf("lab: %s: %w", name, err)
	}
	if err := configure(vh, "lo", netip.Addr{}, 0, netip.Addr{}, 0, nil, nil); err != nil {
		return vm, fmt.Errorf("lab: %s lo: %w", name, err)
	}
	// The kernel marks a veth's carrier up through linkwatch, which may
	// run up to a second after the link was set up (longer on a loaded
	// machine), and IPv6 on a link is not ready before that: a neighbour
	// solicitation arriving earlier goes unanswered, and the next one is
	// a second later. Wait until both ends are ready, so the first
	// connection over the link is not a test of linkwatch.
	for _, e := range []struct {
		h    *netlink.Handle
		name string
	}{{l.nl, nodeIf}, {vh, "eth0"}} {
		if err := waitLinkReady(e.h, e.name, linkReadyTimeout); err != nil {
			return vm, fmt.Errorf("lab: %s: %w", name, err)
		}
	}
	link, err := l.nl.LinkByName(nodeIf)
	if err != nil {
		return vm, fmt.Errorf("lab: %w", err)
	}
	vm.NodeIfIndex = link.Attrs().Index
	return vm, nil
}

// linkReadyTimeout bounds waitLinkReady: linkwatch runs within a second,
// so this leaves room for a loaded machine.
const linkReadyTimeout = 10 * time.Second

// waitLinkReady waits until ifname is operationally up and IPv6 on it is
// ready: it holds a link-local address that is no longer tentative
// (addrconf adds it only once the carrier is seen).
func waitLinkReady(h *netlink.Handle, ifname string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ready, err := linkReady(h, ifname)
		if err != nil || ready {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not up with a usable IPv6 link-local address within %v", ifname, timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func linkReady(h *netlink.Handle, ifname string) (bool, error) {
	link, err := h.LinkByName(ifname)
	if err != nil {
		return false, err
	}
	if link.Attrs().OperState != netlink.OperUp {
		return false, nil
	}
	addrs, err := h.AddrList(link, netlink.FAMILY_V6)
	if err != nil {
		return false, fmt.Errorf("%s: addresses: %w", ifname, err)
	}
	for _, a := range addrs {
		if a.IP.IsLinkLocalUnicast() && a.Flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_DADFAILED) == 0 {
			return true, nil
		}
	}
	return false, nil
}

// Describe prints the topology: namespaces, interfaces and addresses.
func (l *Lab) Describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "node     netns %-16s forwards between the interfaces below\n", l.Node.Name)
	for _, vm := range append(slices.Clone(l.VMs), l.External, l.Remote) {
		if vm == nil {
			continue
		}
		fmt.Fprintf(&b, "%-8s netns %-16s eth0 %-12s %-16s <-> node %s (ifindex %d)\n",
			vm.Name, vm.NS.Name, vm.Addr4, vm.Addr6, vm.NodeIf, vm.NodeIfIndex)
	}
	return b.String()
}

// AddLocalAddress assigns a (a host address: /32 or /128) to the VM's
// loopback, as a backend behind routed DSR holds the VIP: it accepts
// packets addressed to the VIP and answers from it, while the node still
// reaches it by its own address.
func (vm *VM) AddLocalAddress(a netip.Addr) error {
	h, err := netlink.NewHandleAt(vm.NS.Handle())
	if err != nil {
		return fmt.Errorf("lab: netlink in %s: %w", vm.Name, err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("lab: %s: %w", vm.Name, err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}, Flags: unix.IFA_F_NODAD}
	if err := h.AddrAdd(lo, addr); err != nil {
		return fmt.Errorf("lab: %s: add %s to lo: %w", vm.Name, a, err)
	}
	return nil
}

// AddVMForTest is AddVM that fails the test on error.
func (l *Lab) AddVMForTest(tb testing.TB, idx int) *VM {
	tb.Helper()
	vm, err := l.AddVM(idx)
	if err != nil {
		tb.Fatal(err)
	}
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
func SetChecksumOffload(ns *nsutil.NS, ifname string, tx, rx bool) error {
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

// SendPlainFrames turns off the transmit offloads of ifname in ns that
// keep state beside its frames (testenv.SendPlainFrames: VLAN tag
// insertion and checksum offload), so that an XDP program on its veth
// peer sees every frame as it is, and FluxVM's loader attaches XDP there
// (bpf.ErrXDPOffload).
func SendPlainFrames(ns *nsutil.NS, ifname string) error {
	return ns.Do(func() error { return testenv.SendPlainFrames(ifname) })
}
