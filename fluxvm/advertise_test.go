package fluxvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/internal/testutils/adverttest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

var (
	advVIP4 = netip.MustParseAddr("203.0.113.10")
	advVIP6 = netip.MustParseAddr("2001:db8::10")
)

func ptrBool(v bool) *bool { return &v }

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
	if got := adverttest.Decisions(s.Entries); !maps.Equal(got, want) {
		t.Fatalf("after apply %v, want %v (the east-west service has no entry)", got, want)
	}
	gen := s.Generation

	// vm3 (refused) becomes unhealthy; vm2 is still ready: nothing
	// changes, nothing is rewritten.
	reconcile(t, d, 2)
	if s := read("vm3 unhealthy"); s.Generation != gen || !maps.Equal(adverttest.Decisions(s.Entries), want) {
		t.Errorf("vm3 unhealthy: gen %d (was %d) %v", s.Generation, gen, adverttest.Decisions(s.Entries))
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
	if s := read("moved"); !maps.Equal(adverttest.Decisions(s.Entries), want) {
		t.Errorf("moved, not yet checked: %v", adverttest.Decisions(s.Entries))
	}
	rep := reconcile(t, d, 2)
	s = read("all unhealthy")
	withdrawn := map[string]string{vip4.String() + " web": "no ready backend", vip6.String() + " web": "no ready backend"}
	if got := adverttest.Decisions(s.Entries); !maps.Equal(got, withdrawn) || s.Generation <= gen {
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
	if s := read("vm3 back"); !maps.Equal(adverttest.Decisions(s.Entries), want) || s.Generation != gen+1 {
		t.Errorf("vm3 back: gen %d (was %d) %v", s.Generation, gen, adverttest.Decisions(s.Entries))
	}

	// advertise=false, then disabled.
	svc.Advertise = false
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if got := adverttest.Decisions(read("advertise=false").Entries); got[vip4.String()+" web"] != "advertise=false" {
		t.Errorf("advertise=false: %v", got)
	}
	svc.Advertise, svc.Enabled = true, ptrBool(false)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if got := adverttest.Decisions(read("disabled").Entries); got[vip6.String()+" web"] != "service disabled" {
		t.Errorf("disabled: %v", got)
	}
	// Exposure both, enabled: advertised again.
	svc.Enabled, svc.Exposure = nil, ExposureBoth
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	s = read("both")
	if got := adverttest.Decisions(s.Entries); !maps.Equal(got, want) {
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
	if s := read("closed"); s.Generation != gen || !maps.Equal(adverttest.Decisions(s.Entries), want) {
		t.Errorf("after Close: gen %d %v", s.Generation, adverttest.Decisions(s.Entries))
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
	case <-d.adv.Done():
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
