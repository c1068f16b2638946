package api_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// These tests talk to the handler over real sockets, served by a plain
// http.Server without any timeout of its own: the protections against a
// client that announces a body and never sends it are the handler's, so
// an embedder's server gets them too.

// testBodyTimeout is the short body deadline the tests configure.
const testBodyTimeout = 300 * time.Millisecond

// connServer serves a handler with opts (and testBodyTimeout) on
// loopback and counts the connections that are open.
type connServer struct {
	*httptest.Server
	env  *testEnv
	open atomic.Int64
	// changed gets a token (capacity 1) whenever open changes.
	changed chan struct{}
}

func newConnServer(t *testing.T, opts ...func(*api.Options)) *connServer {
	t.Helper()
	env := newEnv(t, append([]func(*api.Options){func(o *api.Options) { o.BodyTimeout = testBodyTimeout }}, opts...)...)
	s := &connServer{env: env, changed: make(chan struct{}, 1)}
	s.Server = httptest.NewUnstartedServer(env.h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			s.open.Add(1)
		case http.StateClosed, http.StateHijacked:
			s.open.Add(-1)
		default:
			return
		}
		select {
		case s.changed <- struct{}{}:
		default:
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s
}

// waitClosed waits until the server has closed every connection.
func (s *connServer) waitClosed(t *testing.T, within time.Duration) {
	t.Helper()
	timeout := time.After(within)
	for s.open.Load() != 0 {
		select {
		case <-s.changed:
		case <-timeout:
			t.Fatalf("%d connections still open after %v", s.open.Load(), within)
		}
	}
}

// stalledRequest sends the request line and headers of a POST that
// announces a 100-byte body, and never sends the body.
func stalledRequest(t testing.TB, addr, path, auth string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	head := "POST " + path + " HTTP/1.1\r\nHost: fluxvm\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
	if auth != "" {
		head += "Authorization: " + auth + "\r\n"
	}
	if _, err := io.WriteString(c, head+"\r\n"); err != nil {
		t.Fatal(err)
	}
	return c
}

// readAnswer reads one response from c (failing after within) and then
// waits for the server to close the connection. answered is when the
// response had arrived.
func readAnswer(c net.Conn, within time.Duration) (resp *http.Response, answered time.Time, err error) {
	resp, answered, err = readAnswerOpen(c, within)
	if err != nil {
		return resp, answered, err
	}
	return resp, answered, waitEOF(c)
}

func readAnswerOpen(c net.Conn, within time.Duration) (*http.Response, time.Time, error) {
	_ = c.SetReadDeadline(time.Now().Add(within))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("no response: %w", err)
	}
	if _, err := io.ReadAll(resp.Body); err != nil {
		return resp, time.Time{}, fmt.Errorf("response body: %w", err)
	}
	if br.Buffered() != 0 {
		return resp, time.Time{}, fmt.Errorf("more data after the response")
	}
	return resp, time.Now(), nil
}

// waitEOF waits (until the read deadline of c) for the server to close c.
func waitEOF(c net.Conn) error {
	// The server must close the connection: the rest of the stream is
	// EOF (or a reset), not a timeout of our read.
	var b [1]byte
	if n, err := c.Read(b[:]); n != 0 || err == nil {
		return fmt.Errorf("more data after the response")
	} else if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("connection still open: %w", err)
	}
	return nil
}

// TestStalledBodyRefusedPromptly sends requests whose announced body never
// arrives and that are refused before their body matters: the answer
// comes at once and the connection is closed, well before the body
// deadline would close it.
func TestStalledBodyRefusedPromptly(t *testing.T) {
	tests := []struct {
		name   string
		path   string
		auth   string
		status int
	}{
		{"no token", "/v1/network/services", "", http.StatusUnauthorized},
		{"unknown token", "/v1/network/services", "Bearer nope", http.StatusUnauthorized},
		{"read token on a mutation", "/v1/network/services", "Bearer " + readToken, http.StatusForbidden},
		{"unknown route", "/v1/network/nothing", "Bearer " + adminToken, http.StatusNotFound},
		{"method not allowed", "/v1/network/services/status", "Bearer " + adminToken, http.StatusMethodNotAllowed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// A body deadline far away: only the refusal may end this.
			s := newConnServer(t, func(o *api.Options) { o.BodyTimeout = time.Minute })
			start := time.Now()
			c := stalledRequest(t, s.Listener.Addr().String(), tt.path, tt.auth)
			resp, answered, err := readAnswer(c, 3*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tt.status || !resp.Close {
				t.Errorf("status %d, close %v; want %d, close", resp.StatusCode, resp.Close, tt.status)
			}
			// Far from the body deadline (a minute): nothing waited for
			// the body.
			if took := answered.Sub(start); took > time.Second {
				t.Errorf("answered after %v", took)
			}
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("closed after %v", took)
			}
			s.waitClosed(t, 2*time.Second)
		})
	}
}

// TestStalledBodyDeadline sends an authenticated request whose body never
// arrives (or stops half way): the handler gives up at the body deadline
// with 408 and the connection is closed.
func TestStalledBodyDeadline(t *testing.T) {
	for _, partial := range []string{"", `{"name": "web",`} {
		t.Run(fmt.Sprintf("%d bytes sent", len(partial)), func(t *testing.T) {
			s := newConnServer(t)
			start := time.Now()
			c := stalledRequest(t, s.Listener.Addr().String(), "/v1/network/services", "Bearer "+adminToken)
			if _, err := io.WriteString(c, partial); err != nil {
				t.Fatal(err)
			}
			resp, answered, err := readAnswer(c, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			took := answered.Sub(start)
			if resp.StatusCode != http.StatusRequestTimeout {
				t.Errorf("status %d, want 408", resp.StatusCode)
			}
			if took < testBodyTimeout || took > testBodyTimeout+2*time.Second {
				t.Errorf("answered after %v, want about the body deadline %v", took, testBodyTimeout)
			}
			s.waitClosed(t, 2*time.Second)
			if len(s.env.dp.applied) != 0 {
				t.Errorf("a request without its body reached the dataplane")
			}
		})
	}
}

// TestManyStalledConnections opens many connections that announce a body
// and never send it, with and without a token: the server closes every
// one of them, none is held beyond the body deadline.
func TestManyStalledConnections(t *testing.T) {
	const perKind = 100
	s := newConnServer(t)
	addr := s.Listener.Addr().String()
	var conns []net.Conn
	for i := 0; i < perKind; i++ {
		conns = append(conns,
			stalledRequest(t, addr, "/v1/network/services", ""),
			stalledRequest(t, addr, "/v1/network/services", "Bearer "+adminToken))
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(conns))
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, err := readAnswer(c, 10*time.Second); err != nil {
				errs <- fmt.Errorf("connection %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	s.waitClosed(t, 5*time.Second)
}

// TestBodyDeadlineKeepsAlive checks that a request whose body arrives in
// time is served normally and leaves the connection usable: the body
// deadline does not cut a later request on the same connection, even one
// that comes after the deadline of the first has passed.
func TestBodyDeadlineKeepsAlive(t *testing.T) {
	s := newConnServer(t)
	c, err := net.Dial("tcp", s.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	for i, pause := range []time.Duration{0, 2 * testBodyTimeout} {
		time.Sleep(pause)
		body := validService
		req := fmt.Sprintf("POST /v1/network/services HTTP/1.1\r\nHost: fluxvm\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
			adminToken, len(body), body)
		if _, err := io.WriteString(c, req); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK || resp.Close {
			t.Errorf("request %d: status %d, close %v", i, resp.StatusCode, resp.Close)
		}
	}
}

// TestRefusedBodySentAnswered checks that a refused client that does send
// its body (a wrong token on a real apply) reads the answer, not a reset,
// over a real connection, for small and large bodies.
func TestRefusedBodySentAnswered(t *testing.T) {
	s := newConnServer(t)
	for _, size := range []int{len(validService), 200 << 10, 900 << 10} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			body := validService + strings.Repeat(" ", size-len(validService))
			req, err := http.NewRequest("POST", s.URL+"/v1/network/services", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", "Bearer wrong-token")
			resp, err := s.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("status %d, want 401", resp.StatusCode)
			}
		})
	}
}
