package main

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// OTLPConfig is the daemon's flow export: the otlp_* keys at the top level
// of [sandbox.dataplane.service], read by the daemon only (the library,
// package fluxvm, exports nothing over the network; an embedder that wants
// export uses package flows/otlp itself). Export is off while Endpoint is
// empty; the other keys are checked all the same, so that a configuration
// is known good before export is turned on. Zero values take the defaults
// of otlp.Config.
type OTLPConfig struct {
	// Endpoint is the receiver's base URL (otlp.Config.Endpoint).
	Endpoint string `toml:"otlp_endpoint"`
	// Encoding is "json" (default) or "protobuf".
	Encoding otlp.Encoding `toml:"otlp_encoding"`
	// Interval of the periodic export (default 10s; 1s..1h).
	Interval fluxvm.Duration `toml:"otlp_interval"`
	// Timeout of one request (default 10s; 100ms..5m).
	Timeout fluxvm.Duration `toml:"otlp_timeout"`
	// Queue bounds the records held (0..1048576; 0: the default, 8192).
	Queue int `toml:"otlp_queue"`
	// MaxBatch bounds the records of one request (0, the default: 512,
	// or Queue when smaller; at most Queue).
	MaxBatch int `toml:"otlp_max_batch"`
	// Headers are added to every request.
	Headers map[string]string `toml:"otlp_headers"`
	// ServiceName is the resource's service.name (default "fluxvmd").
	ServiceName string `toml:"otlp_service_name"`
}

// Bounds of the otlp keys.
const (
	MinOTLPInterval = time.Second
	MaxOTLPInterval = time.Hour
	MinOTLPTimeout  = 100 * time.Millisecond
	MaxOTLPTimeout  = 5 * time.Minute
	MaxOTLPQueue    = 1 << 20
)

// defaultOTLPConfig is the otlp keys with the defaults of otlp.Config
// spelled out: export off.
func defaultOTLPConfig() OTLPConfig {
	return OTLPConfig{
		Encoding: otlp.EncodingJSON,
		Interval: fluxvm.Duration{Duration: otlp.DefaultInterval},
		Timeout:  fluxvm.Duration{Duration: otlp.DefaultTimeout},
		Queue:    otlp.DefaultQueueSize,
		// MaxBatch 0: DefaultMaxBatch, or the queue size when smaller.
		ServiceName: otlp.DefaultServiceName,
	}
}

// exporterConfig is the otlp.Config of o for the node nodeName.
func (o *OTLPConfig) exporterConfig(nodeName string) otlp.Config {
	return otlp.Config{
		Endpoint: o.Endpoint, Encoding: o.Encoding,
		Interval: o.Interval.Duration, Timeout: o.Timeout.Duration,
		QueueSize: o.Queue, MaxBatch: o.MaxBatch, Headers: o.Headers,
		ServiceName: o.ServiceName, NodeName: nodeName,
	}
}

// validate checks the otlp keys (the URL and headers only with an
// endpoint: otlp.Config.Validate); nodeName is node_name (the host name
// when empty, as otlp.Config says).
func (o *OTLPConfig) validate(nodeName string, bad func(category error, k, format string, args ...any)) {
	ok := true
	check := func(cond bool, k, format string, args ...any) {
		if !cond {
			ok = false
			bad(fluxvm.ErrInvalid, k, format, args...)
		}
	}
	check(o.Encoding == "" || o.Encoding == otlp.EncodingJSON || o.Encoding == otlp.EncodingProtobuf,
		"otlp_encoding", "%q is not an encoding (want %q or %q)", o.Encoding, otlp.EncodingJSON, otlp.EncodingProtobuf)
	if d := o.Interval.Duration; d != 0 {
		check(d >= MinOTLPInterval && d <= MaxOTLPInterval, "otlp_interval", "%v is outside %v..%v", d, MinOTLPInterval, MaxOTLPInterval)
	}
	if d := o.Timeout.Duration; d != 0 {
		check(d >= MinOTLPTimeout && d <= MaxOTLPTimeout, "otlp_timeout", "%v is outside %v..%v", d, MinOTLPTimeout, MaxOTLPTimeout)
	}
	check(o.Queue >= 0 && o.Queue <= MaxOTLPQueue, "otlp_queue", "%d is outside 0..%d (0: the default, %d)", o.Queue, MaxOTLPQueue, otlp.DefaultQueueSize)
	queue := o.Queue
	if queue == 0 {
		queue = otlp.DefaultQueueSize
	}
	check(o.MaxBatch >= 0 && o.MaxBatch <= queue, "otlp_max_batch", "%d is outside 0..%d (otlp_queue)", o.MaxBatch, queue)
	if ok && o.Endpoint != "" {
		// What is left: the URL and the headers.
		if err := o.exporterConfig(nodeName).Validate(); err != nil {
			k := "otlp_endpoint"
			if len(o.Headers) > 0 && (otlp.Config{Endpoint: o.Endpoint, NodeName: "n"}).Validate() == nil {
				k = "otlp_headers"
			}
			bad(fluxvm.ErrInvalid, k, "%v", err)
		}
	}
}

// flowSource is what the periodic export reads (Dataplane.Flows).
type flowSource func(limit int, f flows.Filter) ([]flows.Record, error)

// periodicExport hands the flow records to the exporter's queue every
// interval, each record once, never waiting on the network (Enqueue does
// not block).
//
// Which records, and when: those opened after the daemon started (the
// ring's records of an earlier process are left to the on-demand route),
// once they are settled: idle for an interval (no packet within it), or
// open for settleMax intervals (a long-lived flow is sent as it is then,
// and not again). So a record usually goes out with its flow's final
// counts. At stop a final round sends every record not sent yet, settled
// or not, as it is then: no later round would. Each round reads the
// flows.MaxLimit newest records; a node that opens more records than that
// within settleMax intervals loses the excess from the periodic export
// (the ring would overwrite them anyway). A round whose read fails
// changes nothing: the next one carries on from the same place.
type periodicExport struct {
	read     flowSource
	exporter *otlp.Exporter
	interval time.Duration
	log      *slog.Logger
	now      func() time.Time

	// start is the newest seq at start: older records are not sent.
	// When the first read failed, startKnown is false and the first
	// round that reads finds it from started: the newest record first
	// seen before it.
	start      uint64
	startKnown bool
	started    time.Time
	sent       map[uint64]struct{} // seqs above start already enqueued
	last       uint64              // the newest seq the last round read

	// handMu orders a round's hand-over to the exporter against the
	// stop: once closed is set (the final round's deadline passed, or it
	// finished), no round enqueues any more, so nothing reaches the
	// exporter after its Close. What a late final round would have
	// handed over is counted in abandoned, reported as dropped for
	// reason "failed" (unsent at stop) by the API exporter's Stats.
	handMu    sync.Mutex
	closed    bool
	abandoned atomic.Uint64
}

// settleMax is how many intervals a flow may stay active before its
// record is sent anyway.
const settleMax = 6

func newPeriodicExport(read flowSource, x *otlp.Exporter, log *slog.Logger) *periodicExport {
	p := &periodicExport{read: read, exporter: x, interval: x.Config().Interval, log: log, now: time.Now, sent: map[uint64]struct{}{}}
	p.started = p.now()
	recs, err := read(1, flows.Filter{})
	switch {
	case err != nil:
		log.Warn("fluxvmd: flow export: reading the flows failed; the first round that reads them finds where this process began", "error", err)
	case len(recs) == 1:
		p.start, p.startKnown = recs[0].Seq, true
	default:
		p.startKnown = true // an empty ring: every record is ours
	}
	p.last = p.start
	return p
}

// round enqueues the settled records not sent yet (with final, every
// record not sent yet) and returns how many it handed over and how many
// the queue refused.
func (p *periodicExport) round(final bool) (accepted, dropped int) {
	recs, err := p.read(flows.MaxLimit, flows.Filter{})
	if err != nil {
		// Keep the cursor: the next round reads the same window again.
		p.log.Warn("fluxvmd: flow export: reading the flows failed; the next round tries again", "error", err)
		return 0, 0
	}
	if !p.startKnown {
		for _, r := range recs {
			if r.FirstSeen.Before(p.started) {
				p.start = r.Seq
				break
			}
		}
		p.startKnown, p.last = true, p.start
	}
	if len(recs) > 0 && recs[0].Seq < p.last {
		// The ring was recreated (a tier change by another process, a
		// cleanup): its sequence starts again.
		p.start, p.sent = 0, map[uint64]struct{}{}
	}
	if len(recs) > 0 {
		p.last = recs[0].Seq
	}
	now := p.now()
	var out []flows.Record
	for _, r := range recs {
		if r.Seq <= p.start {
			break
		}
		if _, done := p.sent[r.Seq]; done {
			continue
		}
		if final || now.Sub(r.LastSeen) >= p.interval || now.Sub(r.FirstSeen) >= settleMax*p.interval {
			out = append(out, r)
		}
	}
	// Forget what the window no longer holds.
	if len(recs) > 0 {
		oldest := recs[len(recs)-1].Seq
		for s := range p.sent {
			if s < oldest {
				delete(p.sent, s)
			}
		}
	}
	if len(out) == 0 {
		return 0, 0
	}
	slices.Reverse(out) // oldest first
	p.handMu.Lock()
	closed := p.closed
	if !closed {
		accepted, dropped = p.exporter.Enqueue(out)
	}
	p.handMu.Unlock()
	for _, r := range out {
		// A record the full queue refused is not tried again: the queue
		// keeps the older ones, and the on-demand route can still send it.
		p.sent[r.Seq] = struct{}{}
	}
	if closed {
		// The final round outlived the stop's flush deadline: the
		// exporter is closed (or about to be), and these records are
		// left unsent at stop.
		p.abandoned.Add(uint64(len(out)))
		p.log.Warn("fluxvmd: flow export: the final round ended after the flush deadline; its records were not sent", "records", len(out))
		return 0, 0
	}
	if dropped > 0 {
		p.log.Warn("fluxvmd: flow export: queue full, records dropped", "dropped", dropped)
	}
	return accepted, dropped
}

// close ends the hand-over to the exporter: a round still running
// enqueues nothing (it counts its records in abandoned instead).
func (p *periodicExport) close() {
	p.handMu.Lock()
	p.closed = true
	p.handMu.Unlock()
}

// run calls round every interval until ctx ends.
func (p *periodicExport) run(ctx context.Context, wg *sync.WaitGroup) {
	defer wg.Done()
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.round(false)
		}
	}
}

// finalRound is the round at stop: every record not sent yet goes to the
// queue. It waits no longer than ctx allows: a read of the ring that
// hangs is left behind, and when it returns its records are not
// enqueued (the exporter is closed by then) but counted as unsent at
// stop (abandoned: dropped, reason "failed"). No round enqueues after
// finalRound returned.
func (p *periodicExport) finalRound(ctx context.Context) {
	defer p.close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if a, d := p.round(true); a+d > 0 {
			p.log.Info("fluxvmd: flow export: final round at stop", "records", a, "dropped", d)
		}
	}()
	select {
	case <-done:
	case <-ctx.Done():
		p.log.Warn("fluxvmd: flow export: the final round did not finish before the flush deadline")
	}
}

// stopError is the error of an on-demand export the daemon's stop did not
// let run: it is api.ErrExportStopping, so the route answers 503 saying
// the daemon is stopping, not that the receiver failed.
type stopError struct{ msg string }

func (e *stopError) Error() string        { return e.msg }
func (e *stopError) Is(target error) bool { return target == api.ErrExportStopping }

var (
	// errStopRefused: an export that arrived once the stop began, refused
	// at once (nothing was sent).
	errStopRefused error = &stopError{"fluxvmd is stopping: the export was refused, as the stop had begun (nothing was sent)"}
	// errStopCancelled is wrapped by the error of an export in flight
	// that the stop cancelled at its flush deadline.
	errStopCancelled error = &stopError{"fluxvmd is stopping: the export was cancelled at the stop's flush deadline"}
)

// stoppableExporter is the exporter the REST API's on-demand export route
// uses: *otlp.Exporter (its Stats feed /metrics) whose Exports the daemon
// can cancel when it stops. http.Server.Shutdown waits for the handlers
// in flight, and an export to a slow or dead receiver may take its
// timeout times its retries: cancelled, it answers 503 with
// errStopCancelled and Shutdown finishes within its deadline.
type stoppableExporter struct {
	*otlp.Exporter

	ctx    context.Context // ends when the daemon cancels the exports
	cancel context.CancelFunc

	mu       sync.Mutex
	stopping bool
	running  sync.WaitGroup // Exports in flight

	// abandoned, when set, counts records unsent at stop outside the
	// exporter (the periodic export's late final round): Stats adds them
	// to DroppedFailed.
	abandoned *atomic.Uint64
}

func newStoppableExporter(x *otlp.Exporter) *stoppableExporter {
	ctx, cancel := context.WithCancel(context.Background())
	return &stoppableExporter{Exporter: x, ctx: ctx, cancel: cancel}
}

// Export sends recs as otlp.Exporter.Export does, until ctx ends or the
// daemon cancels it. Once the daemon is stopping it refuses at once.
func (s *stoppableExporter) Export(ctx context.Context, recs []flows.Record) (otlp.Report, error) {
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		return otlp.Report{Encoding: s.Config().Encoding}, errStopRefused
	}
	s.running.Add(1)
	s.mu.Unlock()
	defer s.running.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(s.ctx, cancel)()
	rep, err := s.Exporter.Export(ctx, recs)
	if err != nil && s.ctx.Err() != nil {
		err = fmt.Errorf("%w: %w", errStopCancelled, err)
	}
	return rep, err
}

// Stats is the exporter's Stats (for /metrics), with the records the
// periodic export left unsent at stop without handing them to the
// exporter counted in DroppedFailed.
func (s *stoppableExporter) Stats() otlp.Stats {
	st := s.Exporter.Stats()
	if s.abandoned != nil {
		st.DroppedFailed += s.abandoned.Load()
	}
	return st
}

// stop refuses new Exports and lets those in flight run until deadline
// ends (then cancels them), returning once none is left.
func (s *stoppableExporter) stop(deadline context.Context) {
	s.mu.Lock()
	s.stopping = true
	s.mu.Unlock()
	defer context.AfterFunc(deadline, s.cancel)()
	s.running.Wait()
	s.cancel()
}

// flowExport is the daemon's flow export while otlp_endpoint is set: the
// exporter, its periodic export and the on-demand route's view of it.
type flowExport struct {
	x        *otlp.Exporter
	api      *stoppableExporter // what the REST API exports through
	periodic *periodicExport
	log      *slog.Logger
	stopLoop context.CancelFunc
	loop     sync.WaitGroup
	once     sync.Once
}

// startFlowExport starts the exporter of cfg and its periodic export of
// what read returns.
func startFlowExport(cfg otlp.Config, read flowSource, log *slog.Logger) (*flowExport, error) {
	x, err := otlp.New(cfg)
	if err != nil {
		return nil, err
	}
	e := &flowExport{x: x, api: newStoppableExporter(x), periodic: newPeriodicExport(read, x, log), log: log}
	e.api.abandoned = &e.periodic.abandoned
	var loopCtx context.Context
	loopCtx, e.stopLoop = context.WithCancel(context.Background())
	e.loop.Add(1)
	go e.periodic.run(loopCtx, &e.loop)
	return e, nil
}

// stop ends the flow export within flush's deadline: it stops the
// periodic export, runs its final round (records settled since the last
// round, and those still open, as they are now), lets the on-demand exports in flight finish until the
// deadline (then cancels them) and flushes the exporter's queue with
// what is left of it; what is still unsent then is abandoned and
// counted. Calls after the first do nothing.
func (e *flowExport) stop(flush context.Context) {
	e.once.Do(func() {
		e.stopLoop()
		e.loop.Wait()
		e.periodic.finalRound(flush)
		e.api.stop(flush)
		if err := e.x.Close(flush); err != nil {
			e.log.Warn("fluxvmd: flow export: not everything was sent before the stop", "error", err)
		}
	})
}

// tracing is the daemon's tracer provider while otlp_endpoint is set: the
// spans of its control-plane work (REST requests, applies, the catalog's
// restore, GC rounds, health reconciles) go to the same receiver as the
// flow records, on /v1/traces.
type tracing struct {
	tp   *sdktrace.TracerProvider
	log  *slog.Logger
	once sync.Once
}

func startTracing(ctx context.Context, cfg otlp.Config, log *slog.Logger) (*tracing, error) {
	tp, err := otlp.NewTracerProvider(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("traces: %w", err)
	}
	return &tracing{tp: tp, log: log}, nil
}

// stop flushes the spans not sent yet within flush's deadline and shuts
// the provider down; spans ended later are dropped. Calls after the first
// do nothing.
func (t *tracing) stop(flush context.Context) {
	t.once.Do(func() {
		if err := t.tp.Shutdown(flush); err != nil {
			t.log.Warn("fluxvmd: traces: not every span was sent before the stop", "error", err)
		}
	})
}
