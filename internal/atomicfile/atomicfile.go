// Package atomicfile replaces files so that a reader, or a crash, sees
// either the old content or the new one, never a mix or a truncated file.
//
// The new content goes to a temporary file in the target's directory (so
// the rename stays on one file system), which is written, given its mode,
// fsynced and closed, then renamed over the target; finally the directory
// is fsynced so the rename itself survives a crash. The temporary file's
// name starts with "." + the target's base name + ".tmp-", so it stays out
// of the way of programs that list the directory, and a caller can find
// the leftovers of an interrupted write by [TempPrefix].
package atomicfile

import (
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
)

// DirMode is the permission of directories Write creates (before the
// umask).
const DirMode fs.FileMode = 0o755

// DirSyncError is the error of a Write whose rename succeeded but whose
// final fsync of the directory failed: readers already see the new file,
// but it may not survive a crash. Any other error of Write leaves the
// target as it was.
type DirSyncError struct {
	Err error
}

func (e *DirSyncError) Error() string {
	return "written, but syncing the directory failed: " + e.Err.Error()
}

func (e *DirSyncError) Unwrap() error { return e.Err }

// TempPrefix is how the name of every temporary file Write makes for path
// starts (the name alone, without the directory).
func TempPrefix(path string) string { return "." + filepath.Base(path) + ".tmp-" }

// Write replaces path with data and gives it perm (exactly: the umask
// does not apply). Missing directories are created with [DirMode]. On
// every failure the temporary file is removed; when only the directory
// sync failed the error is a [*DirSyncError].
func Write(path string, data []byte, perm fs.FileMode) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, DirMode); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, TempPrefix(path)+"*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	renamed := false
	defer func() {
		if !renamed {
			os.Remove(tmp)
		}
	}()
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	renamed = true
	if err := SyncDir(dir); err != nil {
		return &DirSyncError{Err: err}
	}
	return nil
}

// SyncDir fsyncs the directory dir, so that the entries created, renamed
// or removed in it survive a crash.
func SyncDir(dir string) error {
	if runtime.GOOS == "windows" {
		// Windows has no fsync of a directory (opening one for it is
		// refused); NTFS journals the rename itself.
		return nil
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
