// Package daemonlog collects what a fluxvmd process prints, safe to read
// while it writes, and tells when the daemon logged that it serves: what
// the lab commands and the tests that start the real daemon wait for.
//
// The output kept is bounded: the first HeadBytes (start-up) and the last
// TailBytes; what falls between is dropped and counted, so a daemon that
// logs for hours costs a fixed amount of memory.
package daemonlog

import (
	"bytes"
	"fmt"
	"sync"
)

// servingLine is what fluxvmd logs once its REST API accepts requests.
var servingLine = []byte("fluxvmd: serving")

const (
	// HeadBytes is how much of the start of the output is kept.
	HeadBytes = 64 << 10
	// TailBytes is how much of the end of the output is kept (at least
	// what error messages print, a few KiB).
	TailBytes = 1 << 20
)

// Output is a daemon's output. Use New.
type Output struct {
	mu      sync.Mutex
	head    []byte // the first HeadBytes
	tail    []byte // the last bytes after head, at most 2×TailBytes before trimming
	dropped int64  // bytes between head and tail no longer kept
	// scan is the end of the output not yet searched for servingLine,
	// preceded by the len(servingLine)-1 bytes before it (a line split
	// across writes): each byte is searched about once.
	scan    []byte
	serving chan struct{}
	seen    bool
}

// New returns an empty Output.
func New() *Output { return &Output{serving: make(chan struct{})} }

// Write records p (the process's stdout and stderr).
func (o *Output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	rest := p
	if n := HeadBytes - len(o.head); n > 0 {
		n = min(n, len(rest))
		o.head = append(o.head, rest[:n]...)
		rest = rest[n:]
	}
	if len(rest) > 0 {
		o.tail = append(o.tail, rest...)
		// Trimmed in steps of TailBytes, so copying stays linear.
		if len(o.tail) > 2*TailBytes {
			cut := len(o.tail) - TailBytes
			o.dropped += int64(cut)
			o.tail = append(o.tail[:0:0], o.tail[cut:]...)
		}
	}
	if !o.seen {
		o.scan = append(o.scan, p...)
		if bytes.Contains(o.scan, servingLine) {
			o.seen = true
			o.scan = nil
			close(o.serving)
		} else if keep := len(servingLine) - 1; len(o.scan) > keep {
			o.scan = append(o.scan[:0], o.scan[len(o.scan)-keep:]...)
		}
	}
	return len(p), nil
}

// Serving is closed once the daemon logged that it serves.
func (o *Output) Serving() <-chan struct{} { return o.serving }

// Bytes returns a copy of the output kept: all of it while it is short,
// else its start, a line saying how much was dropped, and its end.
func (o *Output) Bytes() []byte {
	o.mu.Lock()
	defer o.mu.Unlock()
	b := make([]byte, 0, len(o.head)+len(o.tail)+64)
	b = append(b, o.head...)
	if o.dropped > 0 {
		b = fmt.Appendf(b, "\n[daemonlog: %d bytes dropped]\n", o.dropped)
	}
	return append(b, o.tail...)
}

func (o *Output) String() string { return string(o.Bytes()) }

// Tail is the last n bytes of the output, for an error message.
func (o *Output) Tail(n int) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	var b []byte
	if len(o.tail) >= n || o.dropped > 0 {
		b = o.tail[max(0, len(o.tail)-n):]
	} else {
		b = append(append([]byte{}, o.head...), o.tail...)
		b = b[max(0, len(b)-n):]
	}
	return string(b)
}
