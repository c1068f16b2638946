package pkt

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// VerifyChecksums checks the IPv4 header checksum and the TCP or UDP
// checksum (over the pseudo-header) of an untagged Ethernet frame without
// IPv6 extension headers. An IPv4 UDP checksum of zero means "none" and is
// accepted.
func VerifyChecksums(frame []byte) error {
	if len(frame) < ethLen {
		return errors.New("pkt: short frame")
	}
	var pseudo []byte
	var l4 []byte
	var proto byte
	switch binary.BigEndian.Uint16(frame[12:]) {
	case 0x0800:
		ip := frame[ethLen:]
		hl := int(ip[0]&0x0f) * 4
		tot := int(binary.BigEndian.Uint16(ip[2:]))
		if len(ip) < tot || tot < hl {
			return errors.New("pkt: bad IPv4 lengths")
		}
		if Checksum(ip[:hl]) != 0 {
			return fmt.Errorf("pkt: bad IPv4 header checksum %#04x", binary.BigEndian.Uint16(ip[10:]))
		}
		proto = ip[9]
		l4 = ip[hl:tot]
		pseudo = append(append([]byte{}, ip[12:20]...), 0, proto, byte(len(l4)>>8), byte(len(l4)))
	case 0x86dd:
		ip := frame[ethLen:]
		plen := int(binary.BigEndian.Uint16(ip[4:]))
		if len(ip) < ipv6Len+plen {
			return errors.New("pkt: bad IPv6 length")
		}
		proto = ip[6]
		l4 = ip[ipv6Len : ipv6Len+plen]
		pseudo = append(append([]byte{}, ip[8:40]...), 0, 0, byte(len(l4)>>8), byte(len(l4)), 0, 0, 0, proto)
	default:
		return errors.New("pkt: not IP")
	}
	switch proto {
	case 6:
		if len(l4) < 20 {
			return errors.New("pkt: short TCP header")
		}
	case 17:
		if len(l4) < 8 {
			return errors.New("pkt: short UDP header")
		}
		if binary.BigEndian.Uint16(l4[6:]) == 0 {
			if len(pseudo) == 12 {
				return nil // IPv4: no checksum
			}
			return errors.New("pkt: IPv6 UDP checksum is zero")
		}
	default:
		return nil
	}
	if c := Checksum(append(pseudo, l4...)); c != 0 {
		return fmt.Errorf("pkt: bad L4 checksum (residue %#04x)", c)
	}
	return nil
}
