package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"

	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// maxAnswer bounds the answer the CLI reads (the flows route's largest
// answer is well below it).
const maxAnswer = 64 << 20

// client calls one node's REST API.
type client struct {
	base  *url.URL // scheme and host, and a path prefix if any
	token string
	http  *http.Client
}

// newClient checks the global flags and makes the client: the address,
// the token (tokenFrom) and the TLS roots.
func newClient(g *globals, env func(string) string) (*client, error) {
	base, err := parseAddr(g.addr)
	if err != nil {
		return nil, err
	}
	if g.timeout <= 0 {
		return nil, usagef("-timeout must be positive, not %v", g.timeout)
	}
	tok, err := tokenFrom(g.tokenFile, env)
	if err != nil {
		return nil, err
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if g.caFile != "" {
		pool, err := caPool(g.caFile)
		if err != nil {
			return nil, err
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	return &client{base: base, token: tok, http: &http.Client{Transport: tr, Timeout: g.timeout}}, nil
}

// parseAddr reads -addr: a http or https URL, or host:port (then http).
func parseAddr(addr string) (*url.URL, error) {
	if addr == "" {
		return nil, usagef("-addr is empty")
	}
	if !strings.Contains(addr, "://") {
		addr = "http://" + addr
	}
	u, err := url.Parse(addr)
	if err != nil {
		return nil, usagef("-addr %q: %v", addr, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, usagef("-addr %q: want http://host:port or https://host:port", addr)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return nil, usagef("-addr %q: no user, query or fragment, please", addr)
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	u.RawPath = ""
	return u, nil
}

// tokenFrom returns the bearer token: the first token of file (a line
// that is neither empty nor a '#' comment, the daemon's token file
// format) when file is set, else the first of $FLUXVM_TOKEN,
// $FLUXVM_ADMIN_TOKEN and $FLUXVM_READ_TOKEN that is set.
func tokenFrom(file string, env func(string) string) (string, error) {
	if file != "" {
		raw, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("read token file: %w", err)
		}
		for line := range strings.Lines(string(raw)) {
			line = strings.TrimSpace(line)
			if line != "" && !strings.HasPrefix(line, "#") {
				return line, nil
			}
		}
		return "", usagef("token file %s holds no token", file)
	}
	for _, name := range []string{envToken, envAdminToken, envReadToken} {
		if v := strings.TrimSpace(env(name)); v != "" {
			return v, nil
		}
	}
	return "", usagef("no token: set -token-file, or $%s ($%s, $%s)", envToken, envAdminToken, envReadToken)
}

// caPool returns the system roots plus the certificates of a PEM file.
func caPool(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("read CA file: %w", err)
	}
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("CA file %s: no PEM certificate in it", file)
	}
	return pool, nil
}

// apiError is an error answer of the API (api.ErrorResponse).
type apiError struct {
	status int
	detail api.ErrorDetail
}

func (e *apiError) Error() string {
	msg := string(e.detail.Code) + ": " + e.detail.Message
	if e.detail.Field != "" {
		msg += " (field " + e.detail.Field + ")"
	}
	return msg
}

// request is one call of the API.
type request struct {
	method string
	path   string     // under the base URL, already escaped
	query  url.Values // nil: none
	body   io.Reader  // nil: none; else sent as ctype, streamed as read
	ctype  string     // "": application/json
	length int64      // the body's length when known (> 0), else chunked
	accept string     // "": application/json
}

// send sends r and returns the answer, whose body the caller reads and
// closes; an answer of 300 or more is an *apiError (or, when its body is
// not the API's error document, an error quoting the status and the
// start of the body). Neither the request's body nor the answer's is
// held in memory here: a snapshot streams through.
func (c *client) send(ctx context.Context, r request) (*http.Response, error) {
	u := *c.base
	u.Path += r.path
	if r.query != nil {
		u.RawQuery = r.query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, r.method, u.String(), r.body)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", r.method, r.path, err)
	}
	if r.body != nil && r.length > 0 {
		req.ContentLength = r.length
	}
	accept := r.accept
	if accept == "" {
		accept = "application/json"
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Accept", accept)
	req.Header.Set("User-Agent", "fluxvmctl")
	if r.body != nil {
		ctype := r.ctype
		if ctype == "" {
			ctype = "application/json"
		}
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: node %s unreachable: %w", r.method, r.path, c.base.Redacted(), unwrapURLError(err))
	}
	if resp.StatusCode < 300 {
		return resp, nil
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	if err != nil {
		return nil, fmt.Errorf("%s %s: %s, and reading its answer: %w", r.method, r.path, resp.Status, err)
	}
	var er api.ErrorResponse
	if json.Unmarshal(raw, &er) == nil && er.Error.Code != "" {
		return nil, &apiError{status: resp.StatusCode, detail: er.Error}
	}
	return nil, fmt.Errorf("%s %s: %s: %s", r.method, r.path, resp.Status, snippet(raw))
}

// do sends r and returns the answer's body, read whole (at most
// maxAnswer bytes); errors as send.
func (c *client) do(ctx context.Context, r request) ([]byte, int, error) {
	resp, err := c.send(ctx, r)
	if err != nil {
		var ae *apiError
		if errors.As(err, &ae) {
			return nil, ae.status, err
		}
		return nil, 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer+1))
	if err != nil {
		return nil, resp.StatusCode, fmt.Errorf("%s %s: read the answer of %s: %w", r.method, r.path, c.base.Redacted(), unwrapURLError(err))
	}
	if len(raw) > maxAnswer {
		return nil, resp.StatusCode, fmt.Errorf("%s %s: answer larger than %d bytes", r.method, r.path, maxAnswer)
	}
	return raw, resp.StatusCode, nil
}

// unwrapURLError drops the *url.Error wrapper (its message repeats the
// method and the URL the caller already names); a timeout says so.
func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		if ue.Timeout() {
			return errors.New("timed out (see -timeout)")
		}
		return ue.Err
	}
	return err
}

// snippet is the start of a body for an error message.
func snippet(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	if s == "" {
		return "(empty body)"
	}
	return s
}

// decode decodes an answer into one of the SDK's types; unknown fields
// are kept silent, so that a newer node does not break an older CLI.
func decode(raw []byte, v any, what string) error {
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("decode %s: %w", what, err)
	}
	return nil
}

// indentJSON is the server's JSON as is, indented, with a final newline.
func indentJSON(raw []byte) ([]byte, error) {
	var b bytes.Buffer
	if err := json.Indent(&b, bytes.TrimSpace(raw), "", "  "); err != nil {
		return nil, fmt.Errorf("answer is not JSON: %w", err)
	}
	b.WriteByte('\n')
	return b.Bytes(), nil
}
