//go:build linux

package scenario

// End-to-end test of the VIP advertisements: a north-south service with
// advertise=true and a TCP health check. The snapshot file and the REST
// answer follow the backends' servers within the health check's times,
// and a reader polling the file meanwhile only ever sees complete
// snapshots whose generation never goes backwards.

import (
	"bytes"
	"errors"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// advReader reads the snapshot file in a loop until stopped, checking
// every read.
type advReader struct {
	path string
	stop chan struct{}
	done chan struct{}

	mu       sync.Mutex
	reads    int
	missing  int
	problems []string
	gens     []uint64 // distinct generations, in the order seen
}

func startAdvReader(path string) *advReader {
	r := &advReader{path: path, stop: make(chan struct{}), done: make(chan struct{})}
	go r.run()
	return r
}

func (r *advReader) run() {
	defer close(r.done)
	var last uint64
	for {
		select {
		case <-r.stop:
			return
		default:
		}
		data, err := os.ReadFile(r.path)
		r.mu.Lock()
		switch {
		case errors.Is(err, fs.ErrNotExist):
			r.missing++
		case err != nil:
			r.problems = append(r.problems, err.Error())
		default:
			r.reads++
			s, err := advert.Decode(data)
			switch {
			case err != nil:
				r.problems = append(r.problems, "unparsable read: "+err.Error())
			case s.Generation < last:
				r.problems = append(r.problems, "generation went backwards")
			case s.Generation > last:
				last = s.Generation
				r.gens = append(r.gens, last)
			}
		}
		r.mu.Unlock()
		time.Sleep(500 * time.Microsecond)
	}
}

func (r *advReader) finish(t *testing.T) {
	t.Helper()
	close(r.stop)
	<-r.done
	r.mu.Lock()
	defer r.mu.Unlock()
	t.Logf("reader: %d complete reads, generations %v", r.reads, r.gens)
	if len(r.problems) > 0 {
		t.Errorf("reader saw %d bad reads, first: %s", len(r.problems), r.problems[0])
	}
	if r.missing > 0 {
		t.Errorf("the file was missing in %d reads after it was first published", r.missing)
	}
	if r.reads < 100 {
		t.Errorf("only %d reads: the reader did not run throughout", r.reads)
	}
}

// advWait polls the dataplane's snapshot until every VIP's entry is in
// the wanted state (reason "" = advertised) and returns it with the time
// it took; it fails the test after bound.
func advWait(t *testing.T, e *Env, reason advert.Reason, bound time.Duration) (advert.Snapshot, time.Duration) {
	t.Helper()
	start := time.Now()
	for {
		s := e.DP.Advertisements()
		ok := len(s.Entries) == 2
		for _, en := range s.Entries {
			ok = ok && en.Service == "web" && en.Advertised == (reason == "") && en.Reason == reason
		}
		took := time.Since(start)
		if ok {
			return s, took
		}
		if took > bound {
			t.Fatalf("advertisements not %q within %v: %+v", reason, bound, s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// advCheckFile checks that the file and the REST answer hold s.
func advCheckFile(t *testing.T, h http.Handler, path string, s advert.Snapshot) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	f, err := advert.Decode(data)
	if err != nil {
		t.Fatal(err)
	}
	if f.Generation != s.Generation || !f.Timestamp.Equal(s.Timestamp) || len(f.Entries) != len(s.Entries) {
		t.Errorf("file has generation %d, Advertisements %d", f.Generation, s.Generation)
	}
	req := httptest.NewRequest("GET", "/v1/network/services/advertisements", nil)
	req.Header.Set("Authorization", "Bearer read-token")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	if w.Code != http.StatusOK || !bytes.Equal(w.Body.Bytes(), data) {
		t.Errorf("GET advertisements (%d) differs from the file:\n%s\n%s", w.Code, w.Body, data)
	}
}

// TestE2EAdvertisementsFollowHealth: both backends' servers stop, the
// checks mark them unhealthy and both VIPs are withdrawn ("no ready
// backend") within unhealthy_threshold x interval + timeout (+ slack);
// one server starts again and the VIPs are advertised again within
// healthy_threshold x interval + timeout (+ slack), with traffic from the
// external client reaching that backend.
func TestE2EAdvertisementsFollowHealth(t *testing.T) {
	testenv.RequirePrivileged(t)
	path := filepath.Join(t.TempDir(), "run", "service-advertisements.json")
	e, err := NewEnvConfig(2, nil, func(c *fluxvm.Config) {
		c.NorthSouthInterfaces = []string{"uplink"}
		c.SNATAddress = nsSNAT4
		c.SNATAddressV6 = nsSNAT6
		c.AdvertisementsPath = path
		c.NodeName = "lab-node"
	})
	if err != nil {
		t.Fatalf("scenario env: %v", err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("scenario env close: %v", err)
		}
	})
	h, err := api.New(api.RolesOf(e.DP), api.Options{ReadTokens: []string{"read-token"}})
	if err != nil {
		t.Fatal(err)
	}

	hc := &fluxvm.HealthCheck{Kind: "tcp", TimeoutMs: 100, IntervalMs: 200, UnhealthyThreshold: 2, HealthyThreshold: 2}
	svc := e2eService(t, e, e2eBackend{vm: "vm2", weight: 1}, e2eBackend{vm: "vm3", weight: 1})
	svc.Ports = []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}}
	svc.Exposure, svc.Advertise, svc.HealthCheck = fluxvm.ExposureNorthSouth, true, hc
	e2eApply(t, e, svc)
	const slack = 600 * time.Millisecond
	interval, timeout := time.Duration(hc.IntervalMs)*time.Millisecond, time.Duration(hc.TimeoutMs)*time.Millisecond
	downBound := time.Duration(hc.UnhealthyThreshold)*interval + timeout + slack
	upBound := time.Duration(hc.HealthyThreshold)*interval + timeout + slack

	s, _ := advWait(t, e, "", time.Second)
	advCheckFile(t, h, path, s)
	if got := s.AdvertisedPrefixes(); len(got) != 2 || got[0] != netip.PrefixFrom(VIP4, 32) || got[1] != netip.PrefixFrom(VIP6, 128) || s.Node != "lab-node" {
		t.Fatalf("initially advertised %v (node %q)", got, s.Node)
	}
	gen := s.Generation
	r := startAdvReader(path)

	for i := range e.servers {
		if err := e.servers[i].Close(); err != nil {
			t.Fatal(err)
		}
	}
	s, took := advWait(t, e, advert.ReasonNoReadyBackend, downBound)
	t.Logf("both servers stopped: withdrawn after %v (bound %v), generation %d -> %d", took, downBound, gen, s.Generation)
	if s.Generation <= gen {
		t.Errorf("withdrawal kept generation %d", s.Generation)
	}
	advCheckFile(t, h, path, s)
	if st := e.DP.Status().Advertisements; st.Path != path || st.Generation != s.Generation || st.Withdrawn != 2 || st.Advertised != 0 || st.LastError != "" {
		t.Errorf("status %+v", st)
	}
	gen = s.Generation

	_, i, err := e.Backend("vm3")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := e.Backends[i].Serve(BackendPort)
	if err != nil {
		t.Fatal(err)
	}
	e.servers[i] = srv // Env.Close stops it
	s, took = advWait(t, e, "", upBound)
	t.Logf("vm3 restarted: advertised after %v (bound %v), generation %d -> %d", took, upBound, gen, s.Generation)
	if s.Generation <= gen {
		t.Errorf("advertising again kept generation %d", s.Generation)
	}
	advCheckFile(t, h, path, s)
	r.finish(t)

	// Traffic follows: the external client reaches the VIPs on vm3.
	for _, fam := range e2eFamilies {
		c, err := e.Lab.External.DialTCP(netip.AddrPortFrom(fam.vip, 80), e2eOK)
		if err != nil {
			t.Fatalf("%s: external client through the advertised VIP: %v", fam.name, err)
		}
		if c.Backend != "vm3" {
			t.Errorf("%s: answered by %s, want vm3 (vm2 is down)", fam.name, c.Backend)
		}
		c.Close()
	}

	// Env.Close stops every server once: give vm2 a running one again.
	_, j, err := e.Backend("vm2")
	if err != nil {
		t.Fatal(err)
	}
	if e.servers[j], err = e.Backends[j].Serve(BackendPort); err != nil {
		t.Fatal(err)
	}
}
