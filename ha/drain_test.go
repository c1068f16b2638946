package ha

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/bpftest"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

func (n *node) haOn() {
	n.t.Helper()
	var m bpf.Meta
	if err := n.o.Maps.FluxvmMeta.Lookup(uint32(0), &m); err != nil {
		n.t.Fatal(err)
	}
	m.Flags |= bpf.MetaFlagHA
	if err := n.o.Maps.FluxvmMeta.Put(uint32(0), m); err != nil {
		n.t.Fatal(err)
	}
}

// TestReplication: flows the real datapath learns on node A queue records
// (fluxvm_haq) that the drainer turns into journal batches; a target
// cursor pulls them in small deltas, applies them to node B (which
// numbers services and backends otherwise) and acks; every flow then goes
// on on B exactly as on A. The queue is the only channel: no snapshot.
func TestReplication(t *testing.T) {
	a, b := newNode(t, 1, 1), newNode(t, 40, 100)
	a.haOn()
	j, err := NewJournal("web", 5, JournalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := NewDrainer(DrainerConfig{Queue: a.o.Maps.FluxvmHaq, Drops: a.o.Maps.FluxvmHadrop,
		Journal: func(sid uint32) *Journal {
			for _, s := range a.sids {
				if s == sid {
					return j
				}
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	type flow struct {
		k          conntrack.Key
		northSouth bool
		src, dst   netip.AddrPort
	}
	var flows []flow
	var cur Cursor
	pull := func() {
		t.Helper()
		if _, err := d.Drain(20 * time.Millisecond); err != nil {
			t.Fatal(err)
		}
		j.Seal()
		for {
			delta, err := j.Since(cur.Seq, cur.Journal, 7)
			if err != nil {
				t.Fatal(err)
			}
			if err := cur.Check(delta); err != nil {
				t.Fatalf("delta %d..%d: %v", delta.From, delta.To, err)
			}
			if _, err := Apply(context.Background(), delta, b.target()); err != nil {
				t.Fatal(err)
			}
			cur.Advance(delta)
			if err := j.Ack(cur.Seq); err != nil {
				t.Fatal(err)
			}
			if delta.To == delta.From {
				return
			}
		}
	}
	for round := 0; round < 3; round++ {
		for i := 0; i < 20; i++ {
			n := round*20 + i
			fe := frontends[n%len(frontends)]
			ns := fe.flags&bpf.SvcFlagNorthSouth != 0
			client := netip.MustParseAddr(fmt.Sprintf("10.0.0.%d", 1+n))
			switch {
			case fe.vip.Addr().Is6():
				client = netip.MustParseAddr(fmt.Sprintf("fd00::%x", 1+n))
			case ns:
				client = netip.MustParseAddr(fmt.Sprintf("198.51.100.%d", 1+n))
			}
			k := conntrack.Key{Client: netip.AddrPortFrom(client, uint16(43000+n)), VIP: fe.vip, Proto: conntrack.ProtoTCP}
			a.send(k, pkt.SYN, ns)
			ret, src, dst := a.send(k, pkt.ACK, ns)
			if ret != bpftest.TCOK {
				t.Fatalf("%s: verdict %d on A", k, int32(ret))
			}
			flows = append(flows, flow{k, ns, src, dst})
		}
		pull()
	}
	read, skipped, dropped, err := d.Stats()
	if err != nil || read != uint64(len(flows)) || skipped != 0 || dropped != 0 {
		t.Errorf("drainer: read %d, skipped %d, dropped %d (%v); want %d records, none skipped or dropped", read, skipped, dropped, err, len(flows))
	}
	for _, f := range flows {
		ret, src, dst := b.send(f.k, pkt.ACK, f.northSouth)
		if ret != bpftest.TCOK || src != f.src || dst != f.dst {
			t.Errorf("%s: on B %d %s -> %s, on A %s -> %s", f.k, int32(ret), src, dst, f.src, f.dst)
		}
	}
	if _, broken := pairs(t, b); broken != 0 {
		t.Errorf("%d flows on B without their reverse half", broken)
	}
	if st := j.Stats(); st.Batches != 0 || cur.Seq != st.LastSeq {
		t.Errorf("journal %+v, cursor %+v: want everything acked", st, cur)
	}
}
