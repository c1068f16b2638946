//go:build linux

package ecmplab

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
)

// lineLog keeps the lines written to it (a process's stdout), across
// the processes that wrote them.
type lineLog struct {
	mu    sync.Mutex
	part  []byte
	lines []string
}

func (w *lineLog) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.part = append(w.part, p...)
	for {
		i := bytes.IndexByte(w.part, '\n')
		if i < 0 {
			return len(p), nil
		}
		if line := strings.TrimSpace(string(w.part[:i])); line != "" {
			w.lines = append(w.lines, line)
		}
		w.part = w.part[i+1:]
	}
}

// ReplicatorLines returns what the group's replicator printed so far,
// one JSON object a line (a round that changed something or failed:
// "at", "duration", "pairs", "error"; cmd/fluxvm-replicator), over
// every run of it (Regroup restarts it).
func (l *Lab) ReplicatorLines() []string {
	l.replLines.mu.Lock()
	defer l.replLines.mu.Unlock()
	return slices.Clone(l.replLines.lines)
}

// ReplicatorOutput is the end of what the running replicator logged on
// stderr, for an error message.
func (l *Lab) ReplicatorOutput() string {
	if l.repl == nil {
		return ""
	}
	return l.repl.Out.Tail(3000)
}

// GroupMembers are the edges the replicator runs with (Regroup).
func (l *Lab) GroupMembers() []*Edge {
	var out []*Edge
	for _, e := range l.Edges {
		if e.Running() {
			out = append(out, e)
		}
	}
	return out
}

// Regroup (re)starts the group's replicator (Config.Group) in the
// router's namespace with the running edges as its members
// (`fluxvm-replicator -group ecmp-e1=http://<uplink>:7788,...`, the
// edges' node_names), as Fabric would when an edge's lease starts or
// ends, and returns once every member is joined. The replicator keeps
// nothing the edges do not (their cursors are theirs), so a restart
// costs one round. With one running edge there is nothing to replicate:
// it is joined by hand (a group's first edge). A replicator that keeps
// an edge that is down goes on replicating the others (its rounds fail
// for that edge's pairs); the lab drops a gone edge when a survivor
// takes its SNAT address over (TakeOver), as Fabric would once its
// lease ended.
func (l *Lab) Regroup(ctx context.Context) error {
	if !l.cfg.Group {
		return fmt.Errorf("ecmplab: not a group (Config.Group)")
	}
	if err := l.repl.stop(10 * time.Second); err != nil {
		return err
	}
	l.repl = nil
	members := l.GroupMembers()
	if len(members) == 1 {
		if err := members[0].Request(ctx, "POST", "/v1/network/services/ha/join", nil, nil); err != nil {
			return fmt.Errorf("ecmplab: join %s: %w", members[0].Name, err)
		}
	}
	if len(members) < 2 {
		return nil
	}
	var group []string
	for _, e := range members {
		group = append(group, fmt.Sprintf("ecmp-%s=http://%s:%d", e.Name, e.Uplink, apiPort))
	}
	p, err := startProcOut(l.Router, "fluxvm-replicator", []string{"FLUXVM_ADMIN_TOKEN=" + l.token}, l.replLines, l.cfg.Replicator,
		"-group", strings.Join(group, ","), "-interval", l.cfg.HAInterval.String())
	if err != nil {
		return err
	}
	l.repl = p
	for _, e := range members {
		if err := e.waitJoined(ctx); err != nil {
			return err
		}
	}
	return nil
}

// HAStatus is the edge's GET /v1/network/services/ha: in a group its
// cursor of every other edge's journals (Sources) and whether it joined.
func (e *Edge) HAStatus(ctx context.Context) (fluxvm.HAStatus, error) {
	var st fluxvm.HAStatus
	err := e.Request(ctx, "GET", "/v1/network/services/ha", nil, &st)
	return st, err
}

// waitJoined waits until the edge says it joined the group (the
// replicator's join after a round that brought it every other edge's
// journals); until then it withdraws its advertisements.
func (e *Edge) waitJoined(ctx context.Context) error {
	var st fluxvm.HAStatus
	var err error
	if perr := poll(ctx, 30*time.Second, func() bool {
		st, err = e.HAStatus(ctx)
		return err == nil && st.Joined
	}); perr != nil {
		var out string
		if p := e.lab.repl; p != nil {
			out = p.Out.Tail(3000)
		}
		return fmt.Errorf("ecmplab: %s not joined (%+v, %v): %w\n--- replicator:\n%s", e.Name, st, err, perr, out)
	}
	return nil
}
