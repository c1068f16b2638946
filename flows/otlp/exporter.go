package otlp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	collogs "go.opentelemetry.io/proto/otlp/collector/logs/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/fluxvm/servicefabric/flows"
)

// ErrClosed is returned by Export after Close.
var ErrClosed = errors.New("otlp: exporter closed")

// StatusError is a receiver's answer other than 2xx.
type StatusError struct {
	StatusCode int
	// Message is the start of the response body, when it had text.
	Message string
	// RetryAfter is the delay the receiver asked for (0 when none).
	RetryAfter time.Duration
}

func (e *StatusError) Error() string {
	s := fmt.Sprintf("otlp: receiver answered %d %s", e.StatusCode, http.StatusText(e.StatusCode))
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// Retryable reports whether the OTLP specification allows the request to
// be retried: 429, 502, 503 and 504. Every other status is permanent.
func (e *StatusError) Retryable() bool {
	switch e.StatusCode {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// Report is what one Export sent.
type Report struct {
	// Records the receiver accepted, in Batches requests.
	Records int `json:"records"`
	Batches int `json:"batches"`
	// Rejected records: refused by the receiver (a permanent error, or
	// rejected in a partial success) or not sent because an earlier batch
	// failed or the context ended.
	Rejected int `json:"rejected"`
	// Retries of requests.
	Retries int `json:"retries"`
	// Bytes of the request bodies the receiver accepted.
	Bytes    int      `json:"bytes"`
	Encoding Encoding `json:"encoding"`
}

// Stats are an Exporter's counters since New, for /metrics.
type Stats struct {
	// Queued records waiting or in flight now.
	Queued int `json:"queued"`
	// RecordsSent the receiver accepted, in BatchesSent requests.
	RecordsSent uint64 `json:"records_sent"`
	BatchesSent uint64 `json:"batches_sent"`
	// BatchesFailed: requests given up on (permanent error, retries
	// exhausted, Close's deadline, Export's context).
	BatchesFailed uint64 `json:"batches_failed"`
	// Retries of requests.
	Retries uint64 `json:"retries"`
	// DroppedQueueFull: records Enqueue refused (queue full, or closed).
	DroppedQueueFull uint64 `json:"dropped_queue_full"`
	// DroppedFailed: records of failed batches, records a receiver
	// rejected in a partial success, and records still queued when Close's
	// deadline passed.
	DroppedFailed uint64 `json:"dropped_failed"`
	// LastError and when it happened (zero when none yet).
	LastError     string    `json:"last_error,omitempty"`
	LastErrorTime time.Time `json:"last_error_time,omitzero"`
}

// Exporter sends flow records to an OTLP/HTTP receiver as logs. Enqueue
// hands records to a bounded queue that a background loop exports every
// Interval and whenever a batch is full; Export sends records at once.
// Only Export waits on the network, and only as long as its context lets
// it; Close flushes within its context's deadline.
type Exporter struct {
	cfg    Config
	url    string
	ctype  string
	client *http.Client

	mu       sync.Mutex
	queue    []flows.Record
	inflight int // records taken from queue by the loop, not yet done
	closed   bool
	stats    Stats
	lost     int // records the final flush did not deliver

	wake      chan struct{} // a full batch is queued
	stop      chan struct{} // Close was called
	done      chan struct{} // the loop ended
	runCtx    context.Context
	cancelRun context.CancelFunc
}

// New checks cfg and starts an Exporter's loop. Close it.
func New(cfg Config) (*Exporter, error) {
	cfg, err := cfg.normalize()
	if err != nil {
		return nil, err
	}
	e := &Exporter{
		cfg:    cfg,
		url:    cfg.Endpoint + "/v1/logs",
		ctype:  "application/json",
		client: &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()},
		wake:   make(chan struct{}, 1),
		stop:   make(chan struct{}),
		done:   make(chan struct{}),
	}
	if cfg.Encoding == EncodingProtobuf {
		e.ctype = "application/x-protobuf"
	}
	e.runCtx, e.cancelRun = context.WithCancel(context.Background())
	go e.loop()
	return e, nil
}

// Config is the exporter's configuration, defaults filled in.
func (e *Exporter) Config() Config { return e.cfg }

// Enqueue queues recs for the background loop and never blocks. The
// exporter holds at most QueueSize records (queued or in flight); when
// recs do not all fit, the newest ones, at the end of recs, are dropped
// and counted: the records already queued are the older ones, which the
// datapath's ring may have overwritten by now, while the newest are still
// there for the next read or an on-demand Export. So accepted records keep
// their order, and a caller knows exactly which it lost (recs[accepted:]).
// After Close everything is dropped.
func (e *Exporter) Enqueue(recs []flows.Record) (accepted, dropped int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.closed {
		accepted = min(len(recs), e.cfg.QueueSize-len(e.queue)-e.inflight)
	}
	dropped = len(recs) - accepted
	e.queue = append(e.queue, recs[:accepted]...)
	e.stats.DroppedQueueFull += uint64(dropped)
	if len(e.queue) >= e.cfg.MaxBatch {
		select {
		case e.wake <- struct{}{}:
		default:
		}
	}
	return accepted, dropped
}

// Stats returns the exporter's counters.
func (e *Exporter) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.stats
	s.Queued = len(e.queue) + e.inflight
	return s
}

// Export sends recs now, in batches of at most MaxBatch, retrying as the
// Config says within ctx; it stops at the first batch that fails and
// returns what it sent with the error. It bypasses the queue (the
// on-demand route uses it); its results count in Stats.
func (e *Exporter) Export(ctx context.Context, recs []flows.Record) (Report, error) {
	rep := Report{Encoding: e.cfg.Encoding}
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return rep, ErrClosed
	}
	// Close's deadline ends an Export too.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(e.runCtx, cancel)()
	for len(recs) > 0 {
		n := min(len(recs), e.cfg.MaxBatch)
		res := e.send(ctx, recs[:n])
		rep.Retries += res.retries
		rep.Records += res.accepted
		rep.Rejected += n - res.accepted
		if res.err != nil {
			rep.Rejected += len(recs) - n
			e.count(func(s *Stats) { s.DroppedFailed += uint64(len(recs) - n) })
			return rep, res.err
		}
		rep.Batches++
		rep.Bytes += res.bytes
		recs = recs[n:]
	}
	return rep, nil
}

// Close stops the loop after it sent what is queued, waiting no longer
// than ctx allows: then the request in flight is abandoned and the records
// left are counted in DroppedFailed. It returns an error when records were
// left undelivered. Calls after the first return nil.
func (e *Exporter) Close(ctx context.Context) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	close(e.stop)
	var ctxErr error
	select {
	case <-e.done:
	case <-ctx.Done():
		ctxErr = ctx.Err()
		e.cancelRun() // ends the request in flight and any backoff at once
		<-e.done
	}
	e.cancelRun()
	e.client.CloseIdleConnections()
	e.mu.Lock()
	lost := e.lost
	e.mu.Unlock()
	switch {
	case ctxErr != nil:
		return fmt.Errorf("otlp: close: %d records not delivered: %w", lost, ctxErr)
	case lost > 0:
		return fmt.Errorf("otlp: close: %d records not delivered", lost)
	}
	return nil
}

func (e *Exporter) loop() {
	defer close(e.done)
	t := time.NewTicker(e.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-e.stop:
			e.drain(0)
			return
		case <-t.C:
			e.drain(0)
		case <-e.wake:
			e.drain(e.cfg.MaxBatch)
		}
	}
}

// drain sends queued batches while at least atLeast records are queued
// (anything when 0). Once Close was called, what it cannot deliver counts
// as lost: the batch in flight then, and what is left when Close's
// deadline ends the flush.
func (e *Exporter) drain(atLeast int) {
	for {
		e.mu.Lock()
		n := min(len(e.queue), e.cfg.MaxBatch)
		if e.runCtx.Err() != nil {
			left := len(e.queue)
			e.lost += left
			e.stats.DroppedFailed += uint64(left)
			e.queue = nil
			n = 0
		}
		if n == 0 || n < atLeast {
			e.mu.Unlock()
			return
		}
		batch := e.queue[:n:n]
		e.queue = e.queue[n:]
		e.inflight = n
		e.mu.Unlock()

		res := e.send(e.runCtx, batch)

		e.mu.Lock()
		e.inflight = 0
		if e.closed {
			e.lost += n - res.accepted
		}
		e.mu.Unlock()
	}
}

type sendResult struct {
	accepted int // records the receiver took
	bytes    int
	retries  int
	err      error
}

// send exports one batch with retries and counts the outcome.
func (e *Exporter) send(ctx context.Context, batch []flows.Record) sendResult {
	body, err := e.encode(batch, time.Now())
	if err != nil {
		e.fail(len(batch), err)
		return sendResult{err: err}
	}
	var res sendResult
	start := time.Now()
	for attempt := 0; ; attempt++ {
		rejected, msg, err := e.post(ctx, body, len(batch))
		if err == nil {
			res.accepted = len(batch) - rejected
			res.bytes = len(body)
			e.count(func(s *Stats) {
				s.RecordsSent += uint64(res.accepted)
				s.BatchesSent++
				if rejected > 0 {
					s.DroppedFailed += uint64(rejected)
					s.LastError = fmt.Sprintf("otlp: receiver rejected %d of %d records: %s", rejected, len(batch), msg)
					s.LastErrorTime = time.Now()
				}
			})
			return res
		}
		delay, retry := e.retryDelay(ctx, err, attempt)
		if retry && time.Since(start)+delay > e.cfg.RetryMaxElapsed {
			err = fmt.Errorf("giving up after %d retries in %v: %w", attempt, time.Since(start).Round(time.Millisecond), err)
			retry = false
		}
		if !retry {
			res.err = err
			e.fail(len(batch), err)
			return res
		}
		res.retries++
		e.count(func(s *Stats) { s.Retries++ })
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			res.err = fmt.Errorf("otlp: waiting to retry: %w (last error: %v)", ctx.Err(), err)
			e.fail(len(batch), res.err)
			return res
		}
	}
}

// retryDelay says whether err may be retried, and after how long.
func (e *Exporter) retryDelay(ctx context.Context, err error, attempt int) (time.Duration, bool) {
	if ctx.Err() != nil {
		return 0, false // the caller's context (or Close) ended it
	}
	var se *StatusError
	if errors.As(err, &se) {
		if !se.Retryable() {
			return 0, false
		}
		if se.RetryAfter > 0 {
			return se.RetryAfter, true
		}
	}
	// A network error or a timeout of this attempt, or a retryable
	// status without Retry-After: exponential backoff with jitter.
	d := e.cfg.RetryInitial << min(attempt, 30)
	if d <= 0 || d > e.cfg.RetryMax {
		d = e.cfg.RetryMax
	}
	d = d/2 + rand.N(d+1) // +-50%
	return min(d, e.cfg.RetryMax), true
}

func (e *Exporter) fail(records int, err error) {
	e.count(func(s *Stats) {
		s.BatchesFailed++
		s.DroppedFailed += uint64(records)
		s.LastError = err.Error()
		s.LastErrorTime = time.Now()
	})
}

func (e *Exporter) count(f func(*Stats)) {
	e.mu.Lock()
	f(&e.stats)
	e.mu.Unlock()
}

func (e *Exporter) encode(batch []flows.Record, now time.Time) ([]byte, error) {
	req := NewRequest(batch, e.cfg.ServiceName, e.cfg.NodeName, now)
	if e.cfg.Encoding == EncodingProtobuf {
		return proto.Marshal(req)
	}
	return MarshalJSON(req)
}

// maxResponse bounds how much of a response is read.
const maxResponse = 64 << 10

// post makes one request with the per-request timeout. On success it
// returns how many records the receiver rejected in a partial success.
func (e *Exporter) post(ctx context.Context, body []byte, records int) (rejected int, msg string, err error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url, bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	for k, v := range e.cfg.Headers {
		req.Header.Set(k, v)
	}
	req.Header.Set("Content-Type", e.ctype)
	req.Header.Set("User-Agent", "fluxvm-flows-otlp")
	resp, err := e.client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponse))
	if err != nil {
		return 0, "", fmt.Errorf("otlp: reading the response: %w", err)
	}
	ct, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return 0, "", &StatusError{
			StatusCode: resp.StatusCode,
			Message:    responseMessage(ct, data),
			RetryAfter: parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()),
		}
	}
	var out collogs.ExportLogsServiceResponse
	switch {
	case len(data) == 0:
	case ct == "application/x-protobuf":
		err = proto.Unmarshal(data, &out)
	case ct == "application/json":
		err = protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(data, &out)
	}
	if err != nil || out.GetPartialSuccess() == nil {
		return 0, "", nil // accepted; an unreadable 2xx body is not a failure
	}
	ps := out.GetPartialSuccess()
	return int(min(max(ps.GetRejectedLogRecords(), 0), int64(records))), ps.GetErrorMessage(), nil
}

// responseMessage is a short text from an error response: a JSON or text
// body's start (a protobuf google.rpc.Status is not decoded).
func responseMessage(ct string, data []byte) string {
	if ct != "application/json" && !strings.HasPrefix(ct, "text/") {
		return ""
	}
	s := strings.Join(strings.Fields(string(data)), " ")
	if len(s) > 256 {
		s = s[:256] + "..."
	}
	return s
}

// parseRetryAfter reads a Retry-After header: delay seconds or an HTTP
// date. 0 when absent or unreadable.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs <= 0 {
			return 0
		}
		return time.Duration(min(secs, int64(24*time.Hour/time.Second))) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}
