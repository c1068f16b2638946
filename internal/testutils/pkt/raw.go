package pkt

import (
	"encoding/binary"
	"fmt"
)

// Raw edits for cases gopacket will not build: IPv4 options, IPv6
// extension-header chains and hand-damaged headers. All offsets assume an
// untagged Ethernet frame.

const (
	ethLen  = 14
	ipv6Len = 40
)

// Ext is one IPv6 extension header to insert with IPv6Ext.
type Ext struct {
	Proto uint8  // its protocol number (0 hop-by-hop, 43 routing, 44 fragment, 51 AH, 60 dest opts)
	Size  int    // total bytes for generic headers and AH; ignored for fragments
	Frag  uint16 // fragment offset field (bytes/8 << 3 | M flag), for Proto 44
}

// Extension headers used by tests.
var (
	HopByHop = Ext{Proto: 0, Size: 8}
	DestOpts = Ext{Proto: 60, Size: 16}
	Routing  = Ext{Proto: 43, Size: 24}
	AH       = Ext{Proto: 51, Size: 24}
)

// Fragment returns an IPv6 fragment header for offset (in bytes, a
// multiple of 8) with or without the more-fragments flag.
func Fragment(offset uint16, more bool) Ext {
	f := offset &^ 7
	if more {
		f |= 1
	}
	return Ext{Proto: 44, Frag: f}
}

// IPv6Ext inserts the extension headers after the IPv6 header of frame,
// chaining next-header values and fixing the payload length. The upper
// layer keeps its bytes and checksum.
func IPv6Ext(frame []byte, exts ...Ext) []byte {
	if len(frame) < ethLen+ipv6Len || frame[ethLen]>>4 != 6 {
		panic("pkt: IPv6Ext needs an IPv6 frame")
	}
	ip := frame[ethLen : ethLen+ipv6Len]
	upper := ip[6]
	var chain []byte
	for i, e := range exts {
		next := upper
		if i+1 < len(exts) {
			next = exts[i+1].Proto
		}
		var h []byte
		switch e.Proto {
		case 44:
			h = make([]byte, 8)
			binary.BigEndian.PutUint16(h[2:], e.Frag)
			binary.BigEndian.PutUint32(h[4:], 0x01020304)
		case 51:
			if e.Size < 12 || e.Size%8 != 0 {
				panic(fmt.Sprintf("pkt: AH size %d", e.Size))
			}
			h = make([]byte, e.Size)
			h[1] = byte(e.Size/4 - 2)
		default:
			if e.Size < 8 || e.Size%8 != 0 {
				panic(fmt.Sprintf("pkt: extension size %d", e.Size))
			}
			h = make([]byte, e.Size)
			h[1] = byte(e.Size/8 - 1)
			if e.Proto != 43 {
				// PadN option filling the rest: type 1, length.
				h[2], h[3] = 1, byte(e.Size-4)
			}
		}
		h[0] = next
		chain = append(chain, h...)
	}
	out := make([]byte, 0, len(frame)+len(chain))
	out = append(out, frame[:ethLen+ipv6Len]...)
	out = append(out, chain...)
	out = append(out, frame[ethLen+ipv6Len:]...)
	if len(exts) > 0 {
		out[ethLen+6] = exts[0].Proto
	}
	plen := binary.BigEndian.Uint16(out[ethLen+4:])
	binary.BigEndian.PutUint16(out[ethLen+4:], plen+uint16(len(chain)))
	return out
}

// IPv4Options inserts opts (a multiple of 4 bytes) after the fixed IPv4
// header of frame and fixes IHL, total length and the header checksum.
func IPv4Options(frame []byte, opts []byte) []byte {
	if len(opts)%4 != 0 || len(opts) > 40 {
		panic("pkt: IPv4 options must be a multiple of 4 bytes, at most 40")
	}
	out := make([]byte, 0, len(frame)+len(opts))
	out = append(out, frame[:ethLen+20]...)
	out = append(out, opts...)
	out = append(out, frame[ethLen+20:]...)
	ip := out[ethLen:]
	ip[0] = 0x40 | byte((20+len(opts))/4)
	binary.BigEndian.PutUint16(ip[2:], binary.BigEndian.Uint16(ip[2:])+uint16(len(opts)))
	FixIPv4Checksum(out)
	return out
}

// SetIPv4Frag sets the IPv4 flags/fragment-offset field (offset in bytes)
// and fixes the header checksum.
func SetIPv4Frag(frame []byte, offset uint16, more bool) []byte {
	out := append([]byte(nil), frame...)
	f := offset / 8
	if more {
		f |= 0x2000
	}
	binary.BigEndian.PutUint16(out[ethLen+6:], f)
	FixIPv4Checksum(out)
	return out
}

// FixIPv4Checksum recomputes the IPv4 header checksum in place.
func FixIPv4Checksum(frame []byte) {
	ip := frame[ethLen:]
	hl := int(ip[0]&0x0f) * 4
	if hl < 20 || len(ip) < hl {
		return
	}
	ip[10], ip[11] = 0, 0
	binary.BigEndian.PutUint16(ip[10:], Checksum(ip[:hl]))
}

// Checksum is the Internet checksum (RFC 1071) of b.
func Checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
