//go:build linux

package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/netip"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// TierMaxServices is each tier's datapath service capacity
// (FLUXVM_MAX_SERVICES in bpf/fluxvm_service_maps.bpf.h).
var TierMaxServices = map[string]int{"S": 256, "M": 1024, "L": 4096}

// RSSOptions configure RSS.
type RSSOptions struct {
	// Daemon is the fluxvmd binary.
	Daemon string
	// Tiers to measure, each with a daemon and a lab of its own.
	Tiers []string
	// Services and Backends per service to apply over REST. A tier that
	// holds fewer services (S: 256) gets its capacity less 6.
	Services, Backends int
	// MaxRSS and MaxMap bound the daemon's VmRSS and the datapath's map
	// memory (status memory.total_bytes) per tier, in bytes; a tier
	// without a bound is measured, not gated.
	MaxRSS, MaxMap map[string]uint64
}

// RSSTier is what RSS measured at one tier.
type RSSTier struct {
	Tier               string
	Services, Backends int
	Idle, Loaded       procMemory // the daemon before and after the services
	Map, MapIdle       uint64     // map memory (status memory.total_bytes)
	Apply              time.Duration
	Failed             []string
}

// RSSReport is what RSS measured and judged.
type RSSReport struct {
	Tiers  []RSSTier
	Failed []string
}

// rssService is the i-th service of the gate (1-based): one VIP
// (10.97.0.0/16), port 80/tcp, backends backends of their own
// (10.128.0.0/10 at port 8080), weight 1.
func rssService(i, backends int) fluxvm.Service {
	one := uint32(1)
	s := fluxvm.Service{
		Name:  fmt.Sprintf("gate-%04d", i),
		VIPs:  []netip.Addr{netip.AddrFrom4([4]byte{10, 97, byte(i >> 8), byte(i)})},
		Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
	}
	for b := range backends {
		n := i*backends + b
		a := netip.AddrFrom4([4]byte{10, byte(128 + n>>16), byte(n >> 8), byte(n)})
		s.Backends = append(s.Backends, fluxvm.Backend{Address: a, Port: 8080, Weight: &one})
	}
	return s
}

// RSS starts the real daemon per tier in a lab node namespace, applies
// the services over REST (POST /v1/network/services), reads the
// daemon's resident memory (/proc/<pid>/status) and the datapath's map
// memory (GET …/status), prints a table and judges the bounds.
func RSS(ctx context.Context, w io.Writer, o RSSOptions) (*RSSReport, error) {
	rep := &RSSReport{}
	for _, tier := range o.Tiers {
		capacity, ok := TierMaxServices[tier]
		if !ok {
			return rep, fmt.Errorf("scenario: rss: unknown tier %q", tier)
		}
		t, err := rssTier(ctx, w, o, tier, min(o.Services, capacity-6))
		if err != nil {
			return rep, fmt.Errorf("scenario: rss: tier %s: %w", tier, err)
		}
		if b, ok := o.MaxRSS[tier]; ok && t.Loaded.RSS > b {
			t.Failed = append(t.Failed, fmt.Sprintf("tier %s: daemon RSS %s MiB > %s MiB", tier, MiB(t.Loaded.RSS), MiB(b)))
		}
		if b, ok := o.MaxMap[tier]; ok && t.Map > b {
			t.Failed = append(t.Failed, fmt.Sprintf("tier %s: BPF map memory %s MiB > %s MiB", tier, MiB(t.Map), MiB(b)))
		}
		rep.Failed = append(rep.Failed, t.Failed...)
		rep.Tiers = append(rep.Tiers, t)
	}
	fmt.Fprint(w, rep.Table(o))
	return rep, nil
}

func rssTier(ctx context.Context, w io.Writer, o RSSOptions, tier string, services int) (t RSSTier, err error) {
	t = RSSTier{Tier: tier, Services: services, Backends: o.Backends}
	l, err := lab.New()
	if err != nil {
		return t, err
	}
	defer func() { err = errors.Join(err, l.Close()) }()
	d, err := startLabDaemon(ctx, o.Daemon, l, tier, "")
	if err != nil {
		return t, err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	st, err := d.status(ctx)
	if err != nil {
		return t, err
	}
	if st.Memory == nil {
		return t, fmt.Errorf("status has no memory section")
	}
	t.MapIdle = st.Memory.Total
	if t.Idle, err = d.memory(); err != nil {
		return t, err
	}
	fmt.Fprintf(w, "tier %s: fluxvmd pid %d up, RSS %s MiB, map memory %s MiB; applying %d services × %d backends over REST...\n",
		tier, d.cmd.Process.Pid, MiB(t.Idle.RSS), MiB(t.MapIdle), services, o.Backends)
	t0 := time.Now()
	for i := 1; i <= services; i++ {
		if err := d.request(ctx, "POST", "/v1/network/services", rssService(i, o.Backends), nil); err != nil {
			return t, fmt.Errorf("service %d: %w", i, err)
		}
	}
	t.Apply = time.Since(t0)
	if st, err = d.status(ctx); err != nil {
		return t, err
	}
	if st.Memory == nil || st.Memory.Error != "" {
		return t, fmt.Errorf("status memory: %+v", st.Memory)
	}
	t.Map = st.Memory.Total
	if t.Loaded, err = d.memory(); err != nil {
		return t, err
	}
	fmt.Fprintf(w, "tier %s: applied in %s; RSS %s MiB (peak %s), map memory %s MiB (%d Maglev tables)\n",
		tier, t.Apply.Round(time.Millisecond), MiB(t.Loaded.RSS), MiB(t.Loaded.HWM), MiB(t.Map), st.Memory.MaglevInner.Count)
	return t, nil
}

// Table prints the tiers with their bounds and verdicts.
func (r *RSSReport) Table(o RSSOptions) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\nRSS gate (fluxvmd, services × backends applied over REST):\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "tier\tservices\tbackends\tapply s\tRSS idle MiB\tRSS MiB\tpeak MiB\tbound MiB\tmaps idle MiB\tmaps MiB\tbound MiB\tverdict\t")
	bound := func(m map[string]uint64, tier string) string {
		if v, ok := m[tier]; ok {
			return MiB(v)
		}
		return "-"
	}
	for _, t := range r.Tiers {
		verdict := "ok"
		if len(t.Failed) > 0 {
			verdict = "FAIL"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", t.Tier, t.Services, t.Services*t.Backends, t.Apply.Seconds(),
			MiB(t.Idle.RSS), MiB(t.Loaded.RSS), MiB(t.Loaded.HWM), bound(o.MaxRSS, t.Tier), MiB(t.MapIdle), MiB(t.Map), bound(o.MaxMap, t.Tier), verdict)
	}
	tw.Flush()
	if len(r.Failed) == 0 {
		fmt.Fprintf(&b, "RSS: PASS\n")
	} else {
		fmt.Fprintf(&b, "RSS: FAIL: %s\n", strings.Join(r.Failed, "; "))
	}
	return b.String()
}

// maxBoundMiB is the largest bound ParseTierBounds takes (1 TiB): far
// above any tier, and it keeps the conversion to bytes exact in uint64.
const maxBoundMiB = 1 << 20

// ParseTierBounds reads "S=64,M=128,L=256" (MiB) into bytes per tier.
func ParseTierBounds(s string) (map[string]uint64, error) {
	out := map[string]uint64{}
	if s == "" {
		return out, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if _, known := TierMaxServices[k]; !ok || !known {
			return nil, fmt.Errorf("bound %q is not TIER=MiB with TIER S, M or L", kv)
		}
		// The whole value is the number: "64MiB" or "1.5GiB" is refused,
		// not read as 64 or 1.5 MiB.
		mib, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || math.IsNaN(mib) || mib <= 0 || mib > maxBoundMiB {
			return nil, fmt.Errorf("bound %q: %q is not a number of MiB in (0, %d]", kv, v, maxBoundMiB)
		}
		out[k] = uint64(mib * (1 << 20))
	}
	return out, nil
}
