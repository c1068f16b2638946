package bpf

import (
	"bytes"
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// FuzzPrograms runs random frames through all four programs, with an
// east-west service, a north-south NAT service and a north-south DSR
// service installed and the SNAT configured, and checks what must hold for
// any input:
//   - the verdict is one the programs return (next, OK, drop, redirect);
//   - a packet handed on to the next program is byte for byte the input;
//   - a frame never changes length;
//   - a frame whose checksums were right still has right checksums after
//     any rewrite (incremental updates must equal a full computation).
//
// The seeds (run by plain `go test`) are real flows of every kind, their
// replies, and cut and corrupted variants.
//
//	go test -run '^$' -fuzz FuzzPrograms -fuzztime 60s ./bpf/
func FuzzPrograms(f *testing.F) {
	h := newHarness(f)
	vs := variants()
	for i, v := range vs {
		v.setup(h)
		// A north-south NAT VIP and a north-south DSR VIP next to the
		// east-west one, on services of their own.
		ns := netip.AddrPortFrom(v.other, 443)
		h.service(uint32(20+i), ns, v.proto)
		h.backend(uint32(20+i), uint32(20+i), v.backends[0], BackendReady, 0)
		h.table(uint32(20+i), h.fill(uint32(20+i)))
		h.svcFlags(uint32(20+i), ns, v.proto, SvcFlagNorthSouth|SvcFlagNoEastWest)
		dsr := netip.AddrPortFrom(v.other, 53)
		h.service(uint32(30+i), dsr, v.proto)
		h.backend(uint32(30+i), uint32(30+i), v.backends[1], BackendReady, 0)
		h.table(uint32(30+i), h.fill(uint32(30+i)))
		h.svcFlags(uint32(30+i), dsr, v.proto, SvcFlagNorthSouth|SvcFlagDSR)
	}
	h.snat(snatMin, snatMax)

	for _, v := range vs {
		ns := netip.AddrPortFrom(v.other, 443)
		for _, frame := range [][]byte{
			v.fwd(40000, pkt.SYN),
			v.fwd(40000, pkt.ACK),
			v.reply(v.backends[0], 40000, pkt.SYNACK),
			v.frame(v.clientAt(snatMin+2), ns, pkt.SYN),
			v.frame(v.backends[0], netip.AddrPortFrom(v.snatAddr(), snatMin+2), pkt.SYNACK),
			v.frame(v.clientAt(1), netip.AddrPortFrom(v.other, 53), pkt.SYN),
		} {
			f.Add(frame)
			f.Add(frame[:len(frame)-3]) // payload cut short
			f.Add(frame[:14+10])        // inside the IP header
			corrupt := append([]byte(nil), frame...)
			corrupt[len(corrupt)-1] ^= 0xff // bad L4 checksum
			f.Add(corrupt)
		}
	}
	// The same flows behind IPv4 options and IPv6 extension headers, so
	// that rewrites with the L4 header further in are fuzzed too.
	for _, v := range vs {
		ns := netip.AddrPortFrom(v.other, 443)
		for _, hk := range headerKinds() {
			if hk.v6 == v.client.Is4() {
				continue
			}
			for _, frame := range [][]byte{
				v.fwd(40000, pkt.SYN),
				v.reply(v.backends[0], 40000, pkt.ACK),
				v.frame(v.clientAt(snatMin+2), ns, pkt.SYN),
				v.frame(v.backends[0], netip.AddrPortFrom(v.snatAddr(), snatMin+2), pkt.SYNACK),
			} {
				f.Add(hk.wrap(frame))
			}
		}
	}
	// ICMP errors about each kind of flow (east-west to the client, SNAT
	// to the SNAT address), whole and cut quotes, an echo, and the same
	// behind IPv4 options and IPv6 extension headers.
	for _, v := range vs {
		c, b := v.clientAt(40000), v.backends[0]
		s := netip.AddrPortFrom(v.snatAddr(), snatMin+2)
		pmtu, echo := v.icmpErrors()[0], v.icmpEchoes()[0]
		ewQuote := v.frame(c, b, pkt.SYN)
		nsQuote := v.frame(s, b, pkt.SYN)
		for _, frame := range [][]byte{
			icmpMsg(pmtu, v.router(), c.Addr(), quote(ewQuote, -1)),
			icmpMsg(pmtu, v.router(), c.Addr(), quote(ewQuote, 8)),
			icmpMsg(v.icmpErrors()[2], v.router(), c.Addr(), quote(ewQuote, 4)),
			icmpMsg(pmtu, v.router(), s.Addr(), quote(nsQuote, -1)),
			icmpMsg(pmtu, v.router(), s.Addr(), quote(nsQuote, 8)),
			icmpMsg(echo, v.router(), c.Addr(), quote(ewQuote, -1)),
		} {
			f.Add(frame)
			for _, hk := range headerKinds() {
				if hk.v6 != v.client.Is4() {
					f.Add(hk.wrap(frame))
				}
			}
		}
	}
	f.Add([]byte{})
	f.Add(make([]byte, 14))

	progs := []*ebpf.Program{h.objs.FluxvmFromVm, h.objs.FluxvmToVm, h.objs.FluxvmNsIn, h.objs.FluxvmNsOut}
	f.Fuzz(func(t *testing.T, frame []byte) {
		if len(frame) < 14 || len(frame) > 1500 {
			return // the kernel's test run refuses frames shorter than Ethernet
		}
		valid := checksumsOK(frame)
		for _, p := range progs {
			ret, out, ok := runFuzz(t, h, p, frame)
			if !ok {
				return // a frame the kernel's test run refuses to build
			}
			switch ret {
			case tcNext:
				if !bytes.Equal(out, frame) {
					t.Fatalf("%s: passed on a modified packet:\n in %x\nout %x", p, frame, out)
				}
			case tcOK, tcShot, tcRedirect:
			default:
				t.Fatalf("%s: verdict %d", p, int32(ret))
			}
			if ret != tcShot && valid && !checksumsOK(out) {
				t.Fatalf("%s: checksums broken by the rewrite:\n in %x\nout %x", p, frame, out)
			}
		}
	})
}

// runFuzz is run that also checks the output length, and reports false
// for a frame the kernel's test run refuses (EINVAL: for example an IPv4
// EtherType with less than an IPv4 header, which it will not build an skb
// for; TestParserOnVeth sends such frames over a real veth instead).
func runFuzz(t *testing.T, h *harness, p *ebpf.Program, frame []byte) (uint32, []byte, bool) {
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256), Repeat: 1}
	var ret uint32
	var err error
	h.th.Do(func() { ret, err = p.Run(&opts) })
	if errors.Is(err, unix.EINVAL) {
		return 0, nil, false
	}
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	if len(opts.DataOut) != len(frame) {
		t.Fatalf("%s: frame of %d bytes came out with %d", p, len(frame), len(opts.DataOut))
	}
	return ret, opts.DataOut, true
}

// checksumsOK reports whether frame is an IP packet whose checksums verify
// (IPv4 header; TCP or UDP over the pseudo-header, also behind IPv4
// options and IPv6 extension headers). A frame the checker cannot even
// read counts as not verifying.
func checksumsOK(frame []byte) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	return verifyChecksumsAnyHeaders(frame) == nil
}
