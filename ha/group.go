package ha

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"
)

// GroupEdge is one edge of a group as GroupReplicator replicates it.
type GroupEdge struct {
	// Name is the edge's node name (node_name): the source its deltas
	// and snapshots name, under which the other edges keep their cursor
	// of its journals.
	Name string
	// Source is the edge as the source of its journals.
	Source Active
	// Target returns the edge as the target of source's journals: its
	// cursor of them, and the imports.
	Target func(source string) Standby
	// Services lists the services the edge replicates (nil: none).
	Services func(ctx context.Context) ([]string, error)
	// Join, when set, tells the edge it holds the other edges' state (a
	// group edge advertises only once joined): called after each round
	// in which every other edge that is up delivered every service's
	// journal to it. The edge takes it as often as it comes.
	Join func(ctx context.Context) error
}

// GroupReplicator does the control plane's part of flow replication for
// a group of edges, all active (ha_group): each round, every edge's
// journals go to every other edge (a Replicator per ordered pair, in
// group mode: snapshots without prune, no ack of its own), and then each
// source's journal of a service is acked up to the least cursor the other
// edges hold of it, so that no edge's history is trimmed before every
// other edge applied it. An edge that is down fails its pairs' part of
// the round, not the others'; its journals are then acked no further.
type GroupReplicator struct {
	Edges            []GroupEdge
	MaxOps, MaxPages int
	DiffEvery        time.Duration
	Log              *slog.Logger
	pairs            map[[2]string]*Replicator
}

// GroupResult is what one round did from one edge to another.
type GroupResult struct {
	Source string `json:"source"`
	Target string `json:"target"`
	RoundResult
}

// Round runs one round over every ordered pair of edges. The errors of
// the pairs and the acks are joined.
func (g *GroupReplicator) Round(ctx context.Context) ([]GroupResult, error) {
	if err := g.check(); err != nil {
		return nil, err
	}
	if g.pairs == nil {
		g.pairs = map[[2]string]*Replicator{}
	}
	var (
		errs []error
		out  []GroupResult
		// behind: an edge some source that is up could not bring up to
		// date this round; it does not join.
		behind = map[string]bool{}
	)
	for _, src := range g.Edges {
		services, err := src.Services(ctx)
		if err != nil {
			// A source that is down has nothing to deliver: the others
			// may join without it.
			errs = append(errs, fmt.Errorf("ha: group: services of %s: %w", src.Name, err))
			continue
		}
		// The least cursor of each service's journal on src, over the
		// targets that follow it; a target that failed, or follows
		// another incarnation, holds the ack back.
		least := map[string]Cursor{}
		held := map[string]bool{}
		for _, dst := range g.Edges {
			if dst.Name == src.Name {
				continue
			}
			r := g.pair(src, dst)
			r.Services = services
			res, err := r.Round(ctx)
			if err != nil {
				errs = append(errs, fmt.Errorf("ha: group: %s to %s: %w", src.Name, dst.Name, err))
				behind[dst.Name] = true
			}
			done := map[string]bool{}
			for _, x := range res {
				out = append(out, GroupResult{Source: src.Name, Target: dst.Name, RoundResult: x})
				done[x.Service] = true
				c, seen := least[x.Service]
				switch {
				case x.Cursor.Journal == "":
					held[x.Service] = true
				case !seen:
					least[x.Service] = x.Cursor
				case c.Journal != x.Cursor.Journal:
					held[x.Service] = true
				case x.Cursor.Seq < c.Seq:
					least[x.Service] = x.Cursor
				}
			}
			for _, svc := range services {
				if !done[svc] {
					held[svc] = true
				}
			}
			for _, x := range res {
				if x.Cursor.Journal == "" {
					behind[dst.Name] = true
				}
			}
		}
		for _, svc := range services {
			c, ok := least[svc]
			if !ok || held[svc] || c.Seq == 0 {
				continue
			}
			if err := src.Source.Ack(ctx, svc, c.Seq); err != nil && !errors.Is(err, ErrCursorAhead) {
				errs = append(errs, fmt.Errorf("ha: group: ack %s of %s at %d: %w", svc, src.Name, c.Seq, err))
			}
		}
	}
	for _, e := range g.Edges {
		if e.Join == nil || behind[e.Name] {
			continue
		}
		if err := e.Join(ctx); err != nil {
			errs = append(errs, fmt.Errorf("ha: group: join %s: %w", e.Name, err))
		}
	}
	return out, errors.Join(errs...)
}

// pair is the Replicator from src to dst, kept across rounds (its
// snapshot-diff clock).
func (g *GroupReplicator) pair(src, dst GroupEdge) *Replicator {
	k := [2]string{src.Name, dst.Name}
	if r := g.pairs[k]; r != nil {
		return r
	}
	r := &Replicator{Active: src.Source, Standby: dst.Target(src.Name), MaxOps: g.MaxOps, MaxPages: g.MaxPages,
		DiffEvery: g.DiffEvery, Log: g.Log, Group: true}
	if r.Log != nil {
		r.Log = r.Log.With("source", src.Name, "target", dst.Name)
	}
	g.pairs[k] = r
	return r
}

// check refuses a group that cannot be replicated: fewer than two edges,
// an edge without a name, a source, a target or services, two of one
// name.
func (g *GroupReplicator) check() error {
	if len(g.Edges) < 2 {
		return errors.New("ha: group: at least two edges are required")
	}
	var names []string
	for i, e := range g.Edges {
		if e.Name == "" || e.Source == nil || e.Target == nil || e.Services == nil {
			return fmt.Errorf("ha: group: edge %d (%q) needs a name, a source, a target and its services", i, e.Name)
		}
		if slices.Contains(names, e.Name) {
			return fmt.Errorf("ha: group: two edges are named %q", e.Name)
		}
		names = append(names, e.Name)
	}
	return nil
}
