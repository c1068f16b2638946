package fluxvm

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// TestExportImportFlows: a node's flows exported, its conntrack then lost
// and the backends reweighted so that Maglev sends new flows to one VM
// only: importing the snapshot puts every open connection back on the
// backend it had, and each goes on (a connection re-picked to another VM
// would be reset there).
func TestExportImportFlows(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	svc.Ports = []ServicePort{{Port: 80, Protocol: TCP}}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	var conns []*lab.Conn
	elsewhere := 0
	for i := 0; i < 24; i++ {
		c := e.dial(t, []netip.Addr{vip4, vip6}[i%2])
		echo(t, c, "before")
		if c.Backend != e.backends[0].Name {
			elsewhere++
		}
		conns = append(conns, c)
	}
	if elsewhere == 0 {
		t.Fatal("every connection is on the first VM: the test proves nothing")
	}
	var snap bytes.Buffer
	exp, err := d.ExportFlows(ctx, "web", 3, &snap)
	if err != nil || exp.Flows < uint64(len(conns)) {
		t.Fatalf("export: %+v, %v; want at least %d flows", exp, err, len(conns))
	}

	// The flows are lost, and new flows would all go to the first VM.
	ct, err := d.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	es, err := ct.List(conntrack.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, en := range es {
		if err := ct.Delete(en.Key); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.ApplyService(ctx, func() Service { s := e.service(1, 0, 0); s.Ports = svc.Ports; return s }()); err != nil {
		t.Fatal(err)
	}

	// Refused before anything is applied: another service's snapshot, an
	// epoch the caller does not accept; a service this node lacks.
	stale := errors.New("stale lease")
	if _, err := d.ImportFlows(ctx, "web", bytes.NewReader(snap.Bytes()), false, func(h ha.Header) error {
		if h.Epoch < 4 {
			return stale
		}
		return nil
	}); !errors.Is(err, stale) {
		t.Errorf("import under a refused epoch: %v", err)
	}
	if _, err := d.ImportFlows(ctx, "nosuch", bytes.NewReader(snap.Bytes()), false, nil); !errors.Is(err, ErrNotFound) {
		t.Errorf("import into a service that does not exist: %v", err)
	}
	if es, _ := ct.List(conntrack.Filter{}); len(es) != 0 {
		t.Fatalf("refused imports wrote %d flows", len(es))
	}

	res, err := d.ImportFlows(ctx, "web", &snap, false, nil)
	if err != nil || res.Written != exp.Flows || res.Header.Epoch != 3 {
		t.Fatalf("import: %+v, %v; want %d flows written", res, err, exp.Flows)
	}
	for i, c := range conns {
		if err := c.Echo([]byte("after"), 3*time.Second); err != nil {
			t.Errorf("connection %d (on %s) broke after the import: %v", i, c.Backend, err)
		}
	}
}
