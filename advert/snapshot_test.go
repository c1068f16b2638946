package advert

import (
	"bytes"
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// goldenEntries are the entries of testdata/snapshot.json, deliberately out
// of canonical order and with ports unsorted and repeated.
func goldenEntries() []Entry {
	return []Entry{
		Decide(Input{VIP: netip.MustParseAddr("2001:db8::10"), Service: "web", Exposure: ExposureNorthSouth,
			Ports: []Port{{443, "tcp"}}, Enabled: true, Advertise: true, ReadyBackends: 2}),
		Decide(Input{VIP: netip.MustParseAddr("203.0.113.11"), Service: "internal", Exposure: ExposureNorthSouth,
			Ports: []Port{{8080, "tcp"}}, Enabled: true, Advertise: false, ReadyBackends: 2}),
		Decide(Input{VIP: netip.MustParseAddr("203.0.113.10"), Service: "web", Exposure: ExposureNorthSouth,
			Ports: []Port{{443, "tcp"}, {80, "tcp"}, {443, "tcp"}}, Enabled: true, Advertise: true, ReadyBackends: 2}),
		Decide(Input{VIP: netip.MustParseAddr("198.51.100.7"), Service: "dns", Exposure: ExposureBoth,
			Ports: []Port{{53, "udp"}, {53, "tcp"}}, Enabled: true, Advertise: true, ReadyBackends: 0}),
	}
}

// TestJSONContract pins the file format: field names, order, omissions and
// canonical ordering. Changing this file is changing the adapter contract
// (docs/advertisements.md shows the same document).
func TestJSONContract(t *testing.T) {
	want, err := os.ReadFile("testdata/snapshot.json")
	if err != nil {
		t.Fatal(err)
	}
	entries, err := normalize(goldenEntries())
	if err != nil {
		t.Fatal(err)
	}
	s := Snapshot{
		SchemaVersion: SchemaVersion,
		Generation:    42,
		Timestamp:     time.Date(2025, 6, 1, 12, 0, 0, 500_000_000, time.UTC),
		Node:          "node-a",
		Entries:       entries,
	}
	got, err := encode(s)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("encoded snapshot differs from testdata/snapshot.json:\n%s", got)
	}
	back, err := Decode(want)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, s) {
		t.Fatalf("Decode(golden) = %+v, want %+v", back, s)
	}
	wantPrefixes := []netip.Prefix{netip.MustParsePrefix("203.0.113.10/32"), netip.MustParsePrefix("2001:db8::10/128")}
	if got := back.AdvertisedPrefixes(); !reflect.DeepEqual(got, wantPrefixes) {
		t.Fatalf("AdvertisedPrefixes = %v, want %v", got, wantPrefixes)
	}
}

func TestAdvertisedPrefixesSharedVIP(t *testing.T) {
	vip := netip.MustParseAddr("203.0.113.10")
	entries, err := normalize([]Entry{
		{VIP: vip, Service: "a", Reason: ReasonNoReadyBackend},
		{VIP: vip, Service: "b", Advertised: true},
		{VIP: vip, Service: "c", Advertised: true},
		{VIP: netip.MustParseAddr("203.0.113.9"), Service: "d", Reason: ReasonAdvertiseFalse},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := Snapshot{Entries: entries}.AdvertisedPrefixes()
	if want := []netip.Prefix{netip.MustParsePrefix("203.0.113.10/32")}; !reflect.DeepEqual(got, want) {
		t.Fatalf("AdvertisedPrefixes = %v, want %v", got, want)
	}
}

func TestPublishRejectsInvalidEntries(t *testing.T) {
	v4 := netip.MustParseAddr("192.0.2.1")
	ok := Entry{VIP: v4, Service: "s", Advertised: true}
	tests := []struct {
		name    string
		entries []Entry
		msg     string
	}{
		{"no vip", []Entry{{Service: "s", Advertised: true}}, "vip is missing"},
		{"zoned vip", []Entry{{VIP: netip.MustParseAddr("fe80::1%eth0"), Service: "s", Advertised: true}}, "zone"},
		{"4in6 vip", []Entry{{VIP: netip.MustParseAddr("::ffff:192.0.2.1"), Service: "s", Advertised: true}}, "IPv4-mapped"},
		{"no service", []Entry{{VIP: v4, Service: " ", Advertised: true}}, "service is empty"},
		{"reason on advertised", []Entry{{VIP: v4, Service: "s", Advertised: true, Reason: "x"}}, "on an advertised entry"},
		{"withdrawn without reason", []Entry{{VIP: v4, Service: "s"}}, "reason is required"},
		{"unknown exposure", []Entry{{VIP: v4, Service: "s", Advertised: true, Exposure: "sideways"}}, "exposure"},
		{"port 0", []Entry{{VIP: v4, Service: "s", Advertised: true, Ports: []Port{{0, "tcp"}}}}, "port 0"},
		{"bad protocol", []Entry{{VIP: v4, Service: "s", Advertised: true, Ports: []Port{{80, "TCP"}}}}, "protocol"},
		{"duplicate vip and service", []Entry{ok, ok}, "listed twice"},
		{"unknown kind", []Entry{{VIP: v4, Service: "s", Kind: "nat", Advertised: true}}, `kind "nat"`},
		{"SNAT entry of a service", []Entry{{VIP: v4, Service: "web", Kind: KindSNAT, Advertised: true}}, "kind snat has service"},
		{"SNAT entry with ports", []Entry{{VIP: v4, Service: SNATService, Kind: KindSNATPeer, Advertised: true, Ports: []Port{{80, "tcp"}}}}, "no ports"},
		{"SNAT entry with exposure", []Entry{{VIP: v4, Service: SNATService, Kind: KindSNAT, Advertised: true, Exposure: ExposureBoth}}, "no exposure"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "adv.json")
			p, err := NewPublisher(Options{Path: path})
			if err != nil {
				t.Fatal(err)
			}
			_, changed, err := p.Publish(tt.entries)
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid", err)
			}
			if !strings.HasPrefix(err.Error(), "advert: publish: ") || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("err = %q, want prefix %q and %q", err, "advert: publish: ", tt.msg)
			}
			if changed {
				t.Fatal("changed = true on error")
			}
			if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("file written despite invalid entries (stat err %v)", err)
			}
			if _, ok := p.Current(); ok {
				t.Fatal("Current set despite invalid entries")
			}
		})
	}
}

func TestDecodeRejects(t *testing.T) {
	golden, err := os.ReadFile("testdata/snapshot.json")
	if err != nil {
		t.Fatal(err)
	}
	g := string(golden)
	tests := []struct {
		name string
		doc  string
		want error
	}{
		{"empty", "", ErrCorrupt},
		{"not json", "not json{", ErrCorrupt},
		{"truncated", g[:len(g)/2], ErrCorrupt},
		{"array", "[]", ErrCorrupt},
		{"no schema_version", `{"generation":1,"entries":[]}`, ErrCorrupt},
		{"other schema version", strings.Replace(g, `"schema_version": 1`, `"schema_version": 2`, 1), ErrSchemaVersion},
		{"generation 0", strings.Replace(g, `"generation": 42`, `"generation": 0`, 1), ErrCorrupt},
		{"no entries", `{"schema_version":1,"generation":1,"timestamp":"2025-01-01T00:00:00Z"}`, ErrCorrupt},
		{"wrong type", strings.Replace(g, `"generation": 42`, `"generation": "42"`, 1), ErrCorrupt},
		{"prefix mismatch", strings.Replace(g, `"prefix": "203.0.113.10/32"`, `"prefix": "203.0.113.0/24"`, 1), ErrCorrupt},
		{"family mismatch", strings.Replace(g, `"family": "ipv6"`, `"family": "ipv4"`, 1), ErrCorrupt},
		{"entries out of order", strings.Replace(g, `"vip": "198.51.100.7",
      "prefix": "198.51.100.7/32"`, `"vip": "203.0.113.200",
      "prefix": "203.0.113.200/32"`, 1), ErrCorrupt},
		{"advertised with reason", strings.Replace(g, `"advertised": true
`, `"advertised": true, "reason": "x"
`, 1), ErrCorrupt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Decode([]byte(tt.doc))
			if !errors.Is(err, tt.want) {
				t.Fatalf("Decode err = %v, want %v", err, tt.want)
			}
			if !strings.HasPrefix(err.Error(), "advert: decode: ") {
				t.Fatalf("err = %q, want prefix advert: decode:", err)
			}
		})
	}
}

func TestDecodeIgnoresUnknownFields(t *testing.T) {
	doc := `{"schema_version":1,"generation":3,"timestamp":"2025-01-01T00:00:00Z","future":true,
	"entries":[{"vip":"192.0.2.1","prefix":"192.0.2.1/32","family":"ipv4","service":"s","advertised":true,"weight":5}]}`
	s, err := Decode([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	if s.Generation != 3 || len(s.Entries) != 1 || s.Entries[0].Ports == nil {
		t.Fatalf("Decode = %+v", s)
	}
}

func TestReadMissing(t *testing.T) {
	_, err := Read(filepath.Join(t.TempDir(), "none.json"))
	if !errors.Is(err, fs.ErrNotExist) || !strings.HasPrefix(err.Error(), "advert: read: ") {
		t.Fatalf("Read err = %v, want fs.ErrNotExist with advert: read: prefix", err)
	}
}

// TestNormalize checks that Normalize gives exactly the canonical form a
// published snapshot holds (testdata/snapshot.json has goldenEntries),
// leaves its input alone and is idempotent, and that EqualEntries compares
// lists in that form.
func TestNormalize(t *testing.T) {
	in := goldenEntries()
	got := Normalize(in)
	if !reflect.DeepEqual(in, goldenEntries()) {
		t.Fatal("Normalize modified its input")
	}
	data, err := os.ReadFile("testdata/snapshot.json")
	if err != nil {
		t.Fatal(err)
	}
	s, err := Decode(data)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, s.Entries) {
		t.Fatalf("Normalize:\n%+v\nwant the published entries:\n%+v", got, s.Entries)
	}
	if again := Normalize(got); !reflect.DeepEqual(again, got) {
		t.Fatalf("Normalize is not idempotent:\n%+v\nthen\n%+v", got, again)
	}

	// Derived fields come from the VIP whatever the input says; no ports
	// is an empty list, never nil.
	one := Normalize([]Entry{{VIP: netip.MustParseAddr("192.0.2.1"), Service: "x",
		Prefix: netip.MustParsePrefix("10.0.0.0/8"), Family: FamilyIPv6}})
	if e := one[0]; e.Prefix != netip.MustParsePrefix("192.0.2.1/32") || e.Family != FamilyIPv4 || e.Ports == nil {
		t.Fatalf("derived fields: %+v", e)
	}
	if out := Normalize(nil); out == nil || len(out) != 0 {
		t.Fatalf("Normalize(nil) = %#v, want an empty list", out)
	}

	if !EqualEntries(got, s.Entries) {
		t.Fatal("EqualEntries: equal lists reported different")
	}
	if EqualEntries(got, got[1:]) {
		t.Fatal("EqualEntries: lists of different length reported equal")
	}
	for name, change := range map[string]func(*Entry){
		"exposure":   func(e *Entry) { e.Exposure = ExposureEastWest },
		"advertised": func(e *Entry) { e.Advertised, e.Reason = !e.Advertised, ReasonAdvertiseFalse },
		"ports":      func(e *Entry) { e.Ports = append(e.Ports, Port{9, "udp"}) },
		"service":    func(e *Entry) { e.Service += "-other" },
	} {
		other := Normalize(goldenEntries())
		change(&other[1])
		if EqualEntries(got, other) {
			t.Errorf("EqualEntries: lists differing in %s reported equal", name)
		}
	}
}
