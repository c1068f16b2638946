package fluxvm

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// The catalog's own tests (format, journal, compaction, lock file) are
// in package fluxvm/internal/catalog; these are the dataplane's.

// jsvc is a catalog entry: service i with weight w.
func jsvc(i int, w uint32) catalogService {
	svc := benchService(i, w)
	cf := catalogFrontend{VIP: svc.VIPs[0], Port: 80, Protocol: TCP, ServiceID: uint32(i + 1)}
	for j, b := range svc.Backends {
		cf.Backends = append(cf.Backends, catalogBackend{Endpoint: b.Endpoint(), BackendID: uint32(i*10 + j + 1)})
	}
	return catalogService{Service: svc, Revision: uint64(w), AppliedAt: time.Unix(1700000000, 0).UTC(), Frontends: []catalogFrontend{cf}}
}

// TestDataplaneCatalogSurvivesCrash: changes from concurrent clients,
// with compactions running meanwhile, are all in the catalog when they
// are acknowledged: a copy of the catalog files taken without Close (what
// kill -9 leaves) restores exactly the acknowledged services with their
// ids, also with a torn record at the end of the journal. After Close the
// catalog file alone holds the catalog.
func TestDataplaneCatalogSurvivesCrash(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "catalog.json")
	open := func(catalog string) *Dataplane {
		t.Helper()
		d, err := Open(context.Background(), Options{
			Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
			CatalogPath:         catalog,
			ConntrackGCInterval: -1,
		})
		if err != nil {
			t.Fatalf("open: %v", err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	// Compact every few changes, so that compactions overlap changes.
	defer func(v int64) { compactMinBytes = v }(compactMinBytes)
	compactMinBytes = 4 << 10
	d := open(path)
	ctx := context.Background()
	var wg sync.WaitGroup
	for c := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 12 {
				n := c*20 + i%6
				var err error
				if i%4 == 3 {
					err = d.DeleteService(ctx, benchName(c*20+(i-1)%6)) // applied just before
				} else {
					_, err = d.ApplyService(ctx, benchService(n, uint32(1+i)))
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	want := d.Services()
	if len(want) == 0 {
		t.Fatal("no services")
	}

	// kill -9: the files as they are, without Close. A compaction the
	// last changes started may still be replacing files in the
	// background; a copy taken meanwhile mixes two states no crash can
	// leave (the node dies at one instant), so let it finish first.
	d.store.WaitCompaction()
	crash := t.TempDir()
	files, _ := filepath.Glob(path + "*")
	if len(files) < 2 {
		t.Errorf("catalog files %v: want a snapshot and a journal", files)
	}
	var last string
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(crash, filepath.Base(f)), data, 0o600)
		if strings.Contains(f, ".journal.") && f > last {
			last = f
		}
	}
	// The change that was being written when the node died.
	cs := jsvc(99, 1)
	rec, _ := catalog.AppendRecord(nil, catalog.Record{Seq: 1 << 40, Put: &cs})
	if last != "" {
		jf, err := os.OpenFile(filepath.Join(crash, filepath.Base(last)), os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		jf.Write(rec[:len(rec)/2])
		jf.Close()
	}
	restored := open(filepath.Join(crash, "catalog.json"))
	compareServices(t, "after a crash", restored.Services(), want)

	// A clean stop leaves the whole catalog in the catalog file.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if js, _ := filepath.Glob(path + ".journal.*"); len(js) > 0 {
		for _, j := range js {
			if fi, err := os.Stat(j); err == nil && fi.Size() > 0 {
				t.Errorf("after Close, journal %s holds %d bytes", j, fi.Size())
			}
		}
	}
	cat, err := catalog.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(cat.Services) != len(want) {
		t.Errorf("after Close the catalog file holds %d services, want %d", len(cat.Services), len(want))
	}
}

func compareServices(t *testing.T, what string, got, want []ServiceStatus) {
	t.Helper()
	strip := func(ss []ServiceStatus) []string {
		var out []string
		for _, s := range ss {
			b, _ := json.Marshal(struct {
				Svc  Service
				Rev  uint64
				At   time.Time
				SIDs []uint32
			}{s.Service, s.Revision, s.AppliedAt, sids(s)})
			out = append(out, string(b))
		}
		return out
	}
	if g, w := strip(got), strip(want); !reflect.DeepEqual(g, w) {
		t.Errorf("%s: services\n%v\nwant\n%v", what, g, w)
	}
}

func sids(s ServiceStatus) []uint32 {
	var out []uint32
	for _, f := range s.Frontends {
		out = append(out, f.ServiceID)
	}
	return out
}
