//go:build linux

package scenario

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

// PathNoop is the backend's address with the datapath programs replaced
// by a program that does nothing (it returns TCX_NEXT at once), attached
// at the same hooks of the same VM edges: the kernel's price of a TC hook
// with nothing in it. It splits direct/bare (issue 36 point 4, the price
// of being attached) into noop/bare, which no program can lower, and
// direct/noop, the programs' own share. Diagnostic: measured when named
// or with the group "attach-diag" (AttachDiagPaths).
const PathNoop PerfPath = "noop"

// AttachDiagPaths is the group "attach-diag": bare, noop and direct.
var AttachDiagPaths = []PerfPath{PathBare, PathNoop, PathDirect}

// perfSourceNoop is noop's client address on vm1's eth0.
var perfSourceNoop = netip.MustParseAddr("10.200.1.8")

// perfNoopProg is the do-nothing program: r0 = TCX_NEXT (-1), exit. TCX
// reads -1 as "next program, or the packet goes on": what our programs
// return for a packet that is not ours, without the parse.
func perfNoopProg() (*ebpf.Program, error) {
	return ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "fluxvm_lab_noop",
		Type:         ebpf.SchedCLS,
		License:      "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
	})
}

// noopLinks are the do-nothing program's attachments while PathNoop is
// measured.
type noopLinks []link.Link

func (ls noopLinks) close() error {
	var errs []error
	for _, l := range ls {
		errs = append(errs, l.Close())
	}
	return errors.Join(errs...)
}

// attachNoop detaches the datapath programs from the VM edges (as
// PathBare does) and attaches the do-nothing program at TCX ingress and
// egress of each, where fluxvm_from_vm and fluxvm_to_vm sit; undo puts
// the datapath back. On error nothing of it is left.
func (p *perfRun) attachNoop() (undo func() error, err error) {
	prog, err := perfNoopProg()
	if err != nil {
		return nil, fmt.Errorf("noop program: %w", err)
	}
	defer prog.Close() // the links hold it
	if err := p.detach(); err != nil {
		return nil, errors.Join(err, p.attach())
	}
	var ls noopLinks
	err = p.env.Lab.Node.Do(func() error {
		for _, vm := range p.env.Lab.VMs {
			l, err := netlink.LinkByName(vm.NodeIf)
			if err != nil {
				return err
			}
			for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				tl, err := link.AttachTCX(link.TCXOptions{Interface: l.Attrs().Index, Program: prog, Attach: at})
				if err != nil {
					return fmt.Errorf("noop program on %s: %w", vm.NodeIf, err)
				}
				ls = append(ls, tl)
			}
		}
		return nil
	})
	undo = func() error { return errors.Join(ls.close(), p.attach()) }
	if err != nil {
		return nil, errors.Join(err, undo())
	}
	return undo, nil
}
