package advert

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fluxvm/servicefabric/internal/atomicfile"
)

// FileMode is the permission of the snapshot file: readable by every
// local adapter, writable by the daemon only.
const FileMode fs.FileMode = 0o644

// DirMode is the permission given to the snapshot's directory when the
// Publisher has to create it (before the umask).
const DirMode = atomicfile.DirMode

// Options configure a [Publisher].
type Options struct {
	// Path of the snapshot file; [DefaultPath] when empty.
	Path string
	// Node is written as the snapshot's node field; optional.
	Node string
	// Now returns the wall-clock time for timestamps; time.Now when nil.
	Now func() time.Time
	// Logger receives a warning when an existing file is replaced or
	// leftover temporary files are removed; discarded when nil.
	Logger *slog.Logger
}

// Publisher writes the advertisement snapshot to one file. It is safe for
// concurrent use. Use one Publisher per path: two writers on the same file
// would each keep their own generation.
type Publisher struct {
	path string
	node string
	now  func() time.Time
	log  *slog.Logger

	mu      sync.Mutex               // serializes Publish, so files appear in generation order
	cur     atomic.Pointer[Snapshot] // last written or loaded snapshot; nil before any
	loadErr error                    // why the file found at start was not used
}

// NewPublisher returns a Publisher for opts.Path. It reads the file
// already there, if any: a valid snapshot becomes [Publisher.Current], so
// the next Publish continues its generation and does not rewrite unchanged
// content. A file that is not a valid snapshot (corrupt, foreign, another
// schema version) is not an error: it is replaced by the first Publish,
// the generation starts again at 1, and [Publisher.LoadError] says why.
// Leftover temporary files of an interrupted write are removed.
//
// NewPublisher fails only when the existing file cannot be read at all
// (permissions, a directory in its place). It writes nothing and does not
// create the directory; the first Publish does.
func NewPublisher(opts Options) (*Publisher, error) {
	p := &Publisher{path: opts.Path, node: opts.Node, now: opts.Now, log: opts.Logger}
	if p.path == "" {
		p.path = DefaultPath
	}
	p.path = filepath.Clean(p.path)
	if p.now == nil {
		p.now = time.Now
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	p.removeStaleTemps()

	data, err := os.ReadFile(p.path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return p, nil
	case err != nil:
		return nil, fmt.Errorf("advert: open: %w", err)
	}
	s, err := decode(data)
	if err != nil {
		p.loadErr = fmt.Errorf("advert: open %s: %w", p.path, err)
		p.log.Warn("advert: existing snapshot is not valid; the next publish replaces it",
			"path", p.path, "err", err)
		return p, nil
	}
	p.cur.Store(&s)
	return p, nil
}

// Path returns the path of the snapshot file.
func (p *Publisher) Path() string { return p.path }

// LoadError returns why the file found by NewPublisher was not used (it
// matches [ErrCorrupt] or [ErrSchemaVersion]), or nil when there was no
// file or it was valid.
func (p *Publisher) LoadError() error { return p.loadErr }

// Current returns a copy of the last snapshot written, or loaded from the
// existing file at start; ok is false before there is one. It does not
// wait for a Publish in progress.
func (p *Publisher) Current() (s Snapshot, ok bool) {
	c := p.cur.Load()
	if c == nil {
		return Snapshot{}, false
	}
	return c.Clone(), true
}

// Publish makes entries the node's advertisements. entries is the full
// list (entries left out are gone from the snapshot), in any order; it is
// validated and put in canonical order, and the caller's slice is not
// modified. When the result equals the current snapshot apart from
// generation and timestamp, nothing is written and changed is false.
// Otherwise a snapshot with the next generation and the current time
// replaces the file atomically and changed is true. The first Publish of a
// Publisher without a valid existing file always writes, even an empty
// list.
//
// It returns the snapshot now current. On error (wrapping [ErrInvalid], or
// a file system error) the file and Current are unchanged, and the next
// Publish tries again with the same generation. The one exception is a
// failure to sync the directory after the rename: the new file is then
// already visible, so it is returned with changed true, becomes Current,
// and the error says that it may not survive a crash.
//
// A write syncs the file and the directory, which can take milliseconds
// on a busy disk: call Publish from a worker, not while holding a lock
// that the datapath or the health checker needs.
func (p *Publisher) Publish(entries []Entry) (s Snapshot, changed bool, err error) {
	norm, err := normalize(entries)
	if err != nil {
		return Snapshot{}, false, fmt.Errorf("advert: publish: %w", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	cur := p.cur.Load()
	if cur != nil && sameContent(cur, p.node, norm) {
		return cur.Clone(), false, nil
	}
	next := Snapshot{
		SchemaVersion: SchemaVersion,
		Generation:    1,
		Timestamp:     p.now().UTC(),
		Node:          p.node,
		Entries:       norm,
	}
	if cur != nil {
		next.Generation = cur.Generation + 1
	}
	data, err := encode(next)
	if err != nil {
		return Snapshot{}, false, fmt.Errorf("advert: publish: %w", err)
	}
	err = atomicfile.Write(p.path, data, FileMode)
	var notSynced *atomicfile.DirSyncError
	if err != nil && !errors.As(err, &notSynced) {
		return Snapshot{}, false, fmt.Errorf("advert: publish %s: %w", p.path, err)
	}
	// Readers may already see the new file: it is current even if syncing
	// the directory failed, so the generation is never reused.
	p.cur.Store(&next)
	if err != nil {
		return next.Clone(), true, fmt.Errorf("advert: publish %s: %w", p.path, err)
	}
	return next.Clone(), true, nil
}

func (p *Publisher) removeStaleTemps() {
	dir := filepath.Dir(p.path)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	prefix := atomicfile.TempPrefix(p.path)
	for _, e := range ents {
		if e.Type().IsRegular() && strings.HasPrefix(e.Name(), prefix) {
			name := filepath.Join(dir, e.Name())
			if err := os.Remove(name); err == nil {
				p.log.Warn("advert: removed leftover temporary file", "path", name)
			}
		}
	}
}
