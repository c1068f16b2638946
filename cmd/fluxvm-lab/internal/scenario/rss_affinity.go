//go:build linux

package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// AffinityOptions configure RSSAffinity.
type AffinityOptions struct {
	Daemon  string // the fluxvmd binary
	Tier    string // S, M or L; Entries must fit in its conntrack map
	Entries int    // affinity (conntrack) entries to fill
	// Bounds; zero: measured, not gated.
	MaxRSS, MaxMap uint64        // daemon max(VmRSS filled, VmHWM after the GC), map memory (bytes)
	MaxGC          time.Duration // one conntrack GC over the entries
	// MinKept is the share of Entries that must still be in the map after
	// the GC (it must keep live flows; LRU eviction while filling a map
	// to 95% may take a few).
	MinKept float64
}

// TierCTEntries is each tier's conntrack capacity (FLUXVM_CT_ENTRIES).
var TierCTEntries = map[string]int{"S": 65536, "M": 262144, "L": 1048576}

// AffinityReport is what RSSAffinity measured and judged.
type AffinityReport struct {
	Tier                   string
	Entries, Present, Kept int
	Fill                   time.Duration
	Idle, Filled, AfterGC  procMemory
	MapIdle, Map           uint64
	GCWall                 time.Duration
	GC                     fluxvm.GCResult
	Failed                 []string
}

// RSSAffinity starts the real daemon at o.Tier in a lab (client VM vm1,
// backend VM vm2) with one service (VIP4:80 to vm2:8080), opens one
// connection through the VIP so that the datapath learns a real flow,
// clones that conntrack entry into o.Entries entries of fluxvm_fct4 (a
// batch update of the pinned map: other client addresses and ports, the
// same frontend and backend, established, a deadline an hour away, so
// that GC keeps them), then measures the daemon's resident memory, the
// map memory and one conntrack GC over them (POST …/conntrack/gc).
func RSSAffinity(ctx context.Context, w io.Writer, o AffinityOptions) (r *AffinityReport, err error) {
	r = &AffinityReport{Tier: o.Tier, Entries: o.Entries}
	capacity, ok := TierCTEntries[o.Tier]
	switch {
	case !ok:
		return r, fmt.Errorf("scenario: rss-affinity: unknown tier %q", o.Tier)
	case o.Entries < 1 || o.Entries > capacity-capacity/32:
		return r, fmt.Errorf("scenario: rss-affinity: %d entries do not fit tier %s (%d conntrack entries; at most 97%%)", o.Entries, o.Tier, capacity)
	}
	l, err := lab.New()
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, l.Close()) }()
	cli, err := l.AddVM(1)
	if err != nil {
		return r, err
	}
	be, err := l.AddVM(2)
	if err != nil {
		return r, err
	}
	srv, err := be.Serve(BackendPort)
	if err != nil {
		return r, err
	}
	defer srv.Close()
	// 1M entries fill a tier-L conntrack map (1,048,576) to 95%, the
	// default hard threshold: the map pressure controller would compact it
	// to 79% (docs/operations.md "The hard action"). The gate measures the
	// daemon and one GC over all of them, so the controller reads the
	// levels once an hour here.
	d, err := startLabDaemon(ctx, o.Daemon, l, o.Tier,
		`vm_edge_interfaces = [ { name = "vm1", vm_id = "client" }, { name = "vm2", vm_id = "backend" } ]`+"\n"+
			`pressure_interval = "1h"`+"\n")
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	one := uint32(1)
	svc := fluxvm.Service{Name: "affinity", VIPs: []netip.Addr{VIP4}, Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
		Backends: []fluxvm.Backend{{Address: be.Addr4, Port: BackendPort, Weight: &one}}}
	if err := d.request(ctx, "POST", "/v1/network/services", svc, nil); err != nil {
		return r, err
	}
	// One real flow through the VIP, held open while it is copied.
	c, err := cli.DialTCP(netip.AddrPortFrom(VIP4, 80), 5*time.Second)
	if err != nil {
		return r, fmt.Errorf("connect through the VIP: %w", err)
	}
	defer c.Close()
	if err := c.Echo([]byte("ping"), 5*time.Second); err != nil {
		return r, fmt.Errorf("echo through the VIP: %w", err)
	}
	ct, err := ebpf.LoadPinnedMap(filepath.Join(d.PinRoot, "maps", "fluxvm_fct4"), nil)
	if err != nil {
		return r, err
	}
	defer ct.Close()
	var (
		tk, k bpf.Tuple4
		tv, v bpf.CTValue
		found bool
	)
	vip := bpf.AddrWords(VIP4)[0]
	for it := ct.Iterate(); it.Next(&k, &v); {
		if k.Daddr == vip && v.ServiceId != 0 {
			tk, tv, found = k, v, true
			break
		}
	}
	if !found {
		return r, fmt.Errorf("no conntrack entry for the flow through %s", VIP4)
	}
	src, dst := tk.Endpoints()
	fmt.Fprintf(w, "tier %s: fluxvmd pid %d; the real flow %s -> %s: service %d, backend %d, state %d, flags %#x\n",
		o.Tier, d.cmd.Process.Pid, src, dst, tv.ServiceId, tv.BackendId, tv.State, tv.Flags)
	st, err := d.status(ctx)
	if err != nil {
		return r, err
	}
	r.MapIdle = st.Memory.Total
	if r.Idle, err = d.memory(); err != nil {
		return r, err
	}
	// The clones: clients 172.16.0.0/12, 64,000 ports each.
	now, err := conntrack.Now()
	if err != nil {
		return r, err
	}
	tv.CreatedNs, tv.LastSeenNs, tv.DeadlineNs, tv.Flow = uint64(now), uint64(now), uint64(now+time.Hour), 0
	const chunk = 8192
	keys, vals := make([]bpf.Tuple4, 0, chunk), make([]bpf.CTValue, chunk)
	for i := range vals {
		vals[i] = tv
	}
	t0 := time.Now()
	for i := 0; i < o.Entries; {
		if err := ctx.Err(); err != nil {
			return r, err
		}
		keys = keys[:0]
		for ; i < o.Entries && len(keys) < chunk; i++ {
			n := uint32(i / 64000)
			a := netip.AddrFrom4([4]byte{172, byte(16 + n>>16), byte(n >> 8), byte(n)})
			keys = append(keys, bpf.MakeTuple4(netip.AddrPortFrom(a, uint16(1024+i%64000)), dst, tk.Proto))
		}
		if _, err := ct.BatchUpdate(keys, vals[:len(keys)], nil); err != nil {
			return r, fmt.Errorf("fill fluxvm_fct4: %w", err)
		}
	}
	r.Fill = time.Since(t0)
	if r.Present, err = countClones(ct); err != nil {
		return r, err
	}
	if st, err = d.status(ctx); err != nil {
		return r, err
	}
	r.Map = st.Memory.Total
	if r.Filled, err = d.memory(); err != nil {
		return r, err
	}
	fmt.Fprintf(w, "tier %s: filled %d entries in %s (%d in the map); daemon RSS %s MiB, map memory %s MiB; GC...\n",
		o.Tier, o.Entries, r.Fill.Round(time.Millisecond), r.Present, MiB(r.Filled.RSS), MiB(r.Map))
	t0 = time.Now()
	if err := d.request(ctx, "POST", "/v1/network/services/conntrack/gc", nil, &r.GC); err != nil {
		return r, err
	}
	r.GCWall = time.Since(t0)
	if r.AfterGC, err = d.memory(); err != nil {
		return r, err
	}
	if r.Kept, err = countClones(ct); err != nil {
		return r, err
	}
	// The bound is on the most the daemon held: the RSS with the map
	// full, or its peak (VmHWM) up to the end of the GC, whichever is more.
	if peak := r.PeakRSS(); o.MaxRSS > 0 && peak > o.MaxRSS {
		r.Failed = append(r.Failed, fmt.Sprintf("daemon RSS (max of filled %s and peak after GC %s) %s MiB > %s MiB",
			MiB(r.Filled.RSS), MiB(r.AfterGC.HWM), MiB(peak), MiB(o.MaxRSS)))
	}
	if o.MaxMap > 0 && r.Map > o.MaxMap {
		r.Failed = append(r.Failed, fmt.Sprintf("BPF map memory %s MiB > %s MiB", MiB(r.Map), MiB(o.MaxMap)))
	}
	if o.MaxGC > 0 && r.GCWall > o.MaxGC {
		r.Failed = append(r.Failed, fmt.Sprintf("GC over %d entries took %s > %s", r.GC.Scanned, r.GCWall.Round(time.Millisecond), o.MaxGC))
	}
	if float64(r.Kept) < o.MinKept*float64(o.Entries) {
		r.Failed = append(r.Failed, fmt.Sprintf("%d entries after the GC < %.0f%% of %d", r.Kept, o.MinKept*100, o.Entries))
	}
	fmt.Fprint(w, r.Table(o))
	return r, nil
}

// PeakRSS is the daemon's memory the gate bounds: the larger of its RSS
// with the map full and its peak RSS (VmHWM) read after the GC.
func (r *AffinityReport) PeakRSS() uint64 {
	return max(r.Filled.RSS, r.AfterGC.HWM, r.AfterGC.RSS)
}

// clonePrefix holds the clients of the cloned entries.
var clonePrefix = netip.MustParsePrefix("172.16.0.0/12")

// countClones counts the entries of m whose client is in clonePrefix: the
// clones, not the real flow nor anything else the datapath added.
func countClones(m *ebpf.Map) (int, error) {
	var (
		k bpf.Tuple4
		v bpf.CTValue
		n int
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if src, _ := k.Endpoints(); clonePrefix.Contains(src.Addr()) {
			n++
		}
	}
	return n, it.Err()
}

// Table prints the figures with their bounds and the verdict.
func (r *AffinityReport) Table(o AffinityOptions) string {
	var b strings.Builder
	bound := func(ok bool, s string) string {
		if !ok {
			return "-"
		}
		return s
	}
	fmt.Fprintf(&b, "\nRSS-affinity gate (fluxvmd, tier %s, %d affinity entries in fluxvm_fct4):\n", r.Tier, r.Entries)
	fmt.Fprintf(&b, "  cloned entries (172.16/12) %d after the fill, %d after the GC (bound >= %.0f%%)\n", r.Present, r.Kept, o.MinKept*100)
	fmt.Fprintf(&b, "  daemon RSS MiB            %s idle, %s filled, %s after the GC, peak %s (bound on max(filled, peak) %s)\n",
		MiB(r.Idle.RSS), MiB(r.Filled.RSS), MiB(r.AfterGC.RSS), MiB(r.AfterGC.HWM), bound(o.MaxRSS > 0, MiB(o.MaxRSS)))
	fmt.Fprintf(&b, "  BPF map memory MiB        %s idle, %s filled (bound %s)\n", MiB(r.MapIdle), MiB(r.Map), bound(o.MaxMap > 0, MiB(o.MaxMap)))
	fmt.Fprintf(&b, "  conntrack GC              %s over REST, %s in the daemon; scanned %d, expired %d, backend gone %d, repaired %d (bound %s)\n",
		r.GCWall.Round(time.Millisecond), r.GC.Duration.Round(time.Millisecond), r.GC.Scanned, r.GC.Expired, r.GC.BackendGone, r.GC.Repaired, bound(o.MaxGC > 0, o.MaxGC.String()))
	if len(r.Failed) == 0 {
		fmt.Fprintf(&b, "RSS-affinity: PASS\n")
	} else {
		fmt.Fprintf(&b, "RSS-affinity: FAIL: %s\n", strings.Join(r.Failed, "; "))
	}
	return b.String()
}
