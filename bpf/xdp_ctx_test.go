package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// The XDP context layer's test object: the shared headers over
// lib/ctx/xdp.h (testdata/fluxvm_xdp_test.bpf.c).
//
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_xdp_test xdpTest testdata/fluxvm_xdp_test.bpf.c -- -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu

// TestXDPContextLayer runs the shared parser, its counters and the NAT
// rewrite in an XDP program on real frames: TCP and UDP over IPv4 and IPv6
// get their destination rewritten with every checksum right (the frame's
// checksums are full ones in XDP, patched as under CHECKSUM_NONE), an IPv4
// UDP checksum of zero stays zero, and what the parser does not take
// (non-IP, 802.1Q left in the frame, truncated, a fragment) passes
// untouched, counted as in TC.
func TestXDPContextLayer(t *testing.T) {
	testenv.RequirePrivileged(t)
	spec, err := loadXdpTest()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"} {
		spec.Maps[name].MaxEntries = 1024
	}
	var objs xdpTestObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		t.Fatal(err)
	}
	defer objs.Close()
	th := testenv.NewThread(t)

	c4, v4, b4 := netip.MustParseAddrPort("10.0.0.1:40000"), netip.MustParseAddrPort("10.96.0.10:80"), netip.MustParseAddrPort("10.1.0.1:8080")
	c6, v6, b6 := netip.MustParseAddrPort("[fd00::1]:40000"), netip.MustParseAddrPort("[fd00:96::10]:80"), netip.MustParseAddrPort("[fd00:1::1]:8080")
	udp4 := func(src, dst netip.AddrPort) []byte { return pkt.UDP(src, dst, payload) }
	zeroSum := func(f []byte) []byte { // IPv4 UDP without a checksum
		f = append([]byte(nil), f...)
		binary.BigEndian.PutUint16(f[14+20+6:], 0)
		return f
	}
	arp := append(bytes.Repeat([]byte{0xff}, 6), 2, 0, 0, 0, 0, 1, 0x08, 0x06)
	arp = append(arp, make([]byte, 28)...)
	vlan := pkt.TCP(c4, v4, pkt.SYN, payload)
	vlan = append(append(append([]byte(nil), vlan[:12]...), 0x81, 0x00, 0x00, 0x07), vlan[12:]...)

	for _, tt := range []struct {
		name     string
		in, want []byte // want nil: passed untouched
		backend  netip.AddrPort
		counters map[Counter]uint64
	}{
		{"ipv4 tcp", pkt.TCP(c4, v4, pkt.SYN, payload), pkt.TCP(c4, b4, pkt.SYN, payload), b4,
			map[Counter]uint64{CounterIPv4: 1, CounterTCP: 1}},
		{"ipv4 udp", udp4(c4, v4), udp4(c4, b4), b4, map[Counter]uint64{CounterIPv4: 1, CounterUDP: 1}},
		{"ipv4 udp without checksum", zeroSum(udp4(c4, v4)), zeroSum(udp4(c4, b4)), b4, map[Counter]uint64{CounterIPv4: 1, CounterUDP: 1}},
		{"ipv6 tcp", pkt.TCP(c6, v6, pkt.ACK, payload), pkt.TCP(c6, b6, pkt.ACK, payload), b6,
			map[Counter]uint64{CounterIPv6: 1, CounterTCP: 1}},
		{"ipv6 udp", pkt.UDP(c6, v6, payload), pkt.UDP(c6, b6, payload), b6, map[Counter]uint64{CounterIPv6: 1, CounterUDP: 1}},
		{"non-IP", arp, nil, b4, map[Counter]uint64{CounterNonIP: 1}},
		{"802.1Q in the frame", vlan, nil, b4, map[Counter]uint64{CounterNonIP: 1}},
		{"truncated", pkt.TCP(c4, v4, pkt.SYN, payload)[:14+10], nil, b4, map[Counter]uint64{CounterTruncated: 1}},
		{"fragment", pkt.SetIPv4Frag(pkt.TCP(c4, v4, pkt.SYN, payload), 0, true), nil, b4,
			map[Counter]uint64{CounterIPv4: 1, CounterFragment: 1, CounterTCP: 1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if err := objs.FluxvmXdpTestAddr.Set(AddrWords(tt.backend.Addr())); err != nil {
				t.Fatal(err)
			}
			if err := objs.FluxvmXdpTestPort.Set(Port(tt.backend.Port())); err != nil {
				t.Fatal(err)
			}
			before, err := ReadCounters(objs.FluxvmCounters)
			if err != nil {
				t.Fatal(err)
			}
			opts := ebpf.RunOptions{Data: tt.in, DataOut: make([]byte, len(tt.in)+256), Repeat: 1}
			var ret uint32
			th.Do(func() { ret, err = objs.FluxvmXdpDnat.Run(&opts) })
			if err != nil {
				t.Fatal(err)
			}
			if tt.want == nil {
				if ret != 2 /* XDP_PASS */ || !bytes.Equal(opts.DataOut, tt.in) {
					t.Fatalf("verdict %d, packet %x: want XDP_PASS, untouched", ret, opts.DataOut)
				}
			} else {
				if ret != 3 /* XDP_TX */ || !bytes.Equal(opts.DataOut, tt.want) {
					t.Fatalf("verdict %d\n got %x\nwant %x", ret, opts.DataOut, tt.want)
				}
				if err := pkt.VerifyChecksums(opts.DataOut); err != nil {
					t.Fatal(err)
				}
			}
			after, err := ReadCounters(objs.FluxvmCounters)
			if err != nil {
				t.Fatal(err)
			}
			checkCounterDelta(t, before, after, tt.counters)
		})
	}
}
