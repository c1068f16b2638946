package advert

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"
)

// SchemaVersion is the version of the snapshot format this package writes
// and the only one it reads. Fields may be added without a new version
// (readers ignore fields they do not know); renaming or removing a field, or
// changing its meaning, bumps it.
const SchemaVersion = 1

// DefaultPath is where the node daemon publishes the snapshot unless
// configured otherwise.
const DefaultPath = "/run/fluxvm/service-advertisements.json"

// Snapshot is the content of the advertisement file, and of the REST
// response GET /v1/network/services/advertisements.
type Snapshot struct {
	// SchemaVersion is always [SchemaVersion] in what this package
	// writes.
	SchemaVersion int `json:"schema_version"`
	// Generation counts the content changes: it is 1 in the first file a
	// Publisher writes and grows by one with every rewrite. It never goes
	// backwards while the file exists (a new Publisher continues it).
	Generation uint64 `json:"generation"`
	// Timestamp is when this generation was written (UTC, RFC 3339 with
	// nanoseconds). It is the wall clock: use Generation to order
	// snapshots.
	Timestamp time.Time `json:"timestamp"`
	// Node is the node's name, when one is configured.
	Node string `json:"node,omitempty"`
	// Entries lists every (VIP, service) pair the node knows, advertised
	// or not, in canonical order: by VIP (IPv4 before IPv6, then
	// numerically), then by service name. Never null in JSON.
	Entries []Entry `json:"entries"`
}

// Entry is the decision for one VIP of one service.
type Entry struct {
	// VIP is the virtual address (no zone, IPv4 in its 4-byte form).
	VIP netip.Addr `json:"vip"`
	// Prefix is the host route for VIP (/32 or /128), ready for a
	// routing daemon. Publish derives it from VIP; any input value is
	// ignored.
	Prefix netip.Prefix `json:"prefix"`
	// Family is "ipv4" or "ipv6". Publish derives it from VIP.
	Family Family `json:"family"`
	// Service is the name of the service the VIP belongs to; SNATService
	// for the entries of SNAT addresses (Kind KindSNAT, KindSNATPeer).
	Service string `json:"service"`
	// Kind is what the address is: a VIP (KindVIP, empty and omitted),
	// or an SNAT address the node wants routed to it (KindSNAT,
	// KindSNATPeer). An adapter announces every advertised entry's prefix
	// alike; one that knows no kinds reads an SNAT entry as a VIP of the
	// service SNATService, and announces it too.
	Kind Kind `json:"kind,omitempty"`
	// Exposure is the service's exposure ("east-west", "north-south",
	// "both"), when known.
	Exposure string `json:"exposure,omitempty"`
	// Ports are the service's frontend ports on this VIP, sorted by
	// protocol then port, without duplicates. Informational: routing
	// works per address. Never null in JSON.
	Ports []Port `json:"ports"`
	// Advertised says whether the node wants traffic for VIP routed to
	// it for this service.
	Advertised bool `json:"advertised"`
	// Reason says why the entry is withdrawn; empty (and omitted) when
	// Advertised is true, never empty when it is false.
	Reason Reason `json:"reason,omitempty"`
}

// Kind is what an entry's address is.
type Kind string

// Kinds of entries.
const (
	// KindVIP is a VIP of a service (the empty kind, omitted in JSON).
	KindVIP Kind = ""
	// KindSNAT is the node's own SNAT address: the source of its
	// north-south NAT flows, to which their backends reply.
	KindSNAT Kind = "snat"
	// KindSNATPeer is the SNAT address of another edge of the node's
	// group that this node has taken over (that edge is gone): the
	// replies of that edge's flows are to come here, where replication
	// brought the flows.
	KindSNATPeer Kind = "snat-peer"
)

// SNATService is the Service of every SNAT entry: a name the REST API
// reserves, so that no service has it.
const SNATService = "snat"

// Port is one frontend port of a service.
type Port struct {
	Port uint16 `json:"port"`
	// Protocol is "tcp" or "udp".
	Protocol string `json:"protocol"`
}

// Family is an address family name.
type Family string

// Families.
const (
	FamilyIPv4 Family = "ipv4"
	FamilyIPv6 Family = "ipv6"
)

// Clone returns a deep copy of s.
func (s Snapshot) Clone() Snapshot {
	c := s
	c.Entries = make([]Entry, len(s.Entries))
	for i, e := range s.Entries {
		e.Ports = slices.Clone(e.Ports)
		if e.Ports == nil {
			e.Ports = []Port{}
		}
		c.Entries[i] = e
	}
	return c
}

// AdvertisedPrefixes returns the host prefixes the node wants announced:
// each VIP that has at least one advertised entry, once, in canonical
// order. A VIP shared by several services is announced when any of them
// advertises it.
func (s Snapshot) AdvertisedPrefixes() []netip.Prefix {
	var out []netip.Prefix
	for _, e := range s.Entries {
		if !e.Advertised {
			continue
		}
		p := hostPrefix(e.VIP)
		if !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}

// Read reads and validates the snapshot file at path. A missing file gives
// an error matching fs.ErrNotExist.
func Read(path string) (Snapshot, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Snapshot{}, fmt.Errorf("advert: read: %w", err)
	}
	s, err := decode(data)
	if err != nil {
		return Snapshot{}, fmt.Errorf("advert: read %s: %w", path, err)
	}
	return s, nil
}

// Decode parses and validates a snapshot document, as found in the file or
// in the body of GET /v1/network/services/advertisements.
func Decode(data []byte) (Snapshot, error) {
	s, err := decode(data)
	if err != nil {
		return Snapshot{}, fmt.Errorf("advert: decode: %w", err)
	}
	return s, nil
}

func decode(data []byte) (Snapshot, error) {
	var probe struct {
		SchemaVersion *int `json:"schema_version"`
	}
	if err := json.Unmarshal(data, &probe); err != nil {
		return Snapshot{}, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	if probe.SchemaVersion == nil {
		return Snapshot{}, fmt.Errorf("%w: no schema_version", ErrCorrupt)
	}
	if *probe.SchemaVersion != SchemaVersion {
		return Snapshot{}, fmt.Errorf("%w: schema_version %d, want %d", ErrSchemaVersion, *probe.SchemaVersion, SchemaVersion)
	}
	var s Snapshot
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&s); err != nil {
		return Snapshot{}, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	switch s.Generation {
	case 0:
		return Snapshot{}, fmt.Errorf("%w: generation 0", ErrCorrupt)
	case math.MaxUint64:
		// No later generation exists: a publisher continuing it would
		// wrap to 0, which no valid file has.
		return Snapshot{}, fmt.Errorf("%w: generation %d leaves no next generation", ErrCorrupt, s.Generation)
	}
	if s.Entries == nil {
		return Snapshot{}, fmt.Errorf("%w: no entries list", ErrCorrupt)
	}
	s.Timestamp = s.Timestamp.UTC()
	if y := s.Timestamp.Year(); y < 0 || y > 9999 {
		// An offset can push a timestamp out of the years RFC 3339 (and
		// encoding/json) can write in UTC.
		return Snapshot{}, fmt.Errorf("%w: timestamp is outside the years 0000..9999 in UTC", ErrCorrupt)
	}
	for i := range s.Entries {
		e := &s.Entries[i]
		if err := checkEntry(*e); err != nil {
			return Snapshot{}, fmt.Errorf("%w: entries[%d]: %v", ErrCorrupt, i, err)
		}
		if e.Prefix != hostPrefix(e.VIP) || e.Family != familyOf(e.VIP) {
			return Snapshot{}, fmt.Errorf("%w: entries[%d]: prefix or family does not match vip %s", ErrCorrupt, i, e.VIP)
		}
		if !slices.IsSortedFunc(e.Ports, comparePorts) || hasDuplicatePorts(e.Ports) {
			return Snapshot{}, fmt.Errorf("%w: entries[%d]: ports not in canonical order", ErrCorrupt, i)
		}
		if e.Ports == nil {
			e.Ports = []Port{}
		}
		if i > 0 && compareEntries(s.Entries[i-1], *e) >= 0 {
			return Snapshot{}, fmt.Errorf("%w: entries[%d]: not in canonical order or duplicate (vip, service)", ErrCorrupt, i)
		}
	}
	return s, nil
}

// encode renders s the way the file holds it: indented JSON and a final
// newline.
func encode(s Snapshot) ([]byte, error) {
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(data, '\n'), nil
}

// Normalize returns entries in the canonical form a snapshot holds them:
// prefix and family derived from the VIP (any input value is ignored),
// ports sorted by protocol then port without duplicates and never nil,
// entries sorted by VIP (IPv4 before IPv6, then numerically) then service
// name. It does not validate them ([Publisher.Publish] does) and does not
// modify the caller's slices.
func Normalize(entries []Entry) []Entry {
	out := make([]Entry, len(entries))
	for i, e := range entries {
		out[i] = canonicalEntry(e)
	}
	slices.SortFunc(out, compareEntries)
	return out
}

// canonicalEntry returns e with its derived fields set and its ports in
// canonical order, on a copy of the caller's slice.
func canonicalEntry(e Entry) Entry {
	e.Prefix = hostPrefix(e.VIP)
	e.Family = familyOf(e.VIP)
	e.Ports = slices.Clone(e.Ports)
	slices.SortFunc(e.Ports, comparePorts)
	e.Ports = slices.Compact(e.Ports)
	if e.Ports == nil {
		e.Ports = []Port{}
	}
	return e
}

// EqualEntries reports whether two lists in canonical form ([Normalize])
// hold the same entries.
func EqualEntries(a, b []Entry) bool {
	return slices.EqualFunc(a, b, func(x, y Entry) bool {
		return x.VIP == y.VIP && x.Prefix == y.Prefix && x.Family == y.Family &&
			x.Service == y.Service && x.Kind == y.Kind && x.Exposure == y.Exposure &&
			x.Advertised == y.Advertised && x.Reason == y.Reason &&
			slices.Equal(x.Ports, y.Ports)
	})
}

// normalize validates entries and returns them in canonical form
// ([Normalize]).
func normalize(entries []Entry) ([]Entry, error) {
	out := make([]Entry, len(entries))
	for i, e := range entries {
		e = canonicalEntry(e)
		if err := checkEntry(e); err != nil {
			return nil, fmt.Errorf("%w: entries[%d] (vip %s, service %q): %v", ErrInvalid, i, e.VIP, e.Service, err)
		}
		out[i] = e
	}
	slices.SortFunc(out, compareEntries)
	for i := 1; i < len(out); i++ {
		if compareEntries(out[i-1], out[i]) == 0 {
			return nil, fmt.Errorf("%w: vip %s, service %q listed twice", ErrInvalid, out[i].VIP, out[i].Service)
		}
	}
	return out, nil
}

func checkEntry(e Entry) error {
	switch {
	case !e.VIP.IsValid():
		return errors.New("vip is missing")
	case e.VIP.Zone() != "":
		return errors.New("vip has a zone")
	case e.VIP.Is4In6():
		return errors.New("vip is IPv4-mapped IPv6; use the IPv4 form")
	case strings.TrimSpace(e.Service) == "":
		return errors.New("service is empty")
	case e.Advertised && e.Reason != "":
		return fmt.Errorf("reason %q on an advertised entry", e.Reason)
	case !e.Advertised && e.Reason == "":
		return errors.New("reason is required when advertised is false")
	}
	switch e.Kind {
	case KindVIP:
	case KindSNAT, KindSNATPeer:
		if e.Service != SNATService || e.Exposure != "" || len(e.Ports) != 0 {
			return fmt.Errorf("an entry of kind %s has service %q (want %q), no exposure and no ports", e.Kind, e.Service, SNATService)
		}
	default:
		return fmt.Errorf("kind %q is not %q, %q or empty (a VIP)", e.Kind, KindSNAT, KindSNATPeer)
	}
	switch e.Exposure {
	case "", ExposureEastWest, ExposureNorthSouth, ExposureBoth:
	default:
		return fmt.Errorf("exposure %q is not east-west, north-south or both", e.Exposure)
	}
	for _, p := range e.Ports {
		if p.Port == 0 {
			return errors.New("port 0")
		}
		if p.Protocol != "tcp" && p.Protocol != "udp" {
			return fmt.Errorf("protocol %q is not tcp or udp", p.Protocol)
		}
	}
	return nil
}

func hostPrefix(a netip.Addr) netip.Prefix {
	if !a.IsValid() {
		return netip.Prefix{}
	}
	return netip.PrefixFrom(a, a.BitLen())
}

func familyOf(a netip.Addr) Family {
	switch {
	case !a.IsValid():
		return ""
	case a.Is4():
		return FamilyIPv4
	default:
		return FamilyIPv6
	}
}

func compareEntries(a, b Entry) int {
	if c := a.VIP.Compare(b.VIP); c != 0 {
		return c
	}
	return strings.Compare(a.Service, b.Service)
}

func comparePorts(a, b Port) int {
	if c := strings.Compare(a.Protocol, b.Protocol); c != 0 {
		return c
	}
	return int(a.Port) - int(b.Port)
}

func hasDuplicatePorts(ps []Port) bool {
	for i := 1; i < len(ps); i++ {
		if ps[i] == ps[i-1] {
			return true
		}
	}
	return false
}

// sameContent reports whether a snapshot published for node with entries
// (already normalized) would differ from s only in generation and
// timestamp.
func sameContent(s *Snapshot, node string, entries []Entry) bool {
	if s.SchemaVersion != SchemaVersion || s.Node != node {
		return false
	}
	return EqualEntries(s.Entries, entries)
}
