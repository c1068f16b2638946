package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/group"
	"github.com/fluxvm/servicefabric/ha"
)

// node is one edge's REST API: ha.Active and ha.Standby over the
// conntrack export/import/delta routes.
type node struct {
	base  string // http://host:port
	token string
	http  *http.Client
}

// apiError is an error response of the REST API; Is maps its code back to
// the ha errors the replicator branches on.
type apiError struct {
	Status  int
	Code    string
	Message string
}

func (e *apiError) Error() string {
	return fmt.Sprintf("%d %s: %s", e.Status, e.Code, e.Message)
}

func (e *apiError) Is(target error) bool {
	switch e.Code {
	case "reset_required":
		return target == ha.ErrResetRequired
	case "sequence_gap":
		return target == ha.ErrGap
	case "stale_epoch":
		return target == ha.ErrStaleEpoch
	case "fenced":
		return target == ha.ErrFenced
	case "cursor_ahead":
		return target == ha.ErrCursorAhead
	case "seed_mismatch":
		return target == ha.ErrSeeds
	}
	return false
}

func (n *node) servicePath(service, rest string) string {
	return "/v1/network/services/" + url.PathEscape(service) + "/conntrack" + rest
}

// do sends a request; a status of 300 or more becomes an *apiError.
func (n *node) do(ctx context.Context, method, path string, body io.Reader, ctype string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, n.base+path, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+n.token)
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := n.http.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode >= 300 {
		defer resp.Body.Close()
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		e := &apiError{Status: resp.StatusCode, Message: strings.TrimSpace(string(raw))}
		var body struct {
			Error struct {
				Code    string `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(raw, &body) == nil && body.Error.Code != "" {
			e.Code, e.Message = body.Error.Code, body.Error.Message
		}
		return nil, fmt.Errorf("%s %s: %w", method, path, e)
	}
	return resp, nil
}

// json sends in (nil: no body) and decodes the answer into out.
func (n *node) json(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	ctype := ""
	if in != nil {
		raw, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body, ctype = bytes.NewReader(raw), "application/json"
	}
	resp, err := n.do(ctx, method, path, body, ctype)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("%s %s: answer: %w", method, path, err)
	}
	return nil
}

func (n *node) Delta(ctx context.Context, service, journal string, seq uint64, maxOps int) (ha.Delta, error) {
	q := url.Values{"journal": {journal}, "seq": {strconv.FormatUint(seq, 10)}, "max_ops": {strconv.Itoa(maxOps)}}
	var d ha.Delta
	err := n.json(ctx, http.MethodGet, n.servicePath(service, "/delta")+"?"+q.Encode(), nil, &d)
	return d, err
}

func (n *node) Export(ctx context.Context, service string, w io.Writer) error {
	resp, err := n.do(ctx, http.MethodGet, n.servicePath(service, "/export"), nil, "")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	// The stream checks itself: a cut shows as a truncated snapshot at
	// the importer.
	_, err = io.Copy(w, resp.Body)
	return err
}

func (n *node) Ack(ctx context.Context, service string, seq uint64) error {
	var st ha.JournalStats
	return n.json(ctx, http.MethodPost, n.servicePath(service, "/delta/ack"), map[string]uint64{"seq": seq}, &st)
}

func (n *node) Cursor(ctx context.Context, service string) (ha.Cursor, error) {
	st, err := n.status(ctx)
	if err != nil {
		return ha.Cursor{}, err
	}
	return st.Cursors[service], nil
}

func (n *node) status(ctx context.Context) (fluxvm.HAStatus, error) {
	var st fluxvm.HAStatus
	err := n.json(ctx, http.MethodGet, "/v1/network/services/ha", nil, &st)
	return st, err
}

func (n *node) Import(ctx context.Context, service string, r io.Reader, prune bool) (ha.ImportResult, error) {
	resp, err := n.do(ctx, http.MethodPost, n.servicePath(service, "/import")+"?prune="+strconv.FormatBool(prune), r, "application/octet-stream")
	if err != nil {
		return ha.ImportResult{}, err
	}
	defer resp.Body.Close()
	var res ha.ImportResult
	if err := json.NewDecoder(resp.Body).Decode(&res); err != nil {
		return res, fmt.Errorf("import answer: %w", err)
	}
	return res, nil
}

func (n *node) ImportDelta(ctx context.Context, service string, d ha.Delta) (ha.Cursor, error) {
	var res fluxvm.HADeltaResult
	if err := n.json(ctx, http.MethodPost, n.servicePath(service, "/delta/import"), d, &res); err != nil {
		return ha.Cursor{}, err
	}
	return res.Cursor, nil
}

// seeds reads the node's hash_seed and maglev_seed from its status.
func (n *node) seeds(ctx context.Context) (group.Seeds, error) {
	var st struct {
		Seeds *fluxvm.SeedStatus `json:"seeds"`
	}
	if err := n.json(ctx, http.MethodGet, "/v1/network/services/status", nil, &st); err != nil {
		return group.Seeds{}, err
	}
	if st.Seeds == nil {
		return group.Seeds{}, fmt.Errorf("%s: the status reports no seeds (an edge older than seed reporting): upgrade it", n.base)
	}
	return group.Seeds{FlowHash: st.Seeds.FlowHash, Maglev: st.Seeds.Maglev}, nil
}

// checkSeeds refuses a pair whose ends have other seeds: they would pick
// other backends for the same new flow, and the standby refuses the
// active's snapshots anyway (seed_mismatch). The error names both ends
// and both seeds.
func checkSeeds(ctx context.Context, active, standby *node) error {
	sa, err := active.seeds(ctx)
	if err != nil {
		return fmt.Errorf("the active's seeds: %w", err)
	}
	ss, err := standby.seeds(ctx)
	if err != nil {
		return fmt.Errorf("the standby's seeds: %w", err)
	}
	err = group.CheckSeeds(group.Edge{Name: "active " + active.base, Seeds: sa}, group.Edge{Name: "standby " + standby.base, Seeds: ss})
	if err != nil {
		return fmt.Errorf("refusing to replicate: %w (set the same hash_seed and maglev_seed on both and restart one)", err)
	}
	return nil
}

// checkGroupSeeds refuses a group whose edges have other seeds (refused):
// the error names every edge that differs from the first, with its
// seeds. An edge whose seeds cannot be read (down) is left out of the
// comparison and named in down: the round's pairs with it fail anyway,
// and when it answers again it gets snapshots first, whose import checks
// the seeds (ha.ErrSeeds); the other edges go on replicating meanwhile.
func checkGroupSeeds(ctx context.Context, names []string, nodes []*node) (down, refused error) {
	var edges []group.Edge
	var downs []error
	for i, n := range nodes {
		s, err := n.seeds(ctx)
		if err != nil {
			downs = append(downs, fmt.Errorf("the seeds of %s: %w", names[i], err))
			continue
		}
		edges = append(edges, group.Edge{Name: names[i] + " " + n.base, Seeds: s})
	}
	if len(edges) > 1 {
		if err := group.CheckSeeds(edges...); err != nil {
			return errors.Join(downs...), fmt.Errorf("refusing to replicate: %w (set the same hash_seed and maglev_seed on every edge and restart those that differ)", err)
		}
	}
	return errors.Join(downs...), nil
}

// services lists the services the node has.
func (n *node) services(ctx context.Context) ([]string, error) {
	var ss []fluxvm.ServiceStatus
	if err := n.json(ctx, http.MethodGet, "/v1/network/services", nil, &ss); err != nil {
		return nil, err
	}
	out := make([]string, 0, len(ss))
	for _, s := range ss {
		out = append(out, s.Service.Name)
	}
	return out, nil
}

// sourceView is a group edge as the target of one source edge's
// journals: its cursor of them (HAStatus.Sources); the imports are the
// node's.
type sourceView struct {
	*node
	source string
}

func (v sourceView) Cursor(ctx context.Context, service string) (ha.Cursor, error) {
	st, err := v.status(ctx)
	if err != nil {
		return ha.Cursor{}, err
	}
	if !st.Group {
		return ha.Cursor{}, fmt.Errorf("%s is not a group edge (ha_group = false): it cannot follow several sources", v.base)
	}
	return st.Sources[service][v.source], nil
}

// join tells a group edge it holds the other edges' state (POST
// …/ha/join): it advertises from then on.
func (n *node) join(ctx context.Context) error {
	var st fluxvm.HAStatus
	return n.json(ctx, http.MethodPost, "/v1/network/services/ha/join", struct{}{}, &st)
}
