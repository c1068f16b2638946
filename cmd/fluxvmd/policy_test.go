package main

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// writeIPCache writes the ipcache file giving addr the identity id.
func writeIPCache(t *testing.T, path string, addr netip.Addr, id fluxvm.Identity) {
	t.Helper()
	doc := fmt.Sprintf(`{"entries": [{"prefix": %q, "identity": %d}]}`, netip.PrefixFrom(addr, addr.BitLen()), id)
	// Written beside and renamed, as an operator's tooling would.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestDaemonIdentityPolicy runs the real binary with ipcache_file: a
// service and its identity policy applied over REST, the client's address
// has a denied identity in the file, and a connection through the VIP
// fails; the file is edited to give it an allowed identity, POST
// …/policies/reconcile re-reads it, and a connection succeeds; GET
// …/policies shows the listed identities no ipcache entry has. Edited
// back to the denied identity and reconciled again, the open connection
// stops at its next packet.
func TestDaemonIdentityPolicy(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l, cli, be := clientAndBackend(t)

	const allowed, other, denied fluxvm.Identity = 1001, 1003, 2001
	dir := t.TempDir()
	ipcache := filepath.Join(dir, "ipcache.json")
	writeIPCache(t, ipcache, cli.Addr4, denied)
	cfg := filepath.Join(dir, "fluxvmd.toml")
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
advertisements_path = %q
ipcache_file = %q
vm_edge_interfaces = [ { name = "vm1", vm_id = "client" }, { name = "vm2", vm_id = "backend" } ]
`, filepath.Join(testenv.PinRoot(t), "service"), filepath.Join(dir, "catalog.json"), filepath.Join(dir, "adv.json"), ipcache)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, bin, cfg, l)

	policies := func() fluxvm.PoliciesStatus {
		t.Helper()
		body, err := d.Request("GET", "/v1/network/services/policies", nil)
		if err != nil {
			t.Fatal(err)
		}
		var st fluxvm.PoliciesStatus
		if err := json.Unmarshal(body, &st); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		return st
	}
	if st := policies(); st.IPCachePrefixes != 1 || len(st.Policies) != 0 {
		t.Fatalf("at start, the ipcache file is applied: %+v\n%s", st, d.Out)
	}

	vip := netip.MustParseAddr("10.96.0.10")
	applyWeb(t, d, vip, be)
	pol := fluxvm.Policy{Service: "web", DefaultAction: fluxvm.PolicyDeny,
		AllowIdentities: []fluxvm.Identity{allowed, other}, DenyIdentities: []fluxvm.Identity{denied}}
	if _, err := d.Request("POST", "/v1/network/services/policies", pol); err != nil {
		t.Fatal(err)
	}
	st := policies()
	if len(st.Policies) != 1 || st.Policies[0].Service != "web" || !st.Policies[0].Enabled || st.Policies[0].Frontends != 1 ||
		!reflect.DeepEqual(st.Policies[0].Unresolved, []fluxvm.Identity{allowed, other}) {
		t.Fatalf("policies after the apply: %+v", st)
	}

	target := netip.AddrPortFrom(vip, 80)
	if c, err := cli.DialTCP(target, time.Second); err == nil {
		c.Close()
		t.Fatalf("the client, identity %d (denied), connected through the VIP", denied)
	}
	if st := policies(); st.Counters.Denied == 0 {
		t.Errorf("no policy_denied drop counted: %+v", st.Counters)
	}

	// The file now gives the client an allowed identity; the reconcile
	// reads it again.
	writeIPCache(t, ipcache, cli.Addr4, allowed)
	body, err := d.Request("POST", "/v1/network/services/policies/reconcile", nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatal(err)
	}
	if st.IPCachePrefixes != 1 || len(st.Policies) != 1 || !reflect.DeepEqual(st.Policies[0].Unresolved, []fluxvm.Identity{other, denied}) {
		t.Fatalf("after the reconcile: %s", body)
	}
	if got := policies(); !reflect.DeepEqual(got.Policies[0].Unresolved, []fluxvm.Identity{other, denied}) {
		t.Errorf("GET policies after the reconcile: %+v", got)
	}
	c, err := cli.DialTCP(target, 3*time.Second)
	if err != nil {
		t.Fatalf("the client, identity %d (allowed), cannot connect: %v\n%s", allowed, err, d.Out)
	}
	defer c.Close()
	if err := c.Echo([]byte("hello"), 3*time.Second); err != nil {
		t.Fatal(err)
	}

	// A bad file: the reconcile is refused and nothing changes.
	if err := os.WriteFile(ipcache, []byte(`{"entries": [{"prefix": "10.0.0.1/24", "identity": 1}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if body, err := d.Request("POST", "/v1/network/services/policies/reconcile", nil); err == nil {
		t.Errorf("a bad ipcache file was accepted: %s", body)
	}
	if err := c.Echo([]byte("still"), 3*time.Second); err != nil {
		t.Fatalf("a refused reconcile broke the connection: %v", err)
	}

	// Revoked: the open connection stops at its next packet.
	writeIPCache(t, ipcache, cli.Addr4, denied)
	if _, err := d.Request("POST", "/v1/network/services/policies/reconcile", nil); err != nil {
		t.Fatal(err)
	}
	if err := c.Echo([]byte("after"), time.Second); err == nil {
		t.Error("the connection of a revoked identity still works")
	}
	if st := policies(); st.Counters.Revoked == 0 {
		t.Errorf("no revoked packet counted: %+v", st.Counters)
	}

	// The policy can be deleted; the service stays and admits the client.
	if _, err := d.Request("DELETE", "/v1/network/services/web/policy", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Request("GET", "/v1/network/services/web/policy", nil); err == nil {
		t.Error("GET policy after DELETE succeeded")
	}
	c2, err := cli.DialTCP(target, 3*time.Second)
	if err != nil {
		t.Fatalf("without a policy the client cannot connect: %v", err)
	}
	c2.Close()
}
