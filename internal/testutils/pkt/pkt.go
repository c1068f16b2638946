// Package pkt builds and decodes the Ethernet frames that datapath tests
// feed to the real BPF programs. Frames are made with gopacket, with
// lengths and checksums computed, so a test states only what it means.
package pkt

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
)

// Fixed MAC addresses: the programs never look at them, and fixed values
// keep expected output bytes stable.
var (
	SrcMAC = net.HardwareAddr{0x02, 0x00, 0x00, 0x00, 0x00, 0x01}
	DstMAC = net.HardwareAddr{0x02, 0x00, 0x00, 0x00, 0x00, 0x02}
)

// TCPFlags selects the flags of a TCP segment.
type TCPFlags struct{ SYN, ACK, FIN, RST, PSH bool }

// Common flag sets.
var (
	SYN    = TCPFlags{SYN: true}
	SYNACK = TCPFlags{SYN: true, ACK: true}
	ACK    = TCPFlags{ACK: true}
	FIN    = TCPFlags{FIN: true, ACK: true}
	RST    = TCPFlags{RST: true}
)

// Serialize encodes layers into one frame, fixing lengths and computing
// checksums. It panics on layers gopacket cannot encode, which in a test is
// a bug in the test.
func Serialize(ls ...gopacket.SerializableLayer) []byte {
	buf := gopacket.NewSerializeBuffer()
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	if err := gopacket.SerializeLayers(buf, opts, ls...); err != nil {
		panic(fmt.Sprintf("pkt: serialize: %v", err))
	}
	return buf.Bytes()
}

// Ethernet returns the Ethernet header for an IP frame of the family of a.
func Ethernet(a netip.Addr) *layers.Ethernet {
	t := layers.EthernetTypeIPv4
	if a.Is6() && !a.Is4In6() {
		t = layers.EthernetTypeIPv6
	}
	return &layers.Ethernet{SrcMAC: SrcMAC, DstMAC: DstMAC, EthernetType: t}
}

// IP returns an IPv4 or IPv6 header from src to dst carrying proto.
func IP(src, dst netip.Addr, proto layers.IPProtocol) gopacket.NetworkLayer {
	if src.Is4() != dst.Is4() {
		panic("pkt: mixed address families")
	}
	if src.Is4() {
		return &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: proto, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
	}
	return &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: proto, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
}

// TCP builds a TCP segment from src to dst.
func TCP(src, dst netip.AddrPort, f TCPFlags, payload []byte) []byte {
	ip := IP(src.Addr(), dst.Addr(), layers.IPProtocolTCP)
	tcp := &layers.TCP{
		SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		Seq: 1000, Window: 65535,
		SYN: f.SYN, ACK: f.ACK, FIN: f.FIN, RST: f.RST, PSH: f.PSH,
	}
	if f.ACK {
		tcp.Ack = 2000
	}
	if err := tcp.SetNetworkLayerForChecksum(ip); err != nil {
		panic(err)
	}
	return Serialize(Ethernet(src.Addr()), ip.(gopacket.SerializableLayer), tcp, gopacket.Payload(payload))
}

// UDP builds a UDP datagram from src to dst.
func UDP(src, dst netip.AddrPort, payload []byte) []byte {
	ip := IP(src.Addr(), dst.Addr(), layers.IPProtocolUDP)
	udp := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	if err := udp.SetNetworkLayerForChecksum(ip); err != nil {
		panic(err)
	}
	return Serialize(Ethernet(src.Addr()), ip.(gopacket.SerializableLayer), udp, gopacket.Payload(payload))
}

// Decode parses a frame that starts with Ethernet.
func Decode(frame []byte) gopacket.Packet {
	return gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.Default)
}
