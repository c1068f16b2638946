// Package adverttest holds what the tests of the advertisement code
// (fluxvm/internal/advertisements and the dataplane's lab tests) share to
// read a set of advertisement entries.
package adverttest

import "github.com/fluxvm/servicefabric/advert"

// Decisions maps "vip service" to "advertised" or the reason of the
// withdrawal, for every entry.
func Decisions(entries []advert.Entry) map[string]string {
	out := map[string]string{}
	for _, e := range entries {
		v := "advertised"
		if !e.Advertised {
			v = string(e.Reason)
		}
		out[e.VIP.String()+" "+e.Service] = v
	}
	return out
}
