//go:build linux

package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
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
			stopGroupOnCancel(cmd)
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

// stopGroupOnCancel makes cmd a process group of its own and, when its
// context ends, stops the whole group: SIGTERM (the scripts pass it on to
// fluxvm-lab, which tears its lab down and stops its fluxvmd), SIGKILL
// after 30 s; Wait returns at most 40 s after the cancel even if a
// process left behind holds the output pipe.
func stopGroupOnCancel(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error {
		pgid := cmd.Process.Pid
		err := syscall.Kill(-pgid, syscall.SIGTERM)
		time.AfterFunc(30*time.Second, func() { syscall.Kill(-pgid, syscall.SIGKILL) })
		return err
	}
	cmd.WaitDelay = 40 * time.Second
}

// TestStopGroupOnCancel: a script whose child (in the script's group)
// ignores nothing and holds the output pipe is stopped as a whole when
// the context ends, and the child ran its SIGTERM handler.
func TestStopGroupOnCancel(t *testing.T) {
	dir := t.TempDir()
	marker := filepath.Join(dir, "child-stopped")
	script := `sh -c 'trap "touch ` + marker + `; exit 0" TERM; echo child up; while :; do sleep 0.1; done' & wait`
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-c", script)
	stopGroupOnCancel(cmd)
	var out bytes.Buffer
	cmd.Stdout = &out
	start := time.Now()
	cmd.Run()
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Run returned %v after a 500ms timeout", d)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat(marker); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the script's child got no SIGTERM (output %q)", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestAllScript runs scripts/test-service-fabric-all.sh over stand-in
// scripts: FLUXVM_CONFIG names the node's configuration for it as for the
// readiness script, and a SIGTERM stops the running script at once (it
// gets a SIGTERM) and skips the rest.
func TestAllScript(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("test-service-fabric-all.sh wants root")
	}
	dir := t.TempDir()
	log := filepath.Join(dir, "log")
	if err := os.MkdirAll(filepath.Join(dir, "scripts"), 0o755); err != nil {
		t.Fatal(err)
	}
	all, err := os.ReadFile("../../scripts/test-service-fabric-all.sh")
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, "scripts", name), []byte("#!/usr/bin/env bash\n"+body), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write("test-service-fabric-all.sh", string(all))
	for _, n := range []string{"lab", "perf", "slo", "rss", "rss-affinity"} {
		write("test-service-fabric-"+n+".sh", `echo "ran $(basename "$0")" >>"$LOG"; [ -z "${HANG:-}" ] || { trap 'kill $!; echo "term $(basename "$0")" >>"$LOG"; exit 143' TERM; sleep 30 >/dev/null 2>&1 & wait; }`+"\n")
	}
	write("test-production-readiness.sh", `echo "ran readiness" >>"$LOG"`+"\n")
	cfg := filepath.Join(dir, "node.toml")
	if err := os.WriteFile(cfg, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{"PATH=" + os.Getenv("PATH"), "LOG=" + log}

	cmd := exec.Command(filepath.Join(dir, "scripts", "test-service-fabric-all.sh"), "-smoke")
	cmd.Env = append(env, "FLUXVM_CONFIG="+cfg)
	out, err := cmd.CombinedOutput()
	if b, _ := os.ReadFile(log); err != nil || !strings.Contains(string(b), "ran readiness") {
		t.Errorf("with FLUXVM_CONFIG=%s: %v, the readiness script did not run:\n%s\nlog:\n%s", cfg, err, out, b)
	}
	os.Remove(log)

	cmd = exec.Command(filepath.Join(dir, "scripts", "test-service-fabric-all.sh"))
	cmd.Env = append(env, "HANG=1", "FLUXVM_CONFIG="+cfg)
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for b, _ := os.ReadFile(log); !strings.Contains(string(b), "ran test-service-fabric-lab.sh"); b, _ = os.ReadFile(log) {
		if time.Now().After(deadline) {
			t.Fatalf("the lab script did not start:\n%s", buf.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // the stand-in's trap is set
	start := time.Now()
	cmd.Process.Signal(syscall.SIGTERM)
	cmd.Wait()
	b, _ := os.ReadFile(log)
	if d := time.Since(start); d > 5*time.Second || cmd.ProcessState.ExitCode() != 130 {
		t.Errorf("SIGTERM: exit %d after %v, want 130 at once:\n%s", cmd.ProcessState.ExitCode(), d, buf.String())
	}
	if !strings.Contains(string(b), "term test-service-fabric-lab.sh") || strings.Contains(string(b), "ran test-service-fabric-perf.sh") {
		t.Errorf("SIGTERM: the running script was not stopped or the rest ran; log:\n%s", b)
	}
}

// scriptVars returns the NAME=VALUE assignments at the start of the lines
// of script (the last one of each name wins; comments cut).
func scriptVars(t *testing.T, script string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "scripts", script))
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		line, _, _ = strings.Cut(strings.TrimSpace(line), "#")
		for _, f := range strings.Fields(line) {
			k, v, ok := strings.Cut(f, "=")
			if !ok || k == "" || strings.ToUpper(k) != k || strings.ContainsAny(k, "$[") {
				break
			}
			vars[k] = strings.Trim(v, `"`)
		}
	}
	return vars
}

// TestFlagDefaultsMatchScripts: fluxvm-lab's gate flags default to the
// bounds the gate scripts state (the full runs), so that a run without
// the script gates the same way.
func TestFlagDefaultsMatchScripts(t *testing.T) {
	slo := scriptVars(t, "test-service-fabric-slo.sh")
	def := scenario.DefaultSLOThresholds()
	for name, b := range map[string]scenario.LatencyBound{"CONNECT_P50": def.ConnectP50, "CONNECT_P99": def.ConnectP99, "CONN_P50": def.ConnP50, "CONN_P99": def.ConnP99} {
		var got scenario.LatencyBound
		if err := got.Set(slo[name]); err != nil || got != b {
			t.Errorf("slo: script %s=%q (%v), flag default %v", name, slo[name], err, b)
		}
	}
	if slo["MIN_RATE_RATIO"] != fmt.Sprint(def.MinRateRatio) || slo["MAX_ERRORS"] != fmt.Sprint(def.MaxErrors) {
		t.Errorf("slo: script MIN_RATE_RATIO=%s MAX_ERRORS=%s, flag defaults %v %v", slo["MIN_RATE_RATIO"], slo["MAX_ERRORS"], def.MinRateRatio, def.MaxErrors)
	}
	if rss := scriptVars(t, "test-service-fabric-rss.sh"); rss["MAX_RSS"] != rssMaxRSS || rss["MAX_MAP"] != rssMaxMap {
		t.Errorf("rss: script MAX_RSS=%s MAX_MAP=%s, flag defaults %s %s", rss["MAX_RSS"], rss["MAX_MAP"], rssMaxRSS, rssMaxMap)
	}
	// The full run's bounds are the last assignments of the script.
	aff := scriptVars(t, "test-service-fabric-rss-affinity.sh")
	want := map[string]string{"TIER": "L", "ENTRIES": "1000000", "MAX_RSS": fmt.Sprint(affinityMaxRSS), "MAX_MAP": fmt.Sprint(affinityMaxMap),
		"MAX_GC": affinityMaxGC.String(), "MIN_KEPT": fmt.Sprint(affinityMinKept)}
	for k, v := range want {
		if aff[k] != v {
			t.Errorf("rss-affinity: script %s=%s, flag default %s", k, aff[k], v)
		}
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
		{in: "S= 64 ", want: map[string]uint64{"S": 64 << 20}},
		{in: "S=64abc", wantErr: true},
		{in: "S=64MiB", wantErr: true},
		{in: "L=1.5GiB", wantErr: true},
		{in: "S=-1", wantErr: true},
		{in: "S=NaN", wantErr: true},
		{in: "S=Inf", wantErr: true},
		{in: "S=+Inf", wantErr: true},
		{in: "S=1e300", wantErr: true},
		{in: "S=64,", wantErr: true},
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
