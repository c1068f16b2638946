package bpf

import (
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

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
		bulkSource(t, s.vm, 9000)
	}
	err := l.Node.Do(func() error {
		for _, vm := range []*lab.VM{client, vmA, vmB} {
			for _, at := range []struct {
				prog *ebpf.Program
				at   ebpf.AttachType
			}{{h.objs.FluxvmFromVm, ebpf.AttachTCXIngress}, {h.objs.FluxvmToVm, ebpf.AttachTCXEgress}} {
				tl, err := link.AttachTCX(link.TCXOptions{Interface: vm.NodeIfIndex, Program: at.prog, Attach: at.at})
				if err != nil {
					return err
				}
				t.Cleanup(func() { tl.Close() })
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	const capMbps = 50
	h.edt(1, MbpsToEDTRate(capMbps), edtHorizonE2E)

	var got [2]atomic.Int64
	var dlErr [2]error
	done := make(chan int, 2)
	conns := make([]net.Conn, 2)
	for i, vip := range []netip.AddrPort{capped, free} {
		err := client.NS.Do(func() (err error) {
			conns[i], err = net.DialTimeout("tcp", vip.String(), 2*time.Second)
			return err
		})
		if err != nil {
			t.Fatalf("dial %v: %v", vip, err)
		}
		defer conns[i].Close()
		go func() {
			buf := make([]byte, 256<<10)
			for {
				n, err := conns[i].Read(buf)
				got[i].Add(int64(n))
				if err != nil {
					dlErr[i] = err
					done <- i
					return
				}
			}
		}()
	}
	mbps := func(i int, d time.Duration) float64 {
		start := got[i].Load()
		time.Sleep(d)
		return float64(got[i].Load()-start) * 8 / d.Seconds() / 1e6
	}
	time.Sleep(time.Second) // slow start, then the policer's steady state
	var rates [2]float64
	startA, startB := got[0].Load(), got[1].Load()
	time.Sleep(10 * time.Second)
	rates[0] = float64(got[0].Load()-startA) * 8 / 10 / 1e6
	rates[1] = float64(got[1].Load()-startB) * 8 / 10 / 1e6
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
	if after := mbps(0, 2*time.Second); after < 20*capMbps {
		t.Errorf("after removing the cap: %.0f Mbit/s on the same connection; want full speed", after)
	} else {
		t.Logf("after removing the cap: %.0f Mbit/s on the same connection", after)
	}
	select {
	case i := <-done:
		t.Fatalf("download %d ended: %v", i, dlErr[i])
	default:
	}
}

// bulkSource serves, on vm's port, a stream of bytes to every client until
// it goes away.
func bulkSource(t *testing.T, vm *lab.VM, port uint16) {
	t.Helper()
	var ln net.Listener
	err := vm.NS.Do(func() (err error) {
		ln, err = net.Listen("tcp", netip.AddrPortFrom(netip.IPv4Unspecified(), port).String())
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		buf := make([]byte, 256<<10)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				for {
					if _, err := c.Write(buf); err != nil {
						return // the client went away, or the test ended
					}
				}
			}()
		}
	}()
}
