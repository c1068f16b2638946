//go:build unix

package atomicfile

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// tempFiles lists the temporary files Write left for path.
func tempFiles(t *testing.T, path string) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Dir(path))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), TempPrefix(path)) {
			out = append(out, e.Name())
		}
	}
	return out
}

func TestWrite(t *testing.T) {
	old := syscall.Umask(0o077) // perm applies exactly, whatever the umask
	t.Cleanup(func() { syscall.Umask(old) })

	for _, perm := range []fs.FileMode{0o600, 0o644, 0o640} {
		t.Run(perm.String(), func(t *testing.T) {
			// The directory does not exist yet: Write creates it.
			path := filepath.Join(t.TempDir(), "a", "b", "state.json")
			for _, data := range []string{"first", "second, longer than the first", ""} {
				if err := Write(path, []byte(data), perm); err != nil {
					t.Fatalf("Write(%q): %v", data, err)
				}
				got, err := os.ReadFile(path)
				if err != nil {
					t.Fatal(err)
				}
				if string(got) != data {
					t.Fatalf("content %q, want %q", got, data)
				}
				fi, err := os.Stat(path)
				if err != nil {
					t.Fatal(err)
				}
				if fi.Mode().Perm() != perm {
					t.Fatalf("mode %v, want %v", fi.Mode().Perm(), perm)
				}
				if tmp := tempFiles(t, path); len(tmp) != 0 {
					t.Fatalf("temporary files left: %v", tmp)
				}
			}
			di, err := os.Stat(filepath.Dir(path))
			if err != nil {
				t.Fatal(err)
			}
			if di.Mode().Perm()&^DirMode != 0 {
				t.Fatalf("directory mode %v is wider than %v", di.Mode().Perm(), DirMode)
			}
		})
	}
}

// TestWriteRenameOverDirectory makes the rename fail: the target is a
// directory that is not empty. The target stays as it was and the
// temporary file is removed.
func TestWriteRenameOverDirectory(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	if err := os.MkdirAll(filepath.Join(path, "inside"), 0o755); err != nil {
		t.Fatal(err)
	}
	err := Write(path, []byte("data"), 0o600)
	if err == nil {
		t.Fatal("Write over a directory succeeded")
	}
	var dse *DirSyncError
	if errors.As(err, &dse) {
		t.Fatalf("error %v claims the rename succeeded", err)
	}
	var le *os.LinkError
	if !errors.As(err, &le) || le.Op != "rename" {
		t.Fatalf("error %v, want the rename's *os.LinkError", err)
	}
	if fi, err := os.Stat(path); err != nil || !fi.IsDir() {
		t.Fatalf("target changed: %v, %v", fi, err)
	}
	if tmp := tempFiles(t, path); len(tmp) != 0 {
		t.Fatalf("temporary files left: %v", tmp)
	}
}

// TestWriteDirectoryIsAFile makes creating the directory fail.
func TestWriteDirectoryIsAFile(t *testing.T) {
	block := filepath.Join(t.TempDir(), "block")
	if err := os.WriteFile(block, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	err := Write(filepath.Join(block, "state.json"), []byte("data"), 0o600)
	if !errors.Is(err, syscall.ENOTDIR) {
		t.Fatalf("error %v, want ENOTDIR", err)
	}
}

func TestDirSyncError(t *testing.T) {
	inner := &os.PathError{Op: "sync", Path: "/d", Err: syscall.EIO}
	err := error(&DirSyncError{Err: inner})
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("%v does not unwrap to EIO", err)
	}
	if want := "written, but syncing the directory failed: sync /d: input/output error"; err.Error() != want {
		t.Fatalf("error %q, want %q", err, want)
	}
}

func TestSyncDir(t *testing.T) {
	if err := SyncDir(t.TempDir()); err != nil {
		t.Fatal(err)
	}
	if err := SyncDir(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("SyncDir of a missing directory: %v, want ErrNotExist", err)
	}
}
