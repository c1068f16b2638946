package daemonlog

import (
	"bytes"
	"strings"
	"testing"
)

func TestServingSplitAcrossWrites(t *testing.T) {
	o := New()
	o.Write([]byte("starting\nfluxvmd: ser"))
	select {
	case <-o.Serving():
		t.Fatal("serving before the line is complete")
	default:
	}
	o.Write([]byte("ving on 127.0.0.1:7788\n"))
	select {
	case <-o.Serving():
	default:
		t.Fatal("serving line split across two writes not seen")
	}
	o.Write([]byte("fluxvmd: serving again\n")) // no second close
	if got := o.String(); got != "starting\nfluxvmd: serving on 127.0.0.1:7788\nfluxvmd: serving again\n" {
		t.Errorf("output %q", got)
	}
	if got := o.Tail(7); got != "again\n" && got != " again\n" {
		t.Errorf("Tail(7) = %q", got)
	}
}

// A daemon that logs a lot (here 16 MiB in short lines, never the serving
// line) keeps a bounded output: the start, the end and a note of what was
// dropped; Tail still has the last bytes.
func TestOutputBounded(t *testing.T) {
	o := New()
	line := []byte(strings.Repeat("x", 99) + "\n")
	for i := 0; i < (16<<20)/len(line); i++ {
		o.Write(line)
	}
	o.Write([]byte("the last line\n"))
	b := o.Bytes()
	if max := HeadBytes + 2*TailBytes + 100; len(b) > max {
		t.Fatalf("output holds %d bytes after 16 MiB written, want at most %d", len(b), max)
	}
	if !bytes.Contains(b, []byte("bytes dropped]")) {
		t.Errorf("no note of the dropped bytes")
	}
	if !bytes.HasPrefix(b, line) || !bytes.HasSuffix(b, []byte("x\nthe last line\n")) {
		t.Errorf("output lost its start or its end")
	}
	if got := o.Tail(14); got != "the last line\n" {
		t.Errorf("Tail(14) = %q", got)
	}
	select {
	case <-o.Serving():
		t.Error("serving without the line")
	default:
	}
}
