// Package flock holds files and directories with exclusive, non-blocking
// flock(2) locks, as the pin root and the catalog of a dataplane are held,
// and names the process that holds one (from /proc/locks).
//
// A lock is on an open file, not on a path. A holder that removes the
// path it locked (a cleanup removing everything) stays safe when every
// taker, once it holds a lock, checks that the path still names what it
// locked (Same) and starts again otherwise: whoever opened the removed
// file before it was removed finds it locked, or finds it gone.
package flock

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrHeld reports a lock that another open file holds (this process's
// or another's).
var ErrHeld = errors.New("held")

// Try takes an exclusive, non-blocking flock on f. A lock held elsewhere
// fails with an error matching ErrHeld that names the holder.
func Try(f *os.File) error {
	err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		return nil
	}
	if errors.Is(err, unix.EWOULDBLOCK) {
		return fmt.Errorf("%w by %s", ErrHeld, Holder(f))
	}
	return fmt.Errorf("flock: %w", err)
}

// Same reports whether path still names the file open as f.
func Same(f *os.File, path string) bool {
	var a, b unix.Stat_t
	if unix.Fstat(int(f.Fd()), &a) != nil || unix.Stat(path, &b) != nil {
		return false
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}

// Holder names the process holding the flock on the file open as f:
// "this process (pid N): …", "pid N (command)", or "another owner" when
// /proc/locks does not tell.
func Holder(f *os.File) string {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return "another owner"
	}
	locks, err := os.Open("/proc/locks")
	if err != nil {
		return "another owner (/proc/locks unreadable)"
	}
	defer locks.Close()
	id := fmt.Sprintf("%02x:%02x:%d", unix.Major(uint64(st.Dev)), unix.Minor(uint64(st.Dev)), st.Ino)
	sc := bufio.NewScanner(locks)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  WRITE 1234 00:28:24662 0 EOF"; waiters
		// have "->" after the number.
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || fields[1] != "FLOCK" || fields[5] != id {
			continue
		}
		pid, err := strconv.Atoi(fields[4])
		if err != nil || pid <= 0 {
			continue
		}
		if pid == os.Getpid() {
			return fmt.Sprintf("this process (pid %d): a dataplane on it is open", pid)
		}
		if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil {
			return fmt.Sprintf("pid %d (%s)", pid, strings.TrimSpace(string(comm)))
		}
		return fmt.Sprintf("pid %d", pid)
	}
	return "another owner"
}
