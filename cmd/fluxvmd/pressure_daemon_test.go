package main

import (
	"encoding/json"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestDaemonMapPressure drives map pressure control end to end through
// the real binary at tier S: a long-lived connection through the VIP,
// fluxvm_fct4 filled to 97% with established flows of the same service
// seen 90 s ago, the level hard in /metrics and the status, then a round
// over REST: the compacting reload keeps 79% (one point below the soft
// threshold), drops only those stale flows, pins a new map and switches
// the links; the live connection still echoes and a new one works. The
// controller reads the levels once an hour here (pressure_interval): the
// rounds are the test's.
func TestDaemonMapPressure(t *testing.T) {
	testenv.RequirePrivileged(t)
	start := time.Now()
	bin := buildDaemon(t)
	l, cli, be := clientAndBackend(t)

	// The GC timer at its longest: the rounds' GCs are the only ones.
	cfg, pinRoot := writeConfig(t, t.TempDir(), `conntrack_gc_interval = "1h"
pressure_soft_percent = 80
pressure_hard_percent = 95
pressure_interval = "1h"
`)
	d := startDaemon(t, bin, cfg, l)
	vip := netip.MustParseAddr("10.96.0.10")
	applyWeb(t, d, vip, be)
	vipPort := netip.AddrPortFrom(vip, 80)
	live, err := cli.DialTCP(vipPort, 3*time.Second)
	if err != nil {
		t.Fatalf("through the VIP: %v\n%s", err, d.Out)
	}
	defer live.Close()
	if err := live.Echo([]byte("before"), 3*time.Second); err != nil {
		t.Fatal(err)
	}

	// 1. The live flow's entry in the pinned fluxvm_fct4.
	pin := filepath.Join(pinRoot, "maps", "fluxvm_fct4")
	ct4, err := ebpf.LoadPinnedMap(pin, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ct4.Close()
	capacity := int(ct4.MaxEntries())
	if capacity != 65536 {
		t.Fatalf("fluxvm_fct4 holds %d entries at tier S, want 65,536", capacity)
	}
	oldID := mapID(t, ct4)
	vipWord, cliWord := bpf.AddrWords(vip)[0], bpf.AddrWords(cli.Addr4)[0]
	var liveKey bpf.Tuple4
	var liveVal bpf.CTValue
	found := 0
	var k bpf.Tuple4
	var v bpf.CTValue
	for it := ct4.Iterate(); it.Next(&k, &v); {
		if k.Daddr == vipWord && k.Saddr == cliWord && k.Proto == 6 && k.Dport == bpf.Port(80) {
			liveKey, liveVal = k, v
			found++
		}
	}
	if found != 1 || bpf.CTState(liveVal.State) != bpf.CTTCPEstablished {
		t.Fatalf("the live flow in fluxvm_fct4: %d entries (%+v), want one established", found, liveVal)
	}
	t.Logf("live flow: service %d, backend %d, flags %#x", liveVal.ServiceId, liveVal.BackendId, liveVal.Flags)

	// fill writes n established flows of the live flow's service and
	// backend from distinct clients of base (172.16.0.0/12), seen age ago,
	// with their deadline at now+ttl (in the past when ttl < 0).
	fill := func(base netip.Addr, n int, age, ttl time.Duration) {
		t.Helper()
		now, err := conntrack.Now()
		if err != nil {
			t.Fatal(err)
		}
		age = min(age, now/2) // a machine up for less than 3 minutes
		keys, vals := make([]bpf.Tuple4, n), make([]bpf.CTValue, n)
		b := base.As4()
		first := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
		for i := range keys {
			a := first + 1 + uint32(i)
			client := netip.AddrFrom4([4]byte{byte(a >> 24), byte(a >> 16), byte(a >> 8), byte(a)})
			keys[i] = bpf.Tuple4{Saddr: bpf.AddrWords(client)[0], Daddr: vipWord, Sport: bpf.Port(40000), Dport: liveKey.Dport, Proto: 6}
			vals[i] = bpf.CTValue{ServiceId: liveVal.ServiceId, BackendId: liveVal.BackendId,
				CreatedNs: uint64(now - age), LastSeenNs: uint64(now - age), DeadlineNs: uint64(now + ttl),
				State: uint8(bpf.CTTCPEstablished), Flags: liveVal.Flags, PolicyRev: liveVal.PolicyRev}
		}
		if got, err := ct4.BatchUpdate(keys, vals, nil); err != nil || got != n {
			t.Fatalf("fill fluxvm_fct4: %d of %d written: %v", got, n, err)
		}
	}

	// 2. 97%: established flows seen 90 s ago, an hour to live. The live
	// flow is the most recently seen.
	fillAt := time.Now()
	n := capacity * 97 / 100
	fill(netip.MustParseAddr("172.16.0.0"), n, 90*time.Second, time.Hour)
	if err := live.Echo([]byte("full"), 3*time.Second); err != nil {
		t.Fatalf("live connection at 97%%: %v", err)
	}
	filled := time.Since(fillAt)

	// 3. Hard, in /metrics and in the status.
	const gauge = `fluxvm_map_pressure{map="fluxvm_fct4"}`
	if p := metric(t, d, gauge); p < 0.95 {
		t.Fatalf("%s %g after filling %d entries, want >= 0.95", gauge, p, n)
	}
	if st := daemonStatus(t, d); st.Pressure == nil || st.Pressure.Level != fluxvm.PressureHard {
		t.Fatalf("status pressure %+v, want level hard", st.Pressure)
	}

	// 4. A round now: the compacting reload.
	body, err := d.Request("POST", "/v1/network/services/pressure/reconcile", nil)
	if err != nil {
		t.Fatalf("%v\n%s", err, d.Out)
	}
	var r fluxvm.PressureRound
	if err := json.Unmarshal(body, &r); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	if r.Level != fluxvm.PressureHard || r.Compaction == nil {
		t.Fatalf("round %s: want level hard and a compaction", body)
	}
	pc := r.Compaction
	if pc.Error != "" || pc.Deferred != "" || len(pc.Maps) != 1 || pc.Maps[0].Map != "fluxvm_fct4" || len(pc.Links) == 0 {
		t.Fatalf("compaction %s: want fluxvm_fct4 rebuilt and links switched", body)
	}
	m := pc.Maps[0]
	wantKept := capacity * (fluxvm.DefaultPressureSoftPercent - 1) / 100 // 51,773
	if m.Kept < wantKept || m.Kept > wantKept+m.CaughtUp+16 {
		t.Errorf("kept %d (caught up %d), want %d", m.Kept, m.CaughtUp, wantKept)
	}
	if m.DroppedBy["established"] <= 0 || m.Dropped != m.DroppedBy["established"] || m.Kept+m.Dropped < n {
		t.Errorf("dropped %d %v of %d read, want only established flows, %d in all", m.Dropped, m.DroppedBy, m.Entries, n+1-wantKept)
	}
	if m.MapID == m.PreviousMapID || m.PreviousMapID != oldID {
		t.Errorf("map ids: %d, previously %d; the pin named %d", m.MapID, m.PreviousMapID, oldID)
	}
	if p := r.After["fluxvm_fct4"]; p >= 95 {
		t.Errorf("fluxvm_fct4 at %.1f%% after the round", p)
	}
	t.Logf("round %v: compaction %v (switch %v), entries %d, kept %d, dropped %d %v, caught up %d, links %d, after %.2f%%; fill %v",
		r.Duration.Duration, pc.Duration.Duration, pc.Switch.Duration, m.Entries, m.Kept, m.Dropped, m.DroppedBy, m.CaughtUp, len(pc.Links), r.After["fluxvm_fct4"], filled)

	// 5. The live connection, the most recently seen flow, was kept.
	if err := live.Echo([]byte("after"), 3*time.Second); err != nil {
		t.Fatalf("live connection after the round: %v\n%s", err, d.Out)
	}
	// 79% kept; the only traffic since is the live flow (already in the
	// map), so the fill stays below the soft threshold.
	if p := metric(t, d, gauge); p >= 0.80 {
		t.Errorf("%s %g after the round, want < 0.80", gauge, p)
	}
	ct4b, err := ebpf.LoadPinnedMap(pin, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ct4b.Close()
	if id := mapID(t, ct4b); id == oldID || id != m.MapID {
		t.Errorf("the pin names map %d after the round, was %d, the round says %d", id, oldID, m.MapID)
	}
	var got bpf.CTValue
	if err := ct4b.Lookup(&liveKey, &got); err != nil {
		t.Errorf("the live flow in the new map: %v", err)
	}

	// 6. A new connection after the round.
	c2, err := cli.DialTCP(vipPort, 3*time.Second)
	if err != nil {
		t.Fatalf("new connection after the round: %v\n%s", err, d.Out)
	}
	defer c2.Close()
	if err := c2.Echo([]byte("new"), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := live.Echo([]byte("end"), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	t.Logf("took %v", time.Since(start))
}

// mapID is m's kernel id.
func mapID(t *testing.T, m *ebpf.Map) ebpf.MapID {
	t.Helper()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, ok := info.ID()
	if !ok {
		t.Fatal("the kernel gives no map id")
	}
	return id
}
