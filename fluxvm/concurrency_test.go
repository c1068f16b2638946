package fluxvm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// heldWriter blocks its first Write until release is closed, and says
// so on held: the hook that holds an export mid-stream (the stream is
// buffered, 64 KiB, and a chunk of ha.ChunkFlows flows is twice that:
// the first Write comes with the first chunk, while the scan goes on).
type heldWriter struct {
	buf     bytes.Buffer
	writes  int
	held    chan struct{}
	release chan struct{}
}

func (w *heldWriter) Write(p []byte) (int, error) {
	w.writes++
	if w.writes == 1 {
		close(w.held)
		<-w.release
	}
	return w.buf.Write(p)
}

// TestExportHeldOthersComplete (issue 35): an export of a service's
// flows held mid-stream (its writer blocks, the way a slow client of
// GET .../conntrack/export would) does not hold up the rest of the
// dataplane: applies (a new service, a weight change, a delete), a
// health round and a catalog compaction all complete while it is held,
// and the export then finishes with every flow, its stream intact. A
// step that waited on the export would not return until it is released:
// the bound below only turns that hang into a failure.
func TestExportHeldOthersComplete(t *testing.T) {
	e := newNSEnv(t)
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	svc.Ports, svc.Exposure = []ServicePort{{Port: 80, Protocol: TCP}}, ExposureBoth
	svc.HealthCheck = &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 3_600_000, UnhealthyThreshold: 1, HealthyThreshold: 1}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	// Flows enough for several chunks: established ones of web's IPv4
	// TCP frontend, written as the datapath would.
	const synthetic = 3 * ha.ChunkFlows
	fillFlows4(t, e, d, synthetic, 3)
	var conns []*lab.Conn
	for i := range 8 {
		c := e.dial(t, []netip.Addr{vip4, vip6}[i%2])
		echo(t, c, "before")
		conns = append(conns, c)
	}

	w := &heldWriter{held: make(chan struct{}), release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(w.release) }) }
	t.Cleanup(release) // never leave the export hanging
	type result struct {
		res ha.ExportResult
		err error
	}
	exported := make(chan result, 1)
	go func() {
		res, err := d.ExportFlows(ctx, "web", w)
		exported <- result{res, err}
	}()
	select {
	case <-w.held:
	case r := <-exported:
		t.Fatalf("the export ended before its first chunk was written: %+v, %v", r.res, r.err)
	case <-time.After(30 * time.Second):
		t.Fatal("the export wrote no chunk")
	}

	// Each step must complete while the export is held.
	const bound = 30 * time.Second
	other := Service{Name: "other", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.77")}, Ports: []ServicePort{{Port: 81, Protocol: TCP}},
		Backends: []Backend{svc.Backends[0], svc.Backends[2]}}
	for _, step := range []struct {
		name string
		run  func() error
	}{
		{"apply a new service", func() error { _, err := d.ApplyService(ctx, other); return err }},
		{"change a weight", func() error {
			s := svc
			s.Backends = append([]Backend(nil), svc.Backends...)
			s.Backends[0].Weight = u32(3)
			_, err := d.ApplyService(ctx, s)
			return err
		}},
		{"delete a service", func() error { return d.DeleteService(ctx, "other") }},
		{"a health round", func() error {
			rep, err := d.ReconcileHealth(ctx)
			if err == nil && len(rep.Services) != 1 {
				err = fmt.Errorf("report of %d services, want web's", len(rep.Services))
			}
			return err
		}},
		{"a catalog compaction", func() error {
			before := d.store.Status()
			if err := d.store.Compact(); err != nil {
				return err
			}
			// The journal's records (the applies above) went into the
			// snapshot.
			if st := d.store.Status(); before.JournalBytes == 0 || st.JournalBytes != 0 || st.Durable != st.Seq || st.Seq < before.Seq {
				return fmt.Errorf("catalog before the compaction %+v, after %+v: want the journal folded into the snapshot", before, st)
			}
			return nil
		}},
		{"status", func() error { d.Status(); return nil }},
	} {
		done := make(chan error, 1)
		go func() { done <- step.run() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("%s while an export is held: %v", step.name, err)
			}
		case <-time.After(bound):
			t.Fatalf("%s did not complete within %v while an export is held: it waits on the export", step.name, bound)
		}
	}
	select {
	case r := <-exported:
		t.Fatalf("the export ended while held: %+v, %v", r.res, r.err)
	default:
	}

	release()
	r := <-exported
	if r.err != nil || r.res.Flows < synthetic+uint64(len(conns)) {
		t.Fatalf("export after the release: %+v, %v; want at least %d flows", r.res, r.err, synthetic+len(conns))
	}
	sr, err := ha.NewReader(bytes.NewReader(w.buf.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		fs, err := sr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("the held export's stream: %v", err)
		}
		n += len(fs)
	}
	if uint64(n) != r.res.Flows {
		t.Errorf("stream holds %d flows, the export said %d", n, r.res.Flows)
	}
	for _, c := range conns {
		echo(t, c, "after")
	}
}
