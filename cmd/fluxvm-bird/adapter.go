package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/internal/atomicfile"
)

// OutputMode is the permission of the include file: BIRD may run as its
// own user and must read it.
const OutputMode fs.FileMode = 0o644

// Adapter keeps one BIRD include file in step with the advertisement
// snapshot. It is not safe for concurrent use: one goroutine calls Sync.
type Adapter struct {
	Snapshot string // the snapshot file FluxVM publishes
	Output   string // the include file BIRD's configuration includes
	Birdc    string // the birdc binary
	Socket   string // BIRD's control socket; birdc's default when empty
	Render   RenderOptions
	// Retry is how long after a failed configure the next attempt is
	// made when the snapshot has not changed meanwhile.
	Retry time.Duration
	// Timeout bounds one birdc run.
	Timeout time.Duration
	Log     *slog.Logger

	seen       fileID    // the snapshot last read (or found unreadable)
	configured bool      // BIRD accepted the file's current content
	failedAt   time.Time // when the last configure failed
	missing    bool      // the last look found no snapshot
}

// fileID tells snapshot versions apart without reading them: every
// rewrite of the snapshot is a rename, so it has a new inode.
type fileID struct {
	ino   uint64
	mtime time.Time
	size  int64
}

// ConfigureError is a birdc configure that did not confirm that BIRD runs
// the new file. Unreachable is true when birdc could not talk to BIRD at
// all (not running, wrong socket): the file is then kept, since BIRD reads
// it when it starts. Unknown is true when the outcome is not known: birdc
// timed out, could not be run, was killed, or answered without a reply
// code; BIRD may have loaded the new file, so it is kept and the
// configure retried. Otherwise BIRD refused the configuration (an error
// reply, code 8xxx or 9xxx) and the previous file was put back.
type ConfigureError struct {
	Unreachable bool
	Unknown     bool
	Output      string
	Err         error
}

func (e *ConfigureError) Error() string {
	what := "BIRD refused the configuration"
	switch {
	case e.Unreachable:
		what = "BIRD is not reachable"
	case e.Unknown:
		what = "outcome unknown (BIRD may have loaded the new file)"
	}
	return fmt.Sprintf("birdc configure: %s: %v: %s", what, e.Err, strings.TrimSpace(e.Output))
}

func (e *ConfigureError) Unwrap() error { return e.Err }

// Sync looks at the snapshot and, when it changed since the last look (or
// the last configure failed and Retry has passed), renders the include
// file; when the rendered bytes differ from the file's, or BIRD has not
// yet confirmed them, it writes the file atomically and runs birdc
// configure. When BIRD refuses the new file, the previous one is put back
// so that a restart of BIRD still finds a configuration it accepts; when
// the outcome is unknown (birdc timed out or could not run), the new file
// stays, since BIRD may run it, and the configure is retried.
//
// The first Sync always configures, even when the file already holds the
// rendered bytes: nothing says that BIRD has loaded them.
//
// A missing snapshot changes nothing (FluxVM has not published yet, or the
// node rebooted), except that an include file that does not exist yet is
// written without routes, so that BIRD's configuration parses.
func (a *Adapter) Sync(ctx context.Context) error {
	st, err := os.Stat(a.Snapshot)
	if errors.Is(err, fs.ErrNotExist) {
		if !a.missing {
			a.Log.Warn("snapshot missing: routes left as they are", "snapshot", a.Snapshot)
		}
		a.missing, a.seen = true, fileID{}
		if _, err := os.Stat(a.Output); errors.Is(err, fs.ErrNotExist) {
			empty := advert.Snapshot{Entries: []advert.Entry{}}
			return a.apply(ctx, empty, Render(empty, a.Render))
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	a.missing = false
	id := fileID{mtime: st.ModTime(), size: st.Size(), ino: inode(st)}
	retry := !a.configured && !a.failedAt.IsZero() && time.Since(a.failedAt) >= a.Retry
	if id == a.seen && !retry {
		return nil
	}
	snap, err := advert.Read(a.Snapshot)
	if err != nil {
		// Remembered as seen: a corrupt file is reported once, and
		// the next publish (a new inode) is read again.
		a.seen = id
		return err
	}
	a.seen = id
	return a.apply(ctx, snap, Render(snap, a.Render))
}

// apply writes content and configures BIRD, unless the file already holds
// content and BIRD accepted it.
func (a *Adapter) apply(ctx context.Context, snap advert.Snapshot, content []byte) error {
	old, err := os.ReadFile(a.Output)
	hadOld := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("output: %w", err)
	}
	changed := !hadOld || !bytes.Equal(old, content)
	if !changed && a.configured {
		return nil
	}
	if changed {
		if err := writeFile(a.Output, content); err != nil {
			a.configured, a.failedAt = false, time.Now()
			return fmt.Errorf("output: %w", err)
		}
	}
	v4, v6 := countFamilies(snap)
	out, res, err := a.configure(ctx)
	if res == accepted {
		a.configured = true
		a.Log.Info("BIRD configured", "generation", snap.Generation, "ipv4_routes", v4, "ipv6_routes", v6,
			"file_changed", changed, "output", a.Output)
		return nil
	}
	a.configured, a.failedAt = false, time.Now()
	cerr := &ConfigureError{Unreachable: res == unreachableBIRD, Unknown: res == unknownOutcome, Output: out, Err: err}
	if res == refused && changed && hadOld {
		if werr := writeFile(a.Output, old); werr != nil {
			return errors.Join(cerr, fmt.Errorf("output: putting the previous file back: %w", werr))
		}
		return fmt.Errorf("%w (the previous %s is back; retrying in %v)", cerr, a.Output, a.Retry)
	}
	return fmt.Errorf("%w (%s holds generation %d; retrying in %v)", cerr, a.Output, snap.Generation, a.Retry)
}

// configureResult is what a birdc configure run tells about BIRD.
type configureResult int

const (
	accepted        configureResult = iota // BIRD took the file
	refused                                // BIRD answered with an error
	unreachableBIRD                        // birdc could not reach BIRD
	unknownOutcome                         // no answer to go by
)

// configure runs birdc configure and returns its output and what it says.
// birdc runs in verbose mode (-v), so every line of BIRD's reply carries
// its code: only 0003 (reconfigured), 0004 (in progress) or 0005 (queued)
// mean that BIRD took the file, only an error code (8xxx, 9xxx) that it
// refused it. A birdc that timed out, could not start or was killed, or a
// reply with neither, leaves the outcome unknown.
func (a *Adapter) configure(ctx context.Context) (string, configureResult, error) {
	ctx, cancel := context.WithTimeout(ctx, a.Timeout)
	defer cancel()
	args := []string{"-v"}
	if a.Socket != "" {
		args = append(args, "-s", a.Socket)
	}
	args = append(args, "configure")
	cmd := exec.CommandContext(ctx, a.Birdc, args...)
	cmd.Stdin = nil
	// A birdc killed at the timeout whose output pipe something else
	// still holds does not block Sync.
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	text := string(out)
	if ctx.Err() != nil {
		return text, unknownOutcome, fmt.Errorf("birdc did not finish within %v: %w", a.Timeout, ctx.Err())
	}
	var exitErr *exec.ExitError
	if err != nil && (!errors.As(err, &exitErr) || !exitErr.Exited()) {
		// Not started (missing, not executable) or killed by a signal.
		return text, unknownOutcome, err
	}
	for line := range strings.Lines(text) {
		for _, ok := range []string{"0003 ", "0004 ", "0005 "} {
			if strings.HasPrefix(line, ok) {
				return text, accepted, nil
			}
		}
	}
	if err == nil {
		err = errors.New("no reconfiguration in the reply")
	}
	switch {
	case unreachable(text):
		return text, unreachableBIRD, err
	case errorReply(text):
		return text, refused, err
	}
	return text, unknownOutcome, err
}

// unreachable reports whether birdc's output says that it could not reach
// BIRD's control socket.
func unreachable(out string) bool {
	return strings.Contains(out, "Unable to connect to server control socket")
}

// errorReply reports whether BIRD's verbose reply has an error line: a
// code 8xxx (run-time error, a configuration that does not parse among
// them) or 9xxx (command error).
func errorReply(out string) bool {
	for line := range strings.Lines(out) {
		if len(line) >= 5 && (line[0] == '8' || line[0] == '9') && (line[4] == ' ' || line[4] == '-') &&
			strings.Trim(line[1:4], "0123456789") == "" {
			return true
		}
	}
	return false
}

func writeFile(path string, data []byte) error {
	err := atomicfile.Write(path, data, OutputMode)
	var notSynced *atomicfile.DirSyncError
	if errors.As(err, &notSynced) {
		// Readers (BIRD) already see the new file; it may not survive
		// a crash, which the next write after a restart repairs.
		return nil
	}
	return err
}
