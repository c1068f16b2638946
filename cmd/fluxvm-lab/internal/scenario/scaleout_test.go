//go:build linux

package scenario

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/ecmplab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

func TestScaleOutOptions(t *testing.T) {
	ok := DefaultScaleOutOptions()
	ok.Fluxvmd, ok.Adapter = "fluxvmd", "fluxvm-bird"
	for _, tc := range []struct {
		name string
		edit func(*ScaleOutOptions)
		want string
	}{
		{"defaults", func(*ScaleOutOptions) {}, ""},
		{"no binaries", func(o *ScaleOutOptions) { o.Fluxvmd = "" }, "binaries are required"},
		{"one edge", func(o *ScaleOutOptions) { o.Edges = 1 }, "edges 1 out of 2..8"},
		{"too many edges", func(o *ScaleOutOptions) { o.Edges = 9 }, "edges 9 out of 2..8"},
		{"no flows", func(o *ScaleOutOptions) { o.Flows = 1 }, "flows 1 out of"},
		{"short", func(o *ScaleOutOptions) { o.Short = 0 }, "short 0 out of"},
		{"timeout", func(o *ScaleOutOptions) { o.Timeout = time.Second }, "timeout 1s out of"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := ok
			tc.edit(&o)
			err := o.validate()
			if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("validate: %v, want %q", err, tc.want)
			}
		})
	}
}

// TestScaleOut runs the scenario with little traffic: the router's route
// to each VIP names every edge, then the survivors after the kill, then
// the joiner; every flow gets a row in each of the three tables; the
// lab is torn down.
func TestScaleOut(t *testing.T) {
	testenv.RequirePrivileged(t)
	if _, _, err := ecmplab.FindBIRD(); err != nil {
		if testenv.Required() {
			t.Fatalf("%v (%s=1 is set)", err, testenv.RequireEnv)
		}
		t.Skipf("skipping: %v", err)
	}
	o := DefaultScaleOutOptions()
	o.Fluxvmd, o.Adapter = daemontest.Build(t), daemontest.BuildCommand(t, "./cmd/fluxvm-bird")
	o.Short, o.Flows = 30, 6
	var out bytes.Buffer
	if err := ScaleOut(context.Background(), &out, o); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	s := out.String()
	t.Log("\n" + s)
	routes := regexp.MustCompile(`(?m)^   router: 10\.96\.0\.10/32 (.*)$`).FindAllStringSubmatch(s, -1)
	want := []struct {
		has  string
		vias int
	}{{"via 10.252.1.2 (e1) via 10.252.2.2 (e2) via 10.252.3.2 (e3)", 3}, {"", 2}, {"via 10.252.4.2 (e4)", 3}}
	if len(routes) != len(want) {
		t.Fatalf("router's route shown %d times, want %d (start, leave, join)", len(routes), len(want))
	}
	for i, r := range routes {
		if !strings.Contains(r[1], want[i].has) || strings.Count(r[1], "via ") != want[i].vias {
			t.Errorf("route %d: %q, want %d nexthops including %q", i, r[1], want[i].vias, want[i].has)
		}
	}
	if n := len(regexp.MustCompile(`(?m)^   \d+ +cli\d `).FindAllString(s, -1)); n != 3*o.Flows {
		t.Errorf("%d flow rows, want %d", n, 3*o.Flows)
	}
	if !strings.Contains(s, "== teardown:") {
		t.Error("no teardown line")
	}
}
