package bpf

import (
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// edtHorizonE2E is the horizon TestEDTTraffic polices with, the default a
// node gets (fluxvm.DefaultEDTHorizon). Without fq the horizon is the
// burst a sender may exceed the rate by; TCP at line rate over a tiny RTT
// needs it large to recover from the policer's drops without timeouts
// (measured here, 50 Mbit/s cap: 20 ms -> 6-12 Mbit/s, 100 ms -> 25,
// 200 ms -> 47, 250 ms -> 49.7-50.7).
const edtHorizonE2E = 250 * time.Millisecond

// TestEDTTraffic: real TCP through the VM edges' TC programs, without fq
// (this kernel has none; nothing holds a packet until its departure, the
// horizon polices). A client VM downloads from two services at once: one
// capped at 50 Mbit/s must measure within 10% of the cap over 10 s while
// the other runs at full speed; removing the cap lifts the same connection
// to full speed, which is never reset.
func TestEDTTraffic(t *testing.T) {
	if testing.Short() {
		t.Skip("a 14 s traffic test")
	}
	l := lab.NewForTest(t)
	client := l.AddVMForTest(t, 1)
	vmA, vmB := l.AddVMForTest(t, 2), l.AddVMForTest(t, 3)
	h := newHarness(t)
	capped := netip.MustParseAddrPort("10.96.0.10:80")
	free := netip.MustParseAddrPort("10.96.0.11:80")
	for i, s := range []struct {
		vip netip.AddrPort
		vm  *lab.VM
	}{{capped, vmA}, {free, vmB}} {
		id := uint32(i + 1)
		h.service(id, s.vip, ipTCP)
		h.backend(id, id, netip.AddrPortFrom(s.vm.Addr4, 9000), BackendReady, 0)
		h.table(id, h.fill(id))
		stop, err := s.vm.ServeBulk(9000)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(stop)
	}
	h.attachEdges(t, l, client, vmA, vmB)
	const capMbps = 50
	h.edt(1, MbpsToEDTRate(capMbps), edtHorizonE2E)

	var dl [2]*lab.Download
	for i, vip := range []netip.AddrPort{capped, free} {
		var err error
		if dl[i], err = client.StartDownload(vip, 2*time.Second); err != nil {
			t.Fatalf("download from %v: %v", vip, err)
		}
		defer dl[i].Close()
	}
	time.Sleep(time.Second) // slow start, then the policer's steady state
	startA, startB := dl[0].Bytes(), dl[1].Bytes()
	time.Sleep(10 * time.Second)
	rates := [2]float64{float64(dl[0].Bytes()-startA) * 8 / 10 / 1e6, float64(dl[1].Bytes()-startB) * 8 / 10 / 1e6}
	st := h.stats(1)
	t.Logf("capped at %d Mbit/s (horizon %v, no fq): %.1f Mbit/s; uncapped at the same time: %.0f Mbit/s; horizon drops %d", capMbps, edtHorizonE2E, rates[0], rates[1], st.EdtDrops)
	if rates[0] < 0.9*capMbps || rates[0] > 1.1*capMbps {
		t.Errorf("capped service: %.1f Mbit/s over 10 s; want %d Mbit/s within 10%%", rates[0], capMbps)
	}
	if rates[1] < 20*capMbps {
		t.Errorf("uncapped service: %.0f Mbit/s; want full speed (over %d Mbit/s)", rates[1], 20*capMbps)
	}
	if st.EdtDrops == 0 {
		t.Errorf("no horizon drops: the cap was never enforced by the policer")
	}

	// The cap goes: the same connection speeds up.
	h.must(h.objs.FluxvmEdt.Put(uint32(1), EDTValue{}))
	time.Sleep(time.Second)
	if after := dl[0].Mbps(2 * time.Second); after < 20*capMbps {
		t.Errorf("after removing the cap: %.0f Mbit/s on the same connection; want full speed", after)
	} else {
		t.Logf("after removing the cap: %.0f Mbit/s on the same connection", after)
	}
	for i, d := range dl {
		if err := d.Err(); err != nil {
			t.Errorf("download %d ended: %v", i, err)
		}
	}
}
