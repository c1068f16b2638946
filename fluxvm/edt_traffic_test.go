//go:build linux

package fluxvm

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// TestDataplaneEDTNorthSouth: EDT through the control plane and the
// north-south path, with real TCP and no fq (this kernel has none): an
// external client downloads from two north-south services at once, one
// applied with max_egress_mbps = 50. Its replies are translated at the
// backends' VM edge and paced as they leave through the uplink's ns_out
// (found by their source, the VIP); the cap must hold within 10% while the
// other service runs at full speed, and re-applying the service without
// the cap must speed up the same connection.
func TestDataplaneEDTNorthSouth(t *testing.T) {
	if testing.Short() {
		t.Skip("a 12 s traffic test")
	}
	e := newNSEnv(t)
	e.opts.EDT.Enabled = true
	d := e.open(t)
	for _, vm := range e.backends {
		stop, err := vm.ServeBulk(9000)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
	}
	const capMbps = 50
	service := func(name string, vip netip.Addr, mbps uint32) Service {
		s := Service{Name: name, Exposure: ExposureNorthSouth, Mode: ModeNAT, VIPs: []netip.Addr{vip},
			Ports: []ServicePort{{Port: 80, Protocol: TCP}}, MaxEgressMbps: mbps}
		for _, vm := range e.backends {
			s.Backends = append(s.Backends, Backend{Address: vm.Addr4, Port: 9000})
		}
		return s
	}
	capped := service("capped", netip.MustParseAddr("10.96.7.1"), capMbps)
	free := service("free", netip.MustParseAddr("10.96.7.2"), 0)
	for _, s := range []Service{capped, free} {
		if _, err := d.ApplyService(context.Background(), s); err != nil {
			t.Fatalf("apply %s: %v", s.Name, err)
		}
	}
	var dl [2]*lab.Download
	for i, s := range []Service{capped, free} {
		var err error
		if dl[i], err = e.lab.External.StartDownload(netip.AddrPortFrom(s.VIPs[0], 80), 3*time.Second); err != nil {
			t.Fatalf("download from %s: %v", s.Name, err)
		}
		defer dl[i].Close()
	}
	time.Sleep(time.Second)
	a, b := dl[0].Bytes(), dl[1].Bytes()
	time.Sleep(8 * time.Second)
	got := [2]float64{float64(dl[0].Bytes()-a) * 8 / 8 / 1e6, float64(dl[1].Bytes()-b) * 8 / 8 / 1e6}
	st, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("north-south, capped at %d Mbit/s: %.1f Mbit/s; uncapped at the same time: %.0f Mbit/s; edt_horizon drops %d",
		capMbps, got[0], got[1], st.Drops["edt_horizon"])
	if got[0] < 0.9*capMbps || got[0] > 1.1*capMbps {
		t.Errorf("capped service: %.1f Mbit/s over 8 s; want %d within 10%%", got[0], capMbps)
	}
	if got[1] < 20*capMbps {
		t.Errorf("uncapped service: %.0f Mbit/s; want full speed (over %d)", got[1], 20*capMbps)
	}
	if st.Drops["edt_horizon"] == 0 {
		t.Error("no edt_horizon drops: the cap was never enforced")
	}

	capped.MaxEgressMbps = 0
	if _, err := d.ApplyService(context.Background(), capped); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if after := dl[0].Mbps(2 * time.Second); after < 20*capMbps {
		t.Errorf("cap removed: %.0f Mbit/s on the same connection; want full speed", after)
	}
	for i, x := range dl {
		if err := x.Err(); err != nil {
			t.Errorf("download %d ended: %v", i, err)
		}
	}
}
