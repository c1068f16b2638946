package fluxvm

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// errFound ends the walk of cgroupPathByID.
var errFound = errors.New("found")

// cgroupPathByID finds the directory of the cgroup with id (its inode
// number on cgroup2) below root. found is false when no directory has it:
// the cgroup was removed.
func cgroupPathByID(root string, id uint64) (path string, found bool, err error) {
	var st unix.Stat_t
	err = filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			// A cgroup removed during the walk, or one we may not read.
			if p == root {
				return err
			}
			return fs.SkipDir
		}
		if !e.IsDir() {
			return nil
		}
		if unix.Stat(p, &st) == nil && st.Ino == id {
			path = p
			return errFound
		}
		return nil
	})
	if errors.Is(err, errFound) {
		return path, true, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("find cgroup %d below %s: %w", id, root, err)
	}
	return "", false, nil
}
