package bpf

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/fluxvm/servicefabric/internal/ethtool"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestXDPOffloadVerdicts: which features refuse XDP, and what the error
// says: the interface, the offloads in force, the ethtool command that
// turns them off, or that the driver cannot.
func TestXDPOffloadVerdicts(t *testing.T) {
	on, fixedOn := ethtool.Feature{Active: true, Requested: true}, ethtool.Feature{Active: true, Fixed: true}
	for _, tc := range []struct {
		name string
		err  error
		want []string // in the error; none: no error
		not  []string
	}{
		{"nic defaults off", rxOffloadProblem("eth1", map[string]ethtool.Feature{"rx-vlan-hw-parse": {}, "tx-vlan-hw-insert": on, "tx-checksum-ip-generic": on}), nil, nil},
		{"nic rxvlan", rxOffloadProblem("eth1", map[string]ethtool.Feature{"rx-vlan-hw-parse": on}),
			[]string{"eth1", "rx-vlan-hw-parse on", "ethtool -K eth1 rx-vlan-hw-parse off", "xdp_mode off"}, []string{"stag"}},
		{"nic both", rxOffloadProblem("eth1", map[string]ethtool.Feature{"rx-vlan-hw-parse": on, "rx-vlan-stag-hw-parse": on}),
			[]string{"rx-vlan-hw-parse, rx-vlan-stag-hw-parse on", "ethtool -K eth1 rx-vlan-hw-parse off rx-vlan-stag-hw-parse off"}, nil},
		{"nic fixed", rxOffloadProblem("eth1", map[string]ethtool.Feature{"rx-vlan-hw-parse": fixedOn}),
			[]string{"the driver of eth1 cannot turn rx-vlan-hw-parse off", "xdp_mode off"}, []string{"ethtool -K"}},
		{"veth peer plain", peerOffloadProblem("uplink", "eth0", "ifindex 2", map[string]ethtool.Feature{"rx-vlan-hw-parse": on}), nil, nil},
		{"veth peer tags", peerOffloadProblem("uplink", "eth0", "ifindex 2", map[string]ethtool.Feature{"tx-vlan-hw-insert": on}),
			[]string{"uplink", "veth peer eth0 (ifindex 2)", "tx-vlan-hw-insert on", "without its tag", "ethtool -K eth0 tx-vlan-hw-insert off in the peer's namespace"}, []string{"checksum"}},
		{"veth peer checksums", peerOffloadProblem("uplink", "eth0", "ifindex 2", map[string]ethtool.Feature{"tx-checksum-ip-generic": on}),
			[]string{"tx-checksum-ip-generic on", "CHECKSUM_PARTIAL", "ethtool -K eth0 tx-checksum-ip-generic off"}, []string{"tag"}},
	} {
		if len(tc.want) == 0 {
			if tc.err != nil {
				t.Errorf("%s: %v, want none", tc.name, tc.err)
			}
			continue
		}
		if !errors.Is(tc.err, ErrXDPOffload) {
			t.Errorf("%s: %v, want ErrXDPOffload", tc.name, tc.err)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(tc.err.Error(), w) {
				t.Errorf("%s: %q lacks %q", tc.name, tc.err, w)
			}
		}
		for _, w := range tc.not {
			if strings.Contains(tc.err.Error(), w) {
				t.Errorf("%s: %q says %q", tc.name, tc.err, w)
			}
		}
	}
}

// TestAttachXDPRefusesOffloads: on a veth whose peer keeps VLAN tags
// beside its frames or leaves checksums to the receiver (a veth's
// defaults), AttachXDP and CheckXDP fail with ErrXDPOffload naming the
// peer's offloads and the command that turns them off, in every mode,
// and attach nothing; the veth's own rx-vlan-hw-parse decides nothing.
// With the peer's offloads off, XDP attaches; turned on again, the next
// AttachXDP refuses and detaches our link. A peer in another (named)
// namespace is found and read the same way.
func TestAttachXDPRefusesOffloads(t *testing.T) {
	root := filepath.Join(testenv.PinRoot(t), "service")
	refused := func(t *testing.T, d *Datapath, idx int, what string, want, not []string) {
		t.Helper()
		for _, mode := range []XDPMode{XDPNative, XDPGeneric, XDPAuto} {
			_, err := d.AttachXDP(Interface{Index: idx}, mode)
			cerr := d.CheckXDP(Interface{Index: idx})
			for _, e := range []error{err, cerr} {
				if !errors.Is(e, ErrXDPOffload) {
					t.Fatalf("%s, %s: %v; want ErrXDPOffload", what, mode, e)
				}
				for _, w := range want {
					if !strings.Contains(e.Error(), w) {
						t.Errorf("%s, %s: %q lacks %q", what, mode, e, w)
					}
				}
				for _, w := range not {
					if strings.Contains(e.Error(), w) {
						t.Errorf("%s, %s: %q says %q", what, mode, e, w)
					}
				}
			}
			if id, _ := xdpOn(t, idx); id != 0 {
				t.Fatalf("%s, %s: program %d attached", what, mode, id)
			}
			if _, err := os.Stat(filepath.Join(root, "links", fmt.Sprintf("xdp_%d", idx))); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s, %s: a link pin exists for a refused attach: %v", what, mode, err)
			}
		}
	}
	set := func(t *testing.T, name string, f map[string]bool) {
		t.Helper()
		if err := ethtool.SetFeatures(name, f); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("same namespace", func(t *testing.T) {
		testenv.InNetNS(t, func() {
			_, rx, err := testenv.VethPair("fvxtx", "fvxrx")
			if err != nil {
				t.Fatal(err)
			}
			idx := rx.Attrs().Index
			d := openT(t, Options{PinRoot: root, Tier: TierS})
			refused(t, d, idx, "defaults", []string{"on fvxrx", "veth peer fvxtx", "tx-vlan-hw-insert, tx-vlan-stag-hw-insert on", "tx-checksum-ip-generic on",
				"ethtool -K fvxtx tx-vlan-hw-insert off tx-vlan-stag-hw-insert off tx-checksum-ip-generic off"}, nil)
			set(t, "fvxrx", map[string]bool{"rx-vlan-hw-parse": false, "rx-vlan-stag-hw-parse": false})
			refused(t, d, idx, "own rx-vlan-hw-parse off", []string{"tx-vlan-hw-insert"}, nil)
			set(t, "fvxtx", map[string]bool{"tx-checksum-ip-generic": false})
			refused(t, d, idx, "peer checksums complete", []string{"tx-vlan-hw-insert, tx-vlan-stag-hw-insert on"}, []string{"checksum"})
			set(t, "fvxtx", map[string]bool{"tx-checksum-ip-generic": true, "tx-vlan-hw-insert": false, "tx-vlan-stag-hw-insert": false})
			refused(t, d, idx, "peer tags in the frame", []string{"tx-checksum-ip-generic on"}, []string{"tag"})
			set(t, "fvxtx", map[string]bool{"tx-checksum-ip-generic": false})
			if err := d.CheckXDP(Interface{Index: idx}); err != nil {
				t.Fatalf("CheckXDP with the peer's offloads off: %v", err)
			}
			a, err := d.AttachXDP(Interface{Index: idx}, XDPNative)
			if err != nil || a.Mode != XDPNative {
				t.Fatalf("attach with the peer's offloads off: %+v, %v", a, err)
			}
			if id, _ := xdpOn(t, idx); id != progID(t, d.XDPPrograms().FluxvmXdpNs) {
				t.Fatalf("the interface runs %d, want ours", id)
			}
			// Turned on again: the next attach (a restart) refuses and
			// takes our link off.
			set(t, "fvxtx", map[string]bool{"tx-vlan-hw-insert": true})
			refused(t, d, idx, "peer tags beside the frame again", []string{"tx-vlan-hw-insert on"}, nil)
		})
	})

	// vethToNS adds veth fvxrx to the namespace the test runs in, with its
	// peer fvxtx in namespace peerNS (a netlink.NsFd or netlink.NsPid),
	// and returns fvxrx's index.
	vethToNS := func(t *testing.T, peerNS any) int {
		t.Helper()
		err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fvxrx"}, PeerName: "fvxtx", PeerNamespace: peerNS})
		if err != nil {
			t.Fatal(err)
		}
		rx, err := netlink.LinkByName("fvxrx")
		if err != nil {
			t.Fatal(err)
		}
		return rx.Attrs().Index
	}

	t.Run("peer in another namespace", func(t *testing.T) {
		peerNS := testenv.NewNetNS(t, "fvxpeer")
		testenv.InNetNS(t, func() {
			idx := vethToNS(t, netlink.NsFd(int(peerNS.Handle())))
			d := openT(t, Options{PinRoot: root, Tier: TierS})
			refused(t, d, idx, "peer elsewhere", []string{"veth peer fvxtx", "in the namespace with nsid", "tx-vlan-hw-insert", "in the peer's namespace"}, nil)
			if err := peerNS.Do(func() error { return testenv.SendPlainFrames("fvxtx") }); err != nil {
				t.Fatal(err)
			}
			if a, err := d.AttachXDP(Interface{Index: idx}, XDPGeneric); err != nil || a.Mode != XDPGeneric {
				t.Fatalf("attach with the peer's offloads off: %+v, %v", a, err)
			}
		})
	})

	// A namespace with no name, only a process in it (a container's):
	// found through /proc/<pid>/ns/net.
	t.Run("peer in a process's namespace", func(t *testing.T) {
		sleeper := exec.Command("sleep", "120")
		sleeper.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		if err := sleeper.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
		pid := sleeper.Process.Pid
		testenv.InNetNS(t, func() {
			idx := vethToNS(t, netlink.NsPid(pid))
			d := openT(t, Options{PinRoot: root, Tier: TierS})
			refused(t, d, idx, "peer in a process's namespace", []string{"veth peer fvxtx", "in the namespace with nsid", "tx-checksum-ip-generic"}, nil)
			h, err := netns.GetFromPid(pid)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			if err := inNetNS(h, func() error { return testenv.SendPlainFrames("fvxtx") }); err != nil {
				t.Fatal(err)
			}
			if a, err := d.AttachXDP(Interface{Index: idx}, XDPNative); err != nil || a.Mode != XDPNative {
				t.Fatalf("attach with the peer's offloads off: %+v, %v", a, err)
			}
		})
	})

	// A namespace held only by a file descriptor: nothing names it, no
	// process is in it, so its peer cannot be read, which refuses too.
	t.Run("peer out of sight", func(t *testing.T) {
		hc := make(chan netns.NsHandle, 1)
		go func() {
			runtime.LockOSThread()
			orig, err := netns.Get()
			if err != nil {
				hc <- netns.None()
				return
			}
			h, err := netns.New()
			if serr := netns.Set(orig); serr != nil || err != nil {
				hc <- netns.None()
				return
			}
			orig.Close()
			runtime.UnlockOSThread()
			hc <- h
		}()
		h := <-hc
		if !h.IsOpen() {
			t.Fatal("no namespace")
		}
		defer h.Close()
		testenv.InNetNS(t, func() {
			err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "fvxrx"}, PeerName: "fvxtx",
				PeerNamespace: netlink.NsFd(int(h))})
			if err != nil {
				t.Fatal(err)
			}
			rx, err := netlink.LinkByName("fvxrx")
			if err != nil {
				t.Fatal(err)
			}
			d := openT(t, Options{PinRoot: root, Tier: TierS})
			refused(t, d, rx.Attrs().Index, "peer out of sight", []string{"cannot read the offloads of its veth peer", "in the namespace with nsid", "set xdp_mode off"}, nil)
		})
	})
}
