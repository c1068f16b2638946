package advertisements

import (
	"bytes"
	"encoding/json"
	"errors"
	"iter"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/internal/testutils/adverttest"
)

// fakeServices is the View of a dataplane without a datapath: a catalog
// and a health overlay, under a lock as the facade's d.mu.
type fakeServices struct {
	mu        sync.Mutex
	services  map[string]*intent.Service
	unhealthy map[string]map[netip.AddrPort]bool // observed unhealthy
	snat      SNAT
	hold      advert.Reason
	adv       *Advertiser
}

func (f *fakeServices) SNAT() SNAT { return f.snat }

func (f *fakeServices) Hold() advert.Reason { return f.hold }

func (f *fakeServices) Services() iter.Seq[*intent.Service] {
	return func(yield func(*intent.Service) bool) {
		for _, s := range f.services {
			if !yield(s) {
				return
			}
		}
	}
}

// EffectiveState applies the health overlay's rule (package
// fluxvm/internal/health): a Ready backend of a checked service observed
// unhealthy is Unhealthy.
func (f *fakeServices) EffectiveState(svc *intent.Service, b *intent.Backend) intent.BackendState {
	st := b.EffectiveState()
	if st == intent.BackendReady && svc.HealthCheck != nil && f.unhealthy[svc.Name][b.Endpoint()] {
		return intent.BackendUnhealthy
	}
	return st
}

// advertDataplane is a fake dataplane with an Advertiser on path ("":
// in memory).
func advertDataplane(t *testing.T, path string) *fakeServices {
	t.Helper()
	f := &fakeServices{services: map[string]*intent.Service{}, unhealthy: map[string]map[netip.AddrPort]bool{}}
	a, err := New(Config{Path: path, Node: "node-a"}, Deps{View: f})
	if err != nil {
		t.Fatal(err)
	}
	f.adv = a
	return f
}

// setServices replaces the catalog and recomputes, as ApplyService does.
func (f *fakeServices) setServices(svcs ...intent.Service) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.services = map[string]*intent.Service{}
	for _, s := range svcs {
		f.services[s.Name] = &s
	}
	f.adv.Update()
}

// startAdvertiser computes the entries and starts, as Open does.
func (f *fakeServices) startAdvertiser() {
	f.mu.Lock()
	f.adv.Update()
	f.mu.Unlock()
	f.adv.Start()
}

func u32(v uint32) *uint32 { return &v }

var (
	advVIP4 = netip.MustParseAddr("203.0.113.10")
	advVIP6 = netip.MustParseAddr("2001:db8::10")
	advBE4a = netip.MustParseAddrPort("10.200.2.2:8080")
	advBE4b = netip.MustParseAddrPort("10.200.3.2:8080")
	advBE6  = netip.MustParseAddrPort("[fd00:200:2::2]:8080")
)

// advService is a dual-stack north-south service with advertise=true, two
// IPv4 backends and one IPv6 backend.
func advService(name string) intent.Service {
	s := intent.Service{
		Name: name, Exposure: intent.ExposureNorthSouth, Advertise: true,
		VIPs:  []netip.Addr{advVIP4, advVIP6},
		Ports: []intent.ServicePort{{Port: 443, Protocol: intent.TCP}, {Port: 80, Protocol: intent.TCP}, {Port: 80, Protocol: intent.UDP}},
	}
	for _, ep := range []netip.AddrPort{advBE4a, advBE4b, advBE6} {
		s.Backends = append(s.Backends, intent.Backend{Address: ep.Addr(), Port: ep.Port()})
	}
	return s
}

func ptrBool(v bool) *bool { return &v }

func TestAdvertEntries(t *testing.T) {
	unhealthy := func(d *fakeServices, svc string, eps ...netip.AddrPort) {
		m := map[netip.AddrPort]bool{}
		for _, ep := range eps {
			m[ep] = true
		}
		d.unhealthy[svc] = m
	}
	tests := []struct {
		name   string
		mutate func(*intent.Service)
		health func(*fakeServices)
		want   map[string]string // nil: no entries at all
	}{
		{name: "north-south advertised", mutate: func(*intent.Service) {},
			want: map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "advertised"}},
		{name: "both advertised", mutate: func(s *intent.Service) { s.Exposure = intent.ExposureBoth },
			want: map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "advertised"}},
		{name: "east-west has no entry", mutate: func(s *intent.Service) { s.Exposure = intent.ExposureEastWest; s.Advertise = false }},
		{name: "default exposure has no entry", mutate: func(s *intent.Service) { s.Exposure = ""; s.Advertise = false }},
		{name: "east-west asking is withdrawn", mutate: func(s *intent.Service) { s.Exposure = "" }, // validation rejects it; Decide still withdraws
			want: map[string]string{"203.0.113.10 web": "not exposed north-south", "2001:db8::10 web": "not exposed north-south"}},
		{name: "advertise=false", mutate: func(s *intent.Service) { s.Advertise = false },
			want: map[string]string{"203.0.113.10 web": "advertise=false", "2001:db8::10 web": "advertise=false"}},
		{name: "both, advertise=false", mutate: func(s *intent.Service) { s.Exposure = intent.ExposureBoth; s.Advertise = false },
			want: map[string]string{"203.0.113.10 web": "advertise=false", "2001:db8::10 web": "advertise=false"}},
		{name: "disabled service", mutate: func(s *intent.Service) { s.Enabled = ptrBool(false) },
			want: map[string]string{"203.0.113.10 web": "service disabled", "2001:db8::10 web": "service disabled"}},
		{name: "no IPv6 backend", mutate: func(s *intent.Service) { s.Backends = s.Backends[:2] },
			want: map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "no ready backend"}},
		{name: "no backend at all", mutate: func(s *intent.Service) { s.Backends = nil },
			want: map[string]string{"203.0.113.10 web": "no ready backend", "2001:db8::10 web": "no ready backend"}},
		{name: "draining, disabled, weight 0 and unhealthy intents are not ready", mutate: func(s *intent.Service) {
			s.Backends[0].State, s.Backends[0].DrainUntilUnixMs = intent.BackendDraining, 1
			s.Backends[1].Enabled = ptrBool(false)
			s.Backends[2].Weight = u32(0)
			s.Backends = append(s.Backends, intent.Backend{Address: advBE4a.Addr(), Port: 9090, State: intent.BackendUnhealthy})
		}, want: map[string]string{"203.0.113.10 web": "no ready backend", "2001:db8::10 web": "no ready backend"}},
		{name: "one IPv4 backend unhealthy after health", mutate: func(s *intent.Service) { s.HealthCheck = &intent.HealthCheck{Kind: "tcp"} },
			health: func(d *fakeServices) { unhealthy(d, "web", advBE4a) },
			want:   map[string]string{"203.0.113.10 web": "advertised", "2001:db8::10 web": "advertised"}},
		{name: "every IPv4 backend unhealthy after health", mutate: func(s *intent.Service) { s.HealthCheck = &intent.HealthCheck{Kind: "tcp"} },
			health: func(d *fakeServices) { unhealthy(d, "web", advBE4a, advBE4b) },
			want:   map[string]string{"203.0.113.10 web": "no ready backend", "2001:db8::10 web": "advertised"}},
		{name: "observed unhealthy without a check is ignored", mutate: func(*intent.Service) {},
			health: func(d *fakeServices) { unhealthy(d, "web", advBE4a, advBE4b, advBE6) },
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
			d.services["web"] = &s
			got := Entries(d)
			if tt.want == nil {
				if len(got) != 0 {
					t.Fatalf("entries %+v, want none", got)
				}
				return
			}
			if g := adverttest.Decisions(got); !maps.Equal(g, tt.want) {
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

// TestMemPublisher checks that the in-memory snapshot follows the file
// publisher's rules: canonical order (advert.Decode accepts it), the
// generation grows only with content.
func TestMemPublisher(t *testing.T) {
	m := &memPublisher{node: "node-a"}
	if _, ok := m.Current(); ok {
		t.Fatal("a snapshot before any publish")
	}
	d := advertDataplane(t, "")
	d.services["web"] = ptr(advService("web"))
	b := advService("api")
	b.VIPs = []netip.Addr{netip.MustParseAddr("198.51.100.7")}
	b.Backends = b.Backends[:1]
	d.services["api"] = &b
	entries := Entries(d)
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
	got := d.adv.Snapshot()
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
	if got := d.adv.Snapshot(); got.Generation != 2 {
		t.Errorf("unchanged content moved the generation to %d", got.Generation)
	}
	st2, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(st1, st2) || !st1.ModTime().Equal(st2.ModTime()) {
		t.Error("unchanged content rewrote the file")
	}
	if st := d.adv.Status(); st.Path != path || st.Generation != 2 || st.Advertised != 2 || st.Withdrawn != 0 || st.LastError != "" {
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
	d.adv.Close()
	d.adv.Close() // idempotent
	s, err = advert.Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if dec := adverttest.Decisions(s.Entries); dec["203.0.113.10 web"] != "advertise=false" || dec["2001:db8::10 web"] != "advertise=false" {
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
	d2.services["web"] = &web
	d2.startAdvertiser()
	if got := d2.adv.Snapshot(); got.Generation != gen {
		t.Errorf("restart: generation %d, want %d", got.Generation, gen)
	}
	st4, _ := os.Stat(path)
	if !os.SameFile(st3, st4) {
		t.Error("restart rewrote unchanged content")
	}
	web.Advertise = true
	d2.setServices(web)
	if got := d2.adv.Snapshot(); got.Generation != gen+1 {
		t.Errorf("change after restart: generation %d, want %d", got.Generation, gen+1)
	}
	// Cleanup's rule: an empty snapshot withdraws everything.
	d2.adv.Submit([]advert.Entry{})
	d2.adv.Close()
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
	d.services["web"] = ptr(advService("web"))
	// A file where the directory should be, once the publisher exists.
	if err := os.Rename(block, filepath.Dir(path)); err != nil {
		t.Fatal(err)
	}
	block = filepath.Dir(path)
	retry := make(chan time.Time)
	flushed := make(chan error)
	d.adv.testRetry, d.adv.testFlushed = retry, flushed
	d.startAdvertiser()
	s := d.adv.Snapshot()
	if s.Generation != 0 || len(s.AdvertisedPrefixes()) != 2 || s.SchemaVersion != advert.SchemaVersion {
		t.Errorf("unpublished snapshot %+v", s)
	}
	st := d.adv.Status()
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
			t.Fatalf("not published after the path became writable: %+v", d.adv.Status())
		}
	}
	if s, err := advert.Read(path); err != nil || s.Generation != 1 {
		t.Errorf("file after the retry: %+v, %v", s, err)
	}
	if st := d.adv.Status(); st.LastError != "" || st.Generation != 1 {
		t.Errorf("status after the retry %+v", st)
	}
	d.adv.Close()
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
				_ = d.adv.Snapshot()
				d.mu.Lock()
				_ = d.adv.Status()
				d.mu.Unlock()
			}
		}()
	}
	wg.Wait()
	d.setServices(advService("web"))
	d.adv.Close()
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
func ptr[T any](v T) *T { return &v }

// flakyPublisher fails its first fails publishes, then keeps the
// snapshot in memory; it counts the attempts.
type flakyPublisher struct {
	memPublisher
	mu       sync.Mutex
	fails    int
	attempts int
}

var errDiskFull = errors.New("disk full")

func (p *flakyPublisher) Publish(entries []advert.Entry) (advert.Snapshot, bool, error) {
	p.mu.Lock()
	p.attempts++
	fail := p.attempts <= p.fails
	p.mu.Unlock()
	if fail {
		return advert.Snapshot{}, false, errDiskFull
	}
	return p.memPublisher.Publish(entries)
}

// TestAdvertiserRetries: a publisher that fails is retried by the worker
// (one attempt per retry tick) with the latest set, the failure is in
// Status until a publish succeeds, and Close waits for the worker.
func TestAdvertiserRetries(t *testing.T) {
	tests := []struct {
		name  string
		fails int
	}{
		{"succeeds at once", 0},
		{"one failure", 1},
		{"three failures", 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			leaks := goleak.IgnoreCurrent()
			pub := &flakyPublisher{memPublisher: memPublisher{node: "node-a"}, fails: tt.fails}
			d := &fakeServices{services: map[string]*intent.Service{}}
			a, err := New(Config{Node: "node-a"}, Deps{View: d, Publisher: pub})
			if err != nil {
				t.Fatal(err)
			}
			d.adv = a
			retry, flushed := make(chan time.Time), make(chan error)
			a.testRetry, a.testFlushed = retry, flushed
			d.services["web"] = ptr(advService("web"))
			d.startAdvertiser() // the first attempt, in Start
			failed := 0
			if tt.fails > 0 {
				failed = 1
				st := a.Status()
				if !strings.Contains(st.LastError, errDiskFull.Error()) || st.LastErrorAt == nil || st.Generation != 0 {
					t.Fatalf("status after the failed first publish: %+v", st)
				}
			}
			// The worker retries (Start's failure kicked it) until a
			// publish succeeds.
			timeout := time.After(5 * time.Second)
			for done := tt.fails == 0; !done; {
				select {
				case err := <-flushed:
					if err != nil {
						failed++
					} else if done = true; failed != tt.fails {
						t.Errorf("published after %d failures, want %d", failed, tt.fails)
					}
				case retry <- time.Now():
				case <-timeout:
					t.Fatalf("no publish: %+v", a.Status())
				}
			}
			if st := a.Status(); st.LastError != "" || st.Generation != 1 || st.Advertised != 2 {
				t.Errorf("status after the publish: %+v", st)
			}
			pub.mu.Lock()
			attempts := pub.attempts
			pub.mu.Unlock()
			if attempts < tt.fails+1 {
				t.Errorf("%d attempts, want at least %d", attempts, tt.fails+1)
			}
			if err := a.Close(); err != nil {
				t.Fatal(err)
			}
			select {
			case <-a.Done():
			default:
				t.Error("the worker runs after Close")
			}
			goleak.VerifyNone(t, leaks)
		})
	}
}

// TestEntriesSNAT: the node's own SNAT addresses are listed, advertised,
// only with advertise_snat; the ones it took over from gone edges are
// always listed, advertised with it and withdrawn without it; none of
// them changes the VIPs' entries.
func TestEntriesSNAT(t *testing.T) {
	own4, own6 := netip.MustParseAddr("10.97.0.1"), netip.MustParseAddr("fd00:97::1")
	taken := netip.MustParseAddr("10.97.0.2")
	vip := netip.MustParseAddr("10.96.0.10")
	svc := &intent.Service{Name: "web", VIPs: []netip.Addr{vip}, Exposure: intent.ExposureNorthSouth, Advertise: true,
		Ports:    []intent.ServicePort{{Port: 80, Protocol: intent.TCP}},
		Backends: []intent.Backend{{Address: netip.MustParseAddr("10.1.0.1"), Port: 8080}}}
	for _, tc := range []struct {
		name string
		snat SNAT
		want map[netip.Addr]string // address -> kind/advertised or reason
	}{
		{"off, nothing taken over", SNAT{Own: []netip.Addr{own4, own6}}, map[netip.Addr]string{vip: "/true"}},
		{"off, one taken over", SNAT{Own: []netip.Addr{own4}, TakenOver: []netip.Addr{taken}},
			map[netip.Addr]string{vip: "/true", taken: "snat-peer/" + string(advert.ReasonSNATNotAdvertised)}},
		{"on", SNAT{Own: []netip.Addr{own4, own6}, TakenOver: []netip.Addr{taken}, Advertise: true},
			map[netip.Addr]string{vip: "/true", own4: "snat/true", own6: "snat/true", taken: "snat-peer/true"}},
	} {
		f := &fakeServices{services: map[string]*intent.Service{"web": svc}, snat: tc.snat}
		got := map[netip.Addr]string{}
		for _, e := range Entries(f) {
			v := "true"
			if !e.Advertised {
				v = string(e.Reason)
			}
			got[e.VIP] = string(e.Kind) + "/" + v
		}
		if !maps.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
		// Every set is a valid snapshot.
		p, err := advert.NewPublisher(advert.Options{Path: filepath.Join(t.TempDir(), "a.json")})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := p.Publish(Entries(f)); err != nil {
			t.Errorf("%s: publish: %v", tc.name, err)
		}
	}
}

// TestEntriesHold: a hold (a group edge still joining) withdraws every
// entry that would be advertised, VIPs and SNAT addresses, with its
// reason, and leaves the others' reasons.
func TestEntriesHold(t *testing.T) {
	vip, down := netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("10.96.0.11")
	be := []intent.Backend{{Address: netip.MustParseAddr("10.1.0.1"), Port: 8080}}
	f := &fakeServices{services: map[string]*intent.Service{
		"web":  {Name: "web", VIPs: []netip.Addr{vip}, Exposure: intent.ExposureNorthSouth, Advertise: true, Backends: be},
		"down": {Name: "down", VIPs: []netip.Addr{down}, Exposure: intent.ExposureNorthSouth, Advertise: true},
	}, snat: SNAT{Own: []netip.Addr{netip.MustParseAddr("10.97.0.1")}, Advertise: true}}
	reasons := func() map[netip.Addr]advert.Reason {
		out := map[netip.Addr]advert.Reason{}
		for _, e := range Entries(f) {
			out[e.VIP] = e.Reason
		}
		return out
	}
	if got := reasons(); got[vip] != "" || got[down] != advert.ReasonNoReadyBackend || got[netip.MustParseAddr("10.97.0.1")] != "" {
		t.Fatalf("without a hold: %v", got)
	}
	f.hold = advert.ReasonGroupJoining
	if got := reasons(); got[vip] != advert.ReasonGroupJoining || got[down] != advert.ReasonNoReadyBackend || got[netip.MustParseAddr("10.97.0.1")] != advert.ReasonGroupJoining {
		t.Fatalf("held: %v", got)
	}
}
