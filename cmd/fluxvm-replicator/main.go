// Command fluxvm-replicator does the control plane's part of flow-state
// replication for one active and one standby edge (what Zyvor Fabric does
// for many): every interval it pulls the deltas of each service's journal
// on the active after the standby's cursor, imports them into the
// standby, and acks them on the active; when the deltas cannot continue
// the standby (a new journal incarnation, history gone, a gap, a standby
// that restarted) it streams a snapshot from the active into the standby
// instead, and every -diff-every it runs the snapshot-diff (a snapshot
// import with prune) whatever the deltas say. Data of a superseded active
// is refused by the standby (stale_epoch) and reported, never applied.
// Every round first reads both edges' seeds (hash_seed, maglev_seed, from
// GET /v1/network/services/status) and replicates nothing while they
// differ: the round fails with an error naming both ends and both seeds.
//
//	fluxvm-replicator -active http://10.0.0.1:7788 -standby http://10.0.0.2:7788 [-services web,api]
//
// With -group it replicates a group of edges instead (ha_group on every
// edge; docs/operations.md, "Edges of a group"): every edge's journals to
// every other edge, snapshots without prune, each journal acked up to the
// least cursor the other edges hold of it:
//
//	fluxvm-replicator -group e1=http://10.0.0.1:7788,e2=http://10.0.0.2:7788,e3=http://10.0.0.3:7788
//
// Each name is the edge's node_name, which its deltas and snapshots carry.
// An edge that is down does not stop the others: they go on replicating
// every interval (its seeds are checked once it answers again).
// After a round that brought an edge every other (reachable) edge's
// journals, it tells the edge so (POST …/ha/join): a group edge
// advertises its VIPs only once it holds the group's flows.
//
// The admin token comes from -token-file or FLUXVM_ADMIN_TOKEN (the
// standby's imports and the active's acks need it). It prints one JSON
// line per round that changed something, and per failed round.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

// maxBackoff bounds the wait after failing rounds.
const maxBackoff = 30 * time.Second

func main() {
	if err := run(os.Args[1:]); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, "fluxvm-replicator:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("fluxvm-replicator", flag.ContinueOnError)
	active := fs.String("active", "", "base URL of the active edge's REST API (http://host:port)")
	standby := fs.String("standby", "", "base URL of the standby edge's REST API")
	services := fs.String("services", "", "comma-separated services to replicate (default: every service of the active, listed each round)")
	tokenFile := fs.String("token-file", "", "file holding the admin token (default: $FLUXVM_ADMIN_TOKEN)")
	interval := fs.Duration("interval", time.Second, "time between rounds: with the edges' ha_interval, what a failover can lose")
	diffEvery := fs.Duration("diff-every", 30*time.Second, "period of the snapshot-diff (0: only when the deltas cannot continue)")
	maxOps := fs.Int("max-ops", 0, "ops per delta (0: the default)")
	timeout := fs.Duration("timeout", 30*time.Second, "bound of one request (a snapshot included)")
	once := fs.Bool("once", false, "run one round and exit (non-zero when it failed)")
	groupList := fs.String("group", "", "replicate a group instead: comma-separated NAME=URL, one per edge (NAME: its node_name); not with -active/-standby")
	if err := fs.Parse(args); err != nil {
		return err
	}
	pair := *active != "" || *standby != ""
	if (*groupList == "") == !pair || (pair && (*active == "" || *standby == "")) || *interval <= 0 || *diffEvery < 0 || *maxOps < 0 || *maxOps > api.MaxDeltaOps {
		fs.Usage()
		return fmt.Errorf("-active and -standby, or -group, are required; -interval must be positive, -diff-every not negative, -max-ops within 0..%d", api.MaxDeltaOps)
	}
	var members []groupMember
	if *groupList != "" {
		var err error
		if members, err = parseGroup(*groupList); err != nil {
			return err
		}
	}
	token := os.Getenv("FLUXVM_ADMIN_TOKEN")
	if *tokenFile != "" {
		raw, err := os.ReadFile(*tokenFile)
		if err != nil {
			return err
		}
		token = strings.TrimSpace(strings.SplitN(string(raw), "\n", 2)[0])
	}
	if token == "" {
		return errors.New("no admin token: set -token-file or FLUXVM_ADMIN_TOKEN")
	}
	hc := &http.Client{Timeout: *timeout}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	enc := json.NewEncoder(os.Stdout)
	if members != nil {
		g := &ha.GroupReplicator{MaxOps: *maxOps, DiffEvery: *diffEvery, Log: log}
		var (
			names []string
			nodes []*node
		)
		for _, m := range members {
			n := &node{base: m.url, token: token, http: hc}
			names, nodes = append(names, m.name), append(nodes, n)
			g.Edges = append(g.Edges, ha.GroupEdge{Name: m.name, Source: n, Services: n.services, Join: n.join,
				Target: func(source string) ha.Standby { return sourceView{node: n, source: source} }})
		}
		round := func() error {
			start := time.Now()
			// Edges of other seeds are no group: nothing is replicated
			// until they all agree. An edge that is down stops nothing:
			// the others go on (its pairs fail, its journals keep their
			// history for it), and while one is down a round that
			// brought some pair up to date fails without backing off.
			var res []ha.GroupResult
			down, err := checkGroupSeeds(ctx, names, nodes)
			if err == nil {
				res, err = g.Round(ctx)
				err = errors.Join(down, err)
			}
			changed := false
			for _, x := range res {
				changed = changed || x.Ops > 0 || x.Snapshot != nil
			}
			reportRound(enc, start, "pairs", res, changed, err)
			if err != nil && down != nil && slices.ContainsFunc(res, func(x ha.GroupResult) bool { return x.Cursor.Journal != "" }) {
				return partialError{err}
			}
			return err
		}
		return loop(ctx, log, *once, *interval, round)
	}
	a := &node{base: strings.TrimSuffix(*active, "/"), token: token, http: hc}
	s := &node{base: strings.TrimSuffix(*standby, "/"), token: token, http: hc}
	r := &ha.Replicator{Active: a, Standby: s, MaxOps: *maxOps, DiffEvery: *diffEvery, Log: log}
	var fixed []string
	if *services != "" {
		fixed = strings.Split(*services, ",")
	}
	round := func() error {
		r.Services = fixed
		if fixed == nil {
			list, err := a.services(ctx)
			if err != nil {
				return fmt.Errorf("list the active's services: %w", err)
			}
			r.Services = list
		}
		start := time.Now()
		var res []ha.RoundResult
		// Edges of other seeds are no pair: nothing is replicated
		// until they agree (an edge may restart with other seeds at
		// any time, so every round checks).
		err := checkSeeds(ctx, a, s)
		if err == nil {
			res, err = r.Round(ctx)
		}
		changed := false
		for _, x := range res {
			changed = changed || x.Ops > 0 || x.Snapshot != nil
		}
		reportRound(enc, start, "services", res, changed, err)
		return err
	}
	return loop(ctx, log, *once, *interval, round)
}

// reportRound prints one JSON line for a round that changed something or
// failed: when it started, how long it took, what it did (under key:
// "services" for a pair, "pairs" for a group) and its error.
func reportRound(enc *json.Encoder, start time.Time, key string, what any, changed bool, err error) {
	if !changed && err == nil {
		return
	}
	line := map[string]any{"at": start.UTC(), "duration": time.Since(start).String(), key: what}
	if err != nil {
		line["error"] = err.Error()
	}
	enc.Encode(line)
}

// loop runs round every interval until ctx ends (once: one round, its
// error the command's). Failing rounds back off, up to maxBackoff: a
// refused lease (stale_epoch, fenced) or an edge that is down is for the
// control plane to fix, and every retry may stream a whole snapshot.
func loop(ctx context.Context, log *slog.Logger, once bool, interval time.Duration, round func() error) error {
	if once {
		return round()
	}
	wait := interval
	for {
		err := round()
		var partial partialError
		if errors.As(err, &partial) && ctx.Err() == nil {
			wait = interval
			log.Warn("fluxvm-replicator: round failed in part", "err", partial.err)
		} else if err != nil && ctx.Err() == nil {
			wait = min(2*wait, max(maxBackoff, interval))
			log.Warn("fluxvm-replicator: round failed", "err", err, "retry_in", wait)
		} else {
			wait = interval
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
}

// partialError is a group round that failed for some pairs while an
// edge was down, and brought others up to date: loop does not back off
// for it, so that the edges that answer keep replicating every interval.
type partialError struct{ err error }

func (e partialError) Error() string { return e.err.Error() }
func (e partialError) Unwrap() error { return e.err }

// groupMember is one NAME=URL of -group.
type groupMember struct{ name, url string }

// parseGroup reads -group: at least two NAME=URL, names unique.
func parseGroup(s string) ([]groupMember, error) {
	var out []groupMember
	seen := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		name, url, ok := strings.Cut(strings.TrimSpace(f), "=")
		if !ok || name == "" || !strings.HasPrefix(url, "http") {
			return nil, fmt.Errorf("-group: %q is not NAME=URL (the edge's node_name, its REST base URL)", f)
		}
		if seen[name] {
			return nil, fmt.Errorf("-group: %q is named twice", name)
		}
		seen[name] = true
		out = append(out, groupMember{name: name, url: strings.TrimSuffix(url, "/")})
	}
	if len(out) < 2 {
		return nil, fmt.Errorf("-group: %d edge(s); a group has at least two", len(out))
	}
	return out, nil
}
