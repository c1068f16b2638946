package cgtest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// Cgroup is a cgroup v2 directory that one test created and owns.
type Cgroup struct {
	// Path is the cgroup's directory, what AttachCgroup takes.
	Path string
	// Name is its path relative to the hierarchy's root, with a leading
	// "/": what /proc/<pid>/cgroup shows for a process inside.
	Name string
}

// New creates a cgroup "fluxvm-test-<suffix>" directly below the cgroup v2
// root and removes it when the test ends: processes still inside are
// killed and the directory (with any sub-cgroups the test made) removed.
// It skips, or fails with FLUXVM_REQUIRE_PRIVILEGED=1, without root or
// without cgroup v2.
func New(tb testing.TB) *Cgroup {
	tb.Helper()
	root := testenv.CgroupV2Root(tb)
	name := "fluxvm-test-" + testenv.Suffix()
	cg := &Cgroup{Path: filepath.Join(root, name), Name: "/" + name}
	if err := os.Mkdir(cg.Path, 0o755); err != nil {
		tb.Fatalf("cgtest: create cgroup: %v", err)
	}
	tb.Cleanup(func() {
		if err := cg.remove(5 * time.Second); err != nil {
			tb.Errorf("cgtest: %v", err)
		}
	})
	return cg
}

// Procs returns the pids in the cgroup itself (not in sub-cgroups).
func (cg *Cgroup) Procs() ([]int, error) {
	b, err := os.ReadFile(filepath.Join(cg.Path, "cgroup.procs"))
	if err != nil {
		return nil, fmt.Errorf("cgtest: %w", err)
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("cgtest: cgroup.procs of %s: %q", cg.Path, f)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// Populated reports whether a process lives in the cgroup or below it
// (cgroup.events).
func (cg *Cgroup) Populated() (bool, error) {
	return populated(cg.Path)
}

func populated(dir string) (bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
	if err != nil {
		return false, fmt.Errorf("cgtest: %w", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "populated "); ok {
			return v != "0", nil
		}
	}
	return false, fmt.Errorf("cgtest: %s/cgroup.events has no populated line", dir)
}

// remove kills everything in the cgroup and its sub-cgroups, waits (at
// most timeout) until none is left, then removes the directories bottom up.
func (cg *Cgroup) remove(timeout time.Duration) error {
	if _, err := os.Stat(cg.Path); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err := os.WriteFile(filepath.Join(cg.Path, "cgroup.kill"), []byte("1"), 0); err != nil {
		// Kernels before 5.14 have no cgroup.kill: signal what is listed.
		if pids, perr := cg.Procs(); perr == nil {
			for _, pid := range pids {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	deadline := time.Now().Add(timeout)
	for {
		busy, err := cg.Populated()
		if err != nil {
			return err
		}
		if !busy {
			break
		}
		if time.Now().After(deadline) {
			pids, _ := cg.Procs()
			return fmt.Errorf("cgroup %s still populated %v after kill (pids %v)", cg.Path, timeout, pids)
		}
		time.Sleep(10 * time.Millisecond)
	}
	var dirs []string
	err := filepath.WalkDir(cg.Path, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("list cgroup %s: %w", cg.Path, err)
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		for {
			err := syscall.Rmdir(dirs[i])
			if err == nil || err == syscall.ENOENT {
				break
			}
			// A just-killed task may still be leaving the cgroup.
			if err != syscall.EBUSY || time.Now().After(deadline) {
				return fmt.Errorf("remove cgroup %s: %w", dirs[i], err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}
