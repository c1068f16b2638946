//go:build unix

package main

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/advert"
)

// fakeBirdc is a birdc that answers configure as BIRD 2 does in verbose
// mode, as the file "mode" next to it says: ok, refuse or down; hang
// (never answers) and mute (no reply code) leave the outcome unknown. Each run
// appends its arguments and the include file it saw to "calls".
const fakeBirdc = `#!/bin/sh
dir=$(dirname "$0")
{ echo "$*"; cat "$OUT"; echo "--"; } >>"$dir/calls"
case $(cat "$dir/mode") in
ok)     printf '0001 BIRD 2.0.12 ready.\n0002-Reading configuration from /etc/bird/bird.conf\n0003 Reconfigured\n';;
refuse) printf '0001 BIRD 2.0.12 ready.\n0002-Reading configuration from /etc/bird/bird.conf\n8002 /etc/bird/fluxvm-vips.conf:3:1 syntax error\n'; exit 1;;
hang)   exec sleep 5;;
mute)   printf '0001 BIRD 2.0.12 ready.\n';;
down)   echo "Unable to connect to server control socket (/run/bird/bird.ctl): No such file or directory"; exit 1;;
esac
`

type fakeEnv struct {
	t      *testing.T
	dir    string
	a      *Adapter
	pub    *advert.Publisher
	logBuf bytes.Buffer
}

func newFakeEnv(t *testing.T) *fakeEnv {
	dir := t.TempDir()
	e := &fakeEnv{t: t, dir: dir}
	if err := os.WriteFile(filepath.Join(dir, "birdc"), []byte(fakeBirdc), 0o755); err != nil {
		t.Fatal(err)
	}
	e.mode("ok")
	out := filepath.Join(dir, "etc", "fluxvm-vips.conf")
	t.Setenv("OUT", out)
	e.a = &Adapter{
		Snapshot: filepath.Join(dir, "run", "service-advertisements.json"),
		Output:   out, Birdc: filepath.Join(dir, "birdc"), Socket: "/tmp/bird.ctl",
		Render: testRender, Retry: time.Hour, Timeout: 10 * time.Second,
		Log: slog.New(slog.NewTextHandler(&e.logBuf, nil)),
	}
	var err error
	if e.pub, err = advert.NewPublisher(advert.Options{Path: e.a.Snapshot}); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *fakeEnv) mode(m string) {
	if err := os.WriteFile(filepath.Join(e.dir, "mode"), []byte(m), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

func (e *fakeEnv) publish(entries ...advert.Entry) advert.Snapshot {
	s, _, err := e.pub.Publish(entries)
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

// calls returns what each birdc run saw since the last call, and forgets it.
func (e *fakeEnv) calls() []string {
	path := filepath.Join(e.dir, "calls")
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	os.Remove(path)
	c := strings.Split(string(data), "--\n")
	return c[:len(c)-1]
}

func (e *fakeEnv) output() string {
	data, err := os.ReadFile(e.a.Output)
	if err != nil {
		e.t.Fatal(err)
	}
	return string(data)
}

func TestAdapterConfiguresOnlyOnChange(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	s := e.publish(entry("203.0.113.10", "web", true), entry("2001:db8::10", "web", true))
	if err := e.a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	want := string(Render(s, testRender))
	calls := e.calls()
	if len(calls) != 1 || calls[0] != "-v -s /tmp/bird.ctl configure\n"+want {
		t.Fatalf("birdc runs %q, want one configure seeing\n%s", calls, want)
	}
	if e.output() != want {
		t.Errorf("output\n%s", e.output())
	}
	if st, err := os.Stat(e.a.Output); err != nil || st.Mode().Perm() != OutputMode {
		t.Errorf("output mode %v (%v)", st.Mode(), err)
	}

	// Nothing new: no run.
	if err := e.a.Sync(ctx); err != nil || len(e.calls()) != 0 {
		t.Errorf("an unchanged snapshot ran birdc (%v)", err)
	}
	// A new generation that changes nothing BIRD uses (a port): the
	// rendered file is the same, no run.
	withPort := entry("203.0.113.10", "web", true)
	withPort.Ports = []advert.Port{{Port: 443, Protocol: "tcp"}}
	if s2 := e.publish(withPort, entry("2001:db8::10", "web", true)); s2.Generation == s.Generation {
		t.Fatal("the publisher did not write a new generation")
	}
	if err := e.a.Sync(ctx); err != nil || len(e.calls()) != 0 {
		t.Errorf("a new generation with the same routes ran birdc (%v)", err)
	}
	// A withdrawal: configured with the route gone.
	s = e.publish(withPort, entry("2001:db8::10", "web", false))
	if err := e.a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	want = string(Render(s, testRender))
	if calls := e.calls(); len(calls) != 1 || strings.Contains(calls[0], "2001:db8::10") || !strings.HasSuffix(calls[0], want) {
		t.Errorf("after the withdrawal birdc saw %q", calls)
	}
}

func TestAdapterFirstSyncConfiguresUnchangedFile(t *testing.T) {
	e := newFakeEnv(t)
	s := e.publish(entry("203.0.113.10", "web", true))
	if err := os.MkdirAll(filepath.Dir(e.a.Output), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.a.Output, Render(s, testRender), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := e.a.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if calls := e.calls(); len(calls) != 1 {
		t.Errorf("birdc runs %q, want one: nothing says BIRD loaded the file", calls)
	}
}

func TestAdapterRefusedKeepsLastGoodFile(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	e.publish(entry("203.0.113.10", "web", true))
	if err := e.a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	e.calls()
	goodFile := e.output()

	e.mode("refuse")
	next := e.publish(entry("203.0.113.10", "web", true), entry("203.0.113.11", "api", true))
	err := e.a.Sync(ctx)
	var cerr *ConfigureError
	if !errors.As(err, &cerr) || cerr.Unreachable || !strings.Contains(err.Error(), "syntax error") || !strings.Contains(err.Error(), "previous") {
		t.Fatalf("refused configure: %v", err)
	}
	if calls := e.calls(); len(calls) != 1 || !strings.Contains(calls[0], "203.0.113.11") {
		t.Errorf("birdc saw %q, want the new file", calls)
	}
	if e.output() != goodFile {
		t.Errorf("after the refusal the file is\n%s\nwant the last good one\n%s", e.output(), goodFile)
	}

	// Not retried before -retry has passed.
	if err := e.a.Sync(ctx); err != nil || len(e.calls()) != 0 {
		t.Errorf("retried before the retry interval (%v)", err)
	}
	// BIRD accepts it later: the retry writes and configures again.
	e.mode("ok")
	e.a.failedAt = time.Now().Add(-2 * e.a.Retry)
	if err := e.a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if calls := e.calls(); len(calls) != 1 || e.output() != string(Render(next, testRender)) {
		t.Errorf("retry: birdc runs %q, file\n%s", calls, e.output())
	}
}

func TestAdapterBIRDDownKeepsNewFile(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	e.mode("down")
	s := e.publish(entry("2001:db8::10", "web", true))
	err := e.a.Sync(ctx)
	var cerr *ConfigureError
	if !errors.As(err, &cerr) || !cerr.Unreachable || !strings.Contains(err.Error(), "not reachable") {
		t.Fatalf("configure without BIRD: %v", err)
	}
	e.calls()
	// BIRD reads the new file when it starts.
	if want := string(Render(s, testRender)); e.output() != want {
		t.Errorf("file\n%s\nwant the new one\n%s", e.output(), want)
	}
	// Once BIRD answers, the retry configures though nothing changed.
	e.mode("ok")
	e.a.failedAt = time.Now().Add(-2 * e.a.Retry)
	if err := e.a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if calls := e.calls(); len(calls) != 1 {
		t.Errorf("retry: birdc runs %q", calls)
	}
	if err := e.a.Sync(ctx); err != nil || len(e.calls()) != 0 {
		t.Errorf("configured again without a change (%v)", err)
	}
}

// A birdc that times out, cannot be run or gives no reply code says
// nothing about what BIRD runs: BIRD may have loaded the new file, so the
// file stays (not the previous one) and the configure is retried.
func TestAdapterUnknownOutcomeKeepsNewFile(t *testing.T) {
	for _, mode := range []string{"hang", "missing", "mute"} {
		t.Run(mode, func(t *testing.T) {
			e := newFakeEnv(t)
			ctx := context.Background()
			e.publish(entry("203.0.113.10", "web", true))
			if err := e.a.Sync(ctx); err != nil {
				t.Fatal(err)
			}
			e.calls()
			birdc := e.a.Birdc
			switch mode {
			case "missing":
				e.a.Birdc = filepath.Join(e.dir, "no-such-birdc")
			case "hang":
				e.a.Timeout = 300 * time.Millisecond
				e.mode(mode)
			default:
				e.mode(mode)
			}
			next := e.publish(entry("203.0.113.10", "web", true), entry("203.0.113.11", "api", true))
			start := time.Now()
			err := e.a.Sync(ctx)
			if d := time.Since(start); d > 3*time.Second {
				t.Errorf("Sync took %v with a %v birdc timeout", d, e.a.Timeout)
			}
			var cerr *ConfigureError
			if !errors.As(err, &cerr) || !cerr.Unknown || cerr.Unreachable || strings.Contains(err.Error(), "previous") {
				t.Fatalf("configure with birdc %s: %v, want an unknown outcome", mode, err)
			}
			if want := string(Render(next, testRender)); e.output() != want {
				t.Errorf("file\n%s\nwant the new one kept\n%s", e.output(), want)
			}
			// The retry configures again, though the file is unchanged.
			e.a.Birdc, e.a.Timeout = birdc, 10*time.Second
			e.mode("ok")
			e.calls()
			e.a.failedAt = time.Now().Add(-2 * e.a.Retry)
			if err := e.a.Sync(ctx); err != nil {
				t.Fatal(err)
			}
			if calls := e.calls(); len(calls) != 1 || !strings.Contains(calls[0], "203.0.113.11") {
				t.Errorf("retry: birdc runs %q", calls)
			}
		})
	}
}

func TestAdapterMissingAndCorruptSnapshot(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	// No snapshot yet: an empty include file, so that bird.conf parses.
	if err := e.a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	empty := string(Render(advert.Snapshot{}, testRender))
	if e.output() != empty || len(e.calls()) != 1 {
		t.Errorf("without a snapshot: file\n%s", e.output())
	}
	// A corrupt snapshot: reported once, the file stays.
	if err := os.MkdirAll(filepath.Dir(e.a.Snapshot), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.a.Snapshot, []byte("{not json"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := e.a.Sync(ctx); !errors.Is(err, advert.ErrCorrupt) {
		t.Errorf("corrupt snapshot: %v", err)
	}
	if err := e.a.Sync(ctx); err != nil {
		t.Errorf("corrupt snapshot reported again: %v", err)
	}
	if e.output() != empty || len(e.calls()) != 0 {
		t.Errorf("corrupt snapshot changed the file or ran birdc:\n%s", e.output())
	}
	// The publisher replaces it: applied.
	s := e.publish(entry("203.0.113.10", "web", true))
	if err := e.a.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if e.output() != string(Render(s, testRender)) || len(e.calls()) != 1 {
		t.Errorf("after the publish: file\n%s", e.output())
	}
	// The snapshot disappears (reboot): routes stay.
	if err := os.Remove(e.a.Snapshot); err != nil {
		t.Fatal(err)
	}
	if err := e.a.Sync(ctx); err != nil || e.output() != string(Render(s, testRender)) || len(e.calls()) != 0 {
		t.Errorf("missing snapshot changed the routes (%v):\n%s", err, e.output())
	}
}

func TestRunFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-protocol", "bad-name"},
		{"-route-type", "drop"},
		{"-interval", "0s"},
		{"extra"},
	} {
		var out bytes.Buffer
		if code := run(context.Background(), args, &out); code != 2 || !strings.Contains(out.String(), "fluxvm-bird:") {
			t.Errorf("%q: exit %d, %s", args, code, out.String())
		}
	}
}

func TestRunOnce(t *testing.T) {
	e := newFakeEnv(t)
	e.publish(entry("203.0.113.10", "web", true))
	args := []string{"-once", "-snapshot", e.a.Snapshot, "-output", e.a.Output, "-birdc", e.a.Birdc}
	var out bytes.Buffer
	if code := run(context.Background(), args, &out); code != 0 || !strings.Contains(e.output(), "203.0.113.10/32") {
		t.Errorf("exit %d: %s", code, out.String())
	}
	e.mode("down")
	e.publish(entry("203.0.113.11", "web", true))
	out.Reset()
	if code := run(context.Background(), args, &out); code != 1 || !strings.Contains(out.String(), "not reachable") {
		t.Errorf("BIRD down: exit %d: %s", code, out.String())
	}
}
