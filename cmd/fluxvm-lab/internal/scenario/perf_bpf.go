//go:build linux

package scenario

import (
	"fmt"
	"slices"
	"strings"
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

// openBPFProgs opens every program of ours: each program attached in the
// lab's node namespace, where nothing but our dataplane attaches any (TCX
// ingress and egress and XDP, on every interface: the VM edges, the
// uplink), and the socket hooks on the hooked cgroup. A program is one
// object on all the interfaces it is attached to, so it is counted once
// (by id) and its statistics cover all of them. Programs that the
// datapath reaches by tail call run inside their caller's statistics.
// A reopened dataplane runs new objects: setXDP calls it again.
func (p *perfRun) openBPFProgs() error {
	for _, pr := range p.progs {
		pr.Close()
	}
	p.progs, p.progNames = nil, nil
	seen := map[ebpf.ProgramID]bool{}
	keep := func(pr *ebpf.Program, where string) error {
		info, err := pr.Info()
		if err != nil {
			pr.Close()
			return fmt.Errorf("BPF statistics: program on %s: %w", where, err)
		}
		id, _ := info.ID()
		if seen[id] {
			pr.Close()
			return nil
		}
		seen[id] = true
		p.progs = append(p.progs, pr)
		p.progNames = append(p.progNames, info.Name+"@"+where)
		return nil
	}
	add := func(id ebpf.ProgramID, where string) error {
		pr, err := ebpf.NewProgramFromID(id)
		if err != nil {
			return fmt.Errorf("BPF statistics: program %d on %s: %w", id, where, err)
		}
		return keep(pr, where)
	}
	if p.sock != nil {
		sp, err := p.sock.sockProgs()
		for _, pr := range sp {
			if kerr := keep(pr, "cgroup"); err == nil {
				err = kerr
			}
		}
		if err != nil {
			return err
		}
	}
	err := p.env.Lab.Node.Do(func() error {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range links {
			at := l.Attrs()
			for _, t := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				q, err := link.QueryPrograms(link.QueryOptions{Target: at.Index, Attach: t})
				if err != nil {
					return fmt.Errorf("BPF statistics need TCX attachment: query %s: %w", at.Name, err)
				}
				for _, ap := range q.Programs {
					if err := add(ap.ID, at.Name); err != nil {
						return err
					}
				}
			}
			if x := at.Xdp; x != nil && x.ProgId != 0 {
				if err := add(ebpf.ProgramID(x.ProgId), at.Name+"/xdp"); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(p.progNames, func(n string) bool { return strings.HasSuffix(n, "@"+p.env.Client.NodeIf) }) {
		return fmt.Errorf("BPF statistics: no program on %s", p.env.Client.NodeIf)
	}
	if p.ns != nil && p.ns.xdp && !slices.ContainsFunc(p.progNames, func(n string) bool { return strings.HasSuffix(n, "@"+perfUplink+"/xdp") }) {
		return fmt.Errorf("BPF statistics: no XDP program on %s", perfUplink)
	}
	return nil
}

// PerfProgTime is one program's run time and runs during a measurement.
type PerfProgTime struct {
	Time time.Duration
	Runs uint64
}

// bpfReading is a reading of our programs' statistics, by program name
// (programs of one name, such as the objects of a reopened dataplane,
// add up).
type bpfReading map[string]PerfProgTime

// bpfTime reads the run time and runs of every program of ours (empty
// without BPFStats).
func (p *perfRun) bpfTime() (bpfReading, error) {
	r := bpfReading{}
	for i, pr := range p.progs {
		st, err := pr.Stats()
		if err != nil {
			return nil, err
		}
		name, _, _ := strings.Cut(p.progNames[i], "@")
		t := r[name]
		t.Time += st.Runtime
		t.Runs += st.RunCount
		r[name] = t
	}
	return r, nil
}

// accountBPF sets s.BPF, s.BPFRuns and s.BPFProgs from readings before
// and after the measurement: the programs that ran, by name.
func (s *PerfSample) accountBPF(a, b bpfReading) {
	s.BPF, s.BPFRuns, s.BPFProgs = 0, 0, nil
	for name, tb := range b {
		ta := a[name]
		if tb.Runs <= ta.Runs {
			continue
		}
		d := PerfProgTime{Time: max(tb.Time-ta.Time, 0), Runs: tb.Runs - ta.Runs}
		if s.BPFProgs == nil {
			s.BPFProgs = map[string]PerfProgTime{}
		}
		s.BPFProgs[name] = d
		s.BPF += d.Time
		s.BPFRuns += d.Runs
	}
}
