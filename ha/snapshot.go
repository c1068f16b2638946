package ha

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"net/netip"
	"slices"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/group"
)

// The snapshot stream:
//
//	magic "FXVMHA\r\n" | u32 header length | header (JSON, Header)
//	chunk*: u32 flows (1..MaxChunkFlows) | flows × RecordSize bytes | u32 CRC-32C of the flows
//	end:    u32 0 | u64 total flows | SHA-256 of every chunk's flow bytes
//
// Integers are little-endian. A reader verifies each chunk before handing
// its flows out, so an importer applies only whole, verified chunks, and
// the end's count and digest before reporting the stream complete: a
// truncated or altered stream is refused where it breaks. The header names
// the format, the datapath schema, the maps the flows come from and the
// record size, so that a reader refuses what it cannot read rather than
// misread it, and (from format 2) the seeds of the edge that wrote it, so
// that an edge of other seeds refuses it (ErrSeeds).
const (
	// FormatVersion is the version of the stream this package writes.
	// Format 2 added Header.Seeds (required); a reader takes format 1 as
	// well, whose header has none (FormatV1).
	FormatVersion = 2
	// FormatV1 is the format before the header carried the seeds: still
	// read, and imported without a seed check (there is none to make),
	// so that an edge not yet upgraded replicates to one that is.
	FormatV1 = 1
	// RecordSize is the size of one encoded Flow.
	RecordSize = 128
	// MaxChunkFlows bounds a chunk; writers fill chunks of ChunkFlows.
	MaxChunkFlows = 4096
	// ChunkFlows is how many flows a Writer puts in a chunk.
	ChunkFlows = 1024
	// MaxHeaderSize bounds the JSON header.
	MaxHeaderSize = 64 << 10
	// MaxTTL bounds a flow's remaining time: longer than any conntrack
	// timeout a node may set, short enough that a flow cannot outlive
	// its backend by much on a node that imported it.
	MaxTTL = 30 * 24 * time.Hour
)

var magic = [8]byte{'F', 'X', 'V', 'M', 'H', 'A', '\r', '\n'}

// Maps is the fixed allowlist of maps a snapshot may carry: the
// service-owned flow maps, nothing else.
var Maps = []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"}

// Errors of the stream, checkable with errors.Is.
var (
	// ErrFormat: not a snapshot stream, or one of another format
	// version, schema, record size or map set.
	ErrFormat = errors.New("ha: not a snapshot this node can read")
	// ErrCorrupt: a chunk's checksum, a count or the end's digest does
	// not match, or a record is not a flow the datapath could hold.
	ErrCorrupt = errors.New("ha: snapshot corrupt")
	// ErrTruncated: the stream ended before its end record.
	ErrTruncated = errors.New("ha: snapshot truncated")
	// ErrSeeds: the snapshot comes from an edge whose flow-hash or Maglev
	// seed differs from the importer's (Target.Seeds): the two would send
	// the same new flow to different backends, so they are no group, and
	// the import applies nothing.
	ErrSeeds = errors.New("ha: snapshot of an edge with other seeds")
)

// Seeds are the two seeds that decide a new flow's backend on an edge
// (hash_seed and maglev_seed): package group's, which compares the edges
// of a group. Edges that continue each other's flows (an HA pair, the
// edges of a group behind ECMP) must have the same.
type Seeds = group.Seeds

// CheckSeeds reports, wrapping ErrSeeds, when the header's seeds are not
// want; a format-1 header (no seeds) passes: see FormatV1.
func (h *Header) CheckSeeds(want Seeds) error {
	if h.Seeds == nil || *h.Seeds == want {
		return nil
	}
	return fmt.Errorf("%w: node %q wrote it with %s, this edge has %s", ErrSeeds, h.Node, *h.Seeds, want)
}

// Header describes a snapshot.
type Header struct {
	Format int `json:"format"`
	// Schema is the source's datapath schema (bpf.SchemaVersion).
	Schema uint32 `json:"schema"`
	// Node names the source edge; Service the service whose flows these
	// are.
	Node    string `json:"node"`
	Service string `json:"service"`
	// Epoch is the source's lease epoch; 0 when the source holds no
	// lease (it runs without replication: a planned move of a service's
	// flows needs none), which every edge holding a lease refuses as
	// older than its own.
	Epoch Epoch `json:"epoch"`
	// Journal and Seq are the source journal's cursor the snapshot
	// includes: a target continues with the deltas after it. A source
	// without a lease has no journal: Journal is empty and Seq 0, and the
	// snapshot moves no target's cursor.
	Journal string `json:"journal,omitempty"`
	Seq     uint64 `json:"seq"`
	// Maps are the maps the flows come from (Maps).
	Maps []string `json:"maps"`
	// RecordSize is the size of one encoded flow (RecordSize).
	RecordSize int `json:"record_size"`
	// Seeds are the source edge's seeds: required from format 2 on
	// (NewWriter refuses a header without), absent in format 1.
	Seeds *Seeds `json:"seeds,omitempty"`
	// Created is when the export began (wall clock, for people).
	Created time.Time `json:"created"`
}

// check verifies that h describes a stream this package reads.
func (h *Header) check() error {
	switch {
	case h.Format != FormatVersion && h.Format != FormatV1:
		return fmt.Errorf("%w: format %d, this node reads %d and %d", ErrFormat, h.Format, FormatV1, FormatVersion)
	case h.Format == FormatVersion && h.Seeds == nil:
		return fmt.Errorf("%w: format %d without the source's seeds", ErrFormat, h.Format)
	case h.Format == FormatV1 && h.Seeds != nil:
		return fmt.Errorf("%w: format %d with seeds (format %d carries them)", ErrFormat, h.Format, FormatVersion)
	case h.Schema != bpf.SchemaVersion:
		return fmt.Errorf("%w: datapath schema %d, this node has %d", ErrFormat, h.Schema, bpf.SchemaVersion)
	case h.RecordSize != RecordSize:
		return fmt.Errorf("%w: record size %d, this node reads %d", ErrFormat, h.RecordSize, RecordSize)
	case !slices.Equal(h.Maps, Maps):
		return fmt.Errorf("%w: maps %q, the allowlist is %q", ErrFormat, h.Maps, Maps)
	case h.Service == "":
		return fmt.Errorf("%w: no service named", ErrFormat)
	case h.Epoch == 0 && (h.Journal != "" || h.Seq != 0):
		return fmt.Errorf("%w: a journal cursor (%q, seq %d) without a lease epoch", ErrFormat, h.Journal, h.Seq)
	}
	return nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Writer writes a snapshot stream. Write flows, then Close: a stream
// without its end is refused by every reader.
type Writer struct {
	w      *bufio.Writer
	chunk  []byte
	n      int // flows in chunk
	total  uint64
	digest hash.Hash
	err    error
}

// NewWriter writes the magic and h (Format, Schema, Maps and RecordSize
// filled in) to w. h.Seeds must be set: the seeds of the edge whose flows
// these are (an error wrapping ErrFormat otherwise).
func NewWriter(w io.Writer, h Header) (*Writer, error) {
	h.Format, h.Schema, h.Maps, h.RecordSize = FormatVersion, bpf.SchemaVersion, slices.Clone(Maps), RecordSize
	if err := h.check(); err != nil {
		return nil, err
	}
	hdr, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("ha: snapshot header: %w", err)
	}
	sw := &Writer{w: bufio.NewWriterSize(w, 64<<10), chunk: make([]byte, 0, ChunkFlows*RecordSize), digest: sha256.New()}
	sw.w.Write(magic[:])
	sw.w.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(hdr))))
	if _, err := sw.w.Write(hdr); err != nil {
		return nil, fmt.Errorf("ha: snapshot header: %w", err)
	}
	return sw, nil
}

// Write adds f to the stream.
func (w *Writer) Write(f *Flow) error {
	if w.err != nil {
		return w.err
	}
	rec, err := encodeFlow(f)
	if err != nil {
		return err
	}
	w.chunk = append(w.chunk, rec[:]...)
	if w.n++; w.n == ChunkFlows {
		w.err = w.flush()
	}
	return w.err
}

func (w *Writer) flush() error {
	if w.n == 0 {
		return nil
	}
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], uint32(w.n))
	w.w.Write(b[:])
	w.w.Write(w.chunk)
	binary.LittleEndian.PutUint32(b[:], crc32.Checksum(w.chunk, castagnoli))
	if _, err := w.w.Write(b[:]); err != nil {
		return fmt.Errorf("ha: snapshot: %w", err)
	}
	w.digest.Write(w.chunk)
	w.total += uint64(w.n)
	w.chunk, w.n = w.chunk[:0], 0
	return nil
}

// Close writes the last chunk and the end record, and flushes; it does not
// close the underlying writer. Flows reports how many were written.
func (w *Writer) Close() error {
	if w.err != nil {
		return w.err
	}
	if w.err = w.flush(); w.err != nil {
		return w.err
	}
	var end [4 + 8]byte
	binary.LittleEndian.PutUint64(end[4:], w.total)
	w.w.Write(end[:])
	w.w.Write(w.digest.Sum(nil))
	if err := w.w.Flush(); err != nil {
		w.err = fmt.Errorf("ha: snapshot: %w", err)
		return w.err
	}
	w.err = errors.New("ha: snapshot writer closed")
	return nil
}

// Flows is the number of flows written so far.
func (w *Writer) Flows() uint64 { return w.total + uint64(w.n) }

// Reader reads a snapshot stream chunk by chunk.
type Reader struct {
	r      *bufio.Reader
	h      Header
	buf    []byte
	flows  []Flow
	total  uint64
	digest hash.Hash
	done   bool
}

// NewReader reads and checks the stream's magic and header.
func NewReader(r io.Reader) (*Reader, error) {
	sr := &Reader{r: bufio.NewReaderSize(r, 64<<10), digest: sha256.New()}
	var m [8]byte
	if _, err := io.ReadFull(sr.r, m[:]); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrFormat, err)
	}
	if m != magic {
		return nil, fmt.Errorf("%w: no snapshot magic", ErrFormat)
	}
	n, err := sr.u32()
	if err != nil {
		return nil, err
	}
	if n == 0 || n > MaxHeaderSize {
		return nil, fmt.Errorf("%w: header of %d bytes (at most %d)", ErrFormat, n, MaxHeaderSize)
	}
	hdr := make([]byte, n)
	if _, err := io.ReadFull(sr.r, hdr); err != nil {
		return nil, fmt.Errorf("%w: header: %v", ErrTruncated, err)
	}
	dec := json.NewDecoder(bytes.NewReader(hdr))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&sr.h); err != nil {
		return nil, fmt.Errorf("%w: header: %v", ErrFormat, err)
	}
	if err := sr.h.check(); err != nil {
		return nil, err
	}
	return sr, nil
}

// Header is the stream's header.
func (r *Reader) Header() Header { return r.h }

func (r *Reader) u32() (uint32, error) {
	var b [4]byte
	if _, err := io.ReadFull(r.r, b[:]); err != nil {
		return 0, fmt.Errorf("%w: %v", ErrTruncated, err)
	}
	return binary.LittleEndian.Uint32(b[:]), nil
}

// Next returns the next chunk's flows, verified (valid until the next
// call), or io.EOF once the end record matched every chunk read.
func (r *Reader) Next() ([]Flow, error) {
	if r.done {
		return nil, io.EOF
	}
	n, err := r.u32()
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, r.end()
	}
	if n > MaxChunkFlows {
		return nil, fmt.Errorf("%w: a chunk of %d flows (at most %d)", ErrCorrupt, n, MaxChunkFlows)
	}
	size := int(n) * RecordSize
	if cap(r.buf) < size {
		r.buf = make([]byte, size)
	}
	r.buf = r.buf[:size]
	if _, err := io.ReadFull(r.r, r.buf); err != nil {
		return nil, fmt.Errorf("%w: chunk after %d flows: %v", ErrTruncated, r.total, err)
	}
	sum, err := r.u32()
	if err != nil {
		return nil, err
	}
	if crc32.Checksum(r.buf, castagnoli) != sum {
		return nil, fmt.Errorf("%w: the chunk after %d flows fails its checksum", ErrCorrupt, r.total)
	}
	r.flows = r.flows[:0]
	for i := 0; i < int(n); i++ {
		f, err := decodeFlow(r.buf[i*RecordSize : (i+1)*RecordSize])
		if err != nil {
			return nil, fmt.Errorf("%w: flow %d: %v", ErrCorrupt, r.total+uint64(i), err)
		}
		r.flows = append(r.flows, f)
	}
	r.digest.Write(r.buf)
	r.total += uint64(n)
	return r.flows, nil
}

func (r *Reader) end() error {
	var b [8 + sha256.Size]byte
	if _, err := io.ReadFull(r.r, b[:]); err != nil {
		return fmt.Errorf("%w: end record: %v", ErrTruncated, err)
	}
	if total := binary.LittleEndian.Uint64(b[:8]); total != r.total {
		return fmt.Errorf("%w: the end counts %d flows, the chunks held %d", ErrCorrupt, total, r.total)
	}
	if !bytes.Equal(b[8:], r.digest.Sum(nil)) {
		return fmt.Errorf("%w: the end's digest does not match the chunks", ErrCorrupt)
	}
	r.done = true
	return io.EOF
}

// Flows is the number of flows read so far.
func (r *Reader) Flows() uint64 { return r.total }

// The record (RecordSize bytes, little-endian):
//
//	0  family (4 or 6)     1 proto     2 kind     3 state
//	4  flags: 1 reverse derived, 2 audited, 4 NAT half
//	5  3 bytes zero
//	8  client (16)  24 client port (2)  26 VIP port (2)  28 backend port (2)  30 SNAT port (2)
//	32 VIP (16)     48 backend (16)     64 SNAT address (16)
//	80 age (8)      88 idle (8)         96 TTL (8)        104 NAT idle (8)
//	112 16 bytes zero
const (
	recReverseDerived = 1 << 0
	recAudited        = 1 << 1
	recNAT            = 1 << 2
)

// putAddr writes a (unmapped) into the 16 bytes at b: an IPv4 address in
// the first four, the rest zero.
func putAddr(b []byte, a netip.Addr) {
	switch {
	case !a.IsValid():
	case a.Is4():
		a4 := a.As4()
		copy(b[:4], a4[:])
	default:
		a16 := a.As16()
		copy(b[:16], a16[:])
	}
}

func getAddr(b []byte, fam byte) netip.Addr {
	if fam == 4 {
		return netip.AddrFrom4([4]byte(b[:4]))
	}
	return netip.AddrFrom16([16]byte(b[:16]))
}

func encodeFlow(f *Flow) ([RecordSize]byte, error) {
	var b [RecordSize]byte
	if err := f.check(); err != nil {
		return b, err
	}
	fam := byte(6)
	if f.Client.Addr().Unmap().Is4() {
		fam = 4
	}
	b[0], b[1], b[2], b[3] = fam, f.Proto, byte(f.Kind), byte(f.State)
	if f.ReverseDerived {
		b[4] |= recReverseDerived
	}
	if f.Audited {
		b[4] |= recAudited
	}
	if f.NAT != nil {
		b[4] |= recNAT
	}
	unmap := func(ap netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()) }
	c, v, be, sn := unmap(f.Client), unmap(f.VIP), unmap(f.Backend), unmap(f.SNAT)
	putAddr(b[8:], c.Addr())
	binary.LittleEndian.PutUint16(b[24:], c.Port())
	binary.LittleEndian.PutUint16(b[26:], v.Port())
	binary.LittleEndian.PutUint16(b[28:], be.Port())
	binary.LittleEndian.PutUint16(b[30:], sn.Port())
	putAddr(b[32:], v.Addr())
	putAddr(b[48:], be.Addr())
	putAddr(b[64:], sn.Addr())
	binary.LittleEndian.PutUint64(b[80:], uint64(f.Age))
	binary.LittleEndian.PutUint64(b[88:], uint64(f.Idle))
	binary.LittleEndian.PutUint64(b[96:], uint64(f.TTL))
	if f.NAT != nil {
		binary.LittleEndian.PutUint64(b[104:], uint64(f.NAT.Idle))
	}
	return b, nil
}

func decodeFlow(b []byte) (Flow, error) {
	fam := b[0]
	if fam != 4 && fam != 6 {
		return Flow{}, fmt.Errorf("family %d", fam)
	}
	if b[4]&^(recReverseDerived|recAudited|recNAT) != 0 || b[5]|b[6]|b[7] != 0 || !allZero(b[112:]) {
		return Flow{}, errors.New("reserved bits set")
	}
	f := Flow{
		Client:         netip.AddrPortFrom(getAddr(b[8:], fam), binary.LittleEndian.Uint16(b[24:])),
		VIP:            netip.AddrPortFrom(getAddr(b[32:], fam), binary.LittleEndian.Uint16(b[26:])),
		Backend:        netip.AddrPortFrom(getAddr(b[48:], fam), binary.LittleEndian.Uint16(b[28:])),
		Proto:          b[1],
		Kind:           conntrack.Kind(b[2]),
		State:          bpf.CTState(b[3]),
		ReverseDerived: b[4]&recReverseDerived != 0,
		Audited:        b[4]&recAudited != 0,
		Age:            time.Duration(binary.LittleEndian.Uint64(b[80:])),
		Idle:           time.Duration(binary.LittleEndian.Uint64(b[88:])),
		TTL:            time.Duration(binary.LittleEndian.Uint64(b[96:])),
	}
	if f.Kind == conntrack.SNAT {
		f.SNAT = netip.AddrPortFrom(getAddr(b[64:], fam), binary.LittleEndian.Uint16(b[30:]))
	} else if !allZero(b[64:80]) || b[30]|b[31] != 0 {
		return Flow{}, errors.New("an SNAT address on a flow of another kind")
	}
	if b[4]&recNAT != 0 {
		f.NAT = &NATHalf{Idle: time.Duration(binary.LittleEndian.Uint64(b[104:]))}
	} else if !allZero(b[104:112]) {
		return Flow{}, errors.New("a NAT half's time without the half")
	}
	if fam == 4 && (!allZero(b[12:24]) || !allZero(b[36:48]) || !allZero(b[52:64]) || !allZero(b[68:80])) {
		return Flow{}, errors.New("IPv4 addresses with bytes past their four")
	}
	return f, f.check()
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// check reports whether f is a flow the datapath could hold: one family,
// TCP or UDP, a known kind and state, a backend, an SNAT source exactly
// for Kind SNAT, a NAT half exactly where the kind has one, times that are
// not negative.
func (f *Flow) check() error {
	is4 := f.Client.Addr().Unmap().Is4()
	for _, ap := range []struct {
		what string
		a    netip.AddrPort
	}{{"client", f.Client}, {"vip", f.VIP}, {"backend", f.Backend}} {
		if !ap.a.Addr().IsValid() || ap.a.Addr().Unmap().Is4() != is4 {
			return fmt.Errorf("%s %s: not an address of the flow's family", ap.what, ap.a)
		}
	}
	if f.VIP.Port() == 0 || f.Backend.Port() == 0 {
		return fmt.Errorf("%s: port 0", f)
	}
	switch {
	case f.Proto != conntrack.ProtoTCP && f.Proto != conntrack.ProtoUDP:
		return fmt.Errorf("protocol %d", f.Proto)
	case f.Age < 0 || f.Idle < 0 || f.TTL < 0 || f.NAT != nil && f.NAT.Idle < 0:
		return errors.New("a negative time")
	case f.TTL > MaxTTL:
		return fmt.Errorf("a TTL of %s (at most %s)", f.TTL, MaxTTL)
	}
	switch f.State {
	case bpf.CTTCPSyn, bpf.CTTCPEstablished, bpf.CTTCPFin, bpf.CTTCPRst:
		if f.Proto != conntrack.ProtoTCP {
			return fmt.Errorf("state %s on a UDP flow", f.State)
		}
	case bpf.CTUDP:
		if f.Proto != conntrack.ProtoUDP {
			return fmt.Errorf("state %s on a TCP flow", f.State)
		}
	default:
		return fmt.Errorf("state %d", f.State)
	}
	switch f.Kind {
	case conntrack.SNAT:
		if !f.SNAT.Addr().IsValid() || f.SNAT.Addr().Unmap().Is4() != is4 || f.SNAT.Port() == 0 {
			return fmt.Errorf("SNAT flow with SNAT source %s", f.SNAT)
		}
		if f.NAT == nil || f.ReverseDerived {
			return errors.New("an SNAT flow has its mapping and no derived replies")
		}
	case conntrack.EastWest:
		if f.SNAT.IsValid() || (f.NAT == nil) != f.ReverseDerived {
			return errors.New("an east-west flow has a NAT half exactly when its replies are not derived")
		}
	case conntrack.DSR:
		if f.SNAT.IsValid() || f.NAT != nil || f.ReverseDerived {
			return errors.New("a DSR flow has no NAT half")
		}
	default:
		return fmt.Errorf("kind %s is not replicated", f.Kind)
	}
	return nil
}
