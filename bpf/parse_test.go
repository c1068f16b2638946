package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// tcNext is TC_ACT_UNSPEC (== TCX_NEXT) as Program.Run reports it.
const tcNext = ^uint32(0)

var (
	cli4 = netip.MustParseAddrPort("10.0.0.1:40000")
	vip4 = netip.MustParseAddrPort("10.96.0.10:80")
	cli6 = netip.MustParseAddrPort("[fd00::1]:40000")
	vip6 = netip.MustParseAddrPort("[fd00:96::10]:80")
)

// mutate copies frame and applies f to the copy.
func mutate(frame []byte, f func(b []byte)) []byte {
	b := append([]byte(nil), frame...)
	f(b)
	return b
}

// cut returns frame truncated to n bytes with the IP length fields made
// consistent with the cut, so the damage shows at the layer under test.
func cutL4(frame []byte, l4Bytes int) []byte {
	b := append([]byte(nil), frame...)
	switch binary.BigEndian.Uint16(b[12:]) {
	case 0x0800:
		hl := int(b[14]&0x0f) * 4
		b = b[:14+hl+l4Bytes]
		binary.BigEndian.PutUint16(b[16:], uint16(hl+l4Bytes))
		pkt.FixIPv4Checksum(b)
	case 0x86dd:
		b = b[:14+40+l4Bytes]
		binary.BigEndian.PutUint16(b[18:], uint16(l4Bytes))
	}
	return b
}

func icmp4() []byte {
	ip := pkt.IP(cli4.Addr(), vip4.Addr(), layers.IPProtocolICMPv4)
	return pkt.Serialize(pkt.Ethernet(cli4.Addr()), ip.(gopacket.SerializableLayer),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(8, 0), Id: 1, Seq: 1}, gopacket.Payload("ping"))
}

func icmp6() []byte {
	ip := pkt.IP(cli6.Addr(), vip6.Addr(), layers.IPProtocolICMPv6)
	ic := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(128, 0)}
	if err := ic.SetNetworkLayerForChecksum(ip); err != nil {
		panic(err)
	}
	return pkt.Serialize(pkt.Ethernet(cli6.Addr()), ip.(gopacket.SerializableLayer), ic,
		&layers.ICMPv6Echo{Identifier: 1, SeqNumber: 1}, gopacket.Payload("ping"))
}

func arp() []byte {
	return pkt.Serialize(&layers.Ethernet{SrcMAC: pkt.SrcMAC, DstMAC: pkt.DstMAC, EthernetType: layers.EthernetTypeARP},
		&layers.ARP{AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4, HwAddressSize: 6, ProtAddressSize: 4,
			Operation: layers.ARPRequest, SourceHwAddress: pkt.SrcMAC, SourceProtAddress: cli4.Addr().AsSlice(),
			DstHwAddress: make([]byte, 6), DstProtAddress: vip4.Addr().AsSlice()})
}

func vlanTagged() []byte {
	ip := pkt.IP(cli4.Addr(), vip4.Addr(), layers.IPProtocolUDP)
	udp := &layers.UDP{SrcPort: 40000, DstPort: 53}
	_ = udp.SetNetworkLayerForChecksum(ip)
	return pkt.Serialize(&layers.Ethernet{SrcMAC: pkt.SrcMAC, DstMAC: pkt.DstMAC, EthernetType: layers.EthernetTypeDot1Q},
		&layers.Dot1Q{VLANIdentifier: 42, Type: layers.EthernetTypeIPv4}, ip.(gopacket.SerializableLayer), udp)
}

// counts lists the counters a packet must bump, each by one.
func counts(cs ...Counter) map[Counter]uint64 {
	m := make(map[Counter]uint64, len(cs))
	for _, c := range cs {
		m[c]++
	}
	return m
}

// onlyVeth marks frames that BPF_PROG_TEST_RUN refuses with EINVAL because
// the kernel itself validates the fixed IP header of test input. Such frames
// still reach TC from a real device, so they are sent over a veth instead.
const onlyVeth = true

type parserCase struct {
	name     string
	frame    []byte
	want     map[Counter]uint64
	onlyVeth bool
}

func parserCases() []parserCase {
	tcp4 := pkt.TCP(cli4, vip4, pkt.SYN, nil)
	tcpData4 := pkt.TCP(cli4, vip4, pkt.ACK, make([]byte, 64))
	udp4 := pkt.UDP(cli4, vip4, []byte("hello"))
	tcp6 := pkt.TCP(cli6, vip6, pkt.SYN, nil)
	udp6 := pkt.UDP(cli6, vip6, []byte("hello"))
	nop8 := []byte{1, 1, 1, 1, 1, 1, 1, 0} // NOPs then end-of-options

	return []parserCase{
		// Well-formed traffic.
		{"ipv4 tcp", tcp4, counts(CounterIPv4, CounterTCP), false},
		{"ipv4 tcp with payload", pkt.TCP(cli4, vip4, pkt.ACK, []byte("GET / HTTP/1.1\r\n\r\n")), counts(CounterIPv4, CounterTCP), false},
		{"ipv4 udp", udp4, counts(CounterIPv4, CounterUDP), false},
		{"ipv6 tcp", tcp6, counts(CounterIPv6, CounterTCP), false},
		{"ipv6 udp", udp6, counts(CounterIPv6, CounterUDP), false},
		{"ipv4 options tcp", pkt.IPv4Options(tcp4, nop8), counts(CounterIPv4, CounterTCP), false},
		{"ipv4 max options udp", pkt.IPv4Options(udp4, make([]byte, 40)), counts(CounterIPv4, CounterUDP), false},
		{"ipv4 udp with ethernet padding", pkt.UDP(cli4, vip4, nil), counts(CounterIPv4, CounterUDP), false},
		{"tcp with options", tcpWithOptions(), counts(CounterIPv4, CounterTCP), false},
		{"ipv4 icmp", icmp4(), counts(CounterIPv4, CounterL4Other), false},
		{"ipv6 icmp", icmp6(), counts(CounterIPv6, CounterL4Other), false},

		// IPv6 extension headers.
		{"ipv6 hop-by-hop udp", pkt.IPv6Ext(udp6, pkt.HopByHop), counts(CounterIPv6, CounterIPv6ExtHdr, CounterUDP), false},
		{"ipv6 hbh+routing+dest tcp", pkt.IPv6Ext(tcp6, pkt.HopByHop, pkt.Routing, pkt.DestOpts), counts(CounterIPv6, CounterIPv6ExtHdr, CounterTCP), false},
		{"ipv6 routing header with segments left", mutate(pkt.IPv6Ext(tcp6, pkt.HopByHop, pkt.Routing), func(b []byte) { b[14+48+3] = 1 }), counts(CounterIPv6, CounterIPv6ExtHdr, CounterL4Other), false},
		{"ipv6 auth header tcp", pkt.IPv6Ext(tcp6, pkt.AH), counts(CounterIPv6, CounterIPv6ExtHdr, CounterTCP), false},
		{"ipv6 eight ext headers udp", pkt.IPv6Ext(udp6, pkt.HopByHop, pkt.DestOpts, pkt.Routing, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts), counts(CounterIPv6, CounterIPv6ExtHdr, CounterUDP), false},
		{"ipv6 no next header", mutate(pkt.IPv6Ext(udp6, pkt.DestOpts), func(b []byte) { b[14+40] = 59 }), counts(CounterIPv6, CounterIPv6ExtHdr, CounterL4Other), false},

		// Fragments.
		{"ipv4 first fragment tcp", pkt.SetIPv4Frag(tcp4, 0, true), counts(CounterIPv4, CounterFragment, CounterTCP), false},
		{"ipv4 later fragment", pkt.SetIPv4Frag(udp4, 1480, false), counts(CounterIPv4, CounterFragment), false},
		{"ipv6 first fragment udp", pkt.IPv6Ext(udp6, pkt.Fragment(0, true)), counts(CounterIPv6, CounterIPv6ExtHdr, CounterFragment, CounterUDP), false},
		{"ipv6 later fragment", pkt.IPv6Ext(udp6, pkt.Fragment(1448, true)), counts(CounterIPv6, CounterIPv6ExtHdr, CounterFragment), false},
		{"ipv6 atomic fragment udp", pkt.IPv6Ext(udp6, pkt.Fragment(0, false)), counts(CounterIPv6, CounterIPv6ExtHdr, CounterUDP), false},

		// Not IP.
		{"arp", arp(), counts(CounterNonIP), false},
		{"vlan tagged ipv4", vlanTagged(), counts(CounterNonIP), false},

		// Truncated at every layer.
		{"ethernet header only, ipv4 type", tcp4[:14], counts(CounterTruncated), onlyVeth},
		{"ipv4 header cut", tcp4[:14+12], counts(CounterTruncated), onlyVeth},
		{"ipv4 options cut", pkt.IPv4Options(tcp4, nop8)[:14+24], counts(CounterTruncated), false},
		{"ipv4 total length beyond frame", tcpData4[:len(tcpData4)-4], counts(CounterTruncated), false},
		{"tcp header cut", cutL4(tcp4, 12), counts(CounterTruncated), false},
		{"tcp options cut", mutate(tcp4, func(b []byte) { b[14+20+12] = 15 << 4 }), counts(CounterTruncated), false},
		{"udp header cut", cutL4(udp4, 6), counts(CounterTruncated), false},
		{"udp length beyond ip payload", mutate(udp4, func(b []byte) { binary.BigEndian.PutUint16(b[14+20+4:], 200) }), counts(CounterTruncated), false},
		{"ipv6 header cut", tcp6[:14+30], counts(CounterTruncated), onlyVeth},
		{"ipv6 payload length beyond frame", tcp6[:len(tcp6)-1], counts(CounterTruncated), false},
		{"ipv6 tcp header cut", cutL4(tcp6, 19), counts(CounterTruncated), false},
		{"ipv6 ext header beyond payload", mutate(pkt.IPv6Ext(udp6, pkt.DestOpts), func(b []byte) { b[14+41] = 200 }), counts(CounterTruncated), false},

		// Malformed fields.
		{"ipv4 ihl below 5", mutate(tcp4, func(b []byte) { b[14] = 0x44 }), counts(CounterMalformed), false},
		{"ipv4 type carrying ipv6", mutate(tcp4, func(b []byte) { b[14] = 0x65 }), counts(CounterMalformed), false},
		{"ipv4 total length below header", mutate(tcp4, func(b []byte) { binary.BigEndian.PutUint16(b[16:], 12) }), counts(CounterMalformed), false},
		{"ipv6 type carrying ipv4", mutate(tcp6, func(b []byte) { b[14] = 0x45 }), counts(CounterMalformed), false},
		{"tcp data offset below 5", mutate(tcp4, func(b []byte) { b[14+20+12] = 4 << 4 }), counts(CounterMalformed), false},
		{"udp length below 8", mutate(udp4, func(b []byte) { binary.BigEndian.PutUint16(b[14+20+4:], 7) }), counts(CounterMalformed), false},

		// Beyond the parser's bounds.
		{"ipv6 nine ext headers", pkt.IPv6Ext(udp6, pkt.HopByHop, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts, pkt.DestOpts), counts(CounterParseLimit), false},
		{"ipv6 l4 beyond 512 bytes", pkt.IPv6Ext(udp6, Ext(pkt.DestOpts, 256), Ext(pkt.DestOpts, 256), pkt.DestOpts), counts(CounterParseLimit), false},
	}

}

// TestParser runs every case through the real program with
// BPF_PROG_TEST_RUN: the verdict must be "continue", the frame must come
// out byte for byte as it went in, and exactly the listed counters move.
func TestParser(t *testing.T) {
	th := testenv.NewThread(t)
	var objs serviceObjects
	if err := loadServiceObjects(&objs, nil); err != nil {
		t.Fatalf("load: %v", err)
	}
	defer objs.Close()

	for _, tt := range parserCases() {
		t.Run(tt.name, func(t *testing.T) {
			if tt.onlyVeth {
				t.Skip("BPF_PROG_TEST_RUN refuses this frame; TestParserOnVeth covers it")
			}
			before, err := ReadCounters(objs.FluxvmCounters)
			if err != nil {
				t.Fatal(err)
			}
			ret, out := run(t, th, objs.FluxvmFromVm, tt.frame)
			if ret != tcNext {
				t.Errorf("verdict = %d, want TC_ACT_UNSPEC (continue to next program)", int32(ret))
			}
			if !bytes.Equal(out, tt.frame) {
				t.Errorf("packet was modified:\n in: %x\nout: %x", tt.frame, out)
			}
			after, err := ReadCounters(objs.FluxvmCounters)
			if err != nil {
				t.Fatal(err)
			}
			checkCounterDelta(t, before, after, tt.want)
		})
	}
}

// Ext resizes a generic extension header (a helper for the size-limit case).
func Ext(e pkt.Ext, size int) pkt.Ext {
	e.Size = size
	return e
}

// run feeds one frame through prog once, on the test's namespace thread,
// and returns the verdict and the frame as the program left it.
func run(tb testing.TB, th *testenv.Thread, prog *ebpf.Program, frame []byte) (uint32, []byte) {
	tb.Helper()
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256), Repeat: 1}
	var ret uint32
	var err error
	th.Do(func() { ret, err = prog.Run(&opts) })
	if err != nil {
		tb.Fatalf("run: %v", err)
	}
	return ret, opts.DataOut
}

func checkCounterDelta(tb testing.TB, before, after Counters, want map[Counter]uint64) {
	tb.Helper()
	for c := range NumCounters {
		got, w := after[c]-before[c], want[Counter(c)]
		if got != w {
			tb.Errorf("counter %s: +%d, want +%d", Counter(c), got, w)
		}
	}
}

func tcpWithOptions() []byte {
	ip := pkt.IP(cli4.Addr(), vip4.Addr(), layers.IPProtocolTCP)
	tcp := &layers.TCP{SrcPort: 40000, DstPort: 80, SYN: true, Window: 65535, Options: []layers.TCPOption{
		{OptionType: layers.TCPOptionKindMSS, OptionLength: 4, OptionData: []byte{0x05, 0xb4}},
		{OptionType: layers.TCPOptionKindSACKPermitted, OptionLength: 2},
		{OptionType: layers.TCPOptionKindWindowScale, OptionLength: 3, OptionData: []byte{7}},
	}}
	_ = tcp.SetNetworkLayerForChecksum(ip)
	return pkt.Serialize(pkt.Ethernet(cli4.Addr()), ip.(gopacket.SerializableLayer), tcp)
}

// TestParserOnVeth sends every case as a real frame over a veth pair to
// the program attached with TCX on the peer's ingress, as it runs in
// production, and checks the counters.
func TestParserOnVeth(t *testing.T) {
	testenv.InNetNS(t, func() {
		var objs serviceObjects
		if err := loadServiceObjects(&objs, nil); err != nil {
			t.Fatalf("load: %v", err)
		}
		defer objs.Close()
		tx, rx, err := testenv.VethPair("fvtx", "fvrx")
		if err != nil {
			t.Fatal(err)
		}
		l, err := link.AttachTCX(link.TCXOptions{Interface: rx.Attrs().Index, Program: objs.FluxvmFromVm, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			t.Fatalf("attach tcx: %v", err)
		}
		defer l.Close()
		sock := testenv.NewRawSocket(t, tx.Attrs().Index)

		for _, tt := range parserCases() {
			t.Run(tt.name, func(t *testing.T) {
				before, err := ReadCounters(objs.FluxvmCounters)
				if err != nil {
					t.Fatal(err)
				}
				if err := sock.Send(tt.frame); err != nil {
					t.Fatal(err)
				}
				var total uint64
				for _, n := range tt.want {
					total += n
				}
				// Delivery over veth is asynchronous (backlog softirq).
				var after Counters
				for deadline := time.Now().Add(2 * time.Second); ; {
					if after, err = ReadCounters(objs.FluxvmCounters); err != nil {
						t.Fatal(err)
					}
					var got uint64
					for c := range after {
						got += after[c] - before[c]
					}
					if got >= total || time.Now().After(deadline) {
						break
					}
					time.Sleep(time.Millisecond)
				}
				checkCounterDelta(t, before, after, tt.want)
			})
		}
	})
}
