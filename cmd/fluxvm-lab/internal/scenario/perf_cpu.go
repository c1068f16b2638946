//go:build linux

package scenario

// The CPU accounting of a Perf measurement (issue 36).
//
// Machine-wide: /proc/stat. Its idle and iowait columns come, with
// CONFIG_NO_HZ_IDLE (set here), from the idle entry and exit times, not
// from ticks: the busy time of all CPUs, wall time × CPUs less idle,
// iowait and steal, carries no sampling noise (only the 10 ms unit of the
// file). The other columns are tick-sampled (CONFIG_TICK_CPU_ACCOUNTING,
// HZ 250, printed in USER_HZ): the softirq and irq columns hold the
// softirq work wherever it ran (ksoftirqd, irq exit, local_bh_enable in a
// process's context), give or take the sampling. Without
// CONFIG_IRQ_TIME_ACCOUNTING (not set here) the kernel also charges to a
// process as system time every tick that found a softirq running on top
// of it: the TC and XDP programs of our datapath run there, on top of
// whatever process the CPU was running, another engineer's compiler too.
// So the machine-wide figure subtracts other processes' USER time only (a
// tick in user mode is never softirq); their system time stays in it
// (PerfSample.OthersSys says how much), and work moved into softirq
// cannot look like a gain. Steal is the hypervisor's and is subtracted.
//
// Per process: the lab process (servers, in-process clients, the
// dataplane) by getrusage(RUSAGE_SELF), and a worker client by its
// cgroup's cpu.stat usage_usec (each worker is alone in its cgroup).
// Both are the scheduler's run time: precise, and, without
// IRQ_TIME_ACCOUNTING, including the softirqs that ran on top of them.
// The shares therefore overlap the softirq figure and do not add up to
// the machine-wide one (kernel threads, the softirqs on idle CPUs and
// others' system time are in none of them).

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// perUnit is d in µs per connection (conns) or per GB (bulk); 0 without
// either.
func (s PerfSample) perUnit(d time.Duration) float64 {
	if s.Workload == WorkloadBulk {
		if s.Bytes == 0 {
			return 0
		}
		return float64(d) / 1e3 / (float64(s.Bytes) / 1e9)
	}
	if s.OK == 0 {
		return 0
	}
	return float64(d) / 1e3 / float64(s.OK)
}

// Rate is connections per second (conns) or bits per second (bulk).
func (s PerfSample) Rate() float64 {
	if s.Elapsed <= 0 {
		return 0
	}
	if s.Workload == WorkloadBulk {
		return float64(s.Bytes) * 8 / s.Elapsed.Seconds()
	}
	return float64(s.OK) / s.Elapsed.Seconds()
}

// CPUPerUnit is the machine-wide CPU time (PerfSample.CPU) in µs per
// connection (conns) or per GB (bulk).
func (s PerfSample) CPUPerUnit() float64 { return s.perUnit(s.CPU) }

// SoftIRQPerUnit is the machine's irq and softirq time, per connection
// or per GB as CPUPerUnit.
func (s PerfSample) SoftIRQPerUnit() float64 { return s.perUnit(s.SoftIRQ) }

// ClientPerUnit is the client worker's CPU time per connection or per GB
// (0 when the client ran in the lab process).
func (s PerfSample) ClientPerUnit() float64 { return s.perUnit(s.Client) }

// LabPerUnit is the lab process's CPU time per connection or per GB: the
// servers, and the client when it is no worker.
func (s PerfSample) LabPerUnit() float64 { return s.perUnit(s.Lab) }

// BPFPerUnit is our programs' run time in µs per connection (conns) or
// per GB (bulk).
func (s PerfSample) BPFPerUnit() float64 { return s.perUnit(s.BPF) }

// BPFPerRun is our programs' run time in ns per run: one run is one
// packet through one program (at one hook), or one socket call through
// one socket hook. 0 without runs.
func (s PerfSample) BPFPerRun() float64 {
	if s.BPFRuns == 0 {
		return 0
	}
	return float64(s.BPF) / float64(s.BPFRuns)
}

// BPFRunsPerConn is how often our programs ran per connection (conns) or
// per MB (bulk).
func (s PerfSample) BPFRunsPerConn() float64 {
	if s.Workload == WorkloadBulk {
		if s.Bytes == 0 {
			return 0
		}
		return float64(s.BPFRuns) / (float64(s.Bytes) / 1e6)
	}
	if s.OK == 0 {
		return 0
	}
	return float64(s.BPFRuns) / float64(s.OK)
}

// cpuSnap is a reading of the machine's CPU accounting, in USER_HZ ticks
// (100 per second on every Linux architecture Go supports).
type cpuSnap struct {
	at         time.Time // when /proc/stat was read
	idle       uint64    // all CPUs: idle and iowait
	steal      uint64
	irq        uint64 // all CPUs: irq and softirq
	othersUser uint64 // user and children's user time of other processes
	othersSys  uint64 // system and children's system time of other processes
	ok         bool
}

// parseProcStat reads the first ("cpu") line of /proc/stat into c.
func parseProcStat(b []byte, c *cpuSnap) error {
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return fmt.Errorf("/proc/stat: first line %q", line)
	}
	for _, i := range []int{4, 5, 6, 7, 8} { // idle iowait irq softirq steal
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return fmt.Errorf("/proc/stat: %w", err)
		}
		switch i {
		case 4, 5:
			c.idle += v
		case 6, 7:
			c.irq += v
		case 8:
			c.steal = v
		}
	}
	return nil
}

// parsePidStat reads a /proc/<pid>/stat: the user (utime + cutime) and
// system (stime + cstime) ticks, and whether it is a kernel thread
// (parent kthreadd, pid 2). ok is false for a malformed line.
func parsePidStat(b []byte) (user, sys uint64, kthread, ok bool) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false, false
	}
	// After the command: state ppid ... utime(14) stime cutime cstime.
	r := strings.Fields(string(b[i+1:]))
	if len(r) < 15 {
		return 0, 0, false, false
	}
	var v [4]uint64
	for j, s := range r[11:15] {
		n, _ := strconv.ParseInt(s, 10, 64)
		v[j] = uint64(max(n, 0))
	}
	return v[0] + v[2], v[1] + v[3], r[1] == "2", true
}

// readCPU reads /proc/stat and every other process's /proc/<pid>/stat
// (other than ours and than skip: the perf workers, whose CPU time is the
// measurement's).
// A process that ends is reaped by a parent whose children time then
// grows by all of it, so the sum over the processes alive at each
// reading grows by exactly what ran in between. Kernel threads are left
// out of it: their work here is mostly the workload's own (ksoftirqd,
// RCU, kworkers).
func readCPU(skip ...int) cpuSnap {
	c := cpuSnap{at: time.Now()}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSnap{}
	}
	if parseProcStat(b, &c) != nil {
		return cpuSnap{}
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return cpuSnap{}
	}
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid == 2 || slices.Contains(skip, pid) {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue // gone meanwhile
		}
		if u, s, kthread, ok := parsePidStat(b); ok && !kthread {
			c.othersUser += u
			c.othersSys += s
		}
	}
	c.ok = true
	return c
}

// grew is b-a, or 0 when the sum shrank (a process ended before its
// parent reaped it).
func grew(a, b uint64) uint64 { return max(a, b) - a }

// account sets s.CPU, s.SoftIRQ, s.OthersSys and s.Others from readings
// before and after it, on a machine of ncpu CPUs: the busy time is the
// wall time between the readings on all CPUs less idle (with iowait) and
// steal.
func (s *PerfSample) account(a, b cpuSnap, ncpu int) {
	wall := b.at.Sub(a.at)
	if !a.ok || !b.ok || wall <= 0 || ncpu <= 0 {
		return
	}
	tick := 10 * time.Millisecond
	total := wall * time.Duration(ncpu)
	steal := time.Duration(grew(a.steal, b.steal)) * tick
	user := time.Duration(grew(a.othersUser, b.othersUser)) * tick
	sys := time.Duration(grew(a.othersSys, b.othersSys)) * tick
	busy := total - time.Duration(grew(a.idle, b.idle))*tick - steal
	s.CPU = max(busy-user, 0)
	s.SoftIRQ = time.Duration(grew(a.irq, b.irq)) * tick
	s.OthersSys = sys
	s.Others = min(float64(steal+user+sys)/float64(total), 1)
}

// procCPU is the CPU time of the lab process (getrusage RUSAGE_SELF, its
// threads, not its children) and of a client worker's cgroup; cgroup is
// empty for a client in the lab process.
type procCPU struct {
	lab, client time.Duration
}

// readProcCPU reads them.
func readProcCPU(cgroup string) (procCPU, error) {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return procCPU{}, fmt.Errorf("getrusage: %w", err)
	}
	c := procCPU{lab: time.Duration(ru.Utime.Nano() + ru.Stime.Nano())}
	if cgroup == "" {
		return c, nil
	}
	b, err := os.ReadFile(filepath.Join(cgroup, "cpu.stat"))
	if err != nil {
		return c, err
	}
	c.client, err = parseCgroupUsage(b)
	return c, err
}

// parseCgroupUsage reads usage_usec from a cgroup v2 cpu.stat.
func parseCgroupUsage(b []byte) (time.Duration, error) {
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "usage_usec "); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("cpu.stat usage_usec %q: %w", v, err)
			}
			return time.Duration(n) * time.Microsecond, nil
		}
	}
	return 0, fmt.Errorf("cpu.stat: no usage_usec")
}

// accountProcs sets s.Lab and s.Client from readings before and after it.
func (s *PerfSample) accountProcs(a, b procCPU, worker bool) {
	s.Lab = max(b.lab-a.lab, 0)
	s.ClientWorker = worker
	if worker {
		s.Client = max(b.client-a.client, 0)
	}
}

// ncpu is the machine's CPU count for the accounting.
func ncpu() int { return runtime.NumCPU() }
