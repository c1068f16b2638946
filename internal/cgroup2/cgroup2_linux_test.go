package cgroup2

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRootAndCheck runs against the real machine: whatever Root finds must
// pass Check, and the same mount table must agree.
func TestRootAndCheck(t *testing.T) {
	root, err := Root()
	if errors.Is(err, ErrNoCgroupV2) {
		t.Skipf("this machine has no cgroup v2: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := Check(root); err != nil {
		t.Fatalf("Check(Root() = %s): %v", root, err)
	}
	// Every cgroup v2 directory has cgroup.procs; a file is not a cgroup.
	procs := filepath.Join(root, "cgroup.procs")
	if _, err := os.Stat(procs); err != nil {
		t.Fatalf("%s: %v", procs, err)
	}
	if err := Check(procs); !errors.Is(err, ErrNotCgroupV2) || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("Check(%s) = %v; want ErrNotCgroupV2, not a directory", procs, err)
	}
}

func TestCheckRejects(t *testing.T) {
	if err := Check(t.TempDir()); !errors.Is(err, ErrNotCgroupV2) || !strings.Contains(err.Error(), "filesystem magic") {
		t.Errorf("Check(temp dir) = %v; want ErrNotCgroupV2 naming the filesystem", err)
	}
	missing := filepath.Join(t.TempDir(), "nope")
	if err := Check(missing); !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrNotCgroupV2) {
		t.Errorf("Check(missing) = %v; want fs.ErrNotExist", err)
	}
}

// TestCheckV1 checks a cgroup v1 hierarchy when the machine has one
// mounted (hybrid hosts like the one this was written on).
func TestCheckV1(t *testing.T) {
	f, err := os.Open(MountInfoPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ms, err := parseMountInfo(f)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.fsType != "cgroup" {
			continue
		}
		err := Check(m.mountPoint)
		if !errors.Is(err, ErrNotCgroupV2) || !strings.Contains(err.Error(), "cgroup v1") {
			t.Errorf("Check(%s) = %v; want ErrNotCgroupV2 saying cgroup v1", m.mountPoint, err)
		}
		return
	}
	t.Skip("no cgroup v1 hierarchy mounted here")
}
