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
// the joiner; the killed edge's SNAT address is routed to it, withdrawn,
// then routed to the survivor that took it over; every flow gets a row
// in each of the three tables, and, the edges running as a group that
// shares its flows, every flow answers in each; the lab is torn down.
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
	o.Replicator = daemontest.BuildCommand(t, "./cmd/fluxvm-replicator")
	o.Short, o.Flows = 30, 6
	var out bytes.Buffer
	if err := ScaleOut(context.Background(), &out, o); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	s := out.String()
	t.Log("\n" + s)
	routes := regexp.MustCompile(`(?m)^   router: VIP  10\.96\.0\.10/32 (.*)$`).FindAllStringSubmatch(s, -1)
	want := []struct {
		has  string
		vias int
	}{{"via 10.252.1.2 (e1) via 10.252.2.2 (e2) via 10.252.3.2 (e3)", 3}, {"", 2}, {"", 2}, {"via 10.252.4.2 (e4)", 3}}
	if len(routes) != len(want) {
		t.Fatalf("router's route shown %d times, want %d (start, leave, takeover, join)", len(routes), len(want))
	}
	for i, r := range routes {
		if !strings.Contains(r[1], want[i].has) || strings.Count(r[1], "via ") != want[i].vias {
			t.Errorf("route %d: %q, want %d nexthops including %q", i, r[1], want[i].vias, want[i].has)
		}
	}
	// The killed edge is the first flow's; its SNAT address: its own at
	// the start, withdrawn after the kill, then via the survivor that
	// took it over (the first other edge), still so after the join.
	victim := regexp.MustCompile(`(?m)^== (e\d) leaves: kill -9`).FindStringSubmatch(s)
	if victim == nil {
		t.Fatal("no kill step")
	}
	v := victim[1]
	by := "e1"
	if v == "e1" {
		by = "e2"
	}
	snat := regexp.MustCompile(`(?m)^   router: SNAT 10\.97\.0\.`+v[1:]+`/32 (.*)$`).FindAllStringSubmatch(s, -1)
	wantSNAT := []string{
		"via 10.252." + v[1:] + ".2 (" + v + ")   " + v + "'s own",
		"withdrawn   " + v + "'s own",
		"via 10.252." + by[1:] + ".2 (" + by + ")   " + v + "'s, taken over by " + by,
		"via 10.252." + by[1:] + ".2 (" + by + ")   " + v + "'s, taken over by " + by,
	}
	if len(snat) != len(wantSNAT) {
		t.Fatalf("router's route to %s's SNAT address shown %d times, want %d", v, len(snat), len(wantSNAT))
	}
	for i, r := range snat {
		if r[1] != wantSNAT[i] {
			t.Errorf("SNAT route %d: %q, want %q", i, r[1], wantSNAT[i])
		}
	}
	if !strings.Contains(s, "router: SNAT 10.97.0.4/32 via 10.252.4.2 (e4)   e4's own") {
		t.Error("the joining edge's SNAT route not shown via itself")
	}
	if !regexp.MustCompile(`the router routes 10\.97\.0\.\d via e\d \d+(\.\d+)?m?s after the POST`).MatchString(s) {
		t.Error("no takeover time")
	}
	if n := len(regexp.MustCompile(`(?m)^   \d+ +cli\d `).FindAllString(s, -1)); n != 3*o.Flows {
		t.Errorf("%d flow rows, want %d", n, 3*o.Flows)
	}
	// The group shares its flows: every long-lived flow answers in each
	// of the three tables (at the start, after the leave and takeover,
	// after the join).
	answer := regexp.MustCompile(`(?m)^   (\d+) of (\d+) flows answer`).FindAllStringSubmatch(s, -1)
	if len(answer) != 3 {
		t.Fatalf("%d flow tables, want 3", len(answer))
	}
	for i, a := range answer {
		if a[1] != a[2] {
			t.Errorf("table %d: %s of %s flows answer; a group breaks none", i, a[1], a[2])
		}
	}
	if !strings.Contains(s, "== teardown:") {
		t.Error("no teardown line")
	}
}
