//go:build linux

package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/cmd/fluxvm-lab/internal/scenario"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestGatesSmoke runs the smoke versions of the gate scripts (SMOKE=1:
// about 10 s each) as CI would, with the thresholds and bounds the scripts
// state, and one run with a bound no daemon meets, which must fail with
// the figure. Privileged: namespaces, BPF, the real fluxvmd.
func TestGatesSmoke(t *testing.T) {
	testenv.RequirePrivileged(t)
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, script string
		args         []string
		nft          bool
		wantExit     int
		want         []string
	}{
		{name: "slo", script: "test-service-fabric-slo.sh", nft: true,
			want: []string{"connect p99 µs", "connections/s", "errors (both paths", "SLO: PASS"}},
		{name: "rss", script: "test-service-fabric-rss.sh",
			want: []string{"RSS gate", "     S       200      2000", "RSS: PASS"}},
		{name: "rss-affinity", script: "test-service-fabric-rss-affinity.sh",
			want: []string{"tier M, 100000 affinity entries", "scanned 100001, expired 0", "RSS-affinity: PASS"}},
		{name: "rss-bound-fails", script: "test-service-fabric-rss.sh", args: []string{"-max-rss", "S=1"}, wantExit: 1,
			want: []string{"RSS: FAIL: tier S: daemon RSS", "> 1.0 MiB", "rss gate failed"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := exec.LookPath("nft"); tc.nft && err != nil {
				t.Skip("nft not found")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, filepath.Join(root, "scripts", tc.script), tc.args...)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "SMOKE=1")
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			start := time.Now()
			err := cmd.Run()
			exit := cmd.ProcessState.ExitCode()
			t.Logf("%s: exit %d in %s", tc.script, exit, time.Since(start).Round(time.Millisecond))
			if err != nil && exit != tc.wantExit {
				t.Fatalf("%s: %v, want exit %d:\n%s", tc.script, err, tc.wantExit, out.String())
			}
			if exit != tc.wantExit {
				t.Fatalf("%s: exit %d, want %d:\n%s", tc.script, exit, tc.wantExit, out.String())
			}
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("%s: output lacks %q:\n%s", tc.script, w, out.String())
				}
			}
		})
	}
}

func TestParseTierBounds(t *testing.T) {
	cases := []struct {
		in      string
		want    map[string]uint64
		wantErr bool
	}{
		{in: "", want: map[string]uint64{}},
		{in: "S=64", want: map[string]uint64{"S": 64 << 20}},
		{in: "S=64,M=96.5, L=720", want: map[string]uint64{"S": 64 << 20, "M": 96<<20 + 1<<19, "L": 720 << 20}},
		{in: "X=64", wantErr: true},
		{in: "S", wantErr: true},
		{in: "S=0", wantErr: true},
		{in: "S=abc", wantErr: true},
	}
	for _, tc := range cases {
		got, err := scenario.ParseTierBounds(tc.in)
		if (err != nil) != tc.wantErr {
			t.Errorf("ParseTierBounds(%q) error %v, want error %v", tc.in, err, tc.wantErr)
			continue
		}
		if err == nil && len(got) != len(tc.want) {
			t.Errorf("ParseTierBounds(%q) = %v, want %v", tc.in, got, tc.want)
		}
		for k, v := range tc.want {
			if got[k] != v {
				t.Errorf("ParseTierBounds(%q)[%s] = %d, want %d", tc.in, k, got[k], v)
			}
		}
	}
}
