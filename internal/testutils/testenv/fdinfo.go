package testenv

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

// FdinfoMemlock returns the memlock line of the kernel's fdinfo of the
// BPF map open as fd in this process (what `bpftool map show` prints),
// read directly: a source independent of cilium/ebpf's MapInfo for
// checking the memory figures the SDK reports.
func FdinfoMemlock(tb testing.TB, fd int) uint64 {
	tb.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "memlock:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			if err != nil {
				tb.Fatalf("testenv: fdinfo of fd %d: memlock %q: %v", fd, v, err)
			}
			return n
		}
	}
	tb.Fatalf("testenv: fdinfo of fd %d has no memlock line (%v)", fd, sc.Err())
	return 0
}

// BPFHandles counts the BPF objects (maps, programs, links) this process
// has open, from /proc/self/fd: a leak check around an operation that
// must close what it replaced.
func BPFHandles(tb testing.TB) int {
	tb.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(target, "anon_inode:bpf") {
			n++
		}
	}
	return n
}
