//go:build linux

package scenario

// What Perf prints as it goes: the header of a run and a line per
// measurement.

import (
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func (p *perfRun) header() {
	st := p.env.DP.Status()
	mode := "?"
	if len(st.Interfaces) > 0 && len(st.Interfaces[0].Hooks) > 0 {
		mode = st.Interfaces[0].Hooks[0].Mode
	}
	var uts syscall.Utsname
	_ = syscall.Uname(&uts)
	p.printf("fluxvm-lab perf: %d rounds x %s per measurement, %d connection workers, %d bulk stream(s)\n",
		p.o.Rounds, p.o.Duration, p.o.Workers, p.o.Streams)
	p.printf("host: %d CPUs, GOMAXPROCS %d, kernel %s; datapath tier %s, attach %s; node netns %s\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), perfUTS(uts.Release[:]), st.Tier, mode, p.env.Lab.Node.Name)
	if p.o.eastWest() {
		p.printf("east-west paths (client vm1, one backend %s in vm2; conns / bulk destination):\n", p.backend.Addr4)
		for _, path := range p.rep.Paths {
			if !path.northSouth() {
				p.printf("  %-*s from %s to %s\n", p.pathWidth(), path, p.source(path), perfDescribe(path, p.target(path, WorkloadConns), p.target(path, WorkloadBulk)))
			}
		}
	}
	if p.sock != nil {
		p.sockHeader()
	}
	if p.ns != nil {
		p.printf("north-south paths (external client ext behind the node's %s, one backend %s in vm3; SNAT %s; conns / bulk destination):\n",
			perfUplink, p.ns.backend.Addr4, perfNSSNAT4)
		for _, path := range p.rep.Paths {
			if path.northSouth() {
				p.printf("  %-*s from %s to %s\n", p.pathWidth(), path, p.source(path), perfDescribe(path, p.target(path, WorkloadConns), p.target(path, WorkloadBulk)))
			}
		}
		p.printf("  ext computes its TX checksums (offload off) and vm3's eth0 runs an XDP_PASS program, for all three (XDP needs both)\n")
		p.printf("  one dataplane has one xdp_mode: it is switched between measurements by reopening the dataplane (SDK Close + Open), never during one\n")
	}
	if p.o.BPFStats {
		p.printf("BPF run-time statistics are on for this run: every BPF program on the machine, ours included, does two more clock reads per run\n")
		p.printf("  ours, counted (every program attached in the node namespace, and the socket hooks): %s\n", strings.Join(p.progNames, ", "))
	}
	p.printf("workloads: conns = connect, read identity, 4-byte echo, close (%d workers, at most %d per measurement); bulk = %d stream(s) into a sink\n\n",
		p.o.Workers, p.o.MaxConns, p.o.Streams)
}

// pathWidth is the width of the path names in the header: 9, or the
// longest path's.
func (p *perfRun) pathWidth() int {
	w := 9
	for _, path := range p.rep.Paths {
		w = max(w, len(path))
	}
	return w
}

// perfDescriptions say what carries each path's traffic, after its
// destinations in the run's header.
var perfDescriptions = map[PerfPath]string{
	PathBare:       "routed by the node, datapath programs detached",
	PathNoop:       "routed by the node, a do-nothing program at the datapath's hooks instead of ours (diagnostic)",
	PathDirect:     "routed by the node, datapath programs attached (baseline)",
	PathVIP:        "our VIP: Maglev in the TC programs, one backend",
	PathNFT:        "kube-proxy style nftables DNAT (table loaded for these measurements only)",
	PathSockLB:     "our VIP addressed to the backend at connect by the socket hooks (client in the hooked cgroup), no per-packet NAT",
	PathSockDirect: "the backend's address from sock-lb's worker in the hooked cgroup: the hooks run, rewrite nothing (diagnostic)",
	PathNSDirect:   "routed by the node, TC programs on the uplink, xdp_mode off (baseline)",
	PathNSTC:       "north-south VIP: DNAT+SNAT in the TC programs, xdp_mode off",
	PathNSXDP:      "the same VIP with xdp_mode native: the XDP program translates and redirects",
}

func perfDescribe(path PerfPath, echo, sink string) string {
	if d, ok := perfDescriptions[path]; ok {
		return fmt.Sprintf("%s / %s, %s", echo, sink, d)
	}
	return string(path)
}

func perfUTS(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

func (p *perfRun) printSample(s PerfSample) {
	tag := "checks"
	if s.Round > 0 {
		tag = fmt.Sprintf("round %d", s.Round)
	}
	var fig string
	if s.Workload == WorkloadBulk {
		fig = fmt.Sprintf("%8.2f Gbit/s  %.0f ms CPU/GB (softirq %.0f, %s); %d stream(s), %.1f MB",
			s.Rate()/1e9, s.CPUPerUnit()/1e3, s.SoftIRQPerUnit()/1e3, perfShares(s, 1e3), s.OK, float64(s.Bytes)/1e6)
	} else {
		fig = fmt.Sprintf("%8.0f conn/s  %.1f µs CPU/conn (softirq %.1f, %s); p50 %s p99 %s, %d connections",
			s.Rate(), s.CPUPerUnit(), s.SoftIRQPerUnit(), perfShares(s, 1), perfMicros(s.P50), perfMicros(s.P99), s.OK)
	}
	via := ""
	switch s.Path {
	case PathVIP:
		via = fmt.Sprintf("; datapath new flows %d", s.DatapathFlows)
	case PathNFT:
		via = fmt.Sprintf("; nftables new conns %d", s.NFTConns)
	case PathNSTC, PathNSXDP:
		via = fmt.Sprintf("; datapath new flows %d", s.DatapathFlows)
	case PathSockLB, PathSockDirect:
		via = fmt.Sprintf("; sock_rewritten +%d; datapath new flows %d", s.SockRewritten, s.DatapathFlows)
	}
	if s.SockFailOpen > 0 || (s.SockRewritten > 0 && !s.Path.sockPath()) {
		via += fmt.Sprintf("; sock_rewritten +%d, sock_fail_open_* +%d", s.SockRewritten, s.SockFailOpen)
	}
	if s.Path.northSouth() {
		via += fmt.Sprintf("; xdp_translated +%d", s.XDPTranslated)
		if s.XDPPassed > 0 {
			via += fmt.Sprintf(" (xdp_pass_* +%d)", s.XDPPassed)
		}
	}
	if s.Drops > 0 {
		via += fmt.Sprintf("; datapath drops +%d (snat_failed +%d)", s.Drops, s.SNATFailed)
	}
	if p.o.BPFStats {
		unit := "µs/conn"
		v := s.BPFPerUnit()
		if s.Workload == WorkloadBulk {
			unit, v = "ms/GB", v/1e3
		}
		via += fmt.Sprintf("; BPF %.2f %s (%d runs, %.0f ns/run)", v, unit, s.BPFRuns, s.BPFPerRun())
	}
	failed := fmt.Sprintf("; others %.0f%% (their system time %s, kept in CPU)", s.Others*100, s.OthersSys)
	if s.Failed > 0 {
		failed += fmt.Sprintf("; %d FAILED (%s)", s.Failed, s.FirstError)
	}
	width := 6
	if p.ns != nil || p.sock != nil {
		width = 9
	}
	for _, path := range p.rep.Paths {
		width = max(width, len(path))
	}
	p.printf("%-11s %-5s %-*s %s%s%s\n", tag, s.Workload, width, s.Path, fig, via, failed)
}

// perfShares is the client worker's and the lab process's CPU per unit
// of a sample (divided by scale), or the lab process's alone when the
// client ran in it.
func perfShares(s PerfSample, scale float64) string {
	prec := 1
	if scale != 1 {
		prec = 0
	}
	if s.ClientWorker {
		return fmt.Sprintf("client worker %.*f, lab %.*f", prec, s.ClientPerUnit()/scale, prec, s.LabPerUnit()/scale)
	}
	return fmt.Sprintf("lab process with the client %.*f", prec, s.LabPerUnit()/scale)
}

func perfMicros(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Microsecond), 'f', 0, 64) + "µs"
}
