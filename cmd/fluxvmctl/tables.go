package main

import (
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/group"
	"github.com/fluxvm/servicefabric/ha"
)

// The tables. Each writes tab-separated cells to a text/tabwriter; a
// blank line starts a new block with columns of its own. Columns come in
// a fixed order, rows sorted, so that the output is stable.

// row writes one line of cells.
func row(w io.Writer, cells ...any) {
	for i, c := range cells {
		if i > 0 {
			fmt.Fprint(w, "\t")
		}
		fmt.Fprint(w, c)
	}
	fmt.Fprintln(w)
}

// dash is "-" for an empty cell.
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// yesNo prints a bool.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// when prints a time in UTC to the second, "-" when zero.
func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// joinAddrs joins addresses with commas.
func joinAddrs(as []netip.Addr) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return dash(strings.Join(s, ","))
}

// joinPorts joins ports as 80/tcp,443/tcp.
func joinPorts(ps []fluxvm.ServicePort) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return dash(strings.Join(s, ","))
}

// readyBackends counts the backends of a service's intent that take new
// flows (enabled and ready).
func readyBackends(svc fluxvm.Service) int {
	n := 0
	for _, b := range svc.Backends {
		if b.IsEnabled() && b.EffectiveState() == fluxvm.BackendReady {
			n++
		}
	}
	return n
}

func servicesTable(w io.Writer, list []fluxvm.ServiceStatus) {
	row(w, "NAME", "ENABLED", "VIPS", "PORTS", "BACKENDS", "REVISION")
	for _, st := range list {
		s := st.Service
		row(w, s.Name, yesNo(s.IsEnabled()), joinAddrs(s.VIPs), joinPorts(s.Ports),
			fmt.Sprintf("%d/%d", readyBackends(s), len(s.Backends)), st.Revision)
	}
}

func serviceDetail(w io.Writer, st fluxvm.ServiceStatus) {
	s := st.Service
	row(w, "Name:", s.Name)
	row(w, "Enabled:", yesNo(s.IsEnabled()))
	row(w, "Exposure:", dash(string(s.Exposure)))
	row(w, "Mode:", dash(string(s.Mode)))
	row(w, "VIPs:", joinAddrs(s.VIPs))
	row(w, "Ports:", joinPorts(s.Ports))
	row(w, "Backends:", fmt.Sprintf("%d ready of %d", readyBackends(s), len(s.Backends)))
	if hc := s.HealthCheck; hc != nil {
		row(w, "Health check:", fmt.Sprintf("%s, interval %dms, timeout %dms", hc.Kind, hc.IntervalMs, hc.TimeoutMs))
	}
	if s.MaxEgressMbps > 0 {
		row(w, "Max egress:", fmt.Sprintf("%d Mbit/s", s.MaxEgressMbps))
	}
	if s.HostRouting {
		row(w, "Host routing:", "yes")
	}
	if s.Advertise {
		row(w, "Advertise:", "yes")
	}
	row(w, "Revision:", st.Revision)
	row(w, "Applied:", when(st.AppliedAt))
	if e := st.EDT; e != nil {
		row(w, "EDT:", fmt.Sprintf("%d bytes paced, %d horizon drops", e.Bytes, e.HorizonDrops))
	}

	fmt.Fprintln(w)
	row(w, "FRONTEND", "PROTO", "ID", "ELIGIBLE", "BACKENDS", "MAGLEV", "OPEN")
	for _, f := range st.Frontends {
		open := yesNo(f.GuardOpen)
		if f.RepairPending {
			// Closed after a failed change until it is applied again.
			open = "no (repair pending)"
		}
		row(w, f.VIP, f.Protocol, f.ServiceID, f.Eligible, f.Backends, f.MaglevSize, open)
	}

	fmt.Fprintln(w)
	row(w, "BACKEND", "WEIGHT", "ENABLED", "STATE", "DRAIN UNTIL")
	for _, b := range s.Backends {
		drain := "-"
		if b.DrainUntilUnixMs != 0 {
			drain = when(b.DrainUntil())
		}
		row(w, b.Endpoint(), b.EffectiveWeight(), yesNo(b.IsEnabled()), b.EffectiveState(), drain)
	}
}

// featuresSummary lists the load-time features in the programs: "none"
// when the list is empty, "-" when the node does not say (a daemon from
// before load-time features).
func featuresSummary(fs []string) string {
	switch {
	case fs == nil:
		return "-"
	case len(fs) == 0:
		return "none"
	}
	return strings.Join(fs, ", ")
}

// snatTable prints the node's SNAT configuration with its peers.
func snatTable(w io.Writer, st fluxvm.SNATStatus) {
	for _, r := range []struct {
		name string
		a    netip.Addr
	}{{"Address v4:", st.Address4}, {"Address v6:", st.Address6}} {
		v := "-"
		if r.a.IsValid() {
			v = r.a.String()
		}
		row(w, r.name, v)
	}
	row(w, "Ports:", fmt.Sprintf("%d-%d", st.PortMin, st.PortMax))
	row(w, "Peers:", snatPeersSummary(st.Peers))
	row(w, "Taken over:", snatPeersSummary(st.Announced))
}

func snatPeersSummary(peers []netip.Addr) string {
	if len(peers) == 0 {
		return "none"
	}
	s := make([]string, len(peers))
	for i, a := range peers {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}

func statusTable(w io.Writer, st fluxvm.Status) {
	row(w, "Schema:", st.SchemaVersion)
	row(w, "Generation:", st.Generation)
	row(w, "Tier:", st.Tier)
	row(w, "Features:", featuresSummary(st.Load.Features))
	row(w, "Pin root:", st.PinRoot)
	row(w, "Services:", st.Services)
	// Edges of a pair or group must show the same (docs/scale-out-consistency.md).
	row(w, "Seeds:", group.Seeds{FlowHash: st.Seeds.FlowHash, Maglev: st.Seeds.Maglev})
	snat := "-"
	if st.SNAT.Address4.IsValid() || st.SNAT.Address6.IsValid() {
		var as []string
		for _, a := range []netip.Addr{st.SNAT.Address4, st.SNAT.Address6} {
			if a.IsValid() {
				as = append(as, a.String())
			}
		}
		snat = fmt.Sprintf("%s ports %d-%d", strings.Join(as, ","), st.SNAT.PortMin, st.SNAT.PortMax)
	}
	row(w, "SNAT:", snat)
	if len(st.SNAT.Peers) > 0 {
		row(w, "SNAT peers:", snatPeersSummary(st.SNAT.Peers))
	}
	xdp := "off"
	if st.XDPRouteCache.Enabled {
		xdp = "on"
	} else if st.XDPRouteCache.Reason != "" {
		xdp = "off (" + st.XDPRouteCache.Reason + ")"
	}
	row(w, "XDP route cache:", fmt.Sprintf("%s, %d invalidations", xdp, st.XDPRouteCache.Invalidations))
	row(w, "Socket LB:", yesNo(st.SocketLB.Enabled))
	row(w, "EDT:", yesNo(st.EDT.Enabled))
	adv := fmt.Sprintf("generation %d, %d advertised, %d withdrawn", st.Advertisements.Generation, st.Advertisements.Advertised, st.Advertisements.Withdrawn)
	if st.Advertisements.LastError != "" {
		adv += ", failing: " + st.Advertisements.LastError
	}
	row(w, "Advertisements:", adv)
	row(w, "HA:", haSummary(st.HA))
	if p := st.Pressure; p != nil {
		row(w, "Map pressure:", pressureSummary(*p))
	}
	if gc := st.LastGC; gc != nil {
		row(w, "Last GC:", fmt.Sprintf("%s, %d scanned, %d expired", when(gc.At), gc.Scanned, gc.Expired))
	}

	fmt.Fprintln(w)
	row(w, "INTERFACE", "KIND", "IFINDEX", "VM", "HOOKS", "XDP", "PROBLEM")
	for _, in := range st.Interfaces {
		hooks := make([]string, len(in.Hooks))
		for i, h := range in.Hooks {
			hooks[i] = h.Hook + "/" + h.Mode
		}
		problem := in.Problem
		if in.XDPProblem != "" {
			// Why xdp_mode auto left XDP off there.
			problem = strings.TrimPrefix(strings.Join([]string{problem, "xdp off: " + in.XDPProblem}, "; "), "; ")
		}
		row(w, in.Name, in.Kind, in.Index, dash(in.VMID), dash(strings.Join(hooks, ",")), dash(in.XDP), dash(problem))
	}
}

// pressureSummary is the map pressure on one line: the level and the
// fullest flow map.
func pressureSummary(p fluxvm.PressureStatus) string {
	if p.Error != "" {
		return "unknown (" + p.Error + ")"
	}
	top, pct := "", -1.0
	for _, name := range []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"} {
		if m, ok := p.Maps[name]; ok && m.Percent > pct {
			top, pct = name, m.Percent
		}
	}
	s := pressureLevel(p)
	if top != "" {
		s += fmt.Sprintf(", fullest %s %.1f%%", top, pct)
	}
	if p.Rounds > 0 {
		s += fmt.Sprintf(", %d rounds", p.Rounds)
	}
	return s
}

// haSummary is the lease of an edge on one line.
func haSummary(h fluxvm.HAStatus) string {
	if !h.Enabled {
		return "off"
	}
	s := fmt.Sprintf("on, epoch %d", h.Epoch)
	if h.SupersededBy != 0 {
		s += fmt.Sprintf(", FENCED (superseded by epoch %d)", h.SupersededBy)
	}
	return s
}

// counterNames are the columns of fluxvm.Counters.
var counterNames = []string{"PACKETS", "BYTES", "REPLY PKTS", "REPLY BYTES", "NEW FLOWS", "FAILOVERS", "DROPS"}

func counterCells(c fluxvm.Counters) []any {
	return []any{c.Packets, c.Bytes, c.ReplyPackets, c.ReplyBytes, c.NewFlows, c.Failovers, c.Drops}
}

func statsTable(w io.Writer, st fluxvm.Stats, all bool) {
	row(w, append([]any{"SERVICE"}, toAny(counterNames)...)...)
	for _, name := range slices.Sorted(maps.Keys(st.Services)) {
		c := st.Services[name]
		if all || c != (fluxvm.Counters{}) {
			row(w, append([]any{name}, counterCells(c)...)...)
		}
	}
	counterBlock(w, "DROP REASON", st.Drops, all)
	counterBlock(w, "EVENT", st.Parser, all)
	if len(st.EDT) > 0 {
		fmt.Fprintln(w)
		row(w, "EDT SERVICE", "RATE B/S", "BYTES", "HORIZON DROPS")
		for _, name := range slices.Sorted(maps.Keys(st.EDT)) {
			e := st.EDT[name]
			if all || e.Bytes != 0 || e.HorizonDrops != 0 {
				row(w, name, e.RateBytesPerSec, e.Bytes, e.HorizonDrops)
			}
		}
	}
}

// counterBlock prints a map of counters by name, the nonzero ones
// unless all.
func counterBlock(w io.Writer, title string, m map[string]uint64, all bool) {
	fmt.Fprintln(w)
	row(w, title, "COUNT")
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if all || m[k] != 0 {
			row(w, k, m[k])
		}
	}
}

func toAny(s []string) []any {
	a := make([]any, len(s))
	for i, v := range s {
		a[i] = v
	}
	return a
}

func vmStatsTable(w io.Writer, st fluxvm.VMStats) {
	row(w, "VM:", st.VMID)
	row(w, "Interfaces:", dash(strings.Join(st.Interfaces, ",")))
	fmt.Fprintln(w)
	row(w, toAny(counterNames)...)
	row(w, counterCells(st.Counters)...)
}

func healthTable(w io.Writer, rep fluxvm.HealthReport) {
	row(w, "SERVICE", "BACKEND", "INTENT", "OBSERVED", "SUCCESSES", "FAILURES", "LAST CHANGE", "LAST ERROR")
	for _, s := range rep.Services {
		for _, b := range s.Backends {
			row(w, s.Name, netip.AddrPortFrom(b.Address, b.Port), b.IntentState, b.Observed,
				b.ConsecutiveSuccesses, b.ConsecutiveFailures, when(b.LastChange), dash(b.LastError))
		}
	}
}

// addrPort prints an address and port, "-" when absent.
func addrPort(a netip.AddrPort) string {
	if !a.IsValid() {
		return "-"
	}
	return a.String()
}

func flowsTable(w io.Writer, recs []flows.Record) {
	row(w, "LAST SEEN", "SERVICE", "PROTO", "CLIENT", "VIP", "BACKEND", "VERDICT", "REASON", "PKTS", "BYTES", "REPLY PKTS", "REPLY BYTES")
	for _, r := range recs {
		row(w, when(r.LastSeen), dash(r.Service), r.Protocol, addrPort(r.Client), addrPort(r.VIP), addrPort(r.Backend),
			r.Verdict, dash(r.Reason), r.Forward.Packets, r.Forward.Bytes, r.Reply.Packets, r.Reply.Bytes)
	}
}

func advertTable(w io.Writer, s advert.Snapshot) {
	row(w, "Generation:", s.Generation)
	row(w, "Timestamp:", when(s.Timestamp))
	row(w, "Node:", dash(s.Node))
	fmt.Fprintln(w)
	row(w, "VIP", "PREFIX", "SERVICE", "EXPOSURE", "PORTS", "ADVERTISED", "REASON")
	for _, e := range s.Entries {
		ports := make([]string, len(e.Ports))
		for i, p := range e.Ports {
			ports[i] = strconv.Itoa(int(p.Port)) + "/" + p.Protocol
		}
		row(w, e.VIP, e.Prefix, e.Service, dash(e.Exposure), dash(strings.Join(ports, ",")), yesNo(e.Advertised), dash(string(e.Reason)))
	}
}

// identities prints a list of identities.
func identities(ids []fluxvm.Identity) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatUint(uint64(id), 10)
	}
	return dash(strings.Join(s, ","))
}

// l7Mode is the mode of a policy's L7 part, "-" without one.
func l7Mode(st fluxvm.PolicyStatus) string {
	if st.L7 == nil {
		return "-"
	}
	return string(st.L7.Mode)
}

func policiesTable(w io.Writer, st fluxvm.PoliciesStatus) {
	row(w, "IPCache:", fmt.Sprintf("%d prefixes, revision %d", st.IPCachePrefixes, st.IPCacheRevision))
	c := st.Counters
	row(w, "Counters:", fmt.Sprintf("denied %d, missing %d, audited %d, rechecked %d, revoked %d, l7 redirected %d, l7 bypass %d",
		c.Denied, c.Missing, c.Audited, c.Rechecked, c.Revoked, c.L7Redirected, c.L7Bypass))
	fmt.Fprintln(w)
	row(w, "SERVICE", "ENABLED", "REVISION", "DEFAULT", "ALLOW", "DENY", "AUDIT ONLY", "RULES", "UNRESOLVED", "L7", "DENIED", "AUDITED")
	for _, p := range st.Policies {
		row(w, p.Service, yesNo(p.Enabled), p.Revision, p.DefaultAction, identities(p.AllowIdentities), identities(p.DenyIdentities),
			yesNo(p.AuditOnly), p.Rules, identities(p.Unresolved), l7Mode(p), p.Counters.Denied, p.Counters.Audited)
	}
}

func policyDetail(w io.Writer, p fluxvm.PolicyStatus) {
	row(w, "Service:", p.Service)
	row(w, "Enabled:", yesNo(p.Enabled))
	row(w, "Revision:", p.Revision)
	row(w, "Default action:", p.DefaultAction)
	row(w, "Allow identities:", identities(p.AllowIdentities))
	row(w, "Deny identities:", identities(p.DenyIdentities))
	row(w, "Audit only:", yesNo(p.AuditOnly))
	row(w, "Rules:", p.Rules)
	row(w, "Unresolved:", identities(p.Unresolved))
	row(w, "Frontends:", p.Frontends)
	row(w, "L7:", l7Mode(p))
	if p.ProxyIfindex != nil {
		row(w, "Proxy ifindex:", *p.ProxyIfindex)
	}
	row(w, "Counters:", fmt.Sprintf("denied %d, audited %d, l7 redirected %d", p.Counters.Denied, p.Counters.Audited, p.Counters.L7Redirected))
}

func haTable(w io.Writer, st fluxvm.HAStatus) {
	row(w, "Replication:", haSummary(st))
	if !st.Enabled {
		return
	}
	if st.Interval.Duration != 0 {
		row(w, "Interval:", st.Interval.Duration)
	}
	row(w, "Queue:", fmt.Sprintf("read %d, skipped %d, dropped %d", st.Queue.Read, st.Queue.Skipped, st.Queue.Dropped))
	row(w, "GC deletes:", st.GCDeletes)
	if st.Group {
		joined := "joining (advertisements withdrawn until the group's flows are loaded)"
		if st.Joined {
			joined = "joined"
		}
		row(w, "Group:", st.Node+", "+joined)
	}

	fmt.Fprintln(w)
	row(w, "SERVICE", "JOURNAL", "EPOCH", "FENCED", "FIRST", "LAST", "ACKED", "BATCHES", "OPS", "OPEN OPS", "DROPPED BATCHES")
	for _, name := range slices.Sorted(maps.Keys(st.Journals)) {
		j := st.Journals[name]
		row(w, name, j.Journal, j.Epoch, yesNo(j.Fenced), j.FirstSeq, j.LastSeq, j.Acked, j.Batches, j.Ops, j.OpenOps, j.DroppedBatches)
	}

	fmt.Fprintln(w)
	if st.Group {
		row(w, "SERVICE", "SOURCE", "CURSOR JOURNAL", "SEQ", "EPOCH")
		for _, name := range slices.Sorted(maps.Keys(st.Sources)) {
			for _, src := range slices.Sorted(maps.Keys(st.Sources[name])) {
				c := st.Sources[name][src]
				row(w, name, src, c.Journal, c.Seq, c.Epoch)
			}
		}
		return
	}
	row(w, "SERVICE", "CURSOR JOURNAL", "SEQ", "EPOCH")
	for _, name := range slices.Sorted(maps.Keys(st.Cursors)) {
		c := st.Cursors[name]
		row(w, name, c.Journal, c.Seq, c.Epoch)
	}
}

func gcTable(w io.Writer, r fluxvm.GCResult) {
	row(w, "At:", when(r.At))
	row(w, "Duration:", r.Duration)
	row(w, "Scanned:", r.Scanned)
	row(w, "Expired:", r.Expired)
	row(w, "Drained:", r.Drained)
	row(w, "Backend gone:", r.BackendGone)
	row(w, "Orphans removed:", r.Orphans)
	row(w, "Repaired:", r.Repaired)
}

// pressureLevel is the level and thresholds on one line.
func pressureLevel(p fluxvm.PressureStatus) string {
	if p.Error != "" {
		return "unknown (" + p.Error + ")"
	}
	return fmt.Sprintf("%s (soft %d%%, hard %d%%)", p.Level, p.SoftPercent, p.HardPercent)
}

// percent prints a fill.
func percent(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) + "%" }

func pressureTable(w io.Writer, p fluxvm.PressureStatus) {
	row(w, "Level:", pressureLevel(p))
	if p.Unsupported {
		row(w, "Counts:", "unsupported by the kernel (before 6.6): GC on insert failures only")
	}
	row(w, "Insert failures:", p.InsertFailures)
	row(w, "Rounds:", p.Rounds)
	gc := "-"
	if p.GCInterval.Duration != 0 {
		gc = p.GCInterval.Duration.String()
	}
	row(w, "GC interval:", gc)

	fmt.Fprintln(w)
	row(w, "MAP", "ENTRIES", "MAX", "PERCENT")
	for _, name := range slices.Sorted(maps.Keys(p.Maps)) {
		m := p.Maps[name]
		row(w, name, m.Entries, m.MaxEntries, percent(m.Percent))
	}
	if p.LastRound != nil {
		fmt.Fprintln(w)
		roundTable(w, *p.LastRound, "Last round:")
	}
}

// roundTable prints what a round of the map pressure controller did;
// atLabel names its first line.
func roundTable(w io.Writer, r fluxvm.PressureRound, atLabel string) {
	row(w, atLabel, when(r.At))
	row(w, "Level:", dash(r.Level))
	row(w, "Over:", dash(strings.Join(r.Over, ",")))
	row(w, "Duration:", r.Duration)
	if r.Horizon.Duration != 0 {
		row(w, "Horizon:", r.Horizon)
	}
	if r.InsertFailures != 0 {
		row(w, "Insert failures:", r.InsertFailures)
	}
	gc := "-"
	if g := r.GC; g != nil {
		gc = fmt.Sprintf("%d scanned, %d expired, %d drained, %d backend gone, %d orphans removed, %d repaired (%v)",
			g.Scanned, g.Expired, g.Drained, g.BackendGone, g.Orphans, g.Repaired, g.Duration)
	}
	row(w, "GC:", gc)
	s := r.Shed
	row(w, "Shed:", fmt.Sprintf("%d closed, %d half-open, %d idle UDP, %d established", s.Closed, s.HalfOpen, s.IdleUDP, s.Established))
	if len(r.After) > 0 {
		after := make([]string, 0, len(r.After))
		for _, name := range slices.Sorted(maps.Keys(r.After)) {
			after = append(after, name+" "+percent(r.After[name]))
		}
		row(w, "After:", strings.Join(after, ", "))
	}
	c := r.Compaction
	if c == nil {
		row(w, "Compaction:", "-")
		return
	}
	var what string
	switch {
	case c.Error != "":
		what = "FAILED: " + c.Error
	case c.Deferred != "":
		what = "deferred: " + c.Deferred
	default:
		what = fmt.Sprintf("%d maps rebuilt", len(c.Maps))
	}
	row(w, "Compaction:", fmt.Sprintf("%s (%v)", what, c.Duration))
	if len(c.Links) > 0 {
		row(w, "Links switched:", strings.Join(c.Links, ","))
	}
	if len(c.Maps) > 0 {
		fmt.Fprintln(w)
		row(w, "COMPACTED MAP", "ENTRIES", "KEPT", "DROPPED", "CAUGHT UP", "MAP ID", "PREVIOUS MAP ID", "DROPPED BY")
		for _, m := range c.Maps {
			by := make([]string, 0, len(m.DroppedBy))
			for _, class := range slices.Sorted(maps.Keys(m.DroppedBy)) {
				by = append(by, fmt.Sprintf("%s=%d", class, m.DroppedBy[class]))
			}
			row(w, m.Map, m.Entries, m.Kept, m.Dropped, m.CaughtUp, m.MapID, m.PreviousMapID, dash(strings.Join(by, ",")))
		}
	}
}

func telemetryTable(w io.Writer, r api.ExportResponse) {
	row(w, "Read:", r.Read)
	row(w, "Sent:", fmt.Sprintf("%d records in %d requests", r.Sent.Records, r.Sent.Batches))
	row(w, "Rejected:", r.Sent.Rejected)
	row(w, "Retries:", r.Sent.Retries)
	row(w, "Bytes:", r.Sent.Bytes)
	row(w, "Encoding:", dash(string(r.Sent.Encoding)))
}

// cursorString prints a cursor of a journal.
func cursorString(c ha.Cursor) string {
	return fmt.Sprintf("journal %s, seq %d, epoch %d", dash(c.Journal), c.Seq, c.Epoch)
}

// importTable prints what a snapshot import did, with its header.
func importTable(w io.Writer, r ha.ImportResult) {
	h := r.Header
	row(w, "Service:", dash(h.Service))
	row(w, "Source node:", dash(h.Node))
	if h.Epoch == 0 {
		row(w, "Epoch:", "0 (no lease: the source runs without ha_epoch)")
	} else {
		row(w, "Epoch:", h.Epoch)
	}
	if h.Journal == "" && h.Seq == 0 {
		row(w, "Journal cursor:", "none (no journal: deltas need ha_epoch on both nodes)")
	} else {
		row(w, "Journal cursor:", fmt.Sprintf("%s at seq %d", dash(h.Journal), h.Seq))
	}
	row(w, "Created:", when(h.Created))
	importCounts(w, r)
}

// importCounts prints the counts of an import (snapshot or delta).
func importCounts(w io.Writer, r ha.ImportResult) {
	row(w, "Flows read:", r.Flows)
	row(w, "Written:", r.Written)
	row(w, "Fresher here:", r.Fresher)
	row(w, "No frontend:", r.NoFrontend)
	row(w, "No backend:", r.NoBackend)
	row(w, "Port conflicts:", r.PortConflicts)
	row(w, "Foreign SNAT:", r.ForeignSNAT)
	row(w, "Pruned:", r.Pruned)
}

func deltaTable(w io.Writer, d ha.Delta) {
	row(w, "Service:", d.Service)
	row(w, "Journal:", dash(d.Journal))
	row(w, "Epoch:", d.Epoch)
	row(w, "From:", d.From)
	row(w, "To:", d.To)
	reset := "no"
	if d.ResetRequired {
		reset = "YES: load a snapshot (conntrack export, conntrack import) and start again from its cursor"
	}
	row(w, "Reset required:", reset)
	fmt.Fprintln(w)
	row(w, "SEQ", "EPOCH", "OPS", "UPSERTS", "DELETES")
	for _, b := range d.Batches {
		up, del := 0, 0
		for _, op := range b.Ops {
			switch op.Kind {
			case ha.OpUpsert:
				up++
			case ha.OpDelete:
				del++
			}
		}
		row(w, b.Seq, b.Epoch, len(b.Ops), up, del)
	}
}

// journalTable prints one journal's state.
func journalTable(w io.Writer, service string, j ha.JournalStats) {
	row(w, "SERVICE", "JOURNAL", "EPOCH", "FENCED", "FIRST", "LAST", "ACKED", "BATCHES", "OPS", "OPEN OPS", "DROPPED BATCHES", "DROPPED OPS")
	row(w, service, j.Journal, j.Epoch, yesNo(j.Fenced), j.FirstSeq, j.LastSeq, j.Acked, j.Batches, j.Ops, j.OpenOps, j.DroppedBatches, j.DroppedOps)
}
