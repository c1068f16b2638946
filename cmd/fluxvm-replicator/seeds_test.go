//go:build linux

package main

import (
	"bytes"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// setSeed rewrites the edge's configuration line of a seed.
func (e *edge) setSeed(t *testing.T, from, to string) {
	t.Helper()
	raw, err := os.ReadFile(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(raw, []byte(from+"\n")) {
		t.Fatalf("%s: no %q in the configuration", e.name, from)
	}
	if err := os.WriteFile(e.cfg, bytes.Replace(raw, []byte(from+"\n"), []byte(to+"\n"), 1), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestReplicatorRefusesOtherSeeds: a standby whose maglev_seed, or whose
// hash_seed, differs from the active's gets nothing from the real
// replicator (one round, -once): it exits non-zero with a message naming
// both ends and both seeds, and the standby's flow maps stay empty. The
// control, in the same run: the standby restarted with the active's seeds
// gets the active's flows from the next round.
func TestReplicatorRefusesOtherSeeds(t *testing.T) {
	testenv.RequirePrivileged(t)
	fluxvmd := daemontest.Build(t)
	replBin := daemontest.BuildCommand(t, "./cmd/fluxvm-replicator")
	l := newHALab(t)
	pins := testenv.PinRoot(t)
	a, b := newEdge(t, "a", l.a, pins, 2), newEdge(t, "b", l.b, pins, 1)
	b.setSeed(t, "maglev_seed = 42", "maglev_seed = 43")
	a.start(t, fluxvmd)
	b.start(t, fluxvmd)
	l.svc = fluxvm.Service{Name: "web", Exposure: fluxvm.ExposureNorthSouth, VIPs: []netip.Addr{failVIP},
		Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}}}
	for _, be := range l.bes {
		l.svc.Backends = append(l.svc.Backends, fluxvm.Backend{Address: be, Port: 8080})
	}
	for _, e := range []*edge{a, b} {
		e.request(t, "POST", "/v1/network/services", l.svc, nil)
	}
	var flows []*flowConn
	for range 10 {
		flows = append(flows, l.dial(t, false))
	}
	once := func() (string, string, int) {
		t.Helper()
		cmd := exec.Command(replBin, "-active", "http://10.252.1.2:7788", "-standby", "http://10.252.2.2:7788", "-services", "web", "-once")
		cmd.Env = append(os.Environ(), "FLUXVM_ADMIN_TOKEN="+token)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := l.rtr.Do(cmd.Run)
		if _, exited := err.(*exec.ExitError); err != nil && !exited {
			t.Fatal(err)
		}
		return stdout.String(), stderr.String(), cmd.ProcessState.ExitCode()
	}
	onB := func() int {
		t.Helper()
		es, err := b.conntrack(t).List(conntrack.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		return len(es)
	}

	for _, tc := range []struct {
		name, want string
		restart    func()
	}{
		{name: "other maglev_seed", want: "edge standby http://10.252.2.2:7788 has hash_seed=0x309 maglev_seed=0x2b, active http://10.252.1.2:7788 has hash_seed=0x309 maglev_seed=0x2a"},
		{name: "other hash_seed", want: "edge standby http://10.252.2.2:7788 has hash_seed=0x30a maglev_seed=0x2a, active http://10.252.1.2:7788 has hash_seed=0x309 maglev_seed=0x2a",
			restart: func() {
				b.setSeed(t, "maglev_seed = 43", "maglev_seed = 42")
				b.setSeed(t, "hash_seed = 777", "hash_seed = 778")
			}},
	} {
		if tc.restart != nil {
			b.d.Stop()
			tc.restart()
			b.start(t, fluxvmd)
		}
		out, errOut, code := once()
		if code == 0 || !strings.Contains(errOut, "refusing to replicate") || !strings.Contains(errOut, tc.want) ||
			!strings.Contains(out, `"error":"refusing to replicate`) {
			t.Errorf("%s: exit %d\nstdout %s\nstderr %s\nwant a refusal naming %q", tc.name, code, out, errOut, tc.want)
		}
		if n := onB(); n != 0 {
			t.Errorf("%s: the standby holds %d flows after a refused round", tc.name, n)
		}
	}

	// The control: the same seeds, and the flows reach the standby.
	b.d.Stop()
	b.setSeed(t, "hash_seed = 778", "hash_seed = 777")
	b.start(t, fluxvmd)
	if out, errOut, code := once(); code != 0 {
		t.Fatalf("same seeds: exit %d\n%s%s", code, out, errOut)
	}
	if n := onB(); n < len(flows) {
		t.Errorf("same seeds: the standby holds %d flows, want the active's %d", n, len(flows))
	}
}
