package edt

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
)

// TestSyncNode: the node entry is written at the first sync and then
// only when the count changes; a failed write is reported, and the next
// sync of that count writes it (the entry still holds the last count
// written, which a sync of it does not rewrite).
func TestSyncNode(t *testing.T) {
	p, err := New(Config{Enabled: true, Horizon: 250 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var written []uint64
	fail := false
	put := func(n uint64) error {
		if fail {
			return errors.New("map full")
		}
		written = append(written, n)
		return nil
	}
	for _, step := range []struct {
		n      uint64
		fail   bool
		wantOK bool
		want   []uint64 // written so far
	}{
		{0, false, true, []uint64{0}}, // the maps may be new: written once
		{0, false, true, []uint64{0}},
		{2, false, true, []uint64{0, 2}},
		{3, true, false, []uint64{0, 2}},
		{2, false, true, []uint64{0, 2}}, // the entry holds 2 still
		{3, false, true, []uint64{0, 2, 3}},
		{3, false, true, []uint64{0, 2, 3}},
	} {
		fail = step.fail
		err := p.SyncNode(step.n, put)
		if (err == nil) != step.wantOK || len(written) != len(step.want) {
			t.Fatalf("SyncNode(%d): %v, written %v; want ok %v, written %v", step.n, err, written, step.wantOK, step.want)
		}
		for i := range written {
			if written[i] != step.want[i] {
				t.Fatalf("SyncNode(%d): written %v, want %v", step.n, written, step.want)
			}
		}
	}
}

// TestValueOf: an unpaced service has the zero entry; a paced one the
// rate of its cap and the node's horizon; New refuses a horizon out of
// bounds when pacing is on.
func TestValueOf(t *testing.T) {
	p, err := New(Config{Enabled: true, Horizon: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := p.ValueOf(0); err != nil || v != (bpf.EDTValue{}) {
		t.Errorf("ValueOf(0) = %+v, %v; want the zero entry", v, err)
	}
	v, err := p.ValueOf(100)
	if err != nil || v.Rate != bpf.MbpsToEDTRate(100) || v.HorizonNs != uint64(50*time.Millisecond) {
		t.Errorf("ValueOf(100) = %+v, %v; want rate %d, horizon 50ms", v, err, bpf.MbpsToEDTRate(100))
	}
	w, _ := p.ValueOf(200)
	if !SameRate(v, v) || SameRate(v, w) {
		t.Errorf("SameRate: same %v, different %v", SameRate(v, v), SameRate(v, w))
	}
	v.Pacer, v.LastDeparture = 7, 99
	if u, _ := p.ValueOf(100); !SameRate(u, v) {
		t.Error("SameRate looks at the pacer or the clock")
	}
	for _, h := range []time.Duration{0, bpf.MaxEDTHorizon + 1} {
		if _, err := New(Config{Enabled: true, Horizon: h}); err == nil {
			t.Errorf("New with horizon %v: accepted", h)
		}
	}
	if _, err := New(Config{}); err != nil {
		t.Errorf("New with pacing off: %v", err)
	}
}

// TestInterfaceStatus: the mode of an interface and why, from its
// qdiscs and what Start made of it.
func TestInterfaceStatus(t *testing.T) {
	root := uint32(handleRoot)
	h := func(maj, min uint32) uint32 { return maj<<16 | min }
	for _, c := range []struct {
		name    string
		m       managedFQ
		qs      []qdiscInfo
		err     error
		mode    string
		managed bool
		reason  string
	}{
		{"fq root, ours", managedFQ{name: "a", installed: true, previous: "noqueue"}, []qdiscInfo{{kind: "fq", handle: h(HandleMajor, 0), parent: root}}, nil, ModeFQ, true, ""},
		{"fq under every mq class", managedFQ{}, []qdiscInfo{{kind: "mq", parent: root}, {kind: "fq", parent: h(0, 1)}, {kind: "fq", parent: h(0, 2)}}, nil, ModeFQ, false, ""},
		{"mq with another child", managedFQ{}, []qdiscInfo{{kind: "mq", parent: root}, {kind: "fq", parent: h(0, 1)}, {kind: "pfifo_fast", parent: h(0, 2)}}, nil, ModeHorizonPolicing, false, "pfifo_fast"},
		{"no root", managedFQ{}, nil, nil, ModeHorizonPolicing, false, "no root qdisc"},
		{"another root", managedFQ{}, []qdiscInfo{{kind: "noqueue", parent: root}}, nil, ModeHorizonPolicing, false, "root qdisc is noqueue, not fq"},
		{"fallback", managedFQ{name: "a", problem: "no sch_fq"}, []qdiscInfo{{kind: "noqueue", parent: root}}, nil, ModeHorizonPolicing, false, "no sch_fq"},
		{"unreadable", managedFQ{}, nil, errors.New("no such device"), ModeHorizonPolicing, false, "root qdisc unknown: no such device"},
	} {
		t.Run(c.name, func(t *testing.T) {
			st := interfaceStatus("a", c.m, c.qs, c.err)
			if st.Name != "a" || st.Mode != c.mode || st.Managed != c.managed || !strings.Contains(st.Reason, c.reason) || (c.reason == "") != (st.Reason == "") {
				t.Errorf("status %+v; want mode %s, managed %v, reason with %q", st, c.mode, c.managed, c.reason)
			}
		})
	}
}

// TestInterfacesOffAndClosed: no interface is reported while pacing is
// off or after Close; otherwise every attached and listed interface,
// once, sorted.
func TestInterfacesOffAndClosed(t *testing.T) {
	off, _ := New(Config{})
	if got := off.Interfaces([]string{"x0"}); got != nil {
		t.Errorf("pacing off: %+v", got)
	}
	p, _ := New(Config{Enabled: true, Horizon: time.Second, Interfaces: []string{"fluxvm-no-b", "fluxvm-no-a"}})
	got := p.Interfaces([]string{"fluxvm-no-c", "fluxvm-no-a"})
	var names []string
	for _, st := range got {
		names = append(names, st.Name)
	}
	if strings.Join(names, ",") != "fluxvm-no-a,fluxvm-no-b,fluxvm-no-c" {
		t.Errorf("interfaces %v, want a, b, c once each, sorted", names)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if got := p.Interfaces([]string{"x0"}); got != nil {
		t.Errorf("after Close: %+v", got)
	}
}
