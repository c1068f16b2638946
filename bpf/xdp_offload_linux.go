//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/ethtool"
)

// Features by kernel name (ethtool -k). On receive, a driver with
// rx-vlan-hw-parse (802.1Q) or rx-vlan-stag-hw-parse (802.1ad) takes the
// tag out of the frame before XDP runs. A veth passes its peer's skbs
// on: a tag the peer's transmit path left beside the frame (tx-vlan-*
// -hw-insert on the peer) stays beside it, and a checksum the peer's
// stack left to the device (tx-checksum-* on the peer) arrives as
// CHECKSUM_PARTIAL; the veth's own rx-vlan-hw-parse changes neither.
var (
	rxVLANFeatures  = []string{"rx-vlan-hw-parse", "rx-vlan-stag-hw-parse"}
	txVLANFeatures  = []string{"tx-vlan-hw-insert", "tx-vlan-stag-hw-insert"}
	txCsumFeatures  = []string{"tx-checksum-ip-generic", "tx-checksum-ipv4", "tx-checksum-ipv6"}
	runNetnsDir     = "/run/netns"
	procDir         = "/proc"
	errPeerNotFound = errors.New("no network namespace of this process's view has that nsid")
)

// xdpOffloadProblem fails with ErrXDPOffload when the interface (in the
// calling thread's namespace) hands XDP frames that the program would
// misread: a frame whose VLAN tag is kept beside it reads as untagged
// (XDP would translate it and send it without its tag), and a
// CHECKSUM_PARTIAL frame holds only the pseudo-header sum, which the
// program patches as a full checksum. XDP sees neither state. The
// error names the offload and how to turn it off.
func xdpOffloadProblem(name string, index int) error {
	l, err := netlink.LinkByIndex(index)
	if err != nil {
		return fmt.Errorf("bpf: attach xdp on %s: %w", name, err)
	}
	if l.Type() == "veth" {
		return vethPeerProblem(name, l.Attrs())
	}
	f, err := ethtool.Features(name)
	if err != nil {
		return fmt.Errorf("bpf: attach xdp on %s: read its offloads: %w", name, err)
	}
	return rxOffloadProblem(name, f)
}

// rxOffloadProblem is the verdict on an interface that is no veth, by its
// features f.
func rxOffloadProblem(name string, f map[string]ethtool.Feature) error {
	on := activeFeatures(f, rxVLANFeatures)
	if len(on) == 0 {
		return nil
	}
	return fmt.Errorf("bpf: attach xdp on %s: its driver takes VLAN tags out of the frames it receives (%s on), so XDP would read a tagged frame as an untagged one and could send it on without its tag; %s, or set xdp_mode off: %w",
		name, strings.Join(on, ", "), wayOut(name, f, on, ""), ErrXDPOffload)
}

// vethPeerProblem is xdpOffloadProblem for a veth: its peer's transmit
// offloads decide what XDP sees.
func vethPeerProblem(name string, a *netlink.LinkAttrs) error {
	var (
		peer string
		f    map[string]ethtool.Feature
	)
	read := func() error {
		pl, err := netlink.LinkByIndex(a.ParentIndex)
		if err != nil {
			return err
		}
		peer = pl.Attrs().Name
		f, err = ethtool.Features(peer)
		return err
	}
	where := "in the same namespace"
	var err error
	if a.ParentIndex <= 0 {
		err = errors.New("the kernel reports no peer")
	} else if a.NetNsID < 0 {
		err = read()
	} else {
		where = fmt.Sprintf("in the namespace with nsid %d", a.NetNsID)
		err = inNetNSID(a.NetNsID, read)
	}
	if err != nil {
		return fmt.Errorf("bpf: attach xdp on %s: cannot read the offloads of its veth peer (ifindex %d %s), which decide whether XDP sees VLAN tags and complete checksums: %v; set xdp_mode off: %w",
			name, a.ParentIndex, where, err, ErrXDPOffload)
	}
	return peerOffloadProblem(name, peer, fmt.Sprintf("ifindex %d %s", a.ParentIndex, where), f)
}

// peerOffloadProblem is the verdict on a veth by the features f of its
// peer (peer, described by where).
func peerOffloadProblem(name, peer, where string, f map[string]ethtool.Feature) error {
	tags, sums := activeFeatures(f, txVLANFeatures), activeFeatures(f, txCsumFeatures)
	if len(tags)+len(sums) == 0 {
		return nil
	}
	var why []string
	if len(tags) > 0 {
		why = append(why, fmt.Sprintf("keeps the VLAN tags of what it sends beside the frames (%s on), so XDP would read a tagged frame as an untagged one and could send it on without its tag", strings.Join(tags, ", ")))
	}
	if len(sums) > 0 {
		why = append(why, fmt.Sprintf("leaves the TCP/UDP checksums of what it sends to the receiver (%s on: CHECKSUM_PARTIAL frames, which hold only the pseudo-header sum), so the frames XDP translates would carry wrong checksums", strings.Join(sums, ", ")))
	}
	return fmt.Errorf("bpf: attach xdp on %s: its veth peer %s (%s) %s; %s, or set xdp_mode off: %w",
		name, peer, where, strings.Join(why, ", and "), wayOut(peer, f, append(tags, sums...), " in the peer's namespace"), ErrXDPOffload)
}

// activeFeatures returns the names in f that are in force.
func activeFeatures(f map[string]ethtool.Feature, names []string) []string {
	var on []string
	for _, n := range names {
		if f[n].Active {
			on = append(on, n)
		}
	}
	return on
}

// wayOut says how to turn the features on of the interface name off, or
// that its driver cannot.
func wayOut(name string, f map[string]ethtool.Feature, on []string, where string) string {
	var fixed []string
	cmd := "ethtool -K " + name
	for _, n := range on {
		if f[n].Fixed {
			fixed = append(fixed, n)
		}
		cmd += " " + n + " off"
	}
	if len(fixed) > 0 {
		return fmt.Sprintf("the driver of %s cannot turn %s off", name, strings.Join(fixed, ", "))
	}
	return fmt.Sprintf("turn it off (%s%s)", cmd, where)
}

// inNetNSID runs fn on a locked OS thread inside the network namespace
// that has the id nsid in the calling thread's namespace (a veth's
// link-netnsid). It looks among the named namespaces (/run/netns) and
// those of this process's view's processes (/proc/<pid>/ns/net).
func inNetNSID(nsid int, fn func() error) error {
	target, err := netnsByID(nsid)
	if err != nil {
		return err
	}
	defer target.Close()
	if err := inNetNS(target, fn); err != nil {
		return fmt.Errorf("netnsid %d: %w", nsid, err)
	}
	return nil
}

// inNetNS runs fn on a locked OS thread inside the namespace target, and
// moves the thread back (a thread that cannot move back stays locked:
// the runtime retires it with its goroutine).
func inNetNS(target netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			errc <- fmt.Errorf("enter: %w", err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- fmt.Errorf("leave: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// netnsByID opens the namespace with the id nsid (see inNetNSID).
func netnsByID(nsid int) (netns.NsHandle, error) {
	var paths []string
	if ents, err := os.ReadDir(runNetnsDir); err == nil {
		for _, e := range ents {
			paths = append(paths, filepath.Join(runNetnsDir, e.Name()))
		}
	}
	if ents, err := os.ReadDir(procDir); err == nil {
		for _, e := range ents {
			if n := e.Name(); n != "" && strings.Trim(n, "0123456789") == "" {
				paths = append(paths, filepath.Join(procDir, n, "ns", "net"))
			}
		}
	}
	seen := map[uint64]bool{}
	for _, p := range paths {
		h, err := netns.GetFromPath(p)
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if unix.Fstat(int(h), &st) != nil || seen[st.Ino] {
			h.Close()
			continue
		}
		seen[st.Ino] = true
		if id, err := netlink.GetNetNsIdByFd(int(h)); err == nil && id == nsid {
			return h, nil
		}
		h.Close()
	}
	return netns.None(), fmt.Errorf("netnsid %d: %w", nsid, errPeerNotFound)
}
