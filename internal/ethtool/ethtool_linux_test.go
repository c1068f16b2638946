package ethtool_test

import (
	"errors"
	"testing"

	"github.com/fluxvm/servicefabric/internal/ethtool"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestFeatures: the features of a veth read by name, turned off and on
// again; an unknown name changes nothing.
func TestFeatures(t *testing.T) {
	testenv.InNetNS(t, func() {
		if _, _, err := testenv.VethPair("fa", "fb"); err != nil {
			t.Fatal(err)
		}
		f, err := ethtool.Features("fa")
		if err != nil {
			t.Fatal(err)
		}
		// A veth offloads VLAN tags and checksums by default, and has
		// no LRO.
		for name, want := range map[string]ethtool.Feature{
			"rx-vlan-hw-parse":       {Active: true, Requested: true},
			"tx-vlan-hw-insert":      {Active: true, Requested: true},
			"tx-checksum-ip-generic": {Active: true, Requested: true},
			"rx-vlan-filter":         {Fixed: true},
		} {
			if got, ok := f[name]; !ok || got != want {
				t.Errorf("%s: %+v (known %v), want %+v", name, got, ok, want)
			}
		}
		off := map[string]bool{"tx-vlan-hw-insert": false, "tx-vlan-stag-hw-insert": false}
		if err := ethtool.SetFeatures("fa", off); err != nil {
			t.Fatal(err)
		}
		f, err = ethtool.Features("fa")
		if err != nil {
			t.Fatal(err)
		}
		for name := range off {
			if f[name].Active || f[name].Requested {
				t.Errorf("after turning it off, %s is %+v", name, f[name])
			}
		}
		if !f["rx-vlan-hw-parse"].Active {
			t.Errorf("rx-vlan-hw-parse went off with the others")
		}
		err = ethtool.SetFeatures("fa", map[string]bool{"tx-vlan-hw-insert": true, "no-such-feature": true})
		if !errors.Is(err, ethtool.ErrUnknownFeature) {
			t.Errorf("an unknown name: %v, want ethtool.ErrUnknownFeature", err)
		}
		if f, _ := ethtool.Features("fa"); f["tx-vlan-hw-insert"].Active {
			t.Errorf("a refused request changed tx-vlan-hw-insert")
		}
		if _, err := ethtool.Features("nosuchdev"); err == nil {
			t.Errorf("features of a missing interface: no error")
		}
	})
}
