package intent

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
)

func TestIPCache(t *testing.T) {
	c, err := DecodeIPCache(strings.NewReader(`{"entries":[{"prefix":"10.1.0.0/16","identity":1001},{"prefix":"fd00::/64","identity":1002},{"prefix":"10.1.2.3","identity":2001}]}`), 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := ValidateIPCache(c); err != nil {
		t.Fatal(err)
	}
	if got := c.Entries[2]; got.Prefix != netip.MustParsePrefix("10.1.2.3/32") || got.Identity != 2001 {
		t.Errorf("a lone address: %+v, want its /32", got)
	}
	tests := []struct {
		in    string
		field string
		kind  error
	}{
		{`{"entries":[{"prefix":"10.1.0.1/16","identity":1}]}`, "entries[0].prefix", ErrInvalid},
		{`{"entries":[{"prefix":"::ffff:10.1.0.0/112","identity":1}]}`, "entries[0].prefix", ErrInvalid},
		{`{"entries":[{"prefix":"10.0.0.0/8","identity":0}]}`, "entries[0].identity", ErrInvalid},
		{`{"entries":[{"prefix":"10.0.0.0/8","identity":16777216}]}`, "entries[0].identity", ErrInvalid},
		{`{"entries":[{"prefix":"10.0.0.0/8","identity":1},{"prefix":"10.0.0.0/8","identity":2}]}`, "entries[1].prefix", ErrConflict},
		{`{"entries":[{"prefix":"10.0.0.0/8"}]}`, "entries[0].identity", ErrInvalid},
		{`{"entries":[{"identity":3}]}`, "entries[0].prefix", ErrInvalid},
		{`{"entries":[{"prefix":"ten","identity":1}]}`, "entries[0].prefix", ErrMalformed},
		{`{"entries":[{"prefix":"10.0.0.0/8","identity":1,"name":"x"}]}`, "entries[0].name", ErrMalformed},
		{`{"entries":{}}`, "entries", ErrMalformed},
		{`null`, "", ErrMalformed},
	}
	for _, tc := range tests {
		c, err := DecodeIPCache(strings.NewReader(tc.in), 0)
		if err == nil {
			err = ValidateIPCache(c)
		}
		if !errors.Is(err, tc.kind) || fieldOf(err) != tc.field {
			t.Errorf("%s: %v (field %q), want field %q, %v", tc.in, err, fieldOf(err), tc.field, tc.kind)
		}
	}
	var big IPCache
	for i := range MaxIPCacheEntries + 1 {
		big.Entries = append(big.Entries, IPCacheEntry{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32), Identity: 1})
	}
	if err := ValidateIPCache(big); !errors.Is(err, ErrLimit) {
		t.Errorf("%d IPv4 entries: %v, want ErrLimit", len(big.Entries), err)
	}
	var b bytes.Buffer
	b.WriteString(`{"entries":[`)
	for i := range 2*MaxIPCacheEntries + 1 {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"prefix":"10.0.0.0/8","identity":1}`)
	}
	b.WriteString(`]}`)
	if _, err := DecodeIPCache(&b, 64<<20); !errors.Is(err, ErrLimit) || fieldOf(err) != "entries" {
		t.Errorf("oversize ipcache: %v, want ErrLimit on entries", err)
	}
}

func FuzzDecodeIPCache(f *testing.F) {
	for _, s := range []string{`{"entries":[{"prefix":"10.1.0.0/16","identity":1001},{"prefix":"fd00::1","identity":2}]}`, `{}`, `{"entries":null}`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := DecodeIPCache(bytes.NewReader(data), 0)
		if err == nil {
			err = ValidateIPCache(c)
		}
		if err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Kind == nil {
				t.Fatalf("error %v is not a categorised ValidationError", err)
			}
		}
	})
}
