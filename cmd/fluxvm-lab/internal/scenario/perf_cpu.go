//go:build linux

package scenario

import (
	"bytes"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// CPUPerUnit is CPU time in µs per connection (conns) or per GB (bulk).
func (s PerfSample) CPUPerUnit() float64 {
	if s.Workload == WorkloadBulk {
		if s.Bytes == 0 {
			return 0
		}
		return float64(s.CPU) / 1e3 / (float64(s.Bytes) / 1e9)
	}
	if s.OK == 0 {
		return 0
	}
	return float64(s.CPU) / 1e3 / float64(s.OK)
}

// cpuSnap is a reading of the machine's CPU accounting, in USER_HZ ticks
// (100 per second on every Linux architecture Go supports).
type cpuSnap struct {
	busy   uint64 // all CPUs: user, nice, system, irq, softirq, steal
	steal  uint64
	others uint64 // user and children time of other processes
	ok     bool
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
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSnap{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuSnap{}
	}
	var c cpuSnap
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system irq softirq steal
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return cpuSnap{}
		}
		c.busy += v
		if i == 8 {
			c.steal = v
		}
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
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		// After the command: state ppid ... utime(14) stime cutime cstime.
		r := strings.Fields(string(b[i+1:]))
		if len(r) < 15 || r[1] == "2" {
			continue
		}
		for _, v := range r[11:15] {
			n, _ := strconv.ParseInt(v, 10, 64)
			if n > 0 {
				c.others += uint64(n)
			}
		}
	}
	c.ok = true
	return c
}

// account sets s.CPU and s.Others from readings before and after it.
func (s *PerfSample) account(a, b cpuSnap, elapsed time.Duration) {
	if !a.ok || !b.ok || elapsed <= 0 {
		return
	}
	tick := 10 * time.Millisecond
	others := (b.steal - a.steal) + max(b.others, a.others) - a.others
	if busy := b.busy - a.busy; busy > others {
		s.CPU = time.Duration(busy-others) * tick
	}
	s.Others = float64(time.Duration(others)*tick) / float64(elapsed) / float64(runtime.NumCPU())
}

// BPFPerUnit is our programs' run time in µs per connection (conns) or
// per GB (bulk).
func (s PerfSample) BPFPerUnit() float64 {
	c := s
	c.CPU = s.BPF
	return c.CPUPerUnit()
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
