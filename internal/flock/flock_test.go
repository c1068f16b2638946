package flock

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTry: a second hold of one file conflicts within one process (each
// open is its own holder) and names this process; Same notices a locked
// file removed, or replaced by another under the same path.
func TestTry(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.lock")
	open := func() *os.File {
		t.Helper()
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	a, b := open(), open()
	if err := Try(a); err != nil {
		t.Fatal(err)
	}
	err := Try(b)
	if !errors.Is(err, ErrHeld) || !strings.Contains(err.Error(), fmt.Sprintf("this process (pid %d)", os.Getpid())) {
		t.Errorf("second hold: %v; want ErrHeld naming this process", err)
	}
	if !Same(a, path) {
		t.Error("Same: false for the file the path names")
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if Same(a, path) {
		t.Error("Same: true after the path was removed")
	}
	c := open()
	if err := Try(c); err != nil {
		t.Errorf("hold of the file now at the path: %v", err)
	}
	if Same(a, path) {
		t.Error("Same: true for a file replaced under the path")
	}
	a.Close()
	if err := Try(b); err != nil {
		t.Errorf("hold after the holder closed: %v", err)
	}
}
