package otlp

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"
)

// Encoding is the body format of the export requests.
type Encoding string

// Encodings. JSON is the product's contract and the default.
const (
	EncodingJSON     Encoding = "json"     // OTLP/JSON, Content-Type application/json
	EncodingProtobuf Encoding = "protobuf" // binary protobuf, Content-Type application/x-protobuf
)

// Defaults for the zero values of Config.
const (
	DefaultServiceName     = "fluxvmd"
	DefaultInterval        = 10 * time.Second
	DefaultTimeout         = 10 * time.Second
	DefaultQueueSize       = 8192
	DefaultMaxBatch        = 512
	DefaultRetryInitial    = time.Second
	DefaultRetryMax        = 30 * time.Second
	DefaultRetryMaxElapsed = time.Minute
)

// Config configures an Exporter (and NewTracerProvider). Endpoint is
// required; every other zero value takes the default named beside it, and
// a negative duration or size is rejected.
type Config struct {
	// Endpoint is the receiver's base URL, http or https, without the
	// signal path: "http://127.0.0.1:4318". Logs go to Endpoint+"/v1/logs",
	// the daemon's spans (NewTracerProvider) to Endpoint+"/v1/traces".
	Endpoint string
	// Encoding of the requests: EncodingJSON ("", the default) or
	// EncodingProtobuf, for the logs and for NewTracerProvider's spans
	// alike (otlptracehttp speaks both).
	Encoding Encoding
	// Interval between periodic exports of what is queued (DefaultInterval).
	// A full batch goes out without waiting for it.
	Interval time.Duration
	// Timeout of one HTTP request, response included (DefaultTimeout).
	Timeout time.Duration
	// QueueSize bounds the records the exporter holds, queued or in flight
	// (DefaultQueueSize); Enqueue refuses what does not fit.
	QueueSize int
	// MaxBatch is the most records one request carries (DefaultMaxBatch);
	// it cannot exceed QueueSize.
	MaxBatch int
	// Headers are added to every request (e.g. an Authorization token).
	Headers map[string]string
	// NodeName is the resource's host.name and fluxvm.node (the host name
	// when empty).
	NodeName string
	// ServiceName is the resource's service.name (DefaultServiceName).
	ServiceName string
	// Retries of a request that failed on the network, timed out, or was
	// answered 429, 502, 503 or 504 wait RetryInitial (DefaultRetryInitial),
	// doubling up to RetryMax (DefaultRetryMax), each with +-50% jitter, or
	// what the receiver's Retry-After says; a batch is given up once
	// RetryMaxElapsed (DefaultRetryMaxElapsed) would pass before the next
	// try.
	RetryInitial    time.Duration
	RetryMax        time.Duration
	RetryMaxElapsed time.Duration
}

// ErrConfig is wrapped by every error about a Config.
var ErrConfig = errors.New("otlp: invalid config")

func configErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrConfig, fmt.Sprintf(format, args...))
}

// Validate reports whether New would accept c.
func (c Config) Validate() error {
	_, err := c.normalize()
	return err
}

// normalize checks c and fills in the defaults.
func (c Config) normalize() (Config, error) {
	base, err := endpointBase(c.Endpoint)
	if err != nil {
		return c, err
	}
	c.Endpoint = base
	switch c.Encoding {
	case "":
		c.Encoding = EncodingJSON
	case EncodingJSON, EncodingProtobuf:
	default:
		return c, configErr("encoding %q: want %q or %q", c.Encoding, EncodingJSON, EncodingProtobuf)
	}
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"interval", &c.Interval, DefaultInterval},
		{"timeout", &c.Timeout, DefaultTimeout},
		{"retry initial", &c.RetryInitial, DefaultRetryInitial},
		{"retry max", &c.RetryMax, DefaultRetryMax},
		{"retry max elapsed", &c.RetryMaxElapsed, DefaultRetryMaxElapsed},
	} {
		switch {
		case *d.v < 0:
			return c, configErr("%s %v is negative", d.name, *d.v)
		case *d.v == 0:
			*d.v = d.def
		}
	}
	if c.RetryMax < c.RetryInitial {
		c.RetryMax = c.RetryInitial
	}
	switch {
	case c.QueueSize < 0:
		return c, configErr("queue size %d is negative", c.QueueSize)
	case c.QueueSize == 0:
		c.QueueSize = DefaultQueueSize
	}
	switch {
	case c.MaxBatch < 0:
		return c, configErr("max batch %d is negative", c.MaxBatch)
	case c.MaxBatch == 0:
		c.MaxBatch = min(DefaultMaxBatch, c.QueueSize)
	case c.MaxBatch > c.QueueSize:
		return c, configErr("max batch %d exceeds the queue size %d", c.MaxBatch, c.QueueSize)
	}
	for k, v := range c.Headers {
		if k == "" || strings.ContainsAny(k, " \t\r\n:") || strings.ContainsAny(v, "\r\n") {
			return c, configErr("header %q: not a valid HTTP header", k)
		}
	}
	if c.ServiceName == "" {
		c.ServiceName = DefaultServiceName
	}
	if c.NodeName == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			return c, configErr("no node name given and the host name is unknown (%v)", err)
		}
		c.NodeName = h
	}
	return c, nil
}

// endpointBase checks an endpoint URL and returns it without a trailing
// slash.
func endpointBase(s string) (string, error) {
	if s == "" {
		return "", configErr("no endpoint: give the receiver's base URL, e.g. http://127.0.0.1:4318")
	}
	if !strings.Contains(s, "://") {
		return "", configErr("endpoint %q: scheme must be http or https (OTLP/HTTP), e.g. http://127.0.0.1:4318", s)
	}
	u, err := url.Parse(s)
	if err != nil {
		return "", configErr("endpoint %q: %v", s, err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", configErr("endpoint %q: scheme must be http or https (OTLP/HTTP), e.g. http://127.0.0.1:4318", s)
	case u.Host == "" || u.Hostname() == "":
		return "", configErr("endpoint %q: no host", s)
	case u.User != nil:
		return "", configErr("endpoint %q: credentials in the URL; use Headers (Authorization) instead", s)
	case u.RawQuery != "" || u.Fragment != "":
		return "", configErr("endpoint %q: no query or fragment allowed", s)
	}
	p := strings.TrimRight(u.Path, "/")
	for _, sig := range []string{"/v1/logs", "/v1/traces", "/v1/metrics"} {
		if strings.HasSuffix(p, sig) {
			return "", configErr("endpoint %q: give the base URL without %s; the signal paths are appended", s, sig)
		}
	}
	u.Path = p
	u.RawPath = ""
	return u.String(), nil
}
