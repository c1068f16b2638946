package intent

import (
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
)

// IPCacheEntry maps the addresses of a prefix to a security identity. In
// the ipcache the longest prefix covering an address decides its identity;
// an address no prefix covers is IdentityUnknown.
type IPCacheEntry struct {
	Prefix   netip.Prefix `json:"prefix"`
	Identity Identity     `json:"identity"`
}

// MaxIPCacheEntries bounds the ipcache, per address family: the capacity
// of the datapath's identity tries (fluxvm_sid4, fluxvm_sid6).
const MaxIPCacheEntries = 65536

// IPCache is a node's ipcache document: {"entries": [...]}, the format of
// the file the reference daemon reads (ipcache_file) and of what
// embedders hand to the SDK.
type IPCache struct {
	Entries []IPCacheEntry `json:"entries"`
}

// DecodeIPCache reads an ipcache document from r with the rules of
// DecodeService; maxBytes bounds the input (MaxRequestBytes when <= 0;
// a full ipcache of 2 x MaxIPCacheEntries entries needs about 8 MiB).
// More than 2 x MaxIPCacheEntries entries is ErrLimit before they are
// decoded. It does not validate: call ValidateIPCache.
func DecodeIPCache(r io.Reader, maxBytes int64) (IPCache, error) {
	var c IPCache
	err := decodeDocument(r, maxBytes, func(raw json.RawMessage) *ValidationError {
		if jsonNull(raw) {
			return verr(ErrMalformed, "", "must be a JSON object (an ipcache), not null")
		}
		return decodeObject("", raw, []jsonField{
			{"entries", func(p string, raw json.RawMessage) *ValidationError {
				c.Entries = nil
				return decodeArray(p, raw, 2*MaxIPCacheEntries, func(p string, raw json.RawMessage) *ValidationError {
					var e IPCacheEntry
					if jsonNull(raw) {
						return verr(ErrMalformed, p, "must be an object, not null")
					}
					var id uint32
					if ve := decodeObject(p, raw, []jsonField{
						{"prefix", func(p string, raw json.RawMessage) *ValidationError { return decodePrefix(p, raw, &e.Prefix) }},
						{"identity", decodeUint(&id, 1<<32-1)},
					}); ve != nil {
						return ve
					}
					e.Identity = Identity(id)
					c.Entries = append(c.Entries, e)
					return nil
				})
			}},
		})
	})
	if err != nil {
		return IPCache{}, fmt.Errorf("intent: decode ipcache: %w", err)
	}
	return c, nil
}

func decodePrefix(path string, raw json.RawMessage, dst *netip.Prefix) *ValidationError {
	var s string
	if raw[0] != '"' || json.Unmarshal(raw, &s) != nil {
		return verr(ErrMalformed, path, "must be a prefix string (\"10.0.0.0/24\"), got %s", describeJSON(raw))
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		// A lone address is its own host prefix.
		a, aerr := netip.ParseAddr(s)
		if aerr != nil {
			return verr(ErrMalformed, path, "%q is not a prefix or an address", s)
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	*dst = p
	return nil
}

// ValidateIPCache checks an ipcache: every prefix masked (no host bits),
// IPv4 written as IPv4 (not IPv4-mapped IPv6), no prefix twice, identities
// 1..MaxIdentity (0 is what no entry gives), at most MaxIPCacheEntries a
// family.
func ValidateIPCache(c IPCache) error {
	var n [2]int
	seen := make(map[netip.Prefix]int, len(c.Entries))
	for i, e := range c.Entries {
		f := fmt.Sprintf("entries[%d]", i)
		p := e.Prefix
		switch {
		case !p.IsValid():
			return fmt.Errorf("intent: ipcache: %w", verr(ErrInvalid, f+".prefix", "required"))
		case p.Addr().Is4In6():
			return fmt.Errorf("intent: ipcache: %w", verr(ErrInvalid, f+".prefix", "%s: write IPv4 prefixes as IPv4", p))
		case p.Addr().Zone() != "":
			return fmt.Errorf("intent: ipcache: %w", verr(ErrInvalid, f+".prefix", "%s: a prefix has no zone", p))
		case p.Masked() != p:
			return fmt.Errorf("intent: ipcache: %w", verr(ErrInvalid, f+".prefix", "%s has host bits set (did you mean %s?)", p, p.Masked()))
		case e.Identity == IdentityUnknown:
			return fmt.Errorf("intent: ipcache: %w", verr(ErrInvalid, f+".identity", "0 is the unknown source's identity: an entry gives one of 1..%d", MaxIdentity))
		case e.Identity > MaxIdentity:
			return fmt.Errorf("intent: ipcache: %w", verr(ErrInvalid, f+".identity", "%d is out of range 1..%d", e.Identity, MaxIdentity))
		}
		if j, ok := seen[p]; ok {
			return fmt.Errorf("intent: ipcache: %w", verr(ErrConflict, f+".prefix", "%s repeats entries[%d]", p, j))
		}
		seen[p] = i
		fam := addrFamily(p.Addr())
		if n[fam]++; n[fam] > MaxIPCacheEntries {
			return fmt.Errorf("intent: ipcache: %w", verr(ErrLimit, "entries", "more than %d %s prefixes", MaxIPCacheEntries, familyName[fam]))
		}
	}
	return nil
}
