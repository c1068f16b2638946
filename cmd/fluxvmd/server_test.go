package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// noDataplane are roles that must not be reached (every one a nil
// interface): the requests of these tests end before the handler would
// call them.
var noDataplane = api.Roles{
	Services: struct{ api.ServiceStore }{}, Observer: struct{ api.Observer }{}, Admin: struct{ api.Admin }{},
	Flows: struct{ api.FlowReader }{}, Policies: struct{ api.PolicyStore }{}, Snapshots: struct{ api.Snapshots }{},
	Replication: struct{ api.Replication }{},
}

// startAPIServer serves the daemon's REST server, as newAPIServer builds
// it from a with the test's token, on a loopback port.
func startAPIServer(t *testing.T, a APIConfig) (*http.Server, string) {
	t.Helper()
	srv, err := newAPIServer(noDataplane, a, []string{token}, nil, slog.New(slog.DiscardHandler), nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close(); <-done })
	return srv, ln.Addr().String()
}

// TestAPIServerLimits checks the limits newAPIServer sets, from the
// defaults and from a configured body_timeout.
func TestAPIServerLimits(t *testing.T) {
	for _, body := range []time.Duration{DefaultAPIBodyTimeout, 5 * time.Second} {
		a := defaultAPIConfig()
		a.BodyTimeout = fluxvm.Duration{Duration: body}
		srv, err := newAPIServer(noDataplane, a, []string{token}, nil, slog.New(slog.DiscardHandler), nil, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if srv.ReadHeaderTimeout != 10*time.Second || srv.ReadTimeout != 10*time.Second+body ||
			srv.WriteTimeout != body+2*time.Minute || srv.IdleTimeout != 2*time.Minute || srv.MaxHeaderBytes != 64<<10 {
			t.Errorf("body_timeout %v: server %+v", body, srv)
		}
	}
}

// TestAPIServerStalledBodies sends POSTs that announce a 100-byte body and
// never send it, over real connections to the daemon's server: without a
// token the 401 comes at once and the connection closes; with the admin
// token the request fails with 408 at body_timeout and the connection
// closes; many such connections are all closed.
func TestAPIServerStalledBodies(t *testing.T) {
	const bodyTimeout = 3 * time.Second
	a := defaultAPIConfig()
	a.BodyTimeout = fluxvm.Duration{Duration: bodyTimeout}
	_, addr := startAPIServer(t, a)

	stalled := func(auth string) (net.Conn, error) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return nil, err
		}
		head := "POST /v1/network/services HTTP/1.1\r\nHost: fluxvm\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
		if auth != "" {
			head += "Authorization: Bearer " + auth + "\r\n"
		}
		_, err = io.WriteString(c, head+"\r\n")
		return c, err
	}
	// answer reads the response and then waits for the server to close
	// the connection; it returns the status and when the answer came.
	answer := func(c net.Conn) (int, time.Time, error) {
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(bodyTimeout + 10*time.Second))
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return 0, time.Time{}, fmt.Errorf("no response: %w", err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		at := time.Now()
		if n, err := br.Read(make([]byte, 1)); n != 0 || err == nil {
			return resp.StatusCode, at, errors.New("more data after the response")
		} else if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
			return resp.StatusCode, at, errors.New("the server did not close the connection")
		}
		return resp.StatusCode, at, nil
	}

	for _, tt := range []struct {
		name     string
		auth     string
		status   int
		min, max time.Duration // when the answer may come
	}{
		{"no token", "", http.StatusUnauthorized, 0, bodyTimeout / 2},
		{"wrong token", "nope", http.StatusUnauthorized, 0, bodyTimeout / 2},
		{"admin token", token, http.StatusRequestTimeout, bodyTimeout, bodyTimeout + 2*time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			c, err := stalled(tt.auth)
			if err != nil {
				t.Fatal(err)
			}
			status, at, err := answer(c)
			if err != nil {
				t.Fatal(err)
			}
			if status != tt.status {
				t.Errorf("status %d, want %d", status, tt.status)
			}
			if took := at.Sub(start); took < tt.min || took > tt.max {
				t.Errorf("answered after %v, want %v..%v", took, tt.min, tt.max)
			}
		})
	}

	t.Run("many", func(t *testing.T) {
		const n = 250
		var wg sync.WaitGroup
		errs := make(chan error, 2*n)
		for i := range 2 * n {
			auth := ""
			if i%2 == 1 {
				auth = token
			}
			c, err := stalled(auth)
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, _, err := answer(c); err != nil {
					errs <- fmt.Errorf("connection %d: %w", i, err)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})
}

// TestTokenFileMode checks that a token file group or others may access
// is refused, naming the file and its mode, both by check-config and
// when the daemon starts (before anything is loaded), and that a file
// only its owner may access is read.
func TestTokenFileMode(t *testing.T) {
	for _, tt := range []struct {
		mode os.FileMode
		ok   bool
	}{
		{0o600, true}, {0o400, true}, {0o700, true},
		{0o640, false}, {0o644, false}, {0o604, false}, {0o620, false},
		{0o602, false}, {0o610, false}, {0o601, false}, {0o666, false},
	} {
		t.Run(fmt.Sprintf("%04o", tt.mode), func(t *testing.T) {
			dir := t.TempDir()
			file := filepath.Join(dir, "admin.token")
			if err := os.WriteFile(file, []byte("# rotated monthly\n"+token+"\n\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(file, tt.mode); err != nil {
				t.Fatal(err)
			}
			a := defaultAPIConfig()
			a.AdminTokenFile = file
			admin, _, err := tokens(a)
			if tt.ok {
				if err != nil || len(admin) != 1 || admin[0] != token {
					t.Fatalf("tokens = %q, %v", admin, err)
				}
				return
			}
			want := fmt.Sprintf("%s has mode %04o", file, tt.mode)
			if !errors.Is(err, errTokenFileMode) || !strings.Contains(err.Error(), want) {
				t.Fatalf("tokens: %v, want an error saying %q", err, want)
			}
			// check-config reports it too.
			cfg := filepath.Join(dir, "fluxvmd.toml")
			doc := fmt.Sprintf("[sandbox.dataplane.service.api]\nadmin_token_file = %q\n", file)
			if err := os.WriteFile(cfg, []byte(doc), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := run(context.Background(), []string{"-config", cfg, "check-config"}); !errors.Is(err, errTokenFileMode) {
				t.Errorf("check-config: %v, want the token file refused", err)
			}
		})
	}
}
