// Package daemonlog collects what a fluxvmd process prints, safe to read
// while it writes, and tells when the daemon logged that it serves: what
// the lab commands and the tests that start the real daemon wait for.
package daemonlog

import (
	"bytes"
	"sync"
)

// servingLine is what fluxvmd logs once its REST API accepts requests.
var servingLine = []byte("fluxvmd: serving")

// Output is a daemon's output. Use New.
type Output struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	serving chan struct{}
	seen    bool
}

// New returns an empty Output.
func New() *Output { return &Output{serving: make(chan struct{})} }

// Write records p (the process's stdout and stderr).
func (o *Output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	n, err := o.buf.Write(p)
	if !o.seen && bytes.Contains(o.buf.Bytes(), servingLine) {
		o.seen = true
		close(o.serving)
	}
	return n, err
}

// Serving is closed once the daemon logged that it serves.
func (o *Output) Serving() <-chan struct{} { return o.serving }

// Bytes returns a copy of the output so far.
func (o *Output) Bytes() []byte {
	o.mu.Lock()
	defer o.mu.Unlock()
	return bytes.Clone(o.buf.Bytes())
}

func (o *Output) String() string { return string(o.Bytes()) }

// Tail is the last n bytes of the output, for an error message.
func (o *Output) Tail(n int) string {
	b := o.Bytes()
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
