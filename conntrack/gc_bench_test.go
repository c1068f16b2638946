package conntrack

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"runtime/metrics"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/nat"
)

// BenchmarkGC collects 1,000,000 IPv4 flows in the maps of the tier L
// object (fluxvm_fct4 and fluxvm_nat4 at 1<<20 entries), half of them
// expired, over 1,000 Ready backends; and 100,000 flows the same way, to
// show that memory does not grow with the flows. Every iteration refills
// the maps with the timer stopped and times one GC.
//
// The flows are what program generation 4 learns: half of them east-west
// flows with derived replies (the conntrack entry alone, with
// bpf.CTFlagRevDerived), half stored ones (conntrack entry and reverse-NAT
// half, as a frontend with bpf.SvcFlagRevStored, or every east-west flow of
// generation 3, learns them), crossed with expiry so that each quarter of
// the flows is one combination. (Until generation 4 every flow was a
// stored one: figures taken before are of twice the NAT entries.) The
// self-check is exact: the expired half removed, with the NAT halves of
// the stored ones only, the kept stored flows proven paired, and no repair
// sweep.
//
// Sub-benchmarks: "batch" uses the kernel's batch map commands, "iterate"
// the key-by-key fallback of kernels without them; the ratio of the two,
// measured in the same run, is the figure to compare across machines.
//
// Metrics: entries/s is conntrack entries examined per second of GC;
// peak-heap-B is the most Go heap (live and not yet collected objects)
// above the level before GC, sampled every millisecond; B/op is all that
// GC allocated.
func BenchmarkGC(b *testing.B) {
	testenv.RequirePrivileged(b)
	const backends = 1000
	spec, err := bpf.Spec(bpf.TierL)
	if err != nil {
		b.Fatal(err)
	}
	mk := func(name string, entries uint32) *ebpf.Map {
		ms := spec.Maps[name].Copy()
		if entries != 0 {
			ms.MaxEntries = entries
		}
		m, err := ebpf.NewMap(ms)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Close() })
		return m
	}
	// IPv6 maps are not exercised; small ones save a few hundred MiB.
	ct4, nat4 := mk("fluxvm_fct4", 0), mk("fluxvm_nat4", 0)
	ct6, nat6 := mk("fluxvm_fct6", 1024), mk("fluxvm_nat6", 1024)
	be := mk("fluxvm_backends", 0)
	if ct4.MaxEntries() < 1_000_000 || nat4.MaxEntries() < 1_000_000 {
		b.Fatalf("tier L maps hold %d/%d entries, need 1,000,000", ct4.MaxEntries(), nat4.MaxEntries())
	}
	tab, err := nat.New(nat4, nat6)
	if err != nil {
		b.Fatal(err)
	}
	m, err := New(Config{CT4: ct4, CT6: ct6, Backends: be, NAT: tab})
	if err != nil {
		b.Fatal(err)
	}

	beAddr := func(id uint32) uint32 { return word(netip.AddrFrom4([4]byte{10, 200, byte(id >> 8), byte(id)})) }
	for id := uint32(1); id <= backends; id++ {
		if err := be.Put(id, bpf.Backend{Addr: [4]uint32{beAddr(id)}, Port: bpf.Port(8080), Family: bpf.FamilyIPv4,
			State: uint8(bpf.BackendReady), ServiceId: 1}); err != nil {
			b.Fatal(err)
		}
	}

	// The flows' clock: GC runs at t0; odd flows expired a second ago.
	const t0 = time.Hour
	vip := word(netip.MustParseAddr("10.96.0.1"))
	fill := func(flows int) {
		const chunk = 1 << 16
		ck := make([]bpf.Tuple4, 0, chunk)
		cv := make([]bpf.CTValue, 0, chunk)
		nk := make([]bpf.Tuple4, 0, chunk)
		nv := make([]bpf.NATValue, 0, chunk)
		flush := func() {
			if _, err := ct4.BatchUpdate(ck, cv, nil); err != nil {
				b.Fatal(err)
			}
			if len(nk) > 0 { // the chunk's stored flows
				if _, err := nat4.BatchUpdate(nk, nv, nil); err != nil {
					b.Fatal(err)
				}
			}
			ck, cv, nk, nv = ck[:0], cv[:0], nk[:0], nv[:0]
		}
		for i := range uint32(flows) {
			client := word(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}))
			bid := 1 + i%backends
			deadline := t0 + time.Hour
			if i%2 == 1 {
				deadline = t0 - time.Second
			}
			stored := i&2 != 0 // flows 2 and 3 of every 4: odd ones expired
			var flags uint8
			if !stored {
				flags = bpf.CTFlagRevDerived
			}
			ck = append(ck, bpf.Tuple4{Saddr: client, Daddr: vip, Sport: bpf.Port(40000), Dport: bpf.Port(80), Proto: ProtoTCP})
			cv = append(cv, bpf.CTValue{ServiceId: 1, BackendId: bid, CreatedNs: uint64(t0 - time.Minute),
				LastSeenNs: uint64(t0 - time.Minute), DeadlineNs: uint64(deadline), State: uint8(bpf.CTTCPEstablished),
				Flags: flags})
			if stored {
				nk = append(nk, bpf.Tuple4{Saddr: beAddr(bid), Daddr: client, Sport: bpf.Port(8080), Dport: bpf.Port(40000), Proto: ProtoTCP})
				nv = append(nv, bpf.NATValue{Vip: [4]uint32{vip}, Vport: bpf.Port(80), ServiceId: 1, BackendId: bid,
					LastSeenNs: uint64(t0 - time.Minute)})
			}
			if len(ck) == chunk {
				flush()
			}
		}
		if len(ck) > 0 {
			flush()
		}
	}

	for _, run := range []struct {
		flows int
		mode  string
	}{{1_000_000, "batch"}, {1_000_000, "iterate"}, {100_000, "batch"}, {100_000, "iterate"}} {
		flows := run.flows
		b.Run(fmt.Sprintf("flows=%d/%s", flows, run.mode), func(b *testing.B) {
			b.StopTimer() // only GC is timed
			for _, mm := range []*ebpf.Map{ct4, nat4} {
				if err := empty4(mm); err != nil {
					b.Fatal(err)
				}
			}
			m.mode.SetBatch(!(run.mode == "iterate"))
			b.Cleanup(func() { m.mode.SetBatch(!(false)) })
			b.ReportAllocs()
			var (
				scanned int
				spent   time.Duration
				peak    uint64
				repairs int
			)
			testHookRepairSweep = func() { repairs++ }
			b.Cleanup(func() { testHookRepairSweep = nil })
			for range b.N {
				fill(flows)
				runtime.GC()
				stop := sampleHeap()
				start := time.Now()
				b.StartTimer()
				res, err := m.GC(context.Background(), t0)
				b.StopTimer()
				spent += time.Since(start)
				peak = max(peak, stop())
				if err != nil {
					b.Fatal(err)
				}
				want := GCResult{Scanned: flows, Expired: flows / 2, PairedNATRemoved: flows / 4, NATScanned: flows / 4}
				if res != want || repairs != 0 {
					b.Fatalf("GC: %v (%d repair sweeps)\nwant %v (none)", res, repairs, want)
				}
				scanned += res.Scanned
			}
			b.ReportMetric(float64(scanned)/spent.Seconds(), "entries/s")
			b.ReportMetric(float64(peak), "peak-heap-B")
		})
	}
}

// empty4 empties fluxvm_fct4 or fluxvm_nat4 (16-byte keys, values of the
// map's own layout).
func empty4(m *ebpf.Map) error {
	if m.ValueSize() == uint32(binary.Size(bpf.CTValue{})) {
		return emptyBatch[bpf.CTValue](m)
	}
	return emptyBatch[bpf.NATValue](m)
}

func emptyBatch[V any](m *ebpf.Map) error {
	var c ebpf.MapBatchCursor
	keys := make([][16]byte, 4096)
	vals := make([]V, 4096)
	for {
		_, err := m.BatchLookupAndDelete(&c, keys, vals, nil)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func word(a netip.Addr) uint32 {
	b := a.As4()
	return binary.NativeEndian.Uint32(b[:])
}

// sampleHeap samples the Go heap (bytes in live and unswept objects) every
// millisecond until the returned function is called, which returns the
// peak above the level at the start.
func sampleHeap() func() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	read := func() uint64 { metrics.Read(s); return s[0].Value.Uint64() }
	base := read()
	var peak uint64
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(time.Millisecond)
		defer t.Stop()
		for {
			peak = max(peak, read())
			select {
			case <-done:
				peak = max(peak, read())
				return
			case <-t.C:
			}
		}
	}()
	return func() uint64 {
		close(done)
		<-finished
		if peak < base {
			return 0
		}
		return peak - base
	}
}
