package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// TestLimitListener: with the cap reached by clients that connect and
// send nothing, a further client is served only once one of them goes;
// the server never holds more than the cap.
func TestLimitListener(t *testing.T) {
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const limit = 4
	ln := newLimitListener(tcp, limit)
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "ok") }),
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	var idle []net.Conn
	for range limit {
		c, err := net.Dial("tcp", tcp.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		idle = append(idle, c)
	}
	ask := func(wait time.Duration) error {
		c, err := net.Dial("tcp", tcp.Addr().String())
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(wait))
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		resp.Body.Close()
		return nil
	}
	// Served only when a slot is free: the idle clients hold them all.
	if err := ask(300 * time.Millisecond); err == nil {
		t.Fatalf("a client beyond the cap of %d was served", limit)
	}
	if len(ln.sem) != limit {
		t.Errorf("%d connections held, want %d", len(ln.sem), limit)
	}
	idle[0].Close()
	if err := ask(2 * time.Second); err != nil {
		t.Fatalf("after one idle client left: %v", err)
	}
}
