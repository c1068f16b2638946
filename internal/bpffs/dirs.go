package bpffs

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// MissingDirs lists the directories from dir up that do not exist yet,
// deepest first: those that os.MkdirAll(dir) would create, and that the
// rollback of a failed step removes again (RemoveEmptyDirs).
func MissingDirs(dir string) []string {
	if !filepath.IsAbs(dir) {
		return nil
	}
	var out []string
	for d := filepath.Clean(dir); d != filepath.Dir(d); d = filepath.Dir(d) {
		if _, err := os.Lstat(d); !errors.Is(err, fs.ErrNotExist) {
			break
		}
		out = append(out, d)
	}
	return out
}

// RemoveEmptyDirs removes the directories of dirs, in order (deepest
// first), that are still there and empty; one that holds something now
// (someone else's) stays, and is no error.
func RemoveEmptyDirs(dirs []string) error {
	var errs []error
	for _, d := range dirs {
		err := os.Remove(d)
		if err == nil || errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST) {
			continue
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
