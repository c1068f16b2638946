package catalog

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/flock"
)

// LockSuffix names the lock file next to the catalog: path + LockSuffix.
// The dataplane holds an flock on it while it is open, and a cleanup
// while it removes the catalog, the journal and the HA lease file: state
// outside bpffs, which the pin root's lock does not cover (a cleanup that
// does not see the pin root, or names another one, still finds the
// catalog held). A cleanup removes it last (Lock.Remove), a failed first
// start too (Lock.Abandon); a stop leaves it (Lock.Release).
const LockSuffix = ".lock"

// Lock is the hold of a catalog's lock file. A nil *Lock holds nothing:
// its methods do nothing.
type Lock struct {
	path string
	f    *os.File
	made bool // this hold created the file
}

// TakeLock takes the lock file of the catalog at catalog (empty: no
// catalog, no lock: nil). The catalog's directory must exist (the
// journal is written there). A lock held elsewhere fails with an error
// matching bpf.ErrInUse (fluxvm.ErrInUse) naming the holder;
// nothing is changed then.
func TakeLock(catalog string) (*Lock, error) {
	if catalog == "" {
		return nil, nil
	}
	path := catalog + LockSuffix
	for range 3 {
		made := true
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			made = false
			f, err = os.OpenFile(path, os.O_RDWR, 0)
		}
		if errors.Is(err, fs.ErrNotExist) && !made {
			continue // removed between the two opens
		}
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("catalog %s: its directory %s does not exist: %w", catalog, filepath.Dir(catalog), err)
			}
			return nil, fmt.Errorf("catalog %s: lock file: %w", catalog, err)
		}
		if err := flock.Try(f); err != nil {
			f.Close()
			if errors.Is(err, flock.ErrHeld) {
				return nil, fmt.Errorf("catalog %s is %w: %w", catalog, err, bpf.ErrInUse)
			}
			return nil, fmt.Errorf("catalog %s: lock file: %w", catalog, err)
		}
		if !flock.Same(f, path) {
			// Removed (a cleanup finishing) between the open and the
			// lock: lock what the path names now.
			f.Close()
			continue
		}
		return &Lock{path: path, f: f, made: made}, nil
	}
	return nil, fmt.Errorf("catalog %s: lock file removed and recreated while being locked, three times: %w", catalog, bpf.ErrInUse)
}

// Release lets the lock go, leaving the file.
func (l *Lock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// Remove removes the lock file while held, then lets it go: the last step
// of a cleanup. Whoever opened the file before finds it held, and once
// it holds it, that the path names another file or none.
func (l *Lock) Remove() error {
	if l == nil || l.f == nil {
		return nil
	}
	var err error
	if rerr := os.Remove(l.path); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
		err = fmt.Errorf("catalog lock: %w", rerr)
	}
	return errors.Join(err, l.Release())
}

// Abandon undoes TakeLock for a failed start: it removes the file when
// this hold created it, and lets it go.
func (l *Lock) Abandon() error {
	if l == nil || !l.made {
		return l.Release()
	}
	return l.Remove()
}
