package fluxvm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/fluxvm/servicefabric/internal/flock"
)

// CatalogLockSuffix names the lock file next to the catalog:
// CatalogPath + CatalogLockSuffix. Open holds an flock on it while the
// dataplane is open, and Cleanup while it removes the catalog, the
// journal and the HA lease file: state outside bpffs, which the pin
// root's lock does not cover (a cleanup that does not see the pin root,
// or names another one, still finds the catalog held). Dataplane.Cleanup
// and Cleanup remove it last, a failed first Open too; Close leaves it.
const CatalogLockSuffix = ".lock"

// catalogLock is the hold of a catalog's lock file.
type catalogLock struct {
	path string
	f    *os.File
	made bool // this hold created the file
}

// lockCatalog takes the lock file of the catalog at catalog (empty: no
// catalog, no lock). The catalog's directory must exist (the journal
// is written there). A lock held elsewhere fails with ErrInUse naming
// the holder; nothing is changed then.
func lockCatalog(catalog string) (*catalogLock, error) {
	if catalog == "" {
		return nil, nil
	}
	path := catalog + CatalogLockSuffix
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
				return nil, fmt.Errorf("catalog %s is %w: %w", catalog, err, ErrInUse)
			}
			return nil, fmt.Errorf("catalog %s: lock file: %w", catalog, err)
		}
		if !flock.Same(f, path) {
			// Removed (a cleanup finishing) between the open and the
			// lock: lock what the path names now.
			f.Close()
			continue
		}
		return &catalogLock{path: path, f: f, made: made}, nil
	}
	return nil, fmt.Errorf("catalog %s: lock file removed and recreated while being locked, three times: %w", catalog, ErrInUse)
}

// release lets the lock go, leaving the file. nil: nothing held.
func (l *catalogLock) release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// remove removes the lock file while held, then lets it go: the last step
// of a cleanup. Whoever opened the file before finds it held, and once
// it holds it, that the path names another file or none.
func (l *catalogLock) remove() error {
	if l == nil || l.f == nil {
		return nil
	}
	var err error
	if rerr := os.Remove(l.path); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
		err = fmt.Errorf("catalog lock: %w", rerr)
	}
	return errors.Join(err, l.release())
}

// abandon undoes lockCatalog for a failed Open: it removes the file when
// this hold created it, and lets it go.
func (l *catalogLock) abandon() error {
	if l == nil || !l.made {
		return l.release()
	}
	return l.remove()
}
