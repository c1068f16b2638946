package bpf

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// ipcache maps prefix to identity in the harness's identity tries.
func (h *harness) ipcache(prefix string, id uint32) {
	h.t.Helper()
	p := netip.MustParsePrefix(prefix)
	if p.Addr().Is4() {
		h.must(h.objs.FluxvmSid4.Put(SIDKey4{Prefixlen: uint32(p.Bits()), Addr: AddrWords(p.Addr())[0]}, SIDValue{Identity: id}))
		return
	}
	h.must(h.objs.FluxvmSid6.Put(SIDKey6{Prefixlen: uint32(p.Bits()), Addr: AddrWords(p.Addr())}, SIDValue{Identity: id}))
}

// policy writes service s's policy as the control plane does: the rules
// under rule set id rules, then the header naming them.
func (h *harness) policy(s, rules, rev uint32, def, flags uint8, verdicts map[uint32]uint8) {
	h.t.Helper()
	for id, a := range verdicts {
		h.must(h.objs.FluxvmSpol.Put(PolicyKey{Id: rules, Identity: id}, PolicyValue{Action: a}))
	}
	h.must(h.objs.FluxvmSpol.Put(PolicyKey{Id: s, Identity: PolicyHeader}, PolicyValue{Rules: rules, Revision: rev, Action: def, Flags: flags}))
}

func clearMap(t testing.TB, m *ebpf.Map) {
	t.Helper()
	var keys [][]byte
	k := make([]byte, m.KeySize())
	var v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, append([]byte(nil), k...))
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	for _, key := range keys {
		if err := m.Delete(key); err != nil {
			t.Fatal(err)
		}
	}
}

// policyMode is one forward path under test: how its service is set up,
// where client packets enter, and the verdict of a packet it forwards.
type policyMode struct {
	name  string
	setup func(h *harness, v variant)
	prog  func(h *harness) *ebpf.Program
	// forwarded tells a forwarded verdict (DSR has no route here and
	// drops after the policy with its own reason).
	forwarded func(h *harness, ret uint32, before Drops) bool
}

func policyModes() []policyMode {
	ok := func(h *harness, ret uint32, _ Drops) bool { return ret == tcOK }
	return []policyMode{
		{"east-west nat", func(h *harness, v variant) {
			v.setup(h)
			h.svcFlags(sid, v.vip, v.proto, SvcFlagPolicy)
		}, func(h *harness) *ebpf.Program { return h.objs.FluxvmFromVm }, ok},
		{"north-south snat", func(h *harness, v variant) {
			v.nsSetup(h, SvcFlagPolicy)
		}, func(h *harness) *ebpf.Program { return h.objs.FluxvmNsIn }, ok},
		{"dsr", func(h *harness, v variant) {
			v.nsSetup(h, SvcFlagDSR|SvcFlagPolicy)
		}, func(h *harness) *ebpf.Program { return h.objs.FluxvmNsIn }, func(h *harness, ret uint32, before Drops) bool {
			// No route toward the backend in the test run: past the
			// policy, DSR drops with its own reason.
			return ret == tcShot && h.drops()[DropDSRNoRoute] == before[DropDSRNoRoute]+1
		}},
	}
}

// TestPolicy: a service's identity policy decides new flows by the
// source's identity (the ipcache's longest prefix; unknown without one):
// the deny list wins, then the allow list, then the default; audit_only
// forwards what it denies, counted and recorded audited; a missing header
// fails closed; and a changed revision reaches established flows at their
// next packet. Every forward path, both families, TCP and UDP.
func TestPolicy(t *testing.T) {
	const (
		allowed = 1001
		denied  = 2001
		other   = 3001
		rules1  = 10
		rules2  = 11
	)
	h := newHarness(t)
	for _, mode := range policyModes() {
		for _, v := range variants() {
			t.Run(mode.name+"/"+v.name, func(t *testing.T) {
				h.reset()
				for _, m := range []*ebpf.Map{h.objs.FluxvmSpol, h.objs.FluxvmSid4, h.objs.FluxvmSid6} {
					clearMap(t, m)
				}
				mode.setup(h, v)
				prog := mode.prog(h)
				// The client's /128 (or /32) is denied, its /64 (or /16)
				// allowed: the longest prefix decides.
				wide, host := "10.0.0.0/16", v.client.String()+"/32"
				if v.client.Is6() {
					wide, host = "fd00::/64", v.client.String()+"/128"
				}
				h.ipcache(wide, allowed)
				h.ipcache(host, denied)
				send := func(port uint16, f pkt.TCPFlags) (bool, Drops) {
					before := h.drops()
					ret, _ := h.run(prog, v.fwd(port, f))
					return mode.forwarded(h, ret, before), before
				}
				expectDrop := func(port uint16, f pkt.TCPFlags, reason DropReason, what string) {
					t.Helper()
					before := h.drops()
					ret, _ := h.run(prog, v.fwd(port, f))
					if ret != tcShot || h.drops()[reason] != before[reason]+1 {
						t.Fatalf("%s: verdict %d, %s drops %d -> %d; want a %s drop", what, int32(ret), reason, before[reason], h.drops()[reason], reason)
					}
				}

				// Default deny, the client's identity (its /32: denied)
				// on the deny list: dropped, nothing learned.
				h.policy(sid, rules1, 1, PolicyDeny, 0, map[uint32]uint8{allowed: PolicyAllow})
				expectDrop(40000, pkt.SYN, DropPolicyDenied, "default deny, identity not allowed")
				if _, ok := h.ct(v.flow(40000)); ok {
					t.Fatal("a denied flow was learned")
				}
				// The host entry gone, the /16 (/64) decides: allowed.
				h.must(h.delIPCache(host))
				if ok, _ := send(40001, pkt.SYN); !ok {
					t.Fatal("an allowed identity's flow was not forwarded")
				}
				ct, ok := h.ct(v.flow(40001))
				if !ok || ct.PolicyRev != 1 {
					t.Fatalf("conntrack %+v (present %v): want the flow admitted under revision 1", ct, ok)
				}
				// Unknown identity (no prefix) under default allow with a
				// deny rule for another identity: allowed.
				h.must(h.delIPCache(wide))
				h.policy(sid, rules2, 2, PolicyAllow, 0, map[uint32]uint8{denied: PolicyDeny})
				if ok, _ := send(40002, pkt.SYN); !ok {
					t.Fatal("an unknown source under default allow was not forwarded")
				}

				// Revocation: the established flow 40001 (identity
				// allowed) under a new revision that denies it.
				h.ipcache(wide, allowed)
				c0 := h.counters()
				h.policy(sid, rules1, 3, PolicyAllow, 0, map[uint32]uint8{allowed: PolicyDeny})
				expectDrop(40001, pkt.ACK, DropPolicyDenied, "an established flow after its identity was revoked")
				c1 := h.counters()
				if c1[CounterPolicyRechecked]-c0[CounterPolicyRechecked] != 1 || c1[CounterPolicyRevoked]-c0[CounterPolicyRevoked] != 1 {
					t.Errorf("rechecked %d, revoked %d; want 1 and 1", c1[CounterPolicyRechecked]-c0[CounterPolicyRechecked], c1[CounterPolicyRevoked]-c0[CounterPolicyRevoked])
				}
				// Allowed again (another rule set, revision 4): the same
				// flow goes on, on its backend, admitted under 4, and its
				// next packet costs no recheck.
				h.policy(sid, rules2, 4, PolicyAllow, 0, nil)
				if ok, _ := send(40001, pkt.ACK); !ok {
					t.Fatal("the flow allowed again was not forwarded")
				}
				if ct2, _ := h.ct(v.flow(40001)); ct2.PolicyRev != 4 || ct2.BackendId != ct.BackendId {
					t.Errorf("conntrack %+v: want revision 4 on backend %d", ct2, ct.BackendId)
				}
				c2 := h.counters()
				if ok, _ := send(40001, pkt.ACK); !ok || h.counters()[CounterPolicyRechecked] != c2[CounterPolicyRechecked] {
					t.Errorf("a packet under its own revision: forwarded %v, rechecked %d more", ok, h.counters()[CounterPolicyRechecked]-c2[CounterPolicyRechecked])
				}

				// Audit only: denied, forwarded, counted, recorded
				// audited.
				h.flowSampling(1)
				h.policy(sid, rules1, 5, PolicyDeny, PolicyFlagAudit, map[uint32]uint8{other: PolicyAllow})
				a0, sa0 := h.counters()[CounterPolicyAudited], h.stats(sid).PolicyAudited
				if ok, _ := send(40003, pkt.SYN); !ok {
					t.Fatal("audit_only dropped a denied flow")
				}
				if n, sn := h.counters()[CounterPolicyAudited]-a0, h.stats(sid).PolicyAudited-sa0; n != 1 || sn != 1 {
					t.Errorf("policy_audited +%d, the service's +%d; want 1 and 1", n, sn)
				}
				if ct, ok := h.ct(v.flow(40003)); ok && ct.Flow != 0 && mode.name != "dsr" {
					if f, ok := h.flowRecord(ct.Flow); !ok || FlowVerdict(f.Verdict) != FlowAudited {
						t.Errorf("record %+v (present %v): want verdict audited", f, ok)
					}
				} else if mode.name != "dsr" {
					t.Errorf("audited flow: conntrack %+v (present %v), no record", ct, ok)
				}
				h.flowSampling(0)

				// Fail closed: the flag without a header drops, new
				// flows and established ones.
				h.must(h.objs.FluxvmSpol.Delete(PolicyKey{Id: sid, Identity: PolicyHeader}))
				expectDrop(40004, pkt.SYN, DropPolicyMissing, "a new flow without the policy's header")
				expectDrop(40001, pkt.ACK, DropPolicyMissing, "an established flow without the policy's header")

				// The policy taken off (flag cleared): no lookups, the
				// flow goes on whatever fluxvm_spol holds.
				h.policy(sid, rules1, 6, PolicyDeny, 0, nil)
				flags := uint32(0)
				switch mode.name {
				case "north-south snat":
					flags = SvcFlagNorthSouth | SvcFlagNoEastWest
				case "dsr":
					flags = SvcFlagNorthSouth | SvcFlagNoEastWest | SvcFlagDSR
				}
				h.svcFlags(sid, v.vip, v.proto, flags)
				if ok, _ := send(40005, pkt.SYN); !ok {
					t.Error("a service without the policy flag consulted its old policy")
				}
			})
		}
	}
}

func (h *harness) delIPCache(prefix string) error {
	p := netip.MustParsePrefix(prefix)
	if p.Addr().Is4() {
		return h.objs.FluxvmSid4.Delete(SIDKey4{Prefixlen: uint32(p.Bits()), Addr: AddrWords(p.Addr())[0]})
	}
	return h.objs.FluxvmSid6.Delete(SIDKey6{Prefixlen: uint32(p.Bits()), Addr: AddrWords(p.Addr())})
}

// BenchmarkPolicy: the conntrack-hit cost of a service's identity policy,
// the same flow with the policy off and on (admitted under the policy's
// current revision: one header lookup), in alternate blocks
// (measureInterleaved); policy-minus-none-ns is the net cost (issue 21:
// at most +20 ns).
func BenchmarkPolicy(b *testing.B) {
	calls := benchCalls(b)
	h := newHarnessSized(b, 0)
	v := variants()[0]
	v.setup(h)
	h.edge()
	h.ipcache("10.0.0.0/16", 1001)
	h.policy(sid, 10, 7, PolicyDeny, 0, map[uint32]uint8{1001: PolicyAllow})
	h.svcFlags(sid, v.vip, v.proto, SvcFlagPolicy)
	if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN)); ret != tcOK {
		b.Fatal("flow not admitted")
	}
	if ct, ok := h.ct(v.flow(40000)); !ok || ct.PolicyRev != 7 {
		b.Fatalf("conntrack %+v (present %v): want the flow admitted under revision 7", ct, ok)
	}
	flags := func(f uint32) func() { return func() { h.svcFlags(sid, v.vip, v.proto, f) } }
	ack := func(int) []byte { return v.fwd(40000, pkt.ACK) }
	cases := []*benchCase{
		{name: "ipv4 tcp conntrack hit, no policy", metric: "v4-ct-hit-no-policy", prog: h.objs.FluxvmFromVm, frame: ack, want: tcOK, before: flags(0)},
		{name: "ipv4 tcp conntrack hit, policy", metric: "v4-ct-hit-policy", prog: h.objs.FluxvmFromVm, frame: ack, want: tcOK, before: flags(SvcFlagPolicy)},
	}
	r0 := h.counters()[CounterPolicyRechecked]
	measureInterleaved(b, h.th, calls, cases, true)
	n := float64(cases[0].sum) / float64(cases[0].n)
	p := float64(cases[1].sum) / float64(cases[1].n)
	b.ReportMetric(p-n, "policy-minus-none-ns")
	if r := h.counters()[CounterPolicyRechecked] - r0; r != 0 {
		b.Fatalf("%d packets decided again: the benchmark did not measure the revision check alone", r)
	}
}

// TestPolicyXDPPasses: XDP serves no service with an identity policy or
// L7 enforce: it
// passes the packet on untouched (TC applies the policy), counted; the
// same service without the policy is translated by XDP.
func TestPolicyXDPPasses(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	objs := newXDPObjects(t, h, l.out)
	for _, c := range []struct {
		name  string
		flags uint32
	}{{"policy", SvcFlagPolicy}, {"l7", SvcFlagPolicy | SvcFlagL7}, {"l7 flag alone", SvcFlagL7}} {
		for _, v := range []variant{variants()[0], variants()[2]} {
			t.Run(c.name+"/"+v.name, func(t *testing.T) {
				h.reset()
				v.nsSetup(h, c.flags)
				in := v.frame(v.clientAt(snatMin), v.vip, pkt.SYN)
				c0 := h.counters()[CounterXDPPassPolicy]
				ret, out := h.runXDP(objs.FluxvmXdpNs, in, l.in)
				if ret != xdpPass || !bytes.Equal(out[:len(in)], in) {
					t.Fatalf("verdict %d; want XDP_PASS with the frame untouched", ret)
				}
				if n := h.counters()[CounterXDPPassPolicy] - c0; n != 1 {
					t.Errorf("xdp_pass_policy +%d, want 1", n)
				}
				if _, ok := h.ct(tuple{v.clientAt(snatMin), v.vip, v.proto}); ok {
					t.Error("XDP learned a flow of a service with a policy")
				}
				v.nsSetup(h, 0)
				if ret, _ := h.runXDP(objs.FluxvmXdpNs, in, l.in); ret != xdpRedirect {
					t.Errorf("without the policy: verdict %d; want XDP_REDIRECT", ret)
				}
			})
		}
	}
}
