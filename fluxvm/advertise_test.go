package fluxvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/health"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// advertDataplane is a Dataplane without a datapath: enough for the
// advertisement code, which reads only the services and the health
// overlay. path "" keeps the snapshot in memory.
func advertDataplane(t *testing.T, path string) *Dataplane {
	t.Helper()
	d := &Dataplane{
		opts:     Options{AdvertisementsPath: path, NodeName: "node-a"},
		log:      slog.New(slog.DiscardHandler),
		services: map[string]*service{},
	}
	d.health.observed = map[string]map[netip.AddrPort]*health.Status{}
	if err := d.initAdvertiser(); err != nil {
		t.Fatal(err)
	}
	return d
}

// setServices replaces the catalog and recomputes, as ApplyService does.
func (d *Dataplane) setServices(svcs ...Service) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.services = map[string]*service{}
	for _, s := range svcs {
		d.services[s.Name] = &service{intent: s}
	}
	d.advertise()
}

var (
	advVIP4 = netip.MustParseAddr("203.0.113.10")
	advVIP6 = netip.MustParseAddr("2001:db8::10")
	advBE4a = netip.MustParseAddrPort("10.200.2.2:8080")
	advBE4b = netip.MustParseAddrPort("10.200.3.2:8080")
	advBE6  = netip.MustParseAddrPort("[fd00:200:2::2]:8080")
)

// advService is a dual-stack north-south service with advertise=true, two
// IPv4 backends and one IPv6 backend.
func advService(name string) Service {
	s := Service{
		Name: name, Exposure: ExposureNorthSouth, Advertise: true,
		VIPs:  []netip.Addr{advVIP4, advVIP6},
		Ports: []ServicePort{{Port: 443, Protocol: TCP}, {Port: 80, Protocol: TCP}, {Port: 80, Protocol: UDP}},
	}
	for _, ep := range []netip.AddrPort{advBE4a, advBE4b, advBE6} {
		s.Backends = append(s.Backends, Backend{Address: ep.Addr(), Port: ep.Port()})
	}
	return s
}

func ptrBool(v bool) *bool { return &v }

// decisions maps "vip service" to "advertised" or the reason.
func decisions(entries []advert.Entry) map[string]string {
	out := map[string]string{}
	for _, e := range entries {
		v := "advertised"
		if !e.Advertised {
			v = string(e.Reason)
		}
		out[e.VIP.String()+" "+e.Service] = v
	}
	return out
}

func TestAdvertEntries(t *testing.T) {
	unhealthy := func(d *Dataplane, svc string, eps ...netip.AddrPort) {
		m := map[netip.AddrPort]*health.Status{}
		for _, ep := range eps {
			st := health.NewStatus(time.Now())
			st.State = health.Unhealthy
			m[ep] = &st
		}
		d.health.observed[svc] = m
	}
	tests := []struct {
		name   string
		mutate func(*Service)
		health func(*Dataplane)
		want   map[string]string // nil: no entries at all
	}{
		{name: "north-south advertised", mutate: func(*Service) {},
			want: map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "advertised"}},
		{name: "both advertised", mutate: func(s *Service) { s.Exposure = ExposureBoth },
			want: map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "advertised"}},
		{name: "east-west has no entry", mutate: func(s *Service) { s.Exposure = ExposureEastWest; s.Advertise = false }},
		{name: "default exposure has no entry", mutate: func(s *Service) { s.Exposure = ""; s.Advertise = false }},
		{name: "east-west asking is withdrawn", mutate: func(s *Service) { s.Exposure = "" }, // validation rejects it; Decide still withdraws
			want: map[string]string{"203.0.113.10 web": "not exposed north-south", "2001:db8::10 web": "not exposed north-south"}},
		{name: "advertise=false", mutate: func(s *Service) { s.Advertise = false },
			want: map[string]string{"203.0.113.10 web": "advertise=false", "2001:db8::10 web": "advertise=false"}},
		{name: "both, advertise=false", mutate: func(s *Service) { s.Exposure = ExposureBoth; s.Advertise = false },
			want: map[string]string{"203.0.113.10 web": "advertise=false", "2001:db8::10 web": "advertise=false"}},
		{name: "disabled service", mutate: func(s *Service) { s.Enabled = ptrBool(false) },
			want: map[string]string{"203.0.113.10 web": "service disabled", "2001:db8::10 web": "service disabled"}},
		{name: "no IPv6 backend", mutate: func(s *Service) { s.Backends = s.Backends[:2] },
			want: map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "no ready backend"}},
		{name: "no backend at all", mutate: func(s *Service) { s.Backends = nil },
			want: map[string]string{"203.0.113.10 web": "no ready backend", "2001:db8::10 web": "no ready backend"}},
		{name: "draining, disabled, weight 0 and unhealthy intents are not ready", mutate: func(s *Service) {
			s.Backends[0].State, s.Backends[0].DrainUntilUnixMs = BackendDraining, 1
			s.Backends[1].Enabled = ptrBool(false)
			s.Backends[2].Weight = u32(0)
			s.Backends = append(s.Backends, Backend{Address: advBE4a.Addr(), Port: 9090, State: BackendUnhealthy})
		}, want: map[string]string{"203.0.113.10 web": "no ready backend", "2001:db8::10 web": "no ready backend"}},
		{name: "one IPv4 backend unhealthy after health", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp"} },
			health: func(d *Dataplane) { unhealthy(d, "web", advBE4a) },
			want:   map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "advertised"}},
		{name: "every IPv4 backend unhealthy after health", mutate: func(s *Service) { s.HealthCheck = &HealthCheck{Kind: "tcp"} },
			health: func(d *Dataplane) { unhealthy(d, "web", advBE4a, advBE4b) },
			want:   map[string]string{"203.0.113.10 web": "no ready backend", "2001:db8::10 web": "advertised"}},
		{name: "observed unhealthy without a check is ignored", mutate: func(*Service) {},
			health: func(d *Dataplane) { unhealthy(d, "web", advBE4a, advBE4b, advBE6) },
			want:   map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "advertised"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := advertDataplane(t, "")
			s := advService("web")
			tt.mutate(&s)
			if tt.health != nil {
				tt.health(d)
			}
			d.services["web"] = &service{intent: s}
			got := d.advertEntries()
			if tt.want == nil {
				if len(got) != 0 {
					t.Fatalf("entries %+v, want none", got)
				}
				return
			}
			if g := decisions(got); !mapsEqual(g, tt.want) {
				t.Errorf("decisions %v, want %v", g, tt.want)
			}
			for _, e := range got {
				if len(e.Ports) != 3 || e.Exposure == "" {
					t.Errorf("entry %+v: ports or exposure missing", e)
				}
			}
		})
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestMemPublisher checks that the in-memory snapshot follows the file
// publisher's rules: canonical order (advert.Decode accepts it), the
// generation grows only with content.
func TestMemPublisher(t *testing.T) {
	m := &memPublisher{node: "node-a"}
	if _, ok := m.Current(); ok {
		t.Fatal("a snapshot before any publish")
	}
	d := advertDataplane(t, "")
	d.services["web"] = &service{intent: advService("web")}
	b := advService("api")
	b.VIPs = []netip.Addr{netip.MustParseAddr("198.51.100.7")}
	b.Backends = b.Backends[:1]
	d.services["api"] = &service{intent: b}
	entries := d.advertEntries()
	s1, changed, err := m.Publish(entries)
	if err != nil || !changed || s1.Generation != 1 || s1.Node != "node-a" {
		t.Fatalf("first publish: gen %d changed %v err %v", s1.Generation, changed, err)
	}
	data, err := json.Marshal(s1)
	if err != nil {
		t.Fatal(err)
	}
	dec, err := advert.Decode(data)
	if err != nil {
		t.Fatalf("in-memory snapshot is not canonical: %v\n%s", err, data)
	}
	if got := dec.AdvertisedPrefixes(); len(got) != 3 || got[0].String() != "198.51.100.7/32" {
		t.Errorf("prefixes %v", got)
	}
	// Reversed input: same content.
	rev := append([]advert.Entry(nil), entries...)
	for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
		rev[i], rev[j] = rev[j], rev[i]
	}
	if s, changed, _ := m.Publish(rev); changed || s.Generation != 1 {
		t.Errorf("same content: gen %d changed %v", s.Generation, changed)
	}
	entries[0] = advert.Decide(advert.Input{VIP: entries[0].VIP, Service: entries[0].Service, Exposure: entries[0].Exposure})
	if s, changed, _ := m.Publish(entries); !changed || s.Generation != 2 {
		t.Errorf("new content: gen %d changed %v", s.Generation, changed)
	}
}

// TestAdvertiserFile drives the publisher goroutine without a datapath:
// sets submitted in a burst end with the last one in the file, an
// unchanged set does not rewrite it, Close publishes what is pending and
// stops the goroutine, and a new dataplane continues the generation.
func TestAdvertiserFile(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	path := filepath.Join(t.TempDir(), "run", "service-advertisements.json")
	d := advertDataplane(t, path)
	d.startAdvertiser()
	// The empty catalog is published at start.
	s, err := advert.Read(path)
	if err != nil || s.Generation != 1 || len(s.Entries) != 0 || s.Node != "node-a" {
		t.Fatalf("at start: %+v, %v", s, err)
	}

	web := advService("web")
	d.setServices(web)
	got := d.Advertisements()
	if got.Generation != 2 || len(got.AdvertisedPrefixes()) != 2 {
		t.Fatalf("after apply: %+v", got)
	}
	if s, err := advert.Read(path); err != nil || s.Generation != 2 || !snapshotsEqual(s, got) {
		t.Fatalf("file %+v (%v), Advertisements %+v", s, err, got)
	}
	st1, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}

	// The same content again, many times: no rewrite.
	for range 20 {
		d.setServices(web)
	}
	if got := d.Advertisements(); got.Generation != 2 {
		t.Errorf("unchanged content moved the generation to %d", got.Generation)
	}
	st2, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(st1, st2) || !st1.ModTime().Equal(st2.ModTime()) {
		t.Error("unchanged content rewrote the file")
	}
	if st := d.adv.status(); st.Path != path || st.Generation != 2 || st.Advertised != 2 || st.Withdrawn != 0 || st.LastError != "" {
		t.Errorf("status %+v", st)
	}

	// A burst: only the last set matters. Close publishes it.
	for i := range 50 {
		w := web
		w.Advertise = i%2 == 0
		d.setServices(w)
	}
	web.Advertise = false
	d.setServices(web)
	d.stopAdvertiser()
	d.stopAdvertiser() // idempotent
	s, err = advert.Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if dec := decisions(s.Entries); dec["203.0.113.10 web"] != "advertise=false" || dec["2001:db8::10 web"] != "advertise=false" {
		t.Errorf("after Close the file has %v, want the last set (advertise=false)", dec)
	}
	gen := s.Generation
	if gen < 3 {
		t.Errorf("generation %d after a change", gen)
	}
	goleak.VerifyNone(t, leaks)

	// A new dataplane on the same file: same content, no rewrite, the
	// generation continues.
	st3, _ := os.Stat(path)
	d2 := advertDataplane(t, path)
	d2.services["web"] = &service{intent: web}
	d2.startAdvertiser()
	if got := d2.Advertisements(); got.Generation != gen {
		t.Errorf("restart: generation %d, want %d", got.Generation, gen)
	}
	st4, _ := os.Stat(path)
	if !os.SameFile(st3, st4) {
		t.Error("restart rewrote unchanged content")
	}
	web.Advertise = true
	d2.setServices(web)
	if got := d2.Advertisements(); got.Generation != gen+1 {
		t.Errorf("change after restart: generation %d, want %d", got.Generation, gen+1)
	}
	// Cleanup's rule: an empty snapshot withdraws everything.
	d2.adv.submit([]advert.Entry{})
	d2.stopAdvertiser()
	if s, err := advert.Read(path); err != nil || len(s.Entries) != 0 || s.Generation != gen+2 {
		t.Errorf("after the empty publish: %+v, %v", s, err)
	}
	goleak.VerifyNone(t, leaks)
}

// TestAdvertiserPublishError: a path that cannot be written does not stop
// the dataplane; Advertisements reports the computed entries with
// generation 0, Status the error, and the goroutine retries until the
// path becomes writable.
func TestAdvertiserPublishError(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	dir := t.TempDir()
	block := filepath.Join(dir, "blocked")
	if err := os.WriteFile(block, []byte("a file where a directory should be"), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "run", "service-advertisements.json")
	d := advertDataplane(t, path)
	d.services["web"] = &service{intent: advService("web")}
	// A file where the directory should be, once the publisher exists.
	if err := os.Rename(block, filepath.Dir(path)); err != nil {
		t.Fatal(err)
	}
	block = filepath.Dir(path)
	retry := make(chan time.Time)
	flushed := make(chan error)
	d.adv.testRetry, d.adv.testFlushed = retry, flushed
	d.startAdvertiser()
	s := d.Advertisements()
	if s.Generation != 0 || len(s.AdvertisedPrefixes()) != 2 || s.SchemaVersion != advert.SchemaVersion {
		t.Errorf("unpublished snapshot %+v", s)
	}
	st := d.adv.status()
	if st.LastError == "" || st.LastErrorAt == nil || st.Generation != 0 {
		t.Errorf("status %+v, want the error", st)
	}
	// Every attempt fails while the path is blocked (those that the
	// failures of start and Advertisements kicked, too), and after one
	// the goroutine waits for its retry.
	timeout := time.After(5 * time.Second)
	for retried := false; !retried; {
		select {
		case err := <-flushed:
			if err == nil {
				t.Fatal("the goroutine published while the path was blocked")
			}
		case retry <- time.Now():
			retried = true
		case <-timeout:
			t.Fatal("the goroutine does not wait for a retry after a failed publish")
		}
	}
	// Make the path writable: the goroutine retries until it publishes.
	if err := os.Remove(block); err != nil {
		t.Fatal(err)
	}
	timeout = time.After(5 * time.Second)
	for published := false; !published; {
		select {
		case err := <-flushed:
			published = err == nil
		case retry <- time.Now():
		case <-timeout:
			t.Fatalf("not published after the path became writable: %+v", d.adv.status())
		}
	}
	if s, err := advert.Read(path); err != nil || s.Generation != 1 {
		t.Errorf("file after the retry: %+v, %v", s, err)
	}
	if st := d.adv.status(); st.LastError != "" || st.Generation != 1 {
		t.Errorf("status after the retry %+v", st)
	}
	d.stopAdvertiser()
	goleak.VerifyNone(t, leaks)
}

// TestAdvertiserConcurrent submits, reads and reports from several
// goroutines at once (run with -race); the file ends with the last set.
func TestAdvertiserConcurrent(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	path := filepath.Join(t.TempDir(), "service-advertisements.json")
	d := advertDataplane(t, path)
	d.startAdvertiser()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				w := advService("web")
				w.Advertise = (i+g)%3 != 0
				d.setServices(w)
				_ = d.Advertisements()
				d.mu.Lock()
				_ = d.adv.status()
				d.mu.Unlock()
			}
		}()
	}
	wg.Wait()
	d.setServices(advService("web"))
	d.stopAdvertiser()
	s, err := advert.Read(path)
	if err != nil || len(s.AdvertisedPrefixes()) != 2 {
		t.Errorf("final file %+v, %v", s, err)
	}
	goleak.VerifyNone(t, leaks)
}

func snapshotsEqual(a, b advert.Snapshot) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// TestDataplaneAdvertisements runs the integration on the lab: a
// north-south service with advertise=true and a health check whose
// backends are vm2 (listening) and vm3 on a port nobody listens on. The
// file follows apply, health, intent changes and delete; unchanged
// content is not rewritten; Close leaves the file as last published and
// a restart continues it; Cleanup withdraws everything.
func TestDataplaneAdvertisements(t *testing.T) {
	e := newNSEnv(t)
	leaks := goleak.IgnoreCurrent()
	path := filepath.Join(t.TempDir(), "service-advertisements.json")
	e.opts.AdvertisementsPath = path
	e.opts.NodeName = "lab-node"
	d, err := Open(context.Background(), e.opts)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			d.Close()
		}
	})
	ctx := context.Background()
	read := func(phase string) advert.Snapshot {
		t.Helper()
		// Advertisements first: it publishes a set not yet written.
		api := d.Advertisements()
		s, err := advert.Read(path)
		if err != nil {
			t.Fatalf("%s: %v", phase, err)
		}
		if !snapshotsEqual(api, s) {
			t.Fatalf("%s: Advertisements %+v differs from the file %+v", phase, api, s)
		}
		return s
	}
	if s := read("open"); s.Generation != 1 || len(s.Entries) != 0 || s.Node != "lab-node" {
		t.Fatalf("at open: %+v", s)
	}
	if st := d.Status().Advertisements; st.Path != path || st.Generation != 1 {
		t.Errorf("status %+v", st)
	}

	hc := &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 60_000, UnhealthyThreshold: 2, HealthyThreshold: 2}
	svc := e.healthService(hc)
	svc.Exposure, svc.Advertise = ExposureNorthSouth, true
	ew := e.service(1, 1, 1)
	ew.Name, ew.VIPs = "internal", []netip.Addr{netip.MustParseAddr("10.96.0.20"), netip.MustParseAddr("fd00:96::20")}
	for _, s := range []Service{svc, ew} {
		if _, err := d.ApplyService(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	s := read("apply")
	want := map[string]string{vip4.String() + " web": "advertised", vip6.String() + " web": "advertised"}
	if got := decisions(s.Entries); !mapsEqual(got, want) {
		t.Fatalf("after apply %v, want %v (the east-west service has no entry)", got, want)
	}
	gen := s.Generation

	// vm3 (refused) becomes unhealthy; vm2 is still ready: nothing
	// changes, nothing is rewritten.
	reconcile(t, d, 2)
	if s := read("vm3 unhealthy"); s.Generation != gen || !mapsEqual(decisions(s.Entries), want) {
		t.Errorf("vm3 unhealthy: gen %d (was %d) %v", s.Generation, gen, decisions(s.Entries))
	}
	// vm2 moves to port 8081 too: after health, no backend is ready.
	// (A copy: the dataplane keeps the slices of the intent it was given.)
	svc.Backends = append([]Backend(nil), svc.Backends...)
	for i := range svc.Backends {
		svc.Backends[i].Port = 8081
	}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	// Just applied: the new endpoints start unknown, which counts as
	// ready.
	if s := read("moved"); !mapsEqual(decisions(s.Entries), want) {
		t.Errorf("moved, not yet checked: %v", decisions(s.Entries))
	}
	rep := reconcile(t, d, 2)
	s = read("all unhealthy")
	withdrawn := map[string]string{vip4.String() + " web": "no ready backend", vip6.String() + " web": "no ready backend"}
	if got := decisions(s.Entries); !mapsEqual(got, withdrawn) || s.Generation <= gen {
		t.Fatalf("all unhealthy: gen %d (was %d) %v, want %v; health %+v", s.Generation, gen, got, withdrawn, rep)
	}
	gen = s.Generation

	// A server on 8081 in vm3: healthy again after the threshold.
	srv, err := e.backends[1].Serve(8081)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	reconcile(t, d, 2)
	if s := read("vm3 back"); !mapsEqual(decisions(s.Entries), want) || s.Generation != gen+1 {
		t.Errorf("vm3 back: gen %d (was %d) %v", s.Generation, gen, decisions(s.Entries))
	}

	// advertise=false, then disabled.
	svc.Advertise = false
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if got := decisions(read("advertise=false").Entries); got[vip4.String()+" web"] != "advertise=false" {
		t.Errorf("advertise=false: %v", got)
	}
	svc.Advertise, svc.Enabled = true, ptrBool(false)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if got := decisions(read("disabled").Entries); got[vip6.String()+" web"] != "service disabled" {
		t.Errorf("disabled: %v", got)
	}
	// Exposure both, enabled: advertised again.
	svc.Enabled, svc.Exposure = nil, ExposureBoth
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	s = read("both")
	if got := decisions(s.Entries); !mapsEqual(got, want) {
		t.Errorf("both: %v", got)
	}
	// The same intent again: no rewrite.
	st1, _ := os.Stat(path)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if s2 := read("same again"); s2.Generation != s.Generation {
		t.Errorf("same intent moved the generation %d -> %d", s.Generation, s2.Generation)
	}
	if st2, _ := os.Stat(path); !os.SameFile(st1, st2) {
		t.Error("same intent rewrote the file")
	}
	var raw map[string]any
	data, _ := os.ReadFile(path)
	if err := json.Unmarshal(data, &raw); err != nil || raw["schema_version"] != float64(1) {
		t.Errorf("file %s", data)
	}

	// Close: the file stays as last published, and a restart (catalog
	// restore) does not rewrite it.
	gen = s.Generation
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	closed = true
	advertiserStopped(t, d)
	goleak.VerifyNone(t, append(labServers(), leaks)...)
	if s := read("closed"); s.Generation != gen || !mapsEqual(decisions(s.Entries), want) {
		t.Errorf("after Close: gen %d %v", s.Generation, decisions(s.Entries))
	}
	st1, _ = os.Stat(path)
	d, err = Open(context.Background(), e.opts)
	if err != nil {
		t.Fatal(err)
	}
	closed = false
	if s := read("reopened"); s.Generation != gen {
		t.Errorf("reopen: generation %d, want %d", s.Generation, gen)
	}
	if st2, _ := os.Stat(path); !os.SameFile(st1, st2) {
		t.Error("reopen rewrote the unchanged file")
	}

	// Delete: the entries are gone.
	if err := d.DeleteService(ctx, "web"); err != nil {
		t.Fatal(err)
	}
	if s := read("deleted"); len(s.Entries) != 0 || s.Generation != gen+1 {
		t.Errorf("after delete: %+v", s)
	}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	// Cleanup withdraws everything and keeps the file: a publication
	// after whatever the apply and the health checks published (a check
	// that flaps under a loaded machine publishes too).
	before := read("applied again").Generation
	if err := d.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	closed = true
	s, err = advert.Read(path)
	if err != nil || len(s.Entries) != 0 || s.Generation <= before {
		t.Errorf("after Cleanup: %+v, %v; want a generation after %d", s, err, before)
	}
	advertiserStopped(t, d)
	goleak.VerifyNone(t, append(labServers(), leaks)...)
}

// labServers ignores the goroutines of the lab servers a test starts
// (they end at its cleanup): a leak check after Close looks at the
// dataplane's.
func labServers() []goleak.Option {
	// The method's full name, from the code itself: a string would go
	// stale when the package moves.
	closeFn := runtime.FuncForPC(reflect.ValueOf((*lab.Server).Close).Pointer()).Name()
	server := strings.TrimSuffix(closeFn, "Close")
	return []goleak.Option{
		goleak.IgnoreAnyFunction(server + "acceptLoop"),
		goleak.IgnoreAnyFunction(server + "acceptLoop.func1"),
		goleak.IgnoreAnyFunction(server + "udpLoop"),
	}
}

func advertiserStopped(t *testing.T, d *Dataplane) {
	t.Helper()
	select {
	case <-d.adv.done:
	default:
		t.Error("the publisher goroutine still runs after Close")
	}
}

// TestOpenAdvertisementsUnreadable: a snapshot path that cannot be read
// fails Open, naming it.
func TestOpenAdvertisementsUnreadable(t *testing.T) {
	e := newEnv(t)
	dir := t.TempDir()
	e.opts.AdvertisementsPath = dir // a directory in the file's place
	_, err := Open(context.Background(), e.opts)
	if err == nil || !strings.Contains(err.Error(), "advertisements") {
		t.Fatalf("Open = %v, want an advertisements error", err)
	}
	if errors.Is(err, fs.ErrNotExist) {
		t.Errorf("unexpected %v", err)
	}
}

// TestCleanupReportsUnpublishedWithdrawal: Cleanup promises adapters an
// empty snapshot. When that snapshot cannot be written, the file still
// advertises the VIPs of a node that no longer serves them, and Cleanup
// must say so instead of reporting success.
func TestCleanupReportsUnpublishedWithdrawal(t *testing.T) {
	e := newNSEnv(t)
	dir := filepath.Join(t.TempDir(), "run")
	path := filepath.Join(dir, "service-advertisements.json")
	e.opts.AdvertisementsPath = path
	d, err := Open(context.Background(), e.opts)
	if err != nil {
		t.Fatal(err)
	}
	cleaned := false
	t.Cleanup(func() {
		if !cleaned {
			d.Cleanup(context.Background())
		}
	})
	svc := e.nsService("web", advVIP4, advVIP6, ExposureNorthSouth, ModeNAT, false)
	svc.Advertise = true
	if _, err := d.ApplyService(context.Background(), svc); err != nil {
		t.Fatal(err)
	}
	if s := d.Advertisements(); len(s.AdvertisedPrefixes()) != 2 || s.Generation == 0 {
		t.Fatalf("before Cleanup: %+v", s)
	}
	// The directory becomes a file: no snapshot can be written any more.
	moved := dir + ".moved"
	if err := os.Rename(dir, moved); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, []byte("not a directory"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = d.Cleanup(context.Background())
	cleaned = true
	if err == nil || !strings.Contains(err.Error(), "advertisements") {
		t.Errorf("Cleanup = %v, want an error saying the withdrawal was not published", err)
	}
	if s, err := advert.Read(filepath.Join(moved, filepath.Base(path))); err != nil || len(s.AdvertisedPrefixes()) != 2 {
		t.Fatalf("the last published file: %+v, %v", s, err)
	}
	advertiserStopped(t, d)
}
