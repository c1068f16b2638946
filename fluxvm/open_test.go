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
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
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

// TestOpenFailsOnMissingInterface: an interface that does not exist is
// named in Open's error, which matches ErrNotFound (and
// bpf.ErrNoInterface); AddInterface and AddNorthSouthInterface say the
// same.
func TestOpenFailsOnMissingInterface(t *testing.T) {
	e := newEnv(t)
	e.opts.VMEdgeInterfaces = []VMEdgeInterface{{Name: "nope0", VMID: "vm-nope"}}
	_, err := Open(context.Background(), e.opts)
	if !errors.Is(err, ErrNotFound) || !errors.Is(err, bpf.ErrNoInterface) || !strings.Contains(err.Error(), `interface "nope0"`) {
		t.Fatalf("Open with a missing interface: %v; want an error naming \"nope0\" and matching ErrNotFound and bpf.ErrNoInterface", err)
	}
	if strings.Contains(err.Error(), "{Name:") || strings.Contains(err.Error(), "route ip+net") {
		t.Errorf("Open with a missing interface: %v: Go's struct syntax or the net package's wording", err)
	}

	e.opts.VMEdgeInterfaces = nil
	d := e.open(t)
	_, err = d.AddInterface(context.Background(), VMEdgeInterface{Name: "nope0", VMID: "vm-nope"})
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `interface "nope0"`) {
		t.Errorf("AddInterface(nope0): %v; want ErrNotFound naming it", err)
	}
	_, err = d.AddNorthSouthInterface(context.Background(), "nope1")
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `interface "nope1"`) {
		t.Errorf("AddNorthSouthInterface(nope1): %v; want ErrNotFound naming it", err)
	}
}

// TestOpenRollsBackFirstStart: an Open of an empty pin root that fails on
// its second interface (missing, or refused half-way through its attach
// by a foreign cls_bpf filter) leaves nothing: the first interface has no
// program of ours, nor the second, the pin root (and the directory above
// it that Open created) is gone, and no BPF handle stays open in this
// process.
func TestOpenRollsBackFirstStart(t *testing.T) {
	for _, c := range []struct {
		name    string
		mode    bpf.AttachMode
		foreign bool // the second interface exists, with a foreign egress filter
	}{
		{"missing/tcx", bpf.AttachTCX, false},
		{"missing/cls_bpf", bpf.AttachClsBPF, false},
		{"foreign filter/cls_bpf", bpf.AttachClsBPF, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			// Two levels Open must create: both go again.
			parent := filepath.Dir(e.opts.Loader.PinRoot)
			e.opts.Loader.PinRoot = filepath.Join(parent, "node", "service")
			e.opts.Loader.AttachMode = c.mode
			vm, second := e.backends[0], VMEdgeInterface{Name: "nope0", VMID: "vm-nope"}
			if c.foreign {
				foreignEgressFilter(t, e, e.backends[1])
				second = VMEdgeInterface{Name: e.backends[1].NodeIf, VMID: e.backends[1].Name}
			}
			e.opts.VMEdgeInterfaces = []VMEdgeInterface{{Name: vm.NodeIf, VMID: vm.Name}, second}
			before := testenv.BPFHandles(t)
			d, err := Open(context.Background(), e.opts)
			if err == nil {
				d.Close()
				t.Fatal("Open succeeded with a second interface that cannot be attached")
			}
			if d != nil {
				t.Errorf("a failed Open returned a Dataplane")
			}
			if want := map[bool]error{false: ErrNotFound, true: bpf.ErrForeignProgram}[c.foreign]; !errors.Is(err, want) {
				t.Errorf("Open: %v, want %v", err, want)
			}
			for _, v := range []*lab.VM{vm, e.backends[1]} {
				if got := ourPrograms(t, e.lab, v); len(got) != 0 {
					t.Errorf("%s keeps %v after the failed Open", v.NodeIf, got)
				}
			}
			if _, err := os.Stat(filepath.Join(parent, "node")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("the pin root's directory is still there: %v", err)
			}
			left, err := os.ReadDir(parent)
			if err != nil || len(left) != 0 {
				t.Errorf("left under %s: %v (%v)", parent, left, err)
			}
			if after := testenv.BPFHandles(t); after != before {
				t.Errorf("%d BPF handles open after the failed Open, %d before", after, before)
			}
			// Nor the catalog's lock file it created.
			if left, err := os.ReadDir(filepath.Dir(e.opts.CatalogPath)); err != nil || len(left) != 0 {
				t.Errorf("left next to the catalog: %v (%v)", left, err)
			}
			// Nothing left in the way: the same options, without the
			// second interface, open.
			e.opts.VMEdgeInterfaces = e.opts.VMEdgeInterfaces[:1]
			d = e.open(t)
			if err := d.Cleanup(context.Background()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// foreignEgressFilter puts another product's cls_bpf filter at priority 1
// on the egress of vm's node-side interface, where ours would go.
func foreignEgressFilter(t *testing.T, e *env, vm *lab.VM) {
	t.Helper()
	foreign, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { foreign.Close() })
	err = e.lab.Node.Do(func() error {
		l, err := netlink.LinkByName(vm.NodeIf)
		if err != nil {
			return err
		}
		if err := netlink.QdiscReplace(&netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{
			LinkIndex: l.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT,
		}, QdiscType: "clsact"}); err != nil {
			return err
		}
		return netlink.FilterAdd(&netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{
			LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_MIN_EGRESS, Priority: 1, Protocol: unix.ETH_P_ALL,
		}, Fd: foreign.FD(), Name: "someone-else", DirectAction: true})
	})
	if err != nil {
		t.Fatal(err)
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
	opts.VMEdgeInterfaces = append(slices.Clone(e.opts.VMEdgeInterfaces),
		VMEdgeInterface{Name: extra.NodeIf, VMID: extra.Name}, VMEdgeInterface{Name: "nope0", VMID: "vm-nope"})
	before := testenv.BPFHandles(t)
	if d2, err := Open(context.Background(), opts); err == nil {
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
	if after := testenv.BPFHandles(t); after != before {
		t.Errorf("%d BPF handles open after the failed Open, %d before", after, before)
	}
	echo(t, conn, "after the failed Open")
	e.dial(t, vip4).Close()
}

// TestOpenRollbackRestoresSettings: a restart that fails puts back the
// settings the earlier start wrote into the adopted meta and SNAT maps,
// which the running datapath reads: conntrack timeouts, flow sample
// rate, SNAT port range. (They used to stay, the new settings running
// under the old start.)
func TestOpenRollbackRestoresSettings(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	read := func() (bpf.Meta, bpf.SNATConfig) {
		t.Helper()
		var m bpf.Meta
		var s bpf.SNATConfig
		for name, v := range map[string]any{"fluxvm_meta": &m, "fluxvm_snat": &s} {
			pm, err := ebpf.LoadPinnedMap(filepath.Join(e.opts.Loader.PinRoot, "maps", name), nil)
			if err != nil {
				t.Fatal(err)
			}
			err = pm.Lookup(uint32(0), v)
			pm.Close()
			if err != nil {
				t.Fatal(err)
			}
		}
		return m, s
	}
	metaBefore, snatBefore := read()
	opts := e.opts
	opts.Timeouts = conntrack.DefaultTimeouts()
	opts.Timeouts.TCPEstablished += time.Hour
	opts.FlowSampleRate = 7
	opts.NorthSouth.SNATPortMin, opts.NorthSouth.SNATPortMax = 40000, 41000
	opts.VMEdgeInterfaces = append(slices.Clone(e.opts.VMEdgeInterfaces), VMEdgeInterface{Name: "nope0", VMID: "vm-nope"})
	if d2, err := Open(context.Background(), opts); err == nil {
		d2.Close()
		t.Fatal("Open succeeded with a missing interface")
	} else if !errors.Is(err, ErrNotFound) {
		t.Fatalf("Open: %v, want ErrNotFound (the missing interface)", err)
	}
	metaAfter, snatAfter := read()
	if metaAfter != metaBefore {
		t.Errorf("meta after the failed restart:\n%+v\nbefore:\n%+v", metaAfter, metaBefore)
	}
	if snatAfter != snatBefore {
		t.Errorf("SNAT config after the failed restart: %+v, before %+v", snatAfter, snatBefore)
	}
}
