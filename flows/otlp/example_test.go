package otlp_test

import (
	"context"
	"log"
	"time"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
)

// An exporter sends flows to a collector in the background; the daemon
// hands it what it reads from the datapath and reads Stats for /metrics.
func ExampleExporter() {
	e, err := otlp.New(otlp.Config{
		Endpoint: "http://127.0.0.1:4318", // a Collector's otlp receiver (http)
		NodeName: "node-a",
	})
	if err != nil {
		log.Fatal(err)
	}
	var recs []flows.Record // read from fluxvm_sflows
	if _, dropped := e.Enqueue(recs); dropped > 0 {
		log.Printf("otlp queue full: %d flows not exported", dropped)
	}

	// At shutdown: flush, but give up after 5 s.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		log.Print(err)
	}
	log.Printf("sent %d flows", e.Stats().RecordsSent)
}

// The daemon's own spans go to the same collector.
func ExampleNewTracerProvider() {
	ctx := context.Background()
	tp, err := otlp.NewTracerProvider(ctx, otlp.Config{Endpoint: "http://127.0.0.1:4318", NodeName: "node-a"})
	if err != nil {
		log.Fatal(err)
	}
	defer tp.Shutdown(ctx)
	_, span := tp.Tracer("fluxvmd").Start(ctx, "reconcile")
	// ... apply the intent ...
	span.End()
}
