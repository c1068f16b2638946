package flows

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	flowrec "github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
)

// table is a fake map: per-CPU []bpf.ServiceStats or bpf.EdgeSlot values
// by uint32 key, as *ebpf.Map stores them. A key it lacks is
// ebpf.ErrKeyNotExist; failPut makes every Put fail.
type table struct {
	per     map[uint32][]bpf.ServiceStats
	slots   map[uint32]bpf.EdgeSlot
	failPut error
	puts    int
}

func newTable() *table {
	return &table{per: map[uint32][]bpf.ServiceStats{}, slots: map[uint32]bpf.EdgeSlot{}}
}

func (t *table) Lookup(key, out any) error {
	k := key.(uint32)
	switch o := out.(type) {
	case *[]bpf.ServiceStats:
		v, ok := t.per[k]
		if !ok {
			return fmt.Errorf("lookup %d: %w", k, ebpf.ErrKeyNotExist)
		}
		*o = append([]bpf.ServiceStats(nil), v...)
	case *bpf.EdgeSlot:
		*o = t.slots[k] // an array: every key has a value
	default:
		return fmt.Errorf("lookup into %T", out)
	}
	return nil
}

func (t *table) Put(key, value any) error {
	if t.failPut != nil {
		return t.failPut
	}
	t.puts++
	k := key.(uint32)
	switch v := value.(type) {
	case []bpf.ServiceStats:
		t.per[k] = append([]bpf.ServiceStats(nil), v...)
	case bpf.EdgeSlot:
		t.slots[k] = v
	default:
		return fmt.Errorf("put %T", value)
	}
	return nil
}

// stats is a per-CPU value: one bpf.ServiceStats per CPU, each
// counting n in every field.
func stats(n ...uint64) []bpf.ServiceStats {
	out := make([]bpf.ServiceStats, len(n))
	for i, v := range n {
		out[i] = bpf.ServiceStats{Packets: v, Bytes: 10 * v, ReplyPackets: 2 * v, ReplyBytes: 20 * v, NewFlows: 3 * v, Failovers: 4 * v, Drops: 5 * v, EdtDrops: 6 * v}
	}
	return out
}

// counters is what stats(n...) sums to, for a total n.
func counters(n uint64) Counters {
	return Counters{Packets: n, Bytes: 10 * n, ReplyPackets: 2 * n, ReplyBytes: 20 * n, NewFlows: 3 * n, Failovers: 4 * n, Drops: 5 * n}
}

type fakes struct {
	svc, edge, slots *table
	drops            bpf.Drops
	parser           bpf.Counters
	readErr          error
}

func newScope(t *testing.T, edgeSlots uint32) (*Scope, *fakes) {
	t.Helper()
	f := &fakes{svc: newTable(), edge: newTable(), slots: newTable()}
	s, err := New(Config{EdgeSlots: edgeSlots, CPUs: 2}, Deps{
		SvcStats: f.svc, EdgeStats: f.edge, EdgeSlots: f.slots,
		Drops:    func() (bpf.Drops, error) { return f.drops, f.readErr },
		Counters: func() (bpf.Counters, error) { return f.parser, f.readErr },
	})
	if err != nil {
		t.Fatal(err)
	}
	return s, f
}

func TestNewRejects(t *testing.T) {
	full := Deps{SvcStats: newTable(), EdgeStats: newTable(), EdgeSlots: newTable(),
		Drops: func() (bpf.Drops, error) { return bpf.Drops{}, nil }, Counters: func() (bpf.Counters, error) { return bpf.Counters{}, nil }}
	for _, tc := range []struct {
		name string
		cfg  Config
		deps func(d Deps) Deps
		ok   bool
	}{
		{"complete", Config{CPUs: 1}, func(d Deps) Deps { return d }, true},
		{"no svc stats", Config{CPUs: 1}, func(d Deps) Deps { d.SvcStats = nil; return d }, false},
		{"no edge slots", Config{CPUs: 1}, func(d Deps) Deps { d.EdgeSlots = nil; return d }, false},
		{"no drops", Config{CPUs: 1}, func(d Deps) Deps { d.Drops = nil; return d }, false},
		{"negative cpus", Config{CPUs: -1}, func(d Deps) Deps { return d }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg, tc.deps(full))
			if (err == nil) != tc.ok {
				t.Fatalf("New: %v, want ok %v", err, tc.ok)
			}
		})
	}
}

func TestSums(t *testing.T) {
	s, f := newScope(t, 4)
	f.svc.per[1] = stats(1, 2)    // web's first frontend: 3
	f.svc.per[2] = stats(10, 0)   // web's second: 10
	f.svc.per[7] = stats(100, 50) // db: 150
	f.drops[bpf.DropNoBackend] = 9
	f.drops[0] = 1000 // "none" is not reported
	f.parser[bpf.CounterIPv4] = 5
	f.parser[bpf.CounterNATStale] = 6

	got, err := s.Sums(context.Background(), map[string][]uint32{"web": {1, 2}, "db": {7}, "idle": nil})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]ServiceCounters{
		"web":  {counters(13), 6 * 13},
		"db":   {counters(150), 6 * 150},
		"idle": {},
	}
	if !reflect.DeepEqual(got.Services, want) {
		t.Errorf("services = %+v, want %+v", got.Services, want)
	}
	if len(got.Drops) != bpf.NumDropReasons-1 || got.Drops["no_backend"] != 9 || got.Drops["none"] != 0 {
		t.Errorf("drops = %v", got.Drops)
	}
	if _, ok := got.Drops["none"]; ok {
		t.Errorf("drops report reason 0: %v", got.Drops)
	}
	if len(got.Parser) != bpf.NumCounters || got.Parser["ipv4"] != 5 || got.Parser["nat_stale"] != 6 {
		t.Errorf("parser = %v", got.Parser)
	}

	one, err := s.Service([]uint32{1, 2})
	if err != nil || one != want["web"] {
		t.Errorf("Service = %+v, %v; want %+v", one, err, want["web"])
	}

	for _, tc := range []struct {
		name     string
		ctx      func() context.Context
		services map[string][]uint32
		readErr  error
		want     error
	}{
		{"unreadable slot", context.Background, map[string][]uint32{"web": {1, 99}}, nil, ebpf.ErrKeyNotExist},
		{"unreadable counters", context.Background, nil, ebpf.ErrNotSupported, ebpf.ErrNotSupported},
		{"ended ctx", func() context.Context {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx
		}, nil, nil, context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f.readErr = tc.readErr
			defer func() { f.readErr = nil }()
			if _, err := s.Sums(tc.ctx(), tc.services); !errors.Is(err, tc.want) {
				t.Fatalf("Sums: %v, want %v", err, tc.want)
			}
		})
	}
	s.Close()
	if _, err := s.Sums(context.Background(), nil); !errors.Is(err, errs.ErrClosed) {
		t.Errorf("Sums after Close: %v", err)
	}
	if _, err := s.Service([]uint32{1}); !errors.Is(err, errs.ErrClosed) {
		t.Errorf("Service after Close: %v", err)
	}
}

func TestVMStats(t *testing.T) {
	s, f := newScope(t, 8)
	f.edge.per[3] = stats(1, 1)
	f.edge.per[4] = stats(5, 0)
	f.edge.per[5] = stats(100, 0)
	edges := []Edge{
		{Name: "tap-a1", VMID: "a", Slot: 3},
		{Name: "tap-b", VMID: "b", Slot: 5},
		{Name: "tap-a2", VMID: "a", Slot: 4},
		{Name: "tap-a3", VMID: "a"}, // no slot: listed, not counted
	}
	for _, tc := range []struct {
		vm      string
		edges   []Edge
		want    VMStats
		wantErr error
	}{
		{"a", edges, VMStats{VMID: "a", Interfaces: []string{"tap-a1", "tap-a2", "tap-a3"}, Counters: counters(7)}, nil},
		{"b", edges, VMStats{VMID: "b", Interfaces: []string{"tap-b"}, Counters: counters(100)}, nil},
		{"c", edges, VMStats{}, errs.ErrNotFound},
		{"a", nil, VMStats{}, errs.ErrNotFound},
		{"a", []Edge{{Name: "tap-x", VMID: "a", Slot: 6}}, VMStats{}, ebpf.ErrKeyNotExist},
	} {
		t.Run(tc.vm, func(t *testing.T) {
			got, err := s.VMStats(context.Background(), tc.vm, tc.edges)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("VMStats(%s): %v, want %v", tc.vm, err, tc.wantErr)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("VMStats(%s) = %+v, want %+v", tc.vm, got, tc.want)
			}
		})
	}
	s.Close()
	if _, err := s.VMStats(context.Background(), "a", edges); !errors.Is(err, errs.ErrClosed) {
		t.Errorf("VMStats after Close: %v", err)
	}
}

func TestRegister(t *testing.T) {
	const mask = bpf.EdgeSlotMask
	type step struct {
		op          string // "reg" or "unreg"
		ifindex     int
		slot        uint32 // unreg: the slot given back; reg: the one wanted
		problem     bool
		wantEntries map[uint32]bpf.EdgeSlot
	}
	for _, tc := range []struct {
		name   string
		slots  uint32
		before map[uint32]bpf.EdgeSlot // what an earlier start left
		steps  []step
	}{
		{"fresh slots, round robin", 4, nil, []step{
			{op: "reg", ifindex: 10, slot: 1},
			{op: "reg", ifindex: 11, slot: 2},
			{op: "unreg", ifindex: 10, slot: 1},
			// 1 is free again, but 3 comes first.
			{op: "reg", ifindex: 12, slot: 3},
			{op: "reg", ifindex: 13, slot: 1},
			{op: "reg", ifindex: 14, problem: true},
		}},
		{"adopted after a restart", 4, map[uint32]bpf.EdgeSlot{20: {Ifindex: 20, Slot: 2}}, []step{
			{op: "reg", ifindex: 20, slot: 2},
			{op: "reg", ifindex: 21, slot: 1},
			{op: "reg", ifindex: 22, slot: 3},
			{op: "reg", ifindex: 23, problem: true},
		}},
		{"keys that clash", 8, nil, []step{
			{op: "reg", ifindex: 5, slot: 1},
			{op: "reg", ifindex: 5 + int(mask) + 1, problem: true},
			{op: "unreg", ifindex: 5, slot: 1},
			{op: "reg", ifindex: 5 + int(mask) + 1, slot: 2},
		}},
		{"no slots", 0, nil, []step{{op: "reg", ifindex: 1, problem: true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, f := newScope(t, tc.slots)
			for k, v := range tc.before {
				f.slots.slots[k] = v
			}
			for i, st := range tc.steps {
				key := uint32(st.ifindex) & mask
				if st.op == "unreg" {
					if err := s.Unregister(st.ifindex, st.slot); err != nil {
						t.Fatalf("step %d: %v", i, err)
					}
					if e := f.slots.slots[key]; e != (bpf.EdgeSlot{}) {
						t.Fatalf("step %d: entry %d = %+v after Unregister", i, key, e)
					}
					continue
				}
				f.edge.per[st.slot] = stats(7, 7) // what the slot counted before
				slot, problem, err := s.Register(st.ifindex)
				if err != nil {
					t.Fatalf("step %d: %v", i, err)
				}
				if (problem != "") != st.problem || slot != st.slot && !st.problem || st.problem && slot != 0 {
					t.Fatalf("step %d: Register(%d) = %d, %q; want slot %d, problem %v", i, st.ifindex, slot, problem, st.slot, st.problem)
				}
				if st.problem {
					continue
				}
				if e := f.slots.slots[key]; e != (bpf.EdgeSlot{Ifindex: uint32(st.ifindex), Slot: slot}) {
					t.Fatalf("step %d: entry %d = %+v", i, key, e)
				}
				_, adopted := tc.before[key]
				if z := make([]bpf.ServiceStats, 2); !adopted && !reflect.DeepEqual(f.edge.per[slot], z) {
					t.Fatalf("step %d: slot %d not zeroed: %+v", i, slot, f.edge.per[slot])
				}
			}
			if st := s.Status(); tc.slots > 0 && st.EdgeSlots != int(tc.slots)-1 {
				t.Errorf("status %+v", st)
			}
		})
	}
}

func TestRegisterFailures(t *testing.T) {
	s, f := newScope(t, 4)
	f.slots.failPut = ebpf.ErrNotSupported
	if _, _, err := s.Register(3); !errors.Is(err, ebpf.ErrNotSupported) {
		t.Fatalf("Register with failing writes: %v", err)
	}
	f.slots.failPut = nil
	if err := s.Unregister(3, 0); err != nil || f.slots.puts != 0 {
		t.Fatalf("Unregister of slot 0: %v, %d writes", err, f.slots.puts)
	}
	s.Close()
	if _, _, err := s.Register(4); !errors.Is(err, errs.ErrClosed) {
		t.Fatalf("Register after Close: %v", err)
	}
}

func TestNamer(t *testing.T) {
	var asked []int
	closing := errors.New("closing")
	for _, tc := range []struct {
		name     string
		lookup   func(int) (string, error)
		indexes  []int
		want     []string
		asked    []int
		wantErr  error
		services map[uint32]string
	}{
		{"attached, then the namespace once per index", func(i int) (string, error) {
			asked = append(asked, i)
			return fmt.Sprintf("ns%d", i), nil
		}, []int{1, 9, 9, 2, 8}, []string{"tap1", "ns9", "ns9", "up0", "ns8"}, []int{9, 8}, nil, nil},
		{"none in the namespace", func(i int) (string, error) { asked = append(asked, i); return "", nil },
			[]int{7, 7}, []string{"", ""}, []int{7}, nil, nil},
		{"no lookup", nil, []int{7, 1}, []string{"", "tap1"}, nil, nil, nil},
		{"closing", func(i int) (string, error) { asked = append(asked, i); return "", closing },
			[]int{7, 1, 8}, []string{"", "tap1", ""}, []int{7, 8}, closing, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			asked = nil
			s := &Scope{deps: Deps{InterfaceName: tc.lookup}}
			n := s.namer(Names{Services: map[uint32]string{3: "web"}, Interfaces: map[int]string{1: "tap1", 2: "up0"}})
			var got []string
			for _, i := range tc.indexes {
				got = append(got, n.iface(i))
			}
			if !reflect.DeepEqual(got, tc.want) || !reflect.DeepEqual(asked, tc.asked) || !errors.Is(n.err, tc.wantErr) || (tc.wantErr == nil) != (n.err == nil) {
				t.Errorf("names %q asked %v err %v; want %q asked %v err %v", got, asked, n.err, tc.want, tc.asked, tc.wantErr)
			}
			if n.service(3) != "web" || n.service(4) != "" {
				t.Errorf("services: %q %q", n.service(3), n.service(4))
			}
		})
	}
}

func TestIsEventCounter(t *testing.T) {
	for name, want := range map[string]bool{
		"ipv4": false, "tcp": false, "truncated": false, "parse_limit": false,
		"nat_stale": true, "snat_retries": true, "dsr_forwarded": true, "counter(99)": true,
	} {
		if got := IsEventCounter(name); got != want {
			t.Errorf("IsEventCounter(%q) = %v, want %v", name, got, want)
		}
	}
	for c := range bpf.NumCounters {
		name := bpf.Counter(c).String()
		if got, want := IsEventCounter(name), bpf.Counter(c) > bpf.CounterParseLimit; got != want {
			t.Errorf("IsEventCounter(%q) = %v, want %v", name, got, want)
		}
	}
}

// TestFlowsWithoutMaps: a Scope without the ring fails Flows rather
// than reading nil maps, and a closed one fails with ErrClosed.
func TestFlowsWithoutMaps(t *testing.T) {
	s, _ := newScope(t, 1)
	if _, err := s.Flows(context.Background(), 10, flowrec.Filter{}, Names{}); err == nil {
		t.Fatal("Flows without maps succeeded")
	}
	s.Close()
	if _, err := s.Flows(context.Background(), 10, flowrec.Filter{}, Names{}); !errors.Is(err, errs.ErrClosed) {
		t.Fatalf("Flows after Close: %v", err)
	}
}
