package fluxvm

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// ourPrograms names the FluxVM programs on the TC hooks of the VM's
// node-side interface (TCX links and cls_bpf filters), in the node's
// namespace.
func ourPrograms(t *testing.T, l *lab.Lab, vm *lab.VM) []string {
	t.Helper()
	var out []string
	err := l.Node.Do(func() error {
		for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
			names, err := testenv.TCXProgramNames(vm.NodeIfIndex, at)
			if err != nil {
				return err
			}
			for _, n := range names {
				if strings.HasPrefix(n, "fluxvm") {
					out = append(out, at.String()+":"+n)
				}
			}
		}
		link, err := netlink.LinkByIndex(vm.NodeIfIndex)
		if err != nil {
			return err
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(link, parent)
			if err != nil {
				return err
			}
			for _, f := range fs {
				if bf, ok := f.(*netlink.BpfFilter); ok && strings.HasPrefix(bf.Name, "fluxvm") {
					out = append(out, "cls_bpf:"+bf.Name)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// bpfFDs counts this process's open BPF objects (maps, programs, links).
func bpfFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && strings.HasPrefix(target, "anon_inode:bpf") {
			n++
		}
	}
	return n
}

// TestOpenFailsOnMissingInterface: an interface that does not exist is
// named in Open's error, which matches ErrNotFound (and
// bpf.ErrNoInterface); AddInterface and AddNorthSouthInterface say the
// same.
func TestOpenFailsOnMissingInterface(t *testing.T) {
	e := newEnv(t)
	e.opts.Interfaces = []VMEdgeInterface{{Name: "nope0", VMID: "vm-nope"}}
	_, err := Open(e.opts)
	if !errors.Is(err, ErrNotFound) || !errors.Is(err, bpf.ErrNoInterface) || !strings.Contains(err.Error(), `interface "nope0"`) {
		t.Fatalf("Open with a missing interface: %v; want an error naming \"nope0\" and matching ErrNotFound and bpf.ErrNoInterface", err)
	}
	if strings.Contains(err.Error(), "{Name:") || strings.Contains(err.Error(), "route ip+net") {
		t.Errorf("Open with a missing interface: %v: Go's struct syntax or the net package's wording", err)
	}

	e.opts.Interfaces = nil
	d := e.open(t)
	_, err = d.AddInterface(VMEdgeInterface{Name: "nope0", VMID: "vm-nope"})
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `interface "nope0"`) {
		t.Errorf("AddInterface(nope0): %v; want ErrNotFound naming it", err)
	}
	_, err = d.AddNorthSouthInterface("nope1")
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `interface "nope1"`) {
		t.Errorf("AddNorthSouthInterface(nope1): %v; want ErrNotFound naming it", err)
	}
}

// TestOpenRollsBackFirstStart: an Open of an empty pin root that fails on
// its second interface leaves nothing: the first interface has no program
// of ours, the pin root (and the directory above it that Open created)
// is gone, and no BPF handle stays open in this process.
func TestOpenRollsBackFirstStart(t *testing.T) {
	for _, mode := range []bpf.AttachMode{bpf.AttachTCX, bpf.AttachClsBPF} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t)
			// Two levels Open must create: both go again.
			parent := filepath.Dir(e.opts.Loader.PinRoot)
			e.opts.Loader.PinRoot = filepath.Join(parent, "node", "service")
			e.opts.Loader.AttachMode = mode
			vm := e.backends[0]
			e.opts.Interfaces = []VMEdgeInterface{{Name: vm.NodeIf, VMID: vm.Name}, {Name: "nope0", VMID: "vm-nope"}}
			before := bpfFDs(t)
			d, err := Open(e.opts)
			if err == nil {
				d.Close()
				t.Fatal("Open succeeded with a missing second interface")
			}
			if d != nil {
				t.Errorf("a failed Open returned a Dataplane")
			}
			if !errors.Is(err, ErrNotFound) {
				t.Errorf("Open: %v, want ErrNotFound", err)
			}
			if got := ourPrograms(t, e.lab, vm); len(got) != 0 {
				t.Errorf("the first interface keeps %v after the failed Open", got)
			}
			if _, err := os.Stat(filepath.Join(parent, "node")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("the pin root's directory is still there: %v", err)
			}
			left, err := os.ReadDir(parent)
			if err != nil || len(left) != 0 {
				t.Errorf("left under %s: %v (%v)", parent, left, err)
			}
			if after := bpfFDs(t); after != before {
				t.Errorf("%d BPF handles open after the failed Open, %d before", after, before)
			}
			// Nothing left in the way: the same options, without the
			// missing interface, open.
			e.opts.Interfaces = e.opts.Interfaces[:1]
			d = e.open(t)
			if err := d.Cleanup(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestOpenRollbackKeepsEarlierStart: a restart that fails on an interface
// detaches only what it attached itself (an interface the earlier start
// did not have), and leaves the earlier start's datapath in place and
// forwarding: its attachments, its pins, and a connection through the
// VIP.
func TestOpenRollbackKeepsEarlierStart(t *testing.T) {
	e := newEnv(t)
	extra := e.lab.AddVMForTest(t, 5)
	d := e.open(t)
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	conn := e.dial(t, vip4)
	echo(t, conn, "before")
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	pins := func() []string {
		var out []string
		filepath.WalkDir(e.opts.Loader.PinRoot, func(p string, _ fs.DirEntry, err error) error {
			if err == nil {
				out = append(out, p)
			}
			return nil
		})
		slices.Sort(out)
		return out
	}
	pinsBefore := pins()
	progsBefore := ourPrograms(t, e.lab, e.cli)
	if len(progsBefore) != 2 {
		t.Fatalf("the client's interface runs %v, want both hooks", progsBefore)
	}

	opts := e.opts
	opts.Interfaces = append(slices.Clone(e.opts.Interfaces),
		VMEdgeInterface{Name: extra.NodeIf, VMID: extra.Name}, VMEdgeInterface{Name: "nope0", VMID: "vm-nope"})
	before := bpfFDs(t)
	if d2, err := Open(opts); err == nil {
		d2.Close()
		t.Fatal("Open succeeded with a missing interface")
	} else if !errors.Is(err, ErrNotFound) {
		t.Errorf("Open: %v, want ErrNotFound", err)
	}
	if got := ourPrograms(t, e.lab, extra); len(got) != 0 {
		t.Errorf("the interface the failed Open attached keeps %v", got)
	}
	if got := ourPrograms(t, e.lab, e.cli); !slices.Equal(got, progsBefore) {
		t.Errorf("the earlier start's interface runs %v after the failed Open, %v before", got, progsBefore)
	}
	if got := pins(); !slices.Equal(got, pinsBefore) {
		t.Errorf("pins after the failed Open:\n%v\nbefore:\n%v", got, pinsBefore)
	}
	if after := bpfFDs(t); after != before {
		t.Errorf("%d BPF handles open after the failed Open, %d before", after, before)
	}
	echo(t, conn, "after the failed Open")
	e.dial(t, vip4).Close()
}
