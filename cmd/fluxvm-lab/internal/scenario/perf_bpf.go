//go:build linux

package scenario

import (
	"fmt"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// openBPFStats turns the kernel's BPF run-time statistics on and opens
// the datapath programs (openBPFProgs).
func (p *perfRun) openBPFStats() error {
	var err error
	if p.bpfStats, err = ebpf.EnableStats(unix.BPF_STATS_RUN_TIME); err != nil {
		return fmt.Errorf("BPF run-time statistics: %w", err)
	}
	return p.openBPFProgs()
}

// openBPFProgs opens the programs attached to the client's VM edge (each
// program is one object on every edge, so its statistics cover all of
// them) and, with north-south paths, those on the uplink: its TC
// programs and the XDP program while one runs. A reopened dataplane
// runs new objects: setXDP calls it again.
func (p *perfRun) openBPFProgs() error {
	for _, pr := range p.progs {
		pr.Close()
	}
	p.progs = nil
	if p.sock != nil {
		sp, err := p.sock.sockProgs()
		p.progs = append(p.progs, sp...)
		if err != nil {
			return err
		}
	}
	return p.env.Lab.Node.Do(func() error {
		targets := []struct {
			name  string
			index int
		}{{p.env.Client.NodeIf, p.env.Client.NodeIfIndex}}
		if p.ns != nil {
			targets = append(targets, struct {
				name  string
				index int
			}{p.ns.ext.NodeIf, p.ns.ext.NodeIfIndex})
		}
		for _, t := range targets {
			n := len(p.progs)
			for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				q, err := link.QueryPrograms(link.QueryOptions{Target: t.index, Attach: at})
				if err != nil {
					return fmt.Errorf("BPF statistics need TCX attachment: query %s: %w", t.name, err)
				}
				for _, ap := range q.Programs {
					pr, err := ebpf.NewProgramFromID(ap.ID)
					if err != nil {
						return err
					}
					p.progs = append(p.progs, pr)
				}
			}
			if len(p.progs) == n {
				return fmt.Errorf("BPF statistics: no program on %s", t.name)
			}
		}
		if p.ns == nil || !p.ns.xdp {
			return nil
		}
		l, err := netlink.LinkByName(perfUplink)
		if err != nil {
			return err
		}
		x := l.Attrs().Xdp
		if x == nil || x.ProgId == 0 {
			return fmt.Errorf("BPF statistics: no XDP program on %s", perfUplink)
		}
		pr, err := ebpf.NewProgramFromID(ebpf.ProgramID(x.ProgId))
		if err != nil {
			return err
		}
		p.progs = append(p.progs, pr)
		return nil
	})
}

// bpfTime sums the run time and runs of the datapath programs (zero
// without BPFStats).
func (p *perfRun) bpfTime() (time.Duration, uint64, error) {
	var rt time.Duration
	var n uint64
	for _, pr := range p.progs {
		st, err := pr.Stats()
		if err != nil {
			return 0, 0, err
		}
		rt += st.Runtime
		n += st.RunCount
	}
	return rt, n, nil
}
