package catalog

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
)

// TestLock: the catalog's lock file is held by one holder at a time (a
// second fails with ErrInUse and changes nothing); Release lets it go and
// leaves the file, Remove removes it, Abandon removes it only when this
// hold created it.
func TestLock(t *testing.T) {
	for _, tc := range []struct {
		name     string
		existing bool                // the lock file exists before TakeLock
		end      func(l *Lock) error // how the first holder lets go
		left     bool                // the lock file is there afterwards
	}{
		{"release", false, (*Lock).Release, true},
		{"remove", true, (*Lock).Remove, false},
		{"abandon a file it made", false, (*Lock).Abandon, false},
		{"abandon a file it found", true, (*Lock).Abandon, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "catalog.json")
			if tc.existing {
				if err := os.WriteFile(path+LockSuffix, nil, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			l, err := TakeLock(path)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := TakeLock(path); !errors.Is(err, bpf.ErrInUse) || !strings.Contains(err.Error(), "this process") {
				t.Errorf("second TakeLock while held: %v, want ErrInUse naming the holder", err)
			}
			if err := tc.end(l); err != nil {
				t.Fatal(err)
			}
			_, err = os.Stat(path + LockSuffix)
			if left := err == nil; left != tc.left {
				t.Errorf("lock file left: %v, want %v (%v)", left, tc.left, err)
			}
			l2, err := TakeLock(path)
			if err != nil {
				t.Fatalf("TakeLock after the holder let go: %v", err)
			}
			if err := l2.Release(); err != nil {
				t.Fatal(err)
			}
			if err := tc.end(l); err != nil {
				t.Errorf("second let-go: %v", err)
			}
		})
	}
	t.Run("no catalog", func(t *testing.T) {
		l, err := TakeLock("")
		if l != nil || err != nil {
			t.Errorf("TakeLock(\"\") = %v, %v", l, err)
		}
		if err := l.Release(); err != nil {
			t.Error(err)
		}
	})
	t.Run("no directory", func(t *testing.T) {
		_, err := TakeLock(filepath.Join(t.TempDir(), "missing", "catalog.json"))
		if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "does not exist") {
			t.Errorf("err %v, want the missing directory named", err)
		}
	})
}
