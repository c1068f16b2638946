package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

// Paths of the routes the CLI calls (fluxvm/api/routes.go).
const (
	pathServices     = "/v1/network/services"
	pathStatus       = pathServices + "/status"
	pathStats        = pathServices + "/stats"
	pathHealth       = pathServices + "/health"
	pathReconcile    = pathServices + "/health/reconcile"
	pathGC           = pathServices + "/conntrack/gc"
	pathAdverts      = pathServices + "/advertisements"
	pathFlows        = pathServices + "/flows"
	pathPolicies     = pathServices + "/policies"
	pathHA           = pathServices + "/ha"
	pathLease        = pathHA + "/lease"
	pathSNATPeers    = pathServices + "/snat/peers"
	pathPolicyRecon  = pathPolicies + "/reconcile"
	pathPressureRec  = pathServices + "/pressure/reconcile"
	pathTelemetryExp = pathServices + "/telemetry/export"
	pathVMStatsFirst = "/v1/vms/"
	pathVMStatsLast  = "/network/services/stats"
)

// command is one subcommand. A name of two words ("policies apply") is
// a command of its own, chosen when the second word follows the first.
type command struct {
	name  string
	usage string // name and arguments, for the usage text
	help  string
	run   func(inv *invocation) error
}

// commands lists the subcommands, one per route of the REST API they
// call (never one for a route the API does not have).
var commands = []command{
	{"services", "services", "list the services (GET /v1/network/services)", cmdServices},
	{"service", "service NAME", "one service in detail", cmdService},
	{"status", "status", "the dataplane: schema, tier, interfaces, SNAT, XDP, HA", cmdStatus},
	{"stats", "stats [-all] [-vm ID]", "datapath counters (nonzero unless -all); -vm: one VM's", cmdStats},
	{"health", "health", "observed health of the backends of checked services", cmdHealth},
	{"flows", "flows [filter flags] [-limit N]", "flow records, newest first; filters: -service -backend -verdict -since", cmdFlows},
	{"advertisements", "advertisements", "the VIP advertisement snapshot", cmdAdvertisements},
	{"policies", "policies", "identity policy state: ipcache, policies, counters", cmdPolicies},
	{"policy", "policy NAME", "the identity policy of one service", cmdPolicy},
	{"envoy", "envoy NAME", "the Envoy/xDS document of a service's L7 policy (JSON)", cmdEnvoy},
	{"pressure", "pressure", "map pressure: every map's fill, the level, the last round", cmdPressure},
	{"ha", "ha", "flow-state replication: lease, queue, journals, cursors", cmdHA},
	{"delta", "delta NAME [-journal J] [-seq N] [-max-ops N]", "the journal batches after a cursor (-o json: what delta import takes)", cmdDelta},
	{"apply", "apply FILE|-", "create or replace a service from its JSON (admin)", cmdApply},
	{"delete", "delete NAME", "remove a service (admin)", cmdDelete},
	{"gc", "gc", "run one conntrack garbage collection now (admin)", cmdGC},
	{"health-reconcile", "health-reconcile", "run one round of every health check now (admin)", cmdHealthReconcile},
	{"policies apply", "policies apply FILE|-", "add or replace policies: one JSON object or an array (admin)", cmdPoliciesApply},
	{"policies reconcile", "policies reconcile", "read the ipcache again and rewrite every policy (admin)", cmdPoliciesReconcile},
	{"policy delete", "policy delete NAME", "remove the identity policy of a service (admin)", cmdPolicyDelete},
	{"pressure reconcile", "pressure reconcile", "run one round of the map pressure controller now (admin)", cmdPressureReconcile},
	{"ha lease", "ha lease [-epoch N] [-superseded-by N]", "record a lease update: renew/advance, or fence this edge (admin)", cmdHALease},
	{"ha join", "ha join", "tell a group edge it holds the group's flows: it advertises from then on (admin)", cmdHAJoin},
	{"snat peers", "snat peers ADDR... [-announce ADDR,...] | -none", "set the SNAT addresses of the group's other edges, whose flows this node continues; -announce: those it took over (admin)", cmdSNATPeers},
	{"conntrack export", "conntrack export NAME [-out FILE]", "stream a service's flow snapshot (binary) to FILE or stdout; needs the north-south edge, not ha_epoch", cmdConntrackExport},
	{"conntrack import", "conntrack import NAME FILE|- [-prune]", "apply a flow snapshot; -prune deletes the flows it lacks (admin)", cmdConntrackImport},
	{"delta import", "delta import NAME FILE|-", "apply a delta of the peer's journal (admin)", cmdDeltaImport},
	{"delta ack", "delta ack NAME SEQ", "trim a service's journal up to SEQ (admin)", cmdDeltaAck},
	{"telemetry export", "telemetry export [-limit N]", "send the newest flow records to the OTLP receiver now (admin)", cmdTelemetryExport},
}

// commandByName returns the command that name and args call: the
// two-word command when args starts with its second word, else the
// one-word one, and the arguments left. A service named like a second
// word ("delete") is reached after "--": policy -- delete.
func commandByName(name string, args []string) (command, []string, error) {
	if len(args) > 0 {
		for _, c := range commands {
			if c.name == name+" "+args[0] {
				return c, args[1:], nil
			}
		}
	}
	var subs []string
	for _, c := range commands {
		if c.name == name {
			return c, args, nil
		}
		if strings.HasPrefix(c.name, name+" ") {
			subs = append(subs, c.usage)
		}
	}
	if len(subs) > 0 {
		return command{}, nil, usagef("usage: fluxvmctl %s", strings.Join(subs, " | fluxvmctl "))
	}
	return command{}, nil, usagef("unknown command %q (fluxvmctl -h lists them)", name)
}

// errFlagParse: the flag package already printed what was wrong.
var errFlagParse = errors.New("bad flags")

// invocation is one run of a command.
type invocation struct {
	*globals
	name   string
	args   []string
	stdout io.Writer
	stderr io.Writer
	env    func(string) string
}

// testStdin, when set by a test, is what apply - reads instead of
// os.Stdin.
var testStdin io.Reader

// flags returns the command's flag set, holding the global flags too.
func (inv *invocation) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("fluxvmctl "+inv.name, flag.ContinueOnError)
	fs.SetOutput(inv.stderr)
	inv.register(fs)
	return fs
}

// parse parses the command's arguments (flags may come before or after
// the positional ones) and checks that there is one positional argument
// for each name of what (a last name ending in "..." takes any number).
func (inv *invocation) parse(fs *flag.FlagSet, what ...string) ([]string, error) {
	var pos []string
	args := inv.args
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, errFlagParse
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	// A last name ending in "..." takes any number of arguments, none too.
	variadic := len(what) > 0 && strings.HasSuffix(what[len(what)-1], "...")
	if variadic && len(pos) >= len(what)-1 {
		what = pos
	}
	if len(pos) != len(what) {
		if len(what) == 0 {
			return nil, usagef("%s takes no argument", inv.name)
		}
		return nil, usagef("usage: fluxvmctl %s %s", inv.name, strings.Join(what, " "))
	}
	if inv.output != "table" && inv.output != "json" {
		return nil, usagef("-o %q: want table or json", inv.output)
	}
	return pos, nil
}

// call sends r; with -o json it prints the answer as is (indented),
// else it decodes it into v (one of the SDK's types) and prints table.
func (inv *invocation) call(r request, v any, table func(w io.Writer)) error {
	c, err := newClient(inv.globals, inv.env)
	if err != nil {
		return err
	}
	raw, _, err := c.do(context.Background(), r)
	if err != nil {
		return err
	}
	if inv.output == "json" {
		if len(bytes.TrimSpace(raw)) == 0 {
			return nil // 204
		}
		out, err := indentJSON(raw)
		if err != nil {
			return fmt.Errorf("%s %s: %w", r.method, r.path, err)
		}
		_, err = inv.stdout.Write(out)
		return err
	}
	if v != nil {
		if err := decode(raw, v, r.method+" "+r.path); err != nil {
			return err
		}
	}
	return inv.table(table)
}

// simple is a command without flags or arguments that GETs path.
func (inv *invocation) simple(path string, v any, table func(w io.Writer)) error {
	if _, err := inv.parse(inv.flags()); err != nil {
		return err
	}
	return inv.call(request{method: http.MethodGet, path: path}, v, table)
}

// servicePath is the path of a service (its name escaped).
func servicePath(name, rest string) string {
	return pathServices + "/" + url.PathEscape(name) + rest
}

func cmdServices(inv *invocation) error {
	var list []fluxvm.ServiceStatus
	return inv.simple(pathServices, &list, func(w io.Writer) { servicesTable(w, list) })
}

func cmdService(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "NAME")
	if err != nil {
		return err
	}
	if fluxvm.IsReservedName(pos[0]) {
		// GET /v1/network/services/status and the like are other routes:
		// their answer is not a service.
		return usagef("%q is reserved for a route of the REST API, not a service name", pos[0])
	}
	var st fluxvm.ServiceStatus
	return inv.call(request{method: http.MethodGet, path: servicePath(pos[0], "")}, &st, func(w io.Writer) { serviceDetail(w, st) })
}

func cmdStatus(inv *invocation) error {
	var st fluxvm.Status
	return inv.simple(pathStatus, &st, func(w io.Writer) { statusTable(w, st) })
}

func cmdStats(inv *invocation) error {
	fs := inv.flags()
	all := fs.Bool("all", false, "print the counters that are zero too")
	vm := fs.String("vm", "", "the counters of one VM's edge interfaces")
	if _, err := inv.parse(fs); err != nil {
		return err
	}
	if *vm != "" {
		var st fluxvm.VMStats
		path := pathVMStatsFirst + url.PathEscape(*vm) + pathVMStatsLast
		return inv.call(request{method: http.MethodGet, path: path}, &st, func(w io.Writer) { vmStatsTable(w, st) })
	}
	var st fluxvm.Stats
	return inv.call(request{method: http.MethodGet, path: pathStats}, &st, func(w io.Writer) { statsTable(w, st, *all) })
}

func cmdHealth(inv *invocation) error {
	var rep fluxvm.HealthReport
	return inv.simple(pathHealth, &rep, func(w io.Writer) { healthTable(w, rep) })
}

func cmdFlows(inv *invocation) error {
	fs := inv.flags()
	service := fs.String("service", "", "only the flows of this service")
	backend := fs.String("backend", "", "only the flows to this backend address")
	verdict := fs.String("verdict", "", "only this verdict: forwarded, dropped, audited or redirected")
	since := fs.String("since", "", "only flows seen since: an RFC 3339 time, or a duration back from now (5m)")
	limit := fs.Int("limit", 0, "at most this many records (default: the node's, "+strconv.Itoa(api.DefaultFlowsLimit)+")")
	if _, err := inv.parse(fs); err != nil {
		return err
	}
	q := url.Values{}
	if *service != "" {
		q.Set("service", *service)
	}
	if *backend != "" {
		q.Set("backend", *backend)
	}
	if *verdict != "" {
		q.Set("verdict", *verdict)
	}
	if *since != "" {
		t, err := parseSince(*since, time.Now())
		if err != nil {
			return err
		}
		q.Set("since", t)
	}
	if isSet(fs, "limit") {
		q.Set("limit", strconv.Itoa(*limit))
	}
	var resp api.FlowsResponse
	return inv.call(request{method: http.MethodGet, path: pathFlows, query: q}, &resp, func(w io.Writer) { flowsTable(w, resp.Records) })
}

// parseSince reads -since: a duration back from now, or a time passed
// to the node as it is (the node checks it is RFC 3339).
func parseSince(v string, now time.Time) (string, error) {
	if d, err := time.ParseDuration(v); err == nil {
		if d < 0 {
			return "", usagef("-since %s: a duration back from now must not be negative", v)
		}
		return now.Add(-d).UTC().Format(time.RFC3339Nano), nil
	}
	return v, nil
}

// isSet reports whether the flag was given.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

func cmdAdvertisements(inv *invocation) error {
	var s advert.Snapshot
	return inv.simple(pathAdverts, &s, func(w io.Writer) { advertTable(w, s) })
}

func cmdPolicies(inv *invocation) error {
	var st fluxvm.PoliciesStatus
	return inv.simple(pathPolicies, &st, func(w io.Writer) { policiesTable(w, st) })
}

func cmdPolicy(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "NAME")
	if err != nil {
		return err
	}
	var st fluxvm.PolicyStatus
	return inv.call(request{method: http.MethodGet, path: servicePath(pos[0], "/policy")}, &st, func(w io.Writer) { policyDetail(w, st) })
}

func cmdHA(inv *invocation) error {
	var st fluxvm.HAStatus
	return inv.simple(pathHA, &st, func(w io.Writer) { haTable(w, st) })
}

func cmdApply(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "FILE|-")
	if err != nil {
		return err
	}
	var body []byte
	if pos[0] == "-" {
		in := io.Reader(os.Stdin)
		if testStdin != nil {
			in = testStdin
		}
		body, err = io.ReadAll(in)
		if err != nil {
			return fmt.Errorf("read the service from stdin: %w", err)
		}
	} else {
		body, err = os.ReadFile(pos[0])
		if err != nil {
			return fmt.Errorf("read the service: %w", err)
		}
	}
	var st fluxvm.ServiceStatus
	return inv.call(request{method: http.MethodPost, path: pathServices, body: bytes.NewReader(body)}, &st, func(w io.Writer) {
		fmt.Fprintf(w, "applied service %s, revision %d\n\n", st.Service.Name, st.Revision)
		serviceDetail(w, st)
	})
}

func cmdDelete(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "NAME")
	if err != nil {
		return err
	}
	return inv.call(request{method: http.MethodDelete, path: servicePath(pos[0], "")}, nil, func(w io.Writer) {
		fmt.Fprintf(w, "deleted service %s\n", pos[0])
	})
}

func cmdGC(inv *invocation) error {
	if _, err := inv.parse(inv.flags()); err != nil {
		return err
	}
	var res fluxvm.GCResult
	return inv.call(request{method: http.MethodPost, path: pathGC}, &res, func(w io.Writer) { gcTable(w, res) })
}

func cmdHealthReconcile(inv *invocation) error {
	if _, err := inv.parse(inv.flags()); err != nil {
		return err
	}
	var rep fluxvm.HealthReport
	return inv.call(request{method: http.MethodPost, path: pathReconcile}, &rep, func(w io.Writer) { healthTable(w, rep) })
}

// input opens what a command reads a body from: a file, or stdin for
// "-". It returns the reader (streamed into the request, never read
// whole here), its length when known (a regular file) and its closer.
func (inv *invocation) input(arg, what string) (io.Reader, int64, func(), error) {
	if arg == "-" {
		in := io.Reader(os.Stdin)
		if testStdin != nil {
			in = testStdin
		}
		return in, 0, func() {}, nil
	}
	f, err := os.Open(arg)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("read %s: %w", what, err)
	}
	var n int64
	if fi, err := f.Stat(); err == nil && fi.Mode().IsRegular() {
		n = fi.Size()
	}
	return f, n, func() { _ = f.Close() }, nil
}

// serviceArg checks a service name argument: a reserved word names a
// route of the REST API, never a service.
func serviceArg(name string) error {
	if fluxvm.IsReservedName(name) {
		return usagef("%q is reserved for a route of the REST API, not a service name", name)
	}
	return nil
}

func cmdPoliciesApply(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "FILE|-")
	if err != nil {
		return err
	}
	in, n, done, err := inv.input(pos[0], "the policies")
	if err != nil {
		return err
	}
	defer done()
	var st fluxvm.PoliciesStatus
	return inv.call(request{method: http.MethodPost, path: pathPolicies, body: in, length: n}, &st, func(w io.Writer) {
		fmt.Fprintf(w, "applied; the node holds %d policies\n\n", len(st.Policies))
		policiesTable(w, st)
	})
}

func cmdPoliciesReconcile(inv *invocation) error {
	if _, err := inv.parse(inv.flags()); err != nil {
		return err
	}
	var st fluxvm.PoliciesStatus
	return inv.call(request{method: http.MethodPost, path: pathPolicyRecon}, &st, func(w io.Writer) { policiesTable(w, st) })
}

func cmdPolicyDelete(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "NAME")
	if err != nil {
		return err
	}
	if err := serviceArg(pos[0]); err != nil {
		return err
	}
	return inv.call(request{method: http.MethodDelete, path: servicePath(pos[0], "/policy")}, nil, func(w io.Writer) {
		fmt.Fprintf(w, "deleted the policy of service %s\n", pos[0])
	})
}

// cmdEnvoy prints the Envoy document, indented JSON with -o table too:
// it is a document for an adapter, not a table.
func cmdEnvoy(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "NAME")
	if err != nil {
		return err
	}
	if err := serviceArg(pos[0]); err != nil {
		return err
	}
	r := request{method: http.MethodGet, path: servicePath(pos[0], "/l7/envoy")}
	raw, err := inv.fetch(r)
	if err != nil {
		return err
	}
	var doc fluxvm.EnvoyDocument
	if err := decode(raw, &doc, r.method+" "+r.path); err != nil {
		return err
	}
	return inv.printJSON(r, raw)
}

// fetch sends r and returns the answer's body.
func (inv *invocation) fetch(r request) ([]byte, error) {
	c, err := newClient(inv.globals, inv.env)
	if err != nil {
		return nil, err
	}
	raw, _, err := c.do(context.Background(), r)
	return raw, err
}

// printJSON prints a JSON answer indented.
func (inv *invocation) printJSON(r request, raw []byte) error {
	out, err := indentJSON(raw)
	if err != nil {
		return fmt.Errorf("%s %s: %w", r.method, r.path, err)
	}
	_, err = inv.stdout.Write(out)
	return err
}

// cmdPressure shows the pressure part of GET status; with -o json, the
// status's pressure object as the node sent it (null when it reports
// none).
func cmdPressure(inv *invocation) error {
	if _, err := inv.parse(inv.flags()); err != nil {
		return err
	}
	r := request{method: http.MethodGet, path: pathStatus}
	raw, err := inv.fetch(r)
	if err != nil {
		return err
	}
	if inv.output == "json" {
		var part struct {
			Pressure json.RawMessage `json:"pressure"`
		}
		if err := decode(raw, &part, r.method+" "+r.path); err != nil {
			return err
		}
		if len(part.Pressure) == 0 {
			part.Pressure = json.RawMessage("null")
		}
		return inv.printJSON(r, part.Pressure)
	}
	var st fluxvm.Status
	if err := decode(raw, &st, r.method+" "+r.path); err != nil {
		return err
	}
	return inv.table(func(w io.Writer) {
		if st.Pressure == nil {
			fmt.Fprintln(w, "the node reports no map pressure")
			return
		}
		pressureTable(w, *st.Pressure)
	})
}

// table prints a table through a tabwriter.
func (inv *invocation) table(table func(w io.Writer)) error {
	tw := tabwriter.NewWriter(inv.stdout, 0, 4, 2, ' ', 0)
	table(tw)
	return tw.Flush()
}

func cmdPressureReconcile(inv *invocation) error {
	if _, err := inv.parse(inv.flags()); err != nil {
		return err
	}
	var round fluxvm.PressureRound
	return inv.call(request{method: http.MethodPost, path: pathPressureRec}, &round, func(w io.Writer) { roundTable(w, round, "At:") })
}

func cmdHALease(inv *invocation) error {
	fs := inv.flags()
	epoch := fs.Uint64("epoch", 0, "renew or advance this edge's lease to this epoch")
	superseded := fs.Uint64("superseded-by", 0, "the newer epoch of the lease another edge holds: fences this edge")
	if _, err := inv.parse(fs); err != nil {
		return err
	}
	var l fluxvm.HALease
	for _, f := range []struct {
		name string
		v    uint64
		dst  *ha.Epoch
	}{{"epoch", *epoch, &l.Epoch}, {"superseded-by", *superseded, &l.SupersededBy}} {
		if !isSet(fs, f.name) {
			continue
		}
		if f.v == 0 {
			return usagef("-%s must be positive (leave it out to say nothing of it)", f.name)
		}
		*f.dst = ha.Epoch(f.v)
	}
	if l == (fluxvm.HALease{}) {
		return usagef("ha lease: give -epoch, -superseded-by or both")
	}
	body, err := json.Marshal(l)
	if err != nil {
		return err
	}
	var st fluxvm.HAStatus
	return inv.call(request{method: http.MethodPost, path: pathLease, body: bytes.NewReader(body)}, &st, func(w io.Writer) { haTable(w, st) })
}

func cmdSNATPeers(inv *invocation) error {
	fs := inv.flags()
	none := fs.Bool("none", false, "clear the list (no address may follow)")
	announce := fs.String("announce", "", "comma-separated: the listed addresses this node took over from gone edges, for the routing to send here")
	args, err := inv.parse(fs, "ADDR...")
	if err != nil {
		return err
	}
	if *none == (len(args) > 0) || (*none && *announce != "") {
		return usagef("usage: fluxvmctl snat peers ADDR... [-announce ADDR,...] | -none (the whole list: addresses, or -none to clear it)")
	}
	parse := func(list []string) ([]netip.Addr, error) {
		out := make([]netip.Addr, 0, len(list))
		for _, a := range list {
			ip, err := netip.ParseAddr(strings.TrimSpace(a))
			if err != nil {
				return nil, usagef("snat peers: %q is not an IP address", a)
			}
			out = append(out, ip)
		}
		return out, nil
	}
	var p fluxvm.SNATPeers
	if p.Addresses, err = parse(args); err != nil {
		return err
	}
	if *announce != "" {
		if p.Announce, err = parse(strings.Split(*announce, ",")); err != nil {
			return err
		}
	}
	body, err := json.Marshal(p)
	if err != nil {
		return err
	}
	var st fluxvm.SNATStatus
	return inv.call(request{method: http.MethodPost, path: pathSNATPeers, body: bytes.NewReader(body)}, &st, func(w io.Writer) { snatTable(w, st) })
}

func cmdHAJoin(inv *invocation) error {
	if _, err := inv.parse(inv.flags()); err != nil {
		return err
	}
	var st fluxvm.HAStatus
	return inv.call(request{method: http.MethodPost, path: pathHA + "/join"}, &st, func(w io.Writer) { haTable(w, st) })
}

func cmdTelemetryExport(inv *invocation) error {
	fs := inv.flags()
	limit := fs.Int("limit", 0, "at most this many of the newest records, 1.."+strconv.Itoa(flows.MaxLimit)+" (default: the node's, "+strconv.Itoa(api.DefaultExportLimit)+")")
	if _, err := inv.parse(fs); err != nil {
		return err
	}
	var q url.Values
	if isSet(fs, "limit") {
		if *limit < 1 || *limit > flows.MaxLimit {
			return usagef("-limit %d: want 1..%d", *limit, flows.MaxLimit)
		}
		q = url.Values{"limit": {strconv.Itoa(*limit)}}
	}
	var res api.ExportResponse
	return inv.call(request{method: http.MethodPost, path: pathTelemetryExp, query: q}, &res, func(w io.Writer) { telemetryTable(w, res) })
}
