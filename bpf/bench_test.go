package bpf

import (
	"encoding/binary"
	"net/netip"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/fluxvm/servicefabric/internal/pkt"
)

// BenchmarkDatapath measures the TC program per packet the honest way for
// BPF_PROG_TEST_RUN: the kernel would re-run a repeated test on the packet
// it already rewrote, so every call runs once (Repeat=1) on a fresh copy of
// the input and the kernel-reported durations are averaged. An empty TC
// program measured the same way gives the floor (syscall-side timer and skb
// setup), which is subtracted. The cases are interleaved in blocks because
// this machine's speed drifts.
//
//	go test -run '^$' -bench BenchmarkDatapath -benchtime 1x ./bpf/
//
// FLUXVM_BENCH_CALLS sets the calls per case (default 200000).
func BenchmarkDatapath(b *testing.B) {
	calls := 200000
	if s := os.Getenv("FLUXVM_BENCH_CALLS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			b.Fatalf("FLUXVM_BENCH_CALLS=%q", s)
		}
		calls = n
	}
	const blocks = 20
	per := calls / blocks

	// Real tier capacities: a shrunken LRU would measure eviction instead.
	h := newHarnessSized(b, 0)
	v4, v6 := variants()[0], variants()[2]
	v4.setup(h)
	v6.setup(h)
	h.edge() // per-interface statistics on, as on a configured VM edge
	// Two flows that already exist: the conntrack-hit case.
	if ret, _ := h.run(h.objs.FluxvmFromVm, v4.fwd(40000, pkt.SYN)); ret != tcOK {
		b.Fatal("v4 flow not set up")
	}
	if ret, _ := h.run(h.objs.FluxvmFromVm, v6.fwd(40000, pkt.SYN)); ret != tcOK {
		b.Fatal("v6 flow not set up")
	}

	empty, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SchedCLS,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
	})
	if err != nil {
		b.Fatal(err)
	}
	defer empty.Close()

	// New flows need a fresh tuple per call: vary the client port and the
	// low bytes of the client address.
	newFlow := func(v variant, i int) []byte {
		f := v.fwd(uint16(1024+i%60000), pkt.SYN)
		srcOff := 14 + 12 // IPv4 source
		if !v.client.Is4() {
			srcOff = 14 + 8 + 12 // last 4 bytes of the IPv6 source
		}
		binary.BigEndian.PutUint16(f[srcOff+2:], uint16(i/60000+2))
		return f
	}
	other := v4.frame(v4.clientAt(40000), netip.AddrPortFrom(v4.other, 80), pkt.ACK)

	type bcase struct {
		name   string
		metric string
		prog   *ebpf.Program
		frame  func(i int) []byte
		want   uint32
		sum    time.Duration
		n      int
	}
	cases := []*bcase{
		{name: "floor (empty TC program)", metric: "floor", prog: empty, frame: func(int) []byte { return other }, want: tcNext},
		{name: "pass-through (not a service)", metric: "pass", prog: h.objs.FluxvmFromVm, frame: func(int) []byte { return other }, want: tcNext},
		{name: "ipv4 tcp conntrack hit", metric: "v4-ct-hit", prog: h.objs.FluxvmFromVm, frame: func(int) []byte { return v4.fwd(40000, pkt.ACK) }, want: tcOK},
		{name: "ipv4 tcp new flow", metric: "v4-new-flow", prog: h.objs.FluxvmFromVm, frame: func(i int) []byte { return newFlow(v4, i) }, want: tcOK},
		{name: "ipv6 tcp conntrack hit", metric: "v6-ct-hit", prog: h.objs.FluxvmFromVm, frame: func(int) []byte { return v6.fwd(40000, pkt.ACK) }, want: tcOK},
		{name: "ipv6 tcp new flow", metric: "v6-new-flow", prog: h.objs.FluxvmFromVm, frame: func(i int) []byte { return newFlow(v6, i) }, want: tcOK},
	}
	// Prebuild inputs so that building them is not measured.
	inputs := make([][][]byte, len(cases))
	for ci, c := range cases {
		inputs[ci] = make([][]byte, calls)
		for i := range calls {
			inputs[ci][i] = c.frame(i)
		}
	}

	b.ResetTimer()
	for blk := range blocks {
		for ci, c := range cases {
			var ret uint32
			var err error
			h.th.Do(func() {
				for i := blk * per; i < (blk+1)*per; i++ {
					var d time.Duration
					ret, d, err = c.prog.Benchmark(inputs[ci][i], 1, nil)
					if err != nil || ret != c.want {
						return
					}
					c.sum += d
					c.n++
				}
			})
			if err != nil || ret != c.want {
				b.Fatalf("%s: verdict %d err %v", c.name, int32(ret), err)
			}
		}
	}
	b.StopTimer()

	floor := float64(cases[0].sum) / float64(cases[0].n)
	b.ReportMetric(floor, "ns/floor")
	for _, c := range cases[1:] {
		mean := float64(c.sum) / float64(c.n)
		b.Logf("%-30s %7.1f ns/pkt gross, %7.1f ns/pkt net of the %.1f ns floor (%d calls)", c.name, mean, mean-floor, floor, c.n)
		b.ReportMetric(mean-floor, "net-ns/"+c.metric)
	}
	for name, p := range map[string]*ebpf.Program{"from_vm": h.objs.FluxvmFromVm, "to_vm": h.objs.FluxvmToVm} {
		info, err := p.Info()
		if err != nil {
			b.Fatal(err)
		}
		if n, ok := info.VerifiedInstructions(); ok {
			b.Logf("verifier processed %d instructions for %s", n, name)
			b.ReportMetric(float64(n), "verified-insns/"+name)
		}
	}
}
