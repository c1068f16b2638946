package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// BenchmarkKatranPair measures our datapath against Katran's XDP
// balancer in pairs a few milliseconds apart, so that this machine's
// drifting speed cancels out of each pair's ratio:
//
//	scripts/katran-pair.sh KATRAN_SRC                        # TC
//	FLUXVM_BENCH_HOOK=xdp scripts/katran-pair.sh KATRAN_SRC  # XDP
//
// It skips unless FLUXVM_KATRAN_OBJ names Katran's compiled balancer
// (katran/lib/bpf/balancer.bpf.c with Katran's default flags: IPIP
// encapsulation; the script compiles it from a Katran tree into a
// temporary directory). Katran is loaded and filled as its own loader
// would for one IPv4 TCP VIP with default flags (the VIP of our
// established row), three reals, the VIP's consistent-hash ring, the
// gateway MAC, and one connection table per CPU of FLUXVM_KATRAN_LRU
// entries in all (Katran's default 8,000,000, split over the CPUs).
//
// Ours is BenchmarkDatapath's set-up at tier-M sizes, with the optional
// load-time features left out unless FLUXVM_BENCH_OMIT says otherwise
// (default "all"; "none" loads every feature), and with
// FLUXVM_BENCH_HOOK=xdp the north-south XDP object's cases (routed DSR).
// Both sides run the same frames in three rows: established (ours' "ipv4
// tcp conntrack hit"), new (a new tuple every call; Katran's new-flow
// rate counter zeroed before each block so that every new flow takes
// its full path, below its flood limit) and passthrough (not a VIP).
//
// Both sides are loaded afresh FLUXVM_PAIR_LOADS times (default 8), one
// after the other, and each load runs FLUXVM_PAIR_ROUNDS rounds (default
// 20): in each round, every row runs a block of FLUXVM_PAIR_CALLS calls
// (default 9000) on each side, the two blocks back to back, which side
// goes first alternating from round to round, each side's empty program
// (XDP for Katran, TC or XDP for ours) measured just before. Every call
// runs once (Repeat=1) on a fresh copy of its input and the
// kernel-reported durations are averaged (BenchmarkDatapath's method);
// a round's floor, the mean of its three empty-program blocks, is
// subtracted. A round's ratio is ours net over Katran's net, a load's
// the ratio of its rounds' mean nets. Each row reports the rounds'
// median and geometric mean, the loads' ratios, and their geometric mean
// with its 95% confidence interval (Student's t over the loads' log
// ratios): a load draws map memory and hash seeds afresh, which moves
// the ratio by several percent between loads (the A/A check below) and
// within a load not at all, so the rounds of one load would give too
// narrow an interval. With the defaults a load makes 180,000 new flows,
// as many as BenchmarkDatapath's 200,000 calls fill ours' conntrack to;
// at most 3/4 of the tier's conntrack is allowed, or inserts would
// evict. After each load both sides' counters must show that every row
// took the path it is named after.
//
// With FLUXVM_BENCH_HOOK=xdp ours' rows run with a context (the
// interface the frames arrive on, for the FIB), Katran's and both floors
// without, as in BenchmarkDatapath; FLUXVM_PAIR_XDP_CTX_FLOOR=1 runs ours'
// floor with ours' context, so that what the context costs the test run
// is not counted as ours.
//
// FLUXVM_PAIR_AA=1 makes the other side a second load of ours (no Katran
// needed): an A/A check of the instrument, whose ratios should be 1.
func BenchmarkKatranPair(b *testing.B) {
	obj := os.Getenv("FLUXVM_KATRAN_OBJ")
	aa := os.Getenv("FLUXVM_PAIR_AA") == "1"
	if obj == "" && !aa {
		b.Skip("FLUXVM_KATRAN_OBJ does not name a compiled Katran balancer (scripts/katran-pair.sh KATRAN_SRC builds one and runs this); FLUXVM_PAIR_AA=1 runs ours against ours")
	}
	testenv.RequirePrivileged(b)
	if on := os.Getenv("FLUXVM_BENCH_ON"); on != "" {
		b.Fatalf("FLUXVM_BENCH_ON=%q: not supported by BenchmarkKatranPair (FLUXVM_BENCH_OMIT chooses ours' features)", on)
	}
	hook := os.Getenv("FLUXVM_BENCH_HOOK")
	switch hook {
	case "":
		hook = "tc"
	case "tc", "xdp":
	default:
		b.Fatalf("FLUXVM_BENCH_HOOK=%q: tc or xdp", hook)
	}
	omitEnv := os.Getenv("FLUXVM_BENCH_OMIT")
	if omitEnv == "" {
		omitEnv = "all"
	}
	omit, err := ParseFeatures(omitEnv)
	if err != nil {
		b.Fatalf("FLUXVM_BENCH_OMIT: %v", err)
	}
	loads := benchEnvInt(b, "FLUXVM_PAIR_LOADS", 8)
	rounds := benchEnvInt(b, "FLUXVM_PAIR_ROUNDS", 20)
	calls := benchEnvInt(b, "FLUXVM_PAIR_CALLS", 9000)
	if loads*rounds < 3 {
		b.Fatalf("FLUXVM_PAIR_LOADS x FLUXVM_PAIR_ROUNDS = %d: at least 3 rounds for an interval", loads*rounds)
	}
	lru := benchEnvInt(b, "FLUXVM_KATRAN_LRU", katranDefaultLRU)
	how := "the default: optional node features off"
	if omit != AllFeatures {
		how = "not the default, which leaves every optional node feature out"
	}
	b.Logf("ours: load-time features loaded: %s (FLUXVM_BENCH_OMIT=%s, %s)", AllFeatures&^omit, omitEnv, how)
	b.Logf("%d loads x %d rounds x %d calls per block, hook %s", loads, rounds, calls, hook)

	var res []pairRound
	var names [2]string
	b.ResetTimer()
	for l := range loads {
		b.StopTimer()
		ours := oursPairSide(b, "ours", hook, omit, rounds*calls)
		var other *pairSide
		if aa {
			other = oursPairSide(b, "ours-b", hook, omit, rounds*calls)
			if hook == "tc" {
				// On one thread, as Katran runs on ours' (ours' XDP
				// rows need their own lab's interface).
				other.th = ours.th
			}
		} else {
			other = katranPairSide(b, obj, ours, lru)
		}
		if l == 0 {
			b.Logf("%s: %s", ours.name, ours.desc)
			b.Logf("%s: %s", other.name, other.desc)
		}
		sides := [2]*pairSide{other, ours}
		names = [2]string{other.name, ours.name}
		for _, s := range sides {
			s.before()
		}
		start, load := time.Now(), pairLoadavg()
		b.StartTimer()
		lr := measurePairs(b, sides, rounds, calls, l)
		b.StopTimer()
		for _, s := range sides {
			s.verify(b, rounds*calls)
			s.close()
		}
		b.Logf("load %d measured in %.1fs, load average %s", l+1, time.Since(start).Seconds(), load)
		res = append(res, lr...)
	}
	reportPairs(b, names, res, loads, hook)
}

// pairRows are the rows of BenchmarkKatranPair, in order.
var pairRows = []string{"established", "new", "passthrough"}

// pairSide is one side of BenchmarkKatranPair: an empty program of its
// hook (the floor) and the rows' cases (pairRows order), run on thread th.
type pairSide struct {
	name  string
	desc  string
	th    *testenv.Thread
	floor *benchCase
	rows  []*benchCase
	// before runs once before the measurement (counters to compare),
	// verify once after it, with the calls each row made: it fails b
	// unless every row took the path it is named after.
	before func()
	verify func(b *testing.B, calls int)
	// close frees what the side loaded (the next load's maps take its
	// memory).
	close func()
}

// pairRound is one round of BenchmarkKatranPair: per side, the floor's
// mean and each row's mean gross duration per call, in ns.
type pairRound struct {
	load  int // the load (both sides loaded afresh) it ran on
	first int // the side that ran first in every pair
	floor [2]float64
	gross [2][]float64
}

func (r pairRound) net(side, row int) float64 { return r.gross[side][row] - r.floor[side] }

// emptyProgram is a program of type typ that returns ret at once.
func emptyProgram(b *testing.B, typ ebpf.ProgramType, ret int32) *ebpf.Program {
	b.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         typ,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, ret), asm.Return()},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { p.Close() })
	return p
}

// floorCase is the empty program of typ on a 64-byte frame, as
// measureInterleavedOn measures it.
func floorCase(b *testing.B, typ ebpf.ProgramType) *benchCase {
	ret, name := int32(-1), "floor (empty TC program)"
	if typ == ebpf.XDP {
		ret, name = xdpPass, "floor (empty XDP program)"
	}
	frame := make([]byte, 64)
	return &benchCase{name: name, prog: emptyProgram(b, typ, ret), frame: func(int) []byte { return frame }, want: uint32(ret)}
}

// oursPairSide loads ours for hook (tc or xdp) with the features omit
// left out, at tier-M capacities, and picks BenchmarkDatapath's cases for
// the rows. total is the number of new flows the run will make: the
// conntrack map must hold them all, or the new row would measure
// eviction.
func oursPairSide(b *testing.B, name, hook string, omit Features, total int) *pairSide {
	b.Helper()
	var (
		h       *harness
		all     []*benchCase
		metrics []string
		svc     uint32
		floor   ebpf.ProgramType
	)
	switch hook {
	case "tc":
		spec, err := loadService()
		if err != nil {
			b.Fatal(err)
		}
		if omit != 0 {
			if err := setFeatures(spec, Options{OmitFeatures: omit}, "TC", true); err != nil {
				b.Fatal(err)
			}
		}
		h = newHarnessSpec(b, spec, 0)
		all = datapathCases(b, h, "", "")
		metrics, svc, floor = []string{"v4-ct-hit", "v4-new-flow", "pass"}, sid, ebpf.SchedCLS
	case "xdp":
		h, all = xdpBenchCasesOmit(b, total, omit)
		metrics, svc, floor = []string{"xdp-v4-dsr-hit", "xdp-v4-new-flow", "xdp-pass"}, sid+1, ebpf.XDP
	}
	s := &pairSide{name: name, th: h.th, floor: floorCase(b, floor)}
	for _, m := range metrics {
		i := slices.IndexFunc(all, func(c *benchCase) bool { return c.metric == m })
		if i < 0 {
			b.Fatalf("%s: no case %q", name, m)
		}
		s.rows = append(s.rows, all[i])
	}
	if hook == "xdp" && os.Getenv("FLUXVM_PAIR_XDP_CTX_FLOOR") == "1" {
		// The floor run with ours' context (the interface the frames
		// arrive on), as ours' XDP rows are: what the test run's
		// context costs is then not counted as ours.
		ctx := slices.Clone(s.rows[0].ctx)
		binary.NativeEndian.PutUint32(ctx[4:], uint32(len(s.floor.frame(0))))
		s.floor.ctx, s.floor.name = ctx, "floor (empty XDP program, with ours' context)"
	}
	capacity := h.objs.FluxvmFct4.MaxEntries()
	if uint64(total) > uint64(capacity)*3/4 {
		b.Fatalf("%d new flows (FLUXVM_PAIR_ROUNDS x FLUXVM_PAIR_CALLS) in a conntrack map of %d: at most 3/4 of it, or inserts would evict", total, capacity)
	}
	s.close = func() {
		h.objs.Close()
		for _, c := range append(s.rows, s.floor) {
			c.prog.Close()
		}
	}
	s.desc = fmt.Sprintf("the %s object at tier-M capacities (conntrack %d entries), rows %q, %q, %q, %s",
		hook, capacity, s.rows[0].name, s.rows[1].name, s.rows[2].name, s.floor.name)

	// The passthrough row's verdict (checked on every call) says it
	// found no service; the service's packets, the established and new
	// rows' calls exactly, that it was not counted as one.
	var st0 ServiceStats
	s.before = func() { st0 = h.stats(svc) }
	s.verify = func(b *testing.B, calls int) {
		b.Helper()
		st1 := h.stats(svc)
		newFlows, packets := st1.NewFlows-st0.NewFlows, st1.Packets-st0.Packets
		// The established flow and the first and last new flows are in
		// the conntrack map: nothing was evicted.
		var missing []string
		est, _ := frameTuple(s.rows[0].frame(0))
		if _, ok := h.ct(est); !ok {
			missing = append(missing, "the established flow")
		}
		lost := 0
		for _, i := range sampleIndexes(calls) {
			tp, _ := frameTuple(s.rows[1].frame(i))
			if _, ok := h.ct(tp); !ok {
				lost++
			}
		}
		if lost > 0 {
			missing = append(missing, fmt.Sprintf("%d of the first and last 1000 new flows", lost))
		}
		b.Logf("%s counters: service %d new flows +%d (want %d), packets +%d (want %d: established and new), not in conntrack: %v",
			name, svc, newFlows, calls, packets, 2*calls, missing)
		if newFlows != uint64(calls) || packets != uint64(2*calls) || len(missing) > 0 {
			b.Fatalf("%s did not take the intended paths (see its counters above)", name)
		}
	}
	return s
}

// sampleIndexes are the first and last 1000 of calls new flows.
func sampleIndexes(calls int) []int {
	var is []int
	for i := range min(1000, calls) {
		is = append(is, i, calls-1-i)
	}
	return is
}

// frameTuple is the IPv4 TCP or UDP flow of an Ethernet frame.
func frameTuple(f []byte) (tuple, error) {
	if len(f) < 14+20 || binary.BigEndian.Uint16(f[12:]) != 0x0800 {
		return tuple{}, errors.New("not an IPv4 frame")
	}
	ihl := int(f[14]&0xf) * 4
	if len(f) < 14+ihl+4 {
		return tuple{}, errors.New("truncated")
	}
	l4 := f[14+ihl:]
	src := netip.AddrPortFrom(netip.AddrFrom4([4]byte(f[26:30])), binary.BigEndian.Uint16(l4))
	dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte(f[30:34])), binary.BigEndian.Uint16(l4[2:]))
	return tuple{src, dst, f[23]}, nil
}

// Katran's compile-time constants (katran/lib/bpf/balancer_consts.h,
// default build) and its loader's default table size.
const (
	katranMaxVIPs    = 512
	katranRingSize   = 65537
	katranMaxConn    = 125000  // MAX_CONN_RATE: new flows per second and CPU before "flood"
	katranDefaultLRU = 8000000 // the loader's default LruSize, split over the forwarding CPUs

	// Global counters live past the per-VIP ones in its stats array.
	katranStatLRUMiss  = katranMaxVIPs + 1 // v1 SYN misses, v2 other TCP misses
	katranStatConnRate = katranMaxVIPs + 2 // v1 new flows in this window, v2 its start
	katranStatFallback = katranMaxVIPs + 3 // the shared table used: no per-CPU one

	ipprotoIPIP = 4
)

// Go images of the Katran map layouts the benchmark writes or reads
// (balancer_structs.h), on a little-endian host; Katran's network-order
// fields are bytes. loadKatran checks their sizes against the object.
type (
	katranFlowKey struct {
		Src, Dst [16]byte
		Ports    [4]byte // source, destination
		Proto    uint8
		_        [3]byte
	}
	katranRealPos struct {
		Pos   uint32
		_     uint32
		Atime uint64
	}
	katranVIP struct {
		Addr  [16]byte
		Port  [2]byte
		Proto uint8
		_     uint8
	}
	katranVIPMeta struct{ Flags, Num uint32 }
	katranReal    struct {
		Dst   [16]byte
		Flags uint8
		_     [3]byte
	}
	katranCtl   [8]byte // a u64, an ifindex or a MAC
	katranStats struct{ V1, V2 uint64 }
)

// katranLB is Katran's balancer loaded with one VIP.
type katranLB struct {
	coll     *ebpf.Collection
	prog     *ebpf.Program
	stats    *ebpf.Map
	lrus     []*ebpf.Map
	perCPU   int
	reals    map[netip.Addr]bool
	gateway  [6]byte
	verified int
	maxRate  uint64 // the most new flows one CPU counted in a window
	ncpu     int
}

// loadKatran loads the object at path and writes what Katran's loader
// writes for one IPv4 TCP VIP vip with default flags: the VIP (number
// 0), the reals (ids 1..), the VIP's ring (every slot a real; which real
// does not change the cost), the gateway MAC (ctl_array[0]) and one
// connection table per CPU, lruTotal entries split over them.
func loadKatran(b *testing.B, path string, vip netip.AddrPort, reals []netip.Addr, lruTotal int) *katranLB {
	b.Helper()
	spec, err := ebpf.LoadCollectionSpec(path)
	if err != nil {
		b.Fatalf("FLUXVM_KATRAN_OBJ: %v", err)
	}
	for _, m := range []struct {
		name       string
		key, value any
	}{
		{"vip_map", katranVIP{}, katranVIPMeta{}},
		{"reals", uint32(0), katranReal{}},
		{"ch_rings", uint32(0), uint32(0)},
		{"ctl_array", uint32(0), katranCtl{}},
		{"stats", uint32(0), katranStats{}},
		{"lru_mapping", uint32(0), uint32(0)},
	} {
		ms := spec.Maps[m.name]
		if ms == nil {
			b.Fatalf("%s: no map %s: not Katran's balancer", path, m.name)
		}
		if int(ms.KeySize) != binary.Size(m.key) || int(ms.ValueSize) != binary.Size(m.value) {
			b.Fatalf("%s: map %s has %d/%d-byte keys/values, the benchmark writes %d/%d", path, m.name, ms.KeySize, ms.ValueSize, binary.Size(m.key), binary.Size(m.value))
		}
	}
	inner := spec.Maps["lru_mapping"].InnerMap
	if inner == nil || int(inner.KeySize) != binary.Size(katranFlowKey{}) || int(inner.ValueSize) != binary.Size(katranRealPos{}) {
		b.Fatalf("%s: lru_mapping's inner map is not a connection table of %d/%d-byte keys/values", path, binary.Size(katranFlowKey{}), binary.Size(katranRealPos{}))
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			b.Fatalf("load Katran: %+v", ve)
		}
		b.Fatalf("load Katran: %v", err)
	}
	b.Cleanup(coll.Close)
	k := &katranLB{coll: coll, prog: coll.Programs["balancer_ingress"], stats: coll.Maps["stats"], reals: map[netip.Addr]bool{}, gateway: [6]byte{0x02, 0, 0, 0, 0, 0xfe}}
	if k.prog == nil {
		b.Fatalf("%s: no program balancer_ingress", path)
	}
	if info, err := k.prog.Info(); err == nil {
		if n, ok := info.VerifiedInstructions(); ok {
			k.verified = int(n)
		}
	}
	must := func(what string, err error) {
		b.Helper()
		if err != nil {
			b.Fatalf("Katran %s: %v", what, err)
		}
	}
	var ctl katranCtl
	copy(ctl[:], k.gateway[:])
	must("ctl_array", coll.Maps["ctl_array"].Put(uint32(0), ctl))
	vk := katranVIP{Proto: ipTCP}
	a := vip.Addr().As4()
	copy(vk.Addr[:], a[:])
	binary.BigEndian.PutUint16(vk.Port[:], vip.Port())
	must("vip_map", coll.Maps["vip_map"].Put(vk, katranVIPMeta{}))
	for i, r := range reals {
		var rd katranReal
		a := r.As4()
		copy(rd.Dst[:], a[:])
		must("reals", coll.Maps["reals"].Put(uint32(i+1), rd))
		k.reals[r] = true
	}
	keys, vals := make([]uint32, katranRingSize), make([]uint32, katranRingSize)
	for i := range keys {
		keys[i], vals[i] = uint32(i), uint32(1+i%len(reals))
	}
	_, err = coll.Maps["ch_rings"].BatchUpdate(keys, vals, nil)
	must("ch_rings", err)
	ncpu, err := ebpf.PossibleCPU()
	must("CPUs", err)
	k.ncpu = ncpu
	k.perCPU = lruTotal / ncpu
	for cpu := range ncpu {
		ms := inner.Copy()
		ms.Name, ms.MaxEntries = fmt.Sprintf("katran_lru%d", cpu), uint32(k.perCPU)
		m, err := ebpf.NewMap(ms)
		must(fmt.Sprintf("connection table of CPU %d", cpu), err)
		b.Cleanup(func() { m.Close() })
		k.lrus = append(k.lrus, m)
		must("lru_mapping", coll.Maps["lru_mapping"].Put(uint32(cpu), m))
	}
	return k
}

// stat is the sum over the CPUs of Katran's counter key.
func (k *katranLB) stat(b *testing.B, key uint32) katranStats {
	b.Helper()
	var s katranStats
	for _, p := range k.perCPUStat(b, key) {
		s.V1 += p.V1
		s.V2 += p.V2
	}
	return s
}

func (k *katranLB) perCPUStat(b *testing.B, key uint32) []katranStats {
	b.Helper()
	var per []katranStats
	if err := k.stats.Lookup(key, &per); err != nil {
		b.Fatalf("Katran stats[%d]: %v", key, err)
	}
	return per
}

// noteRate keeps the most new flows one CPU has counted in its current
// rate window.
func (k *katranLB) noteRate(b *testing.B) {
	for _, p := range k.perCPUStat(b, katranStatConnRate) {
		k.maxRate = max(k.maxRate, p.V1)
	}
}

// newBlock runs before each of Katran's new-flow blocks: it notes how
// many new flows the last block counted in its rate window and zeroes
// the rate counter, so that the block's new flows stay below the flood
// limit (past it Katran stops writing its connection table).
func (k *katranLB) newBlock(b *testing.B) {
	k.noteRate(b)
	if err := k.stats.Put(uint32(katranStatConnRate), make([]katranStats, k.ncpu)); err != nil {
		b.Fatalf("Katran rate counter: %v", err)
	}
}

// katranPairSide loads Katran for the VIP of ours' established row, with
// ours' backends as its reals, on ours' thread (XDP's test run needs no
// namespace of its own), and checks its forward path once.
func katranPairSide(b *testing.B, path string, ours *pairSide, lruTotal int) *pairSide {
	b.Helper()
	est, err := frameTuple(ours.rows[0].frame(0))
	if err != nil {
		b.Fatal(err)
	}
	var reals []netip.Addr
	for _, be := range variants()[0].backends {
		reals = append(reals, be.Addr())
	}
	start := time.Now()
	k := loadKatran(b, path, est.dst, reals, lruTotal)
	s := &pairSide{name: "katran", th: ours.th, floor: floorCase(b, ebpf.XDP)}
	s.desc = fmt.Sprintf("%s loaded in %.1fs (verifier processed %d instructions), VIP %s, %d reals, connection tables %d entries x %d CPUs",
		path, time.Since(start).Seconds(), k.verified, est.dst, len(reals), k.perCPU, len(k.lrus))

	// The established flow's entry on every CPU: Katran's tables are
	// per CPU, and the first packet (a SYN) creates it on the CPU it
	// runs on.
	syn := pkt.TCP(est.src, est.dst, pkt.SYN, payload)
	var errs []error
	s.th.Do(func() {
		var orig unix.CPUSet
		if err := unix.SchedGetaffinity(0, &orig); err != nil {
			errs = append(errs, err)
			return
		}
		defer unix.SchedSetaffinity(0, &orig)
		for cpu := range len(k.lrus) {
			var one unix.CPUSet
			one.Set(cpu)
			if unix.SchedSetaffinity(0, &one) != nil {
				continue // offline
			}
			if ret, _, err := k.prog.Test(syn); err != nil || ret != xdpTX {
				errs = append(errs, fmt.Errorf("the established flow's SYN on CPU %d: verdict %d, %v", cpu, ret, err))
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	// Its packets leave IPIP-encapsulated to a real, via the gateway,
	// the client's packet intact inside.
	in := ours.rows[0].frame(0)
	var ret uint32
	var out []byte
	s.th.Do(func() { ret, out, err = k.prog.Test(in) })
	if err != nil || ret != xdpTX || len(out) != len(in)+20 || [6]byte(out[:6]) != k.gateway ||
		out[14+9] != ipprotoIPIP || !k.reals[netip.AddrFrom4([4]byte(out[30:34]))] || !slices.Equal(out[34:], in[14:]) {
		b.Fatalf("Katran, established: verdict %d, %v, want XDP_TX IPIP to a real via %x\n got %x\n  in %x", ret, err, k.gateway, out, in)
	}
	s.th.Do(func() { ret, _, err = k.prog.Test(ours.rows[2].frame(0)) })
	if err != nil || ret != xdpPass {
		b.Fatalf("Katran, passthrough: verdict %d, %v, want XDP_PASS", ret, err)
	}

	for i, c := range ours.rows {
		kc := &benchCase{name: "katran " + pairRows[i], prog: k.prog, frame: c.frame, want: xdpTX}
		switch pairRows[i] {
		case "new":
			kc.before = func() { k.newBlock(b) }
		case "passthrough":
			kc.want = xdpPass
		}
		s.rows = append(s.rows, kc)
	}
	s.close = func() {
		k.coll.Close()
		for _, m := range k.lrus {
			m.Close()
		}
		s.floor.prog.Close()
	}
	var miss0, fallback0 katranStats
	s.before = func() {
		miss0, fallback0 = k.stat(b, katranStatLRUMiss), k.stat(b, katranStatFallback)
	}
	s.verify = func(b *testing.B, calls int) {
		b.Helper()
		k.noteRate(b) // the last block's
		miss, fallback := k.stat(b, katranStatLRUMiss), k.stat(b, katranStatFallback)
		found := 0
		sample := sampleIndexes(calls)
		for _, i := range sample {
			tp, _ := frameTuple(s.rows[1].frame(i))
			key := katranFlowKey{Proto: tp.proto}
			sa, da := tp.src.Addr().As4(), tp.dst.Addr().As4()
			copy(key.Src[:], sa[:])
			copy(key.Dst[:], da[:])
			binary.BigEndian.PutUint16(key.Ports[0:], tp.src.Port())
			binary.BigEndian.PutUint16(key.Ports[2:], tp.dst.Port())
			for _, m := range k.lrus {
				var v katranRealPos
				if m.Lookup(key, &v) == nil {
					found++
					break
				}
			}
		}
		synMiss, otherMiss, fb := miss.V1-miss0.V1, miss.V2-miss0.V2, fallback.V1-fallback0.V1
		b.Logf("katran counters: non-SYN connection-table misses +%d (want 0: established always found), SYN misses +%d (want %d: every new flow), fallback table +%d (want 0), most new flows in a rate window %d (flood past %d), first and last new flows in a connection table %d of %d",
			otherMiss, synMiss, calls, fb, k.maxRate, katranMaxConn, found, len(sample))
		if otherMiss != 0 || synMiss != uint64(calls) || fb != 0 || k.maxRate > katranMaxConn || found != len(sample) {
			b.Fatal("Katran did not take the intended paths (see its counters above)")
		}
	}
	return s
}

// measurePairs runs rounds rounds: in each, row by row, a block of calls
// calls of each side's floor and then of each side's row, the two sides
// back to back, side 0 first in even rounds and side 1 first in odd
// ones; a round's floor is the mean of its three floor blocks. The new
// row's i-th call in round r runs input r*calls+i (a new flow each).
func measurePairs(b *testing.B, sides [2]*pairSide, rounds, calls, load int) []pairRound {
	b.Helper()
	var res []pairRound
	inputs := make([][]byte, calls)
	block := func(s *pairSide, c *benchCase, r int) float64 {
		b.Helper()
		for i := range inputs {
			inputs[i] = c.frame(r*calls + i)
		}
		if c.before != nil {
			c.before()
		}
		var (
			ret uint32
			err error
			sum time.Duration
			n   int
		)
		s.th.Do(func() {
			for _, in := range inputs {
				var d time.Duration
				if c.ctx != nil {
					ret, d, err = progTestRun(c.prog, in, c.ctx)
				} else {
					ret, d, err = c.prog.Benchmark(in, 1, nil)
				}
				if err != nil || ret != c.want {
					return
				}
				sum += d
				n++
			}
		})
		if err != nil || ret != c.want {
			b.Fatalf("%s %s, round %d: verdict %d, %v (want %d)", s.name, c.name, r+1, int32(ret), err, c.want)
		}
		c.sum += sum
		c.n += n
		return float64(sum) / float64(n)
	}
	for r := range rounds {
		rd := pairRound{load: load, first: r % 2}
		order := [2]int{rd.first, 1 - rd.first}
		for _, si := range order {
			rd.gross[si] = make([]float64, len(pairRows))
		}
		for row := range pairRows {
			// The floors before every row: a disturbance in one floor
			// block weighs a third on the round's.
			for _, si := range order {
				rd.floor[si] += block(sides[si], sides[si].floor, r) / float64(len(pairRows))
			}
			for _, si := range order {
				rd.gross[si][row] = block(sides[si], sides[si].rows[row], r)
			}
		}
		res = append(res, rd)
	}
	return res
}

// reportPairs logs each round and, per row, both sides' medians and the
// ratio side 1 / side 0 (ours over the other): per round (median, and
// geometric mean with the interval the rounds would give if they were
// independent), and per load (the ratio of the load's mean nets), then
// the PAIR line: with more than one load, the geometric mean of the
// loads' ratios and its 95% interval, Student's t over their logs. Each
// load draws the maps' memory and hash seeds afresh, which moves its
// ratio by several percent (the A/A check) where the rounds of one load
// cannot see it. With one load, the rounds' geometric mean and interval.
func reportPairs(b *testing.B, names [2]string, res []pairRound, loads int, hook string) {
	b.Helper()
	ratio := func(r pairRound, row int) float64 { return r.net(1, row) / r.net(0, row) }
	for i, r := range res {
		var parts []string
		for row, name := range pairRows {
			parts = append(parts, fmt.Sprintf("%s %.1f/%.1f=%.2f", name, r.net(1, row), r.net(0, row), ratio(r, row)))
		}
		b.Logf("load %d round %2d (%s first) floors %s %.1f %s %.1f; net ns %s/%s: %s", r.load+1, i+1, names[r.first],
			names[0], r.floor[0], names[1], r.floor[1], names[1], names[0], strings.Join(parts, ", "))
	}
	col := func(f func(pairRound) float64) []float64 {
		xs := make([]float64, len(res))
		for i, r := range res {
			xs[i] = f(r)
		}
		return xs
	}
	what := fmt.Sprintf("Student's t over the log ratios of the %d loads", loads)
	if loads == 1 {
		what = fmt.Sprintf("Student's t over the %d rounds' log ratios, one load", len(res))
	}
	line := fmt.Sprintf("PAIR %s", pairRows[0])
	for row, name := range pairRows {
		for si := range names {
			b.Logf("%-12s %-7s median ns gross %7.1f, floor %6.1f, net %7.1f", name, names[si],
				pairMedian(col(func(r pairRound) float64 { return r.gross[si][row] })),
				pairMedian(col(func(r pairRound) float64 { return r.floor[si] })),
				pairMedian(col(func(r pairRound) float64 { return r.net(si, row) })))
		}
		rs := col(func(r pairRound) float64 { return ratio(r, row) })
		// Per load: the ratio of its rounds' mean nets (a net at or
		// below its floor, which the short rows meet when a floor block
		// is disturbed, has no log ratio but adds to a mean).
		type sums struct{ ours, other float64 }
		perLoad := make([]sums, loads)
		var byFirst [2][]float64
		for i, r := range res {
			perLoad[r.load].ours += r.net(1, row)
			perLoad[r.load].other += r.net(0, row)
			byFirst[r.first] = append(byFirst[r.first], rs[i])
		}
		var loadRatios []float64
		var loadList []string
		for _, p := range perLoad {
			loadRatios = append(loadRatios, p.ours/p.other)
			loadList = append(loadList, fmt.Sprintf("%.3f", p.ours/p.other))
		}
		rgm, rlo, rhi := geoMeanCI95(rs)
		gm, lo, hi := rgm, rlo, rhi
		if loads > 1 {
			gm, lo, hi = geoMeanCI95(loadRatios)
		}
		g0, _, _ := geoMeanCI95(byFirst[0])
		g1, _, _ := geoMeanCI95(byFirst[1])
		b.Logf("%-12s %s/%s per round: median %.3f (range %.2f-%.2f), geometric mean %.3f [%.3f, %.3f] (t over the %d rounds as if independent; NaN: a net at or below its floor); with %s first %.3f, with %s first %.3f",
			name, names[1], names[0], pairMedian(rs), slices.Min(rs), slices.Max(rs), rgm, rlo, rhi, len(rs), names[0], g0, names[1], g1)
		b.Logf("%-12s %s/%s per load (ratio of its rounds' mean nets): %s; geometric mean %.3f, 95%% CI [%.3f, %.3f] (%s)",
			name, names[1], names[0], strings.Join(loadList, ", "), gm, lo, hi, what)
		if row == 0 {
			line += fmt.Sprintf(" %s/%s=%.2f [%.2f,%.2f]", names[1], names[0], gm, lo, hi)
		} else {
			line += fmt.Sprintf(" %s=%.2f [%.2f,%.2f]", name, gm, lo, hi)
		}
		b.ReportMetric(gm, "ratio/"+name)
	}
	b.Logf("%s (%s; geometric means, 95%% CI: %s)", line, hook, what)
}

// pairMedian of xs (NaN for none).
func pairMedian(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// geoMeanCI95 is the geometric mean of the ratios xs and its 95%
// confidence interval: Student's t interval of the mean of log x,
// exponentiated. NaN when fewer than two, or any not positive (a net
// duration at or below its floor).
func geoMeanCI95(xs []float64) (gm, lo, hi float64) {
	n := len(xs)
	if n < 2 || slices.ContainsFunc(xs, func(x float64) bool { return !(x > 0) }) {
		return math.NaN(), math.NaN(), math.NaN()
	}
	var mean, ss float64
	for _, x := range xs {
		mean += math.Log(x)
	}
	mean /= float64(n)
	for _, x := range xs {
		d := math.Log(x) - mean
		ss += d * d
	}
	half := t975(n-1) * math.Sqrt(ss/float64(n-1)/float64(n))
	return math.Exp(mean), math.Exp(mean - half), math.Exp(mean + half)
}

// t975 is the 0.975 quantile of Student's t with df degrees of freedom:
// exact to three decimals from a table up to 30, then the
// Cornish-Fisher expansion around the normal quantile (error below
// 0.001 there).
func t975(df int) float64 {
	table := []float64{12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
		2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
		2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042}
	if df < 1 {
		return math.NaN()
	}
	if df <= len(table) {
		return table[df-1]
	}
	const z = 1.959964
	v := float64(df)
	z3, z5 := z*z*z, z*z*z*z*z
	return z + (z3+z)/(4*v) + (5*z5+16*z3+3*z)/(96*v*v)
}

func pairLoadavg() string {
	raw, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(raw)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "?"
}

// TestPairStatistics: the statistics BenchmarkKatranPair reports, on
// ratios whose answers are known.
func TestPairStatistics(t *testing.T) {
	for _, c := range []struct {
		name           string
		xs             []float64
		gm, lo, hi     float64
		median         float64
		undefinedRatio bool
	}{
		{name: "identical ratios: no spread", xs: []float64{0.8, 0.8, 0.8}, gm: 0.8, lo: 0.8, hi: 0.8, median: 0.8},
		// log 0.5 and log 2: mean 0, sd ln2*sqrt2, se ln2, t(1) 12.706.
		{name: "two ratios, one degree of freedom", xs: []float64{0.5, 2}, gm: 1, lo: math.Exp(-12.706 * math.Ln2), hi: math.Exp(12.706 * math.Ln2), median: 1.25},
		// logs -a, 0, a (a = ln 1.1): mean 0, sd a, se a/sqrt3, t(2) 4.303.
		{name: "three ratios", xs: []float64{1 / 1.1, 1, 1.1}, gm: 1, lo: math.Exp(-4.303 * math.Log(1.1) / math.Sqrt(3)), hi: math.Exp(4.303 * math.Log(1.1) / math.Sqrt(3)), median: 1},
		{name: "a net at its floor", xs: []float64{1, 0, 1.2}, median: 1, undefinedRatio: true},
		{name: "one ratio", xs: []float64{0.9}, median: 0.9, undefinedRatio: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			gm, lo, hi := geoMeanCI95(c.xs)
			if c.undefinedRatio {
				if !math.IsNaN(gm) || !math.IsNaN(lo) || !math.IsNaN(hi) {
					t.Errorf("geoMeanCI95 = %v [%v, %v], want NaN", gm, lo, hi)
				}
			} else {
				for _, v := range []struct {
					what      string
					got, want float64
				}{{"geometric mean", gm, c.gm}, {"low", lo, c.lo}, {"high", hi, c.hi}} {
					if math.Abs(v.got-v.want) > 1e-9*max(1, math.Abs(v.want)) {
						t.Errorf("%s %v, want %v", v.what, v.got, v.want)
					}
				}
			}
			if m := pairMedian(c.xs); m != c.median {
				t.Errorf("median %v, want %v", m, c.median)
			}
		})
	}
	// Past the table, the expansion against published quantiles.
	for df, want := range map[int]float64{30: 2.042, 31: 2.040, 39: 2.023, 40: 2.021, 59: 2.001, 60: 2.000, 120: 1.980, 1000: 1.962} {
		if got := t975(df); math.Abs(got-want) > 0.0015 {
			t.Errorf("t975(%d) = %.4f, want %.3f", df, got, want)
		}
	}
}
