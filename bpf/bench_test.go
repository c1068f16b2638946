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

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
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
//
// FLUXVM_BENCH_BASELINE names another build of the tier-M object (for
// example the committed one of an earlier revision, from `git show
// REV:bpf/fluxvm_service_bpfel.o`): its cases then run interleaved with
// ours in the same run, and each case reports ours/baseline. The object
// whose maps are created first measures slower (up to ~8% here, with the
// same object on both sides), so an A/B is two runs: one as is and one
// with FLUXVM_BENCH_BASELINE_FIRST=1, which creates the baseline's first;
// take the mean of the two ratios.
//
// FLUXVM_BENCH_ON=ha, flow_records or edt switches that feature on, in
// ours only, before the cases' flows are set up (see benchSwitchOn): with
// FLUXVM_BENCH_BASELINE set to this same object, each case's
// ours/baseline is then the price of the switch, on against off (TC
// only).
//
// FLUXVM_BENCH_HOOK=xdp measures the north-south XDP object instead, under
// the same case names (see benchmarkDatapathXDP): the XDP-against-XDP
// side of ../shared/tools/katrancmp, which runs this benchmark.
func BenchmarkDatapath(b *testing.B) {
	calls := benchCalls(b)
	switch hook := os.Getenv("FLUXVM_BENCH_HOOK"); hook {
	case "", "tc":
	case "xdp":
		if on := os.Getenv("FLUXVM_BENCH_ON"); on != "" {
			b.Fatalf("FLUXVM_BENCH_ON=%q: TC only (FLUXVM_BENCH_HOOK=xdp switches nothing on)", on)
		}
		benchmarkDatapathXDP(b, calls)
		return
	default:
		b.Fatalf("FLUXVM_BENCH_HOOK=%q: tc or xdp", hook)
	}

	h, cases, base := benchAgainstBaseline(b, datapathCases)
	if base != nil {
		ours := cases
		cases = nil
		for i := range ours {
			cases = append(cases, ours[i], base[i])
		}
		check := benchSwitchOn(b, h, cases)
		measureInterleaved(b, h.th, calls, cases, true)
		check()
		for i := 0; i < len(cases); i += 2 {
			r := float64(cases[i].sum) / float64(cases[i].n) / (float64(cases[i+1].sum) / float64(cases[i+1].n))
			b.Logf("%-34s ours/baseline %.3f (gross)", cases[i].name, r)
		}
	} else {
		check := benchSwitchOn(b, h, cases)
		measureInterleaved(b, h.th, calls, cases, false)
		check()
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

// datapathCases sets h up for BenchmarkDatapath and returns its cases,
// named with prefix (metrics with mprefix).
// benchAgainstBaseline builds the cases of this object on a harness of
// real tier capacities (a shrunken LRU would measure eviction instead)
// and, with FLUXVM_BENCH_BASELINE set to another object, the same cases
// on a harness of that object ("baseline " names, "base-" metrics),
// created first with FLUXVM_BENCH_BASELINE_FIRST=1 (so that creation
// order can be swapped between runs).
func benchAgainstBaseline(b *testing.B, mk func(b *testing.B, h *harness, prefix, mprefix string) []*benchCase) (h *harness, cases, base []*benchCase) {
	mine := func() {
		spec, err := loadService()
		if err != nil {
			b.Fatal(err)
		}
		h = newHarnessSpec(b, benchOmit(b, "FLUXVM_BENCH_OMIT", spec), 0)
		cases = mk(b, h, "", "")
	}
	path := os.Getenv("FLUXVM_BENCH_BASELINE")
	if path == "" || os.Getenv("FLUXVM_BENCH_BASELINE_FIRST") != "1" {
		mine()
	}
	if path != "" {
		spec, err := ebpf.LoadCollectionSpec(path)
		if err != nil {
			b.Fatalf("FLUXVM_BENCH_BASELINE: %v", err)
		}
		base = mk(b, newHarnessSpec(b, benchOmit(b, "FLUXVM_BENCH_BASELINE_OMIT", spec), 0), "baseline ", "base-")
		if h == nil {
			mine()
		}
	}
	return h, cases, base
}

func datapathCases(b *testing.B, h *harness, prefix, mprefix string) []*benchCase {
	v4, v6 := variants()[0], variants()[2]
	v4.setup(h)
	v6.setupAt(h, sid+1, 11) // a service and backends of its own
	h.edge()                 // per-interface statistics on, as on a configured VM edge
	if prefix == "" {
		benchSwitch(b, h, sid, sid+1)
	}
	// Two flows that already exist: the conntrack-hit case.
	if ret, _ := h.run(h.objs.FluxvmFromVm, v4.fwd(40000, pkt.SYN)); ret != tcOK {
		b.Fatal("v4 flow not set up")
	}
	if ret, _ := h.run(h.objs.FluxvmFromVm, v6.fwd(40000, pkt.SYN)); ret != tcOK {
		b.Fatal("v6 flow not set up")
	}

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
	otherReply := v4.frame(netip.AddrPortFrom(v4.other, 80), v4.clientAt(40000), pkt.ACK)
	directReply := v4.reply(v4.backends[0], 40001, pkt.ACK)

	cases := []*benchCase{
		{name: "pass-through (not a service)", metric: "pass", prog: h.objs.FluxvmFromVm, frame: func(int) []byte { return other }, want: tcNext},
		{name: "ipv4 tcp conntrack hit", metric: "v4-ct-hit", prog: h.objs.FluxvmFromVm, frame: func(int) []byte { return v4.fwd(40000, pkt.ACK) }, want: tcOK},
		{name: "ipv4 tcp new flow", metric: "v4-new-flow", prog: h.objs.FluxvmFromVm, frame: func(i int) []byte { return newFlow(v4, i) }, want: tcOK},
		{name: "ipv6 tcp conntrack hit", metric: "v6-ct-hit", prog: h.objs.FluxvmFromVm, frame: func(int) []byte { return v6.fwd(40000, pkt.ACK) }, want: tcOK},
		{name: "ipv6 tcp new flow", metric: "v6-new-flow", prog: h.objs.FluxvmFromVm, frame: func(i int) []byte { return newFlow(v6, i) }, want: tcOK},
		// The VM-edge egress: a reply of the established flow, and a
		// packet to a VM that is no reply of a flow.
		{name: "ipv4 tcp reply", metric: "v4-reply", prog: h.objs.FluxvmToVm, frame: func(int) []byte { return v4.reply(v4.backends[0], 40000, pkt.ACK) }, want: tcOK},
		{name: "ipv6 tcp reply", metric: "v6-reply", prog: h.objs.FluxvmToVm, frame: func(int) []byte { return v6.reply(v6.backends[0], 40000, pkt.ACK) }, want: tcOK},
		{name: "reply pass-through (not a flow)", metric: "reply-pass", prog: h.objs.FluxvmToVm, frame: func(int) []byte { return otherReply }, want: tcNext},
		// A backend endpoint's packet to a client that never went
		// through the VIP (the lab's direct path: a connection straight
		// to an address a frontend lists): the endpoint is indexed, no
		// slot finds a flow, nor does a stored half.
		{name: "reply pass-through (backend, no flow)", metric: "reply-pass-be", prog: h.objs.FluxvmToVm, frame: func(int) []byte { return directReply }, want: tcNext},
	}
	for _, c := range cases {
		c.name, c.metric = prefix+c.name, mprefix+c.metric
	}
	return cases
}

// benchSwitch turns on, in h, the run-time switch FLUXVM_BENCH_ON names
// (none when unset): ha sets meta's MetaFlagHA, flow_records a
// flow_sample_rate of 1 (every new flow recorded, its hits counted into
// the record), edt paces the services sids at MaxEDTRate (every reply
// stamped with a departure time; the rate is high enough that no reply
// of the benchmark meets the horizon).
func benchSwitch(b *testing.B, h *harness, sids ...uint32) {
	b.Helper()
	switch on := os.Getenv("FLUXVM_BENCH_ON"); on {
	case "":
	case "ha":
		h.haOn(true)
	case "flow_records":
		h.flowSampling(1)
	case "edt":
		for _, s := range sids {
			h.edt(s, MaxEDTRate, MaxEDTHorizon)
		}
	default:
		b.Fatalf("FLUXVM_BENCH_ON=%q: ha, flow_records or edt", on)
	}
}

// benchSwitchOn returns the check, run after the measurement, that the
// switch FLUXVM_BENCH_ON turned on in h (benchSwitch) was exercised by
// BenchmarkDatapath's cases: every new flow recorded (flow_records), the
// replies stamped (edt). HA replicates north-south flows alone: the
// east-west cases queue nothing (checked), so HA on prices the flag's
// test there; BenchmarkHA measures the north-south queueing.
func benchSwitchOn(b *testing.B, h *harness, cases []*benchCase) func() {
	b.Helper()
	on := os.Getenv("FLUXVM_BENCH_ON")
	c0 := h.counters()
	newFlows := func() (n uint64) {
		for _, c := range cases {
			if c.metric == "v4-new-flow" || c.metric == "v6-new-flow" {
				n += uint64(c.n)
			}
		}
		return n
	}
	return func() {
		b.Helper()
		c1 := h.counters()
		switch on {
		case "ha":
			var m Meta
			h.must(h.objs.FluxvmMeta.Lookup(uint32(0), &m))
			if m.Flags&MetaFlagHA == 0 {
				b.Fatal("FLUXVM_BENCH_ON=ha: meta's HA flag is off after the run")
			}
			if e := c1[CounterHAEmitted] - c0[CounterHAEmitted]; e != 0 {
				b.Fatalf("FLUXVM_BENCH_ON=ha: ha_emitted +%d, want 0 (east-west flows are not replicated)", e)
			}
			b.Logf("FLUXVM_BENCH_ON=ha: east-west flows queue nothing: the price of the flag's test alone")
		case "flow_records":
			n := newFlows()
			if r := c1[CounterFlowRecorded] - c0[CounterFlowRecorded]; n == 0 || r < n {
				b.Fatalf("FLUXVM_BENCH_ON=flow_records: flow_recorded +%d, want every one of the %d new flows", r, n)
			}
		case "edt":
			v4, v6 := variants()[0], variants()[2]
			for _, f := range [][]byte{v4.reply(v4.backends[0], 40000, pkt.ACK), v6.reply(v6.backends[0], 40000, pkt.ACK)} {
				if ret, _, ts := h.runTstamp(h.objs.FluxvmToVm, f, 0); ret != tcOK || ts == 0 {
					b.Fatalf("FLUXVM_BENCH_ON=edt: a reply left with verdict %d, tstamp %d: want TC_ACT_OK, stamped", int32(ret), ts)
				}
			}
		}
	}
}

// benchCalls is the number of calls per case: FLUXVM_BENCH_CALLS or 200000.
func benchCalls(b *testing.B) int {
	s := os.Getenv("FLUXVM_BENCH_CALLS")
	if s == "" {
		return 200000
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		b.Fatalf("FLUXVM_BENCH_CALLS=%q", s)
	}
	return n
}

// benchCase is one program and input sequence measured by
// measureInterleaved.
type benchCase struct {
	name   string
	metric string
	prog   *ebpf.Program
	frame  func(i int) []byte
	ctx    []byte // the program's context (BPF_PROG_TEST_RUN ctx_in), or nil
	want   uint32
	any    bool   // any verdict (an ablated variant)
	before func() // run before each of the case's blocks (map state it needs), or nil
	// after runs after each call on input i, unmeasured (to undo what
	// the call left in the maps, so that every call meets the same
	// state), or nil.
	after func(i int, ret uint32)
	// th is the thread (and network namespace) the case runs on, or nil
	// for the one measureInterleaved is given.
	th  *testenv.Thread
	sum time.Duration
	n   int
	// The sum and count of each block, in order (paired comparisons).
	blockSum []time.Duration
	blockN   []int
}

// measureInterleaved runs every case calls times with Repeat=1 on thread th,
// in 20 interleaved blocks, and reports each case's mean kernel-measured
// duration net of an empty TC program measured the same way in the same
// run (the floor).
//
// With pairs, cases come in pairs to compare (A/B): every other block runs
// each pair in the other order, since the case that runs first after
// another kind of case pays for warming the caches (measured: the same
// object against itself came out 7-8% slower when always run first).
//
// It returns the floor's case (its per-block figures net other cases').
func measureInterleaved(b *testing.B, th *testenv.Thread, calls int, cases []*benchCase, pairs bool) *benchCase {
	b.Helper()
	return measureInterleavedOn(b, th, calls, cases, pairs, ebpf.SchedCLS)
}

// measureInterleavedOn is measureInterleaved with a floor of program type
// floorType (an empty XDP program for XDP cases).
func measureInterleavedOn(b *testing.B, th *testenv.Thread, calls int, cases []*benchCase, pairs bool, floorType ebpf.ProgramType) *benchCase {
	b.Helper()
	const blocks = 20
	per := calls / blocks
	floorRet, floorName := int32(-1), "floor (empty TC program)"
	if floorType == ebpf.XDP {
		floorRet, floorName = xdpPass, "floor (empty XDP program)"
	}
	empty, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         floorType,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, floorRet), asm.Return()},
	})
	if err != nil {
		b.Fatal(err)
	}
	defer empty.Close()
	floorFrame := make([]byte, 64)
	cases = append([]*benchCase{{name: floorName, prog: empty, frame: func(int) []byte { return floorFrame }, want: uint32(floorRet)}}, cases...)

	// Prebuild inputs so that building them is not measured.
	inputs := make([][][]byte, len(cases))
	for ci, c := range cases {
		inputs[ci] = make([][]byte, per*blocks)
		for i := range per * blocks {
			inputs[ci][i] = c.frame(i)
		}
	}

	order := make([]int, len(cases))
	b.ResetTimer()
	for blk := range blocks {
		for i := range order {
			order[i] = i
			// cases[0] is the floor; pairs follow it.
			if pairs && blk%2 == 1 && i > 0 {
				order[i] = i + 1 - 2*((i-1)%2)
			}
		}
		for _, ci := range order {
			c := cases[ci]
			if c.before != nil {
				c.before()
			}
			var ret uint32
			var err error
			sum0, n0 := c.sum, c.n
			cth := th
			if c.th != nil {
				cth = c.th
			}
			cth.Do(func() {
				for i := blk * per; i < (blk+1)*per; i++ {
					var d time.Duration
					if c.ctx != nil {
						ret, d, err = progTestRun(c.prog, inputs[ci][i], c.ctx)
					} else {
						ret, d, err = c.prog.Benchmark(inputs[ci][i], 1, nil)
					}
					if err != nil || (ret != c.want && !c.any) {
						return
					}
					c.sum += d
					c.n++
					if c.after != nil {
						c.after(i, ret)
					}
				}
			})
			c.blockSum, c.blockN = append(c.blockSum, c.sum-sum0), append(c.blockN, c.n-n0)
			if err != nil || (ret != c.want && !c.any) {
				b.Fatalf("%s: verdict %d err %v", c.name, int32(ret), err)
			}
		}
	}
	b.StopTimer()

	floor := float64(cases[0].sum) / float64(cases[0].n)
	b.ReportMetric(floor, "ns/floor")
	for _, c := range cases[1:] {
		mean := float64(c.sum) / float64(c.n)
		b.Logf("%-34s %7.1f ns/pkt gross, %7.1f ns/pkt net of the %.1f ns floor (%d calls)", c.name, mean, mean-floor, floor, c.n)
		b.ReportMetric(mean-floor, "net-ns/"+c.metric)
	}
	return cases[0]
}

// BenchmarkMapFloor measures, the same way as BenchmarkDatapath, the map
// operations a new flow cannot avoid, in minimal programs on maps shaped
// like the tier's conntrack and reverse-NAT maps (LRU hash, same key and
// value sizes, same capacity): a lookup that misses, one insert, the
// sequence a new IPv4 east-west flow needs (conntrack lookup miss,
// conntrack insert: the floor under BenchmarkDatapath's new-flow cost on
// this machine), and the one it needed before replies were derived (a
// reverse-NAT insert as well). Keys are random, as the hash of a new tuple
// is. The costs are dominated by cache and TLB misses on the maps' buckets
// and elements, which no program change removes. The maps are far from
// full, as in BenchmarkDatapath: an insert into a full LRU also evicts,
// and costs more.
//
//	go test -run '^$' -bench BenchmarkMapFloor -benchtime 1x ./bpf/
func BenchmarkMapFloor(b *testing.B) {
	testenv.RequirePrivileged(b)
	calls := benchCalls(b)
	spec, err := Spec(TierM)
	if err != nil {
		b.Fatal(err)
	}
	caps, err := CapacitiesOf(spec)
	if err != nil {
		b.Fatal(err)
	}
	newLRU := func(keySize uint32) *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{
			Type:       ebpf.LRUHash,
			KeySize:    keySize,
			ValueSize:  uint32(binary.Size(CTValue{})),
			MaxEntries: caps.Conntrack,
		})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Close() })
		return m
	}
	k4 := uint32(binary.Size(Tuple4{}))
	ct4, miss4, ins4 := newLRU(k4), newLRU(k4), newLRU(k4)
	sct4, snat4 := newLRU(k4), newLRU(k4) // the stored-half sequence's own
	prog := func(ops ...mapOp) *ebpf.Program {
		p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Type:         ebpf.SchedCLS,
			License:      "GPL",
			Instructions: randomKeyProgram(int16(k4), ops),
		})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { p.Close() })
		return p
	}
	frame := make([]byte, 64)
	same := func(int) []byte { return frame }
	th := testenv.NewThread(b)
	measureInterleaved(b, th, calls, []*benchCase{
		{name: "lru lookup miss", metric: "lookup-miss", prog: prog(mapOp{miss4, false}), frame: same, want: tcNext},
		{name: "lru insert", metric: "insert", prog: prog(mapOp{ins4, true}), frame: same, want: tcNext},
		// An east-west new flow since generation 4 (derived replies):
		// the floor under BenchmarkDatapath's new flow.
		{name: "new flow: miss + ct insert", metric: "new-flow-floor", prog: prog(mapOp{ct4, false}, mapOp{ct4, true}), frame: same, want: tcNext},
		// What a new flow paid before (and a frontend with
		// SvcFlagRevStored still pays): a reverse-NAT insert as well.
		{name: "new flow, stored reply half: miss + ct insert + nat insert", metric: "new-flow-stored-floor", prog: prog(mapOp{sct4, false}, mapOp{sct4, true}, mapOp{snat4, true}), frame: same, want: tcNext},
	}, false)
}

// mapOp is one lookup (update false) or insert (update true) in a
// randomKeyProgram.
type mapOp struct {
	m      *ebpf.Map
	update bool
}

// randomKeyProgram builds a TC program that makes up a random keySize-byte
// key (the first 8 bytes random, the rest zero), runs ops with it in order
// and returns TC_ACT_UNSPEC. Inserts store a zeroed value.
func randomKeyProgram(keySize int16, ops []mapOp) asm.Instructions {
	const valueOff = -128 // value buffer; the key sits right below the frame top
	keyOff := -keySize
	ins := asm.Instructions{asm.Mov.Imm(asm.R1, 0)}
	for off := int16(valueOff); off < 0; off += 8 {
		ins = append(ins, asm.StoreMem(asm.R10, off, asm.R1, asm.DWord))
	}
	ins = append(ins,
		asm.FnGetPrandomU32.Call(),
		asm.StoreMem(asm.R10, keyOff, asm.R0, asm.Word),
		asm.FnGetPrandomU32.Call(),
		asm.StoreMem(asm.R10, keyOff+4, asm.R0, asm.Word),
	)
	for _, op := range ops {
		ins = append(ins,
			asm.LoadMapPtr(asm.R1, op.m.FD()),
			asm.Mov.Reg(asm.R2, asm.R10),
			asm.Add.Imm(asm.R2, int32(keyOff)),
		)
		if op.update {
			ins = append(ins,
				asm.Mov.Reg(asm.R3, asm.R10),
				asm.Add.Imm(asm.R3, valueOff),
				asm.Mov.Imm(asm.R4, 0), // BPF_ANY
				asm.FnMapUpdateElem.Call())
		} else {
			ins = append(ins, asm.FnMapLookupElem.Call())
		}
	}
	return append(ins, asm.Mov.Imm(asm.R0, -1), asm.Return())
}
