//go:build linux

package scenario

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestDemo runs the demo with little traffic and no terminal: it ends
// with the FluxScope table of the busiest flows (service web, forwarded,
// packets both ways), and draws no progress bar.
func TestDemo(t *testing.T) {
	testenv.RequirePrivileged(t)
	o := DefaultDemoOptions()
	o.Connections, o.LongLived, o.TopFlows = 40, 4, 5
	var out bytes.Buffer
	if err := Demo(context.Background(), &out, o); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	s := out.String()
	t.Log("\n" + s)
	if strings.Contains(s, "\r") {
		t.Error("progress bar drawn without a terminal")
	}
	_, table, ok := strings.Cut(s, "== FluxScope: ")
	if !ok {
		t.Fatal("no FluxScope table")
	}
	// 40 + 60 north-south + 4 long-lived + 20 after the drain + 4 UDP.
	if m := regexp.MustCompile(`^(\d+) flow records \((\d+) forwarded`).FindStringSubmatch(table); m == nil || len(m[1]) < 3 {
		t.Errorf("table head %q: want at least 100 records", strings.SplitN(table, "\n", 2)[0])
	}
	rows := regexp.MustCompile(`(?m)^   web +\S+ +\S+ +(vm|ns) +(\d+)/(\d+) +\d+/\d+  forwarded$`).FindAllStringSubmatch(table, -1)
	if len(rows) != 5 {
		t.Errorf("%d rows of web flows forwarded with counts, want 5:\n%s", len(rows), table)
	}
	for _, r := range rows {
		if r[2] == "0" || r[3] == "0" {
			t.Errorf("row without packets both ways: %q", r[0])
		}
	}
}
