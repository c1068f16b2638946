package advert

import (
	"errors"
	"os"
	"reflect"
	"testing"
)

// FuzzDecode feeds arbitrary bytes to Decode, the reader of what
// adapters and a restarted publisher find in the file: it must never
// panic, every error must match ErrCorrupt or ErrSchemaVersion, and a
// document it accepts must be one this package can write again: encoding
// it and decoding the result gives the same snapshot, and a Publisher
// that loads it can publish after it.
func FuzzDecode(f *testing.F) {
	if b, err := os.ReadFile("testdata/snapshot.json"); err == nil {
		f.Add(b)
	}
	for _, s := range []string{
		`{"schema_version":1,"generation":1,"timestamp":"2025-01-01T00:00:00Z","entries":[]}`,
		`{"schema_version":1,"generation":18446744073709551615,"timestamp":"2025-01-01T00:00:00Z","entries":[]}`,
		`{"schema_version":1,"generation":1,"timestamp":"0000-01-01T00:00:00+01:00","entries":[]}`,
		`{"schema_version":1,"generation":1,"timestamp":"9999-12-31T23:59:59-01:00","entries":[]}`,
		`{"schema_version":1,"generation":1,"timestamp":"2025-01-01T00:00:00Z","entries":[{"vip":"10.0.0.1","prefix":"10.0.0.1/32","family":"ipv4","service":"a","ports":[],"advertised":true}]}`,
		`{"schema_version":2}`, `{}`, `null`, `[]`, `{"schema_version":1} x`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := Decode(data)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrSchemaVersion) {
				t.Fatalf("error %v matches neither ErrCorrupt nor ErrSchemaVersion", err)
			}
			return
		}
		enc, err := encode(s)
		if err != nil {
			t.Fatalf("Decode accepted a snapshot that cannot be encoded again: %v", err)
		}
		back, err := Decode(enc)
		if err != nil {
			t.Fatalf("re-decode of\n%s\nfailed: %v", enc, err)
		}
		if !reflect.DeepEqual(back, s) {
			t.Fatalf("round trip changed the snapshot:\n got %+v\nwant %+v", back, s)
		}
		if _, err := normalize(s.Entries); err != nil {
			t.Fatalf("entries of an accepted snapshot do not normalize: %v", err)
		}
		// A publisher that finds this file continues its generation.
		path := t.TempDir() + "/adv.json"
		if err := os.WriteFile(path, data, FileMode); err != nil {
			t.Fatal(err)
		}
		p, err := NewPublisher(Options{Path: path, Node: "other-node"})
		if err != nil {
			t.Fatal(err)
		}
		if p.LoadError() != nil {
			t.Fatalf("a document Decode accepts is a load error for NewPublisher: %v", p.LoadError())
		}
		next, changed, err := p.Publish(nil)
		if err != nil || !changed {
			t.Fatalf("publish after a loaded snapshot: changed %v, %v", changed, err)
		}
		if next.Generation <= s.Generation {
			t.Fatalf("generation %d after loaded generation %d", next.Generation, s.Generation)
		}
	})
}
