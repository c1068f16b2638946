package ha

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
)

// testFlow is flow i of a mix: both families, TCP and UDP, every kind.
func testFlow(i int) Flow {
	v6 := i%2 == 1
	addr := func(v4, v6s string) netip.Addr {
		if v6 {
			return netip.MustParseAddr(v6s)
		}
		return netip.MustParseAddr(v4)
	}
	f := Flow{
		Client:  netip.AddrPortFrom(addr("198.51.100.7", "2001:db8:100::7"), uint16(1024+i%60000)),
		VIP:     netip.AddrPortFrom(addr("10.96.0.10", "fd00:96::10"), 80),
		Backend: netip.AddrPortFrom(addr("10.1.0.1", "fd00:1::1"), 8080),
		Proto:   conntrack.ProtoTCP, State: bpf.CTTCPEstablished,
		Age: time.Duration(i) * time.Millisecond, Idle: time.Second, TTL: time.Hour,
	}
	if i%5 == 4 {
		f.Proto, f.State = conntrack.ProtoUDP, bpf.CTUDP
	}
	switch i % 3 {
	case 0:
		f.Kind, f.ReverseDerived = conntrack.EastWest, true
	case 1:
		f.Kind, f.SNAT = conntrack.SNAT, netip.AddrPortFrom(addr("192.0.2.1", "2001:db8::1"), uint16(61000+i%4000))
		f.NAT = &NATHalf{Idle: 2 * time.Second}
	case 2:
		f.Kind, f.Audited = conntrack.DSR, i%4 == 2
	}
	return f
}

func testHeader() Header {
	return Header{Node: "edge-a", Service: "web", Epoch: 7, Journal: "j1", Seq: 42, Created: time.Unix(1700000000, 0).UTC(),
		Seeds: &Seeds{FlowHash: 0x5eed, Maglev: 7}}
}

func writeStream(t testing.TB, flows []Flow) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := NewWriter(&buf, testHeader())
	if err != nil {
		t.Fatal(err)
	}
	for i := range flows {
		if err := w.Write(&flows[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// readAll reads every chunk, returning the flows before the first error.
func readAll(data []byte) (Header, []Flow, error) {
	r, err := NewReader(bytes.NewReader(data))
	if err != nil {
		return Header{}, nil, err
	}
	var out []Flow
	for {
		chunk, err := r.Next()
		if err == io.EOF {
			return r.Header(), out, nil
		}
		if err != nil {
			return r.Header(), out, err
		}
		out = append(out, chunk...)
	}
}

// TestSnapshotRoundTrip: every kind of flow, both families, over several
// chunks, comes back equal, with the header.
func TestSnapshotRoundTrip(t *testing.T) {
	for _, n := range []int{0, 1, ChunkFlows, 2*ChunkFlows + 5} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			flows := make([]Flow, n)
			for i := range flows {
				flows[i] = testFlow(i)
			}
			h, got, err := readAll(writeStream(t, flows))
			if err != nil {
				t.Fatal(err)
			}
			want := testHeader()
			want.Format, want.Schema, want.Maps, want.RecordSize = FormatVersion, bpf.SchemaVersion, Maps, RecordSize
			if !reflect.DeepEqual(h, want) {
				t.Errorf("header %+v\nwant %+v", h, want)
			}
			if len(got) != n {
				t.Fatalf("%d flows back, want %d", len(got), n)
			}
			for i := range got {
				if !reflect.DeepEqual(got[i], flows[i]) {
					t.Fatalf("flow %d: %+v\nwant %+v", i, got[i], flows[i])
				}
			}
		})
	}
}

// TestSnapshotRefuses: a stream altered or cut anywhere is refused where
// it breaks, with the chunks before it intact; a header this node cannot
// read is refused before any flow.
func TestSnapshotRefuses(t *testing.T) {
	flows := make([]Flow, 2*ChunkFlows+3)
	for i := range flows {
		flows[i] = testFlow(i)
	}
	good := writeStream(t, flows)
	hdrLen := int(binary.LittleEndian.Uint32(good[8:12]))
	body := 12 + hdrLen                    // the first chunk's count
	chunk := 4 + ChunkFlows*RecordSize + 4 // one whole chunk
	mutate := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	header := func(edit func(h *Header)) []byte {
		h := testHeader()
		h.Format, h.Schema, h.Maps, h.RecordSize = FormatVersion, bpf.SchemaVersion, Maps, RecordSize
		edit(&h)
		var buf bytes.Buffer
		buf.Write(magic[:])
		raw, err := json.Marshal(h)
		if err != nil {
			t.Fatal(err)
		}
		buf.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(raw))))
		buf.Write(raw)
		buf.Write(good[body:])
		return buf.Bytes()
	}
	tests := []struct {
		name  string
		data  []byte
		want  error
		flows int // read before the error
	}{
		{"not a snapshot", []byte("GET / HTTP/1.1\r\n\r\n"), ErrFormat, 0},
		{"empty", nil, ErrFormat, 0},
		{"another format", header(func(h *Header) { h.Format = 3 }), ErrFormat, 0},
		{"format 0", header(func(h *Header) { h.Format = 0 }), ErrFormat, 0},
		// Format 2 names the source's seeds, format 1 does not: a
		// format-1 stream is read whole (an edge not yet upgraded).
		{"format 2 without seeds", header(func(h *Header) { h.Seeds = nil }), ErrFormat, 0},
		{"format 1 with seeds", header(func(h *Header) { h.Format = FormatV1 }), ErrFormat, 0},
		{"format 1", header(func(h *Header) { h.Format, h.Seeds = FormatV1, nil }), nil, len(flows)},
		{"another schema", header(func(h *Header) { h.Schema++ }), ErrFormat, 0},
		{"another record size", header(func(h *Header) { h.RecordSize = 96 }), ErrFormat, 0},
		{"a map off the allowlist", header(func(h *Header) { h.Maps = append(h.Maps, "fluxvm_spol") }), ErrFormat, 0},
		{"no service", header(func(h *Header) { h.Service = "" }), ErrFormat, 0},
		{"no epoch, a journal cursor", header(func(h *Header) { h.Epoch = 0 }), ErrFormat, 0},
		{"no epoch, a seq of no journal", header(func(h *Header) { h.Epoch, h.Journal = 0, "" }), ErrFormat, 0},
		{"no epoch, a journal at seq 0", header(func(h *Header) { h.Epoch, h.Seq = 0, 0 }), ErrFormat, 0},
		// A source without a lease: no epoch, no journal, read whole.
		{"no lease, no journal", header(func(h *Header) { h.Epoch, h.Journal, h.Seq = 0, "", 0 }), nil, len(flows)},
		{"a header field unknown", mutate(func(b []byte) []byte {
			return bytes.Replace(b, []byte(`"node"`), []byte(`"nope"`), 1)
		}), ErrFormat, 0},
		{"an oversize header", mutate(func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[8:], MaxHeaderSize+1)
			return b
		}), ErrFormat, 0},
		{"a flipped bit in the second chunk", mutate(func(b []byte) []byte {
			b[body+chunk+4+100] ^= 1
			return b
		}), ErrCorrupt, ChunkFlows},
		{"a chunk too big", mutate(func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[body:], MaxChunkFlows+1)
			return b
		}), ErrCorrupt, 0},
		{"cut in the second chunk", good[:body+chunk+1000], ErrTruncated, ChunkFlows},
		{"no end record", good[:len(good)-8-32], ErrTruncated, len(flows)},
		{"the end counts otherwise", mutate(func(b []byte) []byte {
			b[len(b)-32-8]++
			return b
		}), ErrCorrupt, len(flows)},
		{"the end's digest differs", mutate(func(b []byte) []byte {
			b[len(b)-1] ^= 0xff
			return b
		}), ErrCorrupt, len(flows)},
	}
	for _, tc := range tests {
		_, got, err := readAll(tc.data)
		if !errors.Is(err, tc.want) || len(got) != tc.flows {
			t.Errorf("%s: %v after %d flows, want %v after %d", tc.name, err, len(got), tc.want, tc.flows)
		}
	}
	// A record the datapath could not hold is refused even with a good
	// checksum (a writer of another implementation).
	bad := testFlow(0)
	rec, err := encodeFlow(&bad)
	if err != nil {
		t.Fatal(err)
	}
	rec[3] = 99 // state
	if _, err := decodeFlow(rec[:]); err == nil {
		t.Error("a record with an unknown state decoded")
	}
}

// TestSnapshotWriterRefusesBadFlows: the writer encodes only flows the
// datapath could hold.
func TestSnapshotWriterRefusesBadFlows(t *testing.T) {
	edits := map[string]func(f *Flow){
		"families mixed":            func(f *Flow) { f.Backend = netip.MustParseAddrPort("[fd00::1]:80") },
		"ICMP":                      func(f *Flow) { f.Proto = 1 },
		"UDP state on TCP":          func(f *Flow) { f.State = bpf.CTUDP },
		"an L7 flow":                func(f *Flow) { f.Kind = conntrack.L7 },
		"SNAT without its source":   func(f *Flow) { f.Kind, f.NAT, f.ReverseDerived = conntrack.SNAT, &NATHalf{}, false },
		"DSR with a NAT half":       func(f *Flow) { f.Kind, f.NAT, f.ReverseDerived = conntrack.DSR, &NATHalf{}, false },
		"stored east-west, no half": func(f *Flow) { f.ReverseDerived = false },
		"negative age":              func(f *Flow) { f.Age = -1 },
		"no backend":                func(f *Flow) { f.Backend = netip.AddrPort{} },
	}
	var buf bytes.Buffer
	w, err := NewWriter(&buf, testHeader())
	if err != nil {
		t.Fatal(err)
	}
	for name, edit := range edits {
		f := testFlow(0) // east-west, derived, IPv4 TCP
		edit(&f)
		if err := w.Write(&f); err == nil {
			t.Errorf("%s: written", name)
		}
	}
	if _, err := NewWriter(&buf, Header{Service: "web", Journal: "j1", Seq: 3, Seeds: &Seeds{}}); !errors.Is(err, ErrFormat) {
		t.Errorf("a journal cursor without an epoch: %v, want ErrFormat", err)
	}
	if _, err := NewWriter(&buf, Header{Service: "web"}); !errors.Is(err, ErrFormat) {
		t.Errorf("a header without the source's seeds: %v, want ErrFormat", err)
	}
	// A source without a lease writes epoch 0 and no cursor.
	if _, err := NewWriter(&buf, Header{Service: "web", Seeds: &Seeds{}}); err != nil {
		t.Errorf("a header of no lease and no journal: %v", err)
	}
}

// TestSnapshotBoundedMemory: a million flows stream through a writer and a
// reader joined by a pipe without the heap growing with them.
func TestSnapshotBoundedMemory(t *testing.T) {
	n := 1_000_000
	if testing.Short() {
		n = 100_000
	}
	pr, pw := io.Pipe()
	go func() {
		w, err := NewWriter(pw, testHeader())
		if err != nil {
			pw.CloseWithError(err)
			return
		}
		for i := 0; i < n; i++ {
			f := testFlow(i)
			if err := w.Write(&f); err != nil {
				pw.CloseWithError(err)
				return
			}
		}
		pw.CloseWithError(w.Close())
	}()
	r, err := NewReader(pr)
	if err != nil {
		t.Fatal(err)
	}
	var peak uint64
	var ms runtime.MemStats
	for chunks := 0; ; chunks++ {
		_, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if chunks%100 == 0 {
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
		}
	}
	if r.Flows() != uint64(n) {
		t.Fatalf("%d flows read, want %d", r.Flows(), n)
	}
	// The stream is n*128 bytes (128 MB for a million); the heap holds a
	// chunk or two of it.
	if peak > 64<<20 {
		t.Errorf("heap in use peaked at %d MiB streaming %d flows", peak>>20, n)
	}
}

// FuzzSnapshotReader: the reader never panics on any input, and every
// error is one of the stream's.
func FuzzSnapshotReader(f *testing.F) {
	flows := []Flow{testFlow(0), testFlow(1), testFlow(2)}
	var buf bytes.Buffer
	w, _ := NewWriter(&buf, testHeader())
	for i := range flows {
		w.Write(&flows[i])
	}
	w.Close()
	f.Add(buf.Bytes())
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _, err := readAll(data)
		if err != nil && !errors.Is(err, ErrFormat) && !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrTruncated) {
			t.Fatalf("uncategorised error %v", err)
		}
	})
}

// BenchmarkSnapshot: flows/s through the encoder and the decoder.
func BenchmarkSnapshot(b *testing.B) {
	flows := make([]Flow, 4*ChunkFlows)
	for i := range flows {
		flows[i] = testFlow(i)
	}
	b.Run("write", func(b *testing.B) {
		for b.Loop() {
			w, _ := NewWriter(io.Discard, testHeader())
			for i := range flows {
				w.Write(&flows[i])
			}
			w.Close()
		}
		b.ReportMetric(float64(len(flows)*b.N)/b.Elapsed().Seconds(), "flows/s")
	})
	data := writeStream(b, flows)
	b.Run("read", func(b *testing.B) {
		for b.Loop() {
			r, err := NewReader(bytes.NewReader(data))
			if err != nil {
				b.Fatal(err)
			}
			for {
				if _, err := r.Next(); err == io.EOF {
					break
				} else if err != nil {
					b.Fatal(err)
				}
			}
		}
		b.ReportMetric(float64(len(flows)*b.N)/b.Elapsed().Seconds(), "flows/s")
	})
}

// TestHeaderCheckSeeds: a header of other seeds is refused naming both
// pairs; the same seeds pass, and so does a format-1 header, which names
// none (an edge before seeds were carried).
func TestHeaderCheckSeeds(t *testing.T) {
	mine := Seeds{FlowHash: 0x5eed, Maglev: 7}
	for _, tc := range []struct {
		name  string
		seeds *Seeds
		want  []string // in the error; nil: accepted
	}{
		{"same seeds", &Seeds{FlowHash: 0x5eed, Maglev: 7}, nil},
		{"format 1, no seeds", nil, nil},
		{"other maglev seed", &Seeds{FlowHash: 0x5eed, Maglev: 8}, []string{`node "edge-a" wrote it with hash_seed=0x5eed maglev_seed=0x8, this edge has hash_seed=0x5eed maglev_seed=0x7`}},
		{"other hash seed", &Seeds{Maglev: 7}, []string{"hash_seed=0x0 maglev_seed=0x7, this edge has hash_seed=0x5eed"}},
	} {
		h := testHeader()
		h.Seeds = tc.seeds
		err := h.CheckSeeds(mine)
		if (err != nil) != (tc.want != nil) || err != nil && !errors.Is(err, ErrSeeds) {
			t.Errorf("%s: %v, want ErrSeeds: %v", tc.name, err, tc.want != nil)
			continue
		}
		for _, s := range tc.want {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("%s: %q lacks %q", tc.name, err, s)
			}
		}
	}
}
