package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// readOnly makes dir read-only for this process: a mode of 0555, or, for
// a process that a mode does not stop (root), a read-only bind mount of
// dir onto itself, removed at cleanup.
func readOnly(t *testing.T, dir string) {
	t.Helper()
	if err := os.Chmod(dir, 0o555); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(dir, 0o755) })
	if unix.Access(dir, unix.W_OK) != nil {
		return
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Skipf("cannot make %s read-only: a mode does not stop this process and bind mounts fail: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	if err := unix.Mount("", dir, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		t.Fatalf("remount %s read-only: %v", dir, err)
	}
}

// TestWriteReadOnlyDirectory makes creating the temporary file fail: the
// existing target stays as it was and nothing is left behind.
func TestWriteReadOnlyDirectory(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "state.json")
	if err := Write(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	readOnly(t, dir)
	err := Write(path, []byte("new"), 0o644)
	if !errors.Is(err, unix.EACCES) && !errors.Is(err, unix.EROFS) {
		t.Fatalf("Write into a read-only directory: %v, want EACCES or EROFS", err)
	}
	if got, err := os.ReadFile(path); err != nil || string(got) != "old" {
		t.Fatalf("target after the failed write: %q, %v; want %q", got, err, "old")
	}
	if tmp := tempFiles(t, path); len(tmp) != 0 {
		t.Fatalf("temporary files left: %v", tmp)
	}
}
