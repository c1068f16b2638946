package bpf

import (
	"bytes"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// l7Proxy is the proxy interface of TestL7Redirect's headers: no
// interface has it in the test run, which only returns the redirect; the
// bypass cases name loopback, where BPF_PROG_TEST_RUN packets come in.
const (
	l7Proxy    = 4242
	l7Loopback = 1
)

// l7Policy writes service sid's header with L7 enforce toward ifindex
// (and the default allow), and sets the frontend's flags.
func (h *harness) l7Policy(rev uint32, def uint8, ifindex uint32, verdicts map[uint32]uint8, svc func(flags uint32)) {
	h.t.Helper()
	for id, a := range verdicts {
		h.must(h.objs.FluxvmSpol.Put(PolicyKey{Id: 20, Identity: id}, PolicyValue{Action: a}))
	}
	h.must(h.objs.FluxvmSpol.Put(PolicyKey{Id: sid, Identity: PolicyHeader},
		PolicyValue{Rules: 20, Revision: rev, Action: def, Flags: PolicyFlagL7, ProxyIfindex: ifindex}))
	svc(SvcFlagPolicy | SvcFlagL7)
}

// TestL7Redirect: a service with L7 enforce hands its new flows, after the
// identity decision, untranslated to the proxy interface (bpf_redirect_peer),
// and their later packets too; the proxy's own packets (coming in on the
// proxy interface) are load-balanced as usual whatever their source's
// identity; flows from before enforce keep their backend until a fresh SYN
// reuses the tuple; a header without enforce leaves flows to the mode's
// path, a missing one fails closed. East-west NAT and north-south SNAT,
// both families.
func TestL7Redirect(t *testing.T) {
	const denied = 2001
	h := newHarness(t)
	h.edge()
	// East-west with stored reverse halves (so that a reused tuple's
	// half is seen to go); north-south on both edges (enforce needs the
	// VM edge, where the proxy's own flows come in: from_vm).
	modes := []struct {
		name  string
		setup func(v variant, flags uint32)
		prog  *ebpf.Program
	}{
		{"east-west nat", func(v variant, flags uint32) { h.svcFlags(sid, v.vip, v.proto, SvcFlagRevStored|flags) }, h.objs.FluxvmFromVm},
		{"north-south snat", func(v variant, flags uint32) {
			h.svcFlags(sid, v.vip, v.proto, SvcFlagNorthSouth|flags)
		}, h.objs.FluxvmNsIn},
	}
	for _, mode := range modes {
		for _, v := range []variant{variants()[0], variants()[2]} {
			t.Run(mode.name+"/"+v.name, func(t *testing.T) {
				h.reset()
				for _, m := range []*ebpf.Map{h.objs.FluxvmSpol, h.objs.FluxvmSid4, h.objs.FluxvmSid6} {
					clearMap(t, m)
				}
				v.setup(h)
				if mode.name == "north-south snat" {
					v.nsSetup(h, 0)
				}
				svc := func(flags uint32) { mode.setup(v, flags) }
				host := v.client.String() + "/32"
				if v.client.Is6() {
					host = v.client.String() + "/128"
				}
				h.flowSampling(1)
				redirected := func(port uint16, f pkt.TCPFlags, what string) {
					t.Helper()
					in := v.fwd(port, f)
					ret, out := h.run(mode.prog, in)
					if ret != tcRedirect || !bytes.Equal(out[:len(in)], in) {
						t.Fatalf("%s: verdict %d; want TC_ACT_REDIRECT with the packet untranslated", what, int32(ret))
					}
				}
				translatedBy := func(prog *ebpf.Program, port uint16, f pkt.TCPFlags, what string) {
					t.Helper()
					in := v.fwd(port, f)
					if ret, out := h.run(prog, in); ret != tcOK || bytes.Equal(out[:len(in)], in) {
						t.Fatalf("%s: verdict %d; want TC_ACT_OK, translated", what, int32(ret))
					}
				}
				translated := func(port uint16, f pkt.TCPFlags, what string) {
					t.Helper()
					translatedBy(mode.prog, port, f, what)
				}
				dropped := func(port uint16, f pkt.TCPFlags, reason DropReason, what string) {
					t.Helper()
					before := h.drops()
					if ret, _ := h.run(mode.prog, v.fwd(port, f)); ret != tcShot || h.drops()[reason] != before[reason]+1 {
						t.Fatalf("%s: verdict %d; want a %s drop", what, int32(ret), reason)
					}
				}

				// A flow from before enforce: translated, learned.
				h.policy(sid, 10, 1, PolicyAllow, 0, nil)
				svc(SvcFlagPolicy)
				translated(41000, pkt.SYN, "before enforce")
				old, _ := h.ct(v.flow(41000))
				half := v.natKey(v.backends[old.BackendId-1], 41000)
				if mode.name == "north-south snat" {
					half = v.snatKey(v.backends[old.BackendId-1], Port(old.NatPort))
				}
				if _, ok := h.nat(half); !ok {
					t.Fatalf("the flow from before enforce has no reverse half %+v", half)
				}

				// Enforce on: a new flow goes to the proxy whole.
				h.l7Policy(2, PolicyAllow, l7Proxy, nil, svc)
				c0, st0 := h.counters(), h.stats(sid)
				redirected(41001, pkt.SYN, "a new flow")
				ct, ok := h.ct(v.flow(41001))
				if !ok || ct.Flags&CTFlagL7 == 0 || ct.L7Ifindex != l7Proxy || ct.BackendId != 0 || ct.PolicyRev != 2 {
					t.Fatalf("conntrack %+v (present %v): want an L7 entry toward %d under revision 2", ct, ok, l7Proxy)
				}
				if f, ok := h.flowRecord(ct.Flow); !ok || FlowVerdict(f.Verdict) != FlowRedirected || f.FwdPackets != 1 {
					t.Errorf("record %+v (present %v): want verdict redirected, one packet", f, ok)
				}
				// Its next packets follow it; one new flow counted.
				redirected(41001, pkt.ACK, "the flow's next packet")
				c1, st1 := h.counters(), h.stats(sid)
				if n := c1[CounterL7Redirected] - c0[CounterL7Redirected]; n != 1 {
					t.Errorf("l7_redirected +%d; want 1", n)
				}
				if st1.NewFlows-st0.NewFlows != 1 || st1.Packets-st0.Packets != 2 || st1.L7Redirected-st0.L7Redirected != 1 {
					t.Errorf("service stats: new flows +%d, packets +%d, redirected +%d; want 1, 2 and 1",
						st1.NewFlows-st0.NewFlows, st1.Packets-st0.Packets, st1.L7Redirected-st0.L7Redirected)
				}
				// The flow from before keeps its backend; a fresh SYN
				// reusing its tuple after its FIN goes to the proxy.
				translated(41000, pkt.ACK, "an established flow from before enforce")
				translated(41000, pkt.FIN, "its FIN")
				redirected(41000, pkt.SYN, "a fresh SYN reusing the tuple")
				if ct, _ := h.ct(v.flow(41000)); ct.Flags&CTFlagL7 == 0 {
					t.Errorf("conntrack %+v: want the reused tuple's flow taken by L7", ct)
				}
				// The stored half goes with its flow (it would translate
				// the old backend's late packets onto the proxied
				// connection); an SNAT mapping stays for the GC.
				if _, ok := h.nat(half); ok != (mode.name == "north-south snat") {
					t.Errorf("reverse half of the replaced flow present %v", ok)
				}

				// The identity decision comes first: a denied source's
				// new flow drops, nothing learned; revoking an identity
				// stops its redirected flow.
				h.ipcache(host, denied)
				h.l7Policy(3, PolicyAllow, l7Proxy, map[uint32]uint8{denied: PolicyDeny}, svc)
				d0 := h.stats(sid).PolicyDenied
				dropped(41002, pkt.SYN, DropPolicyDenied, "a denied identity's new flow")
				if _, ok := h.ct(v.flow(41002)); ok {
					t.Error("a denied flow was learned")
				}
				dropped(41001, pkt.ACK, DropPolicyDenied, "a redirected flow after its identity was revoked")
				if n := h.stats(sid).PolicyDenied - d0; n != 2 {
					t.Errorf("service policy_denied +%d; want 2 (a new flow, a revoked one)", n)
				}

				// The proxy's own flows (in on the proxy interface) are
				// load-balanced, whatever the identity of their source:
				// no loop.
				b0 := h.counters()
				h.l7Policy(4, PolicyDeny, l7Loopback, nil, svc)
				translatedBy(h.objs.FluxvmFromVm, 41003, pkt.SYN, "the proxy's new flow")
				translatedBy(h.objs.FluxvmFromVm, 41003, pkt.ACK, "the proxy's next packet")
				if ct, ok := h.ct(v.flow(41003)); !ok || ct.Flags&CTFlagL7 != 0 || ct.BackendId == 0 {
					t.Errorf("conntrack %+v (present %v): want the proxy's flow on a backend", ct, ok)
				}
				b1 := h.counters()
				if b1[CounterL7Bypass]-b0[CounterL7Bypass] != 2 || b1[CounterL7Redirected] != b0[CounterL7Redirected] {
					t.Errorf("l7_bypass +%d, l7_redirected +%d; want 2 and 0", b1[CounterL7Bypass]-b0[CounterL7Bypass], b1[CounterL7Redirected]-b0[CounterL7Redirected])
				}

				// audit_only under enforce: a denied identity's flow goes
				// to the proxy, recorded audited.
				h.ipcache(host, denied)
				h.must(h.objs.FluxvmSpol.Put(PolicyKey{Id: sid, Identity: PolicyHeader},
					PolicyValue{Rules: 21, Revision: 7, Action: PolicyDeny, Flags: PolicyFlagL7 | PolicyFlagAudit, ProxyIfindex: l7Proxy}))
				redirected(41007, pkt.SYN, "an audited flow")
				if ct, _ := h.ct(v.flow(41007)); ct.Flags&CTFlagAudited == 0 {
					t.Errorf("conntrack %+v: want the flow audited", ct)
				} else if f, ok := h.flowRecord(ct.Flow); !ok || FlowVerdict(f.Verdict) != FlowAudited {
					t.Errorf("record %+v (present %v): want verdict audited", f, ok)
				}

				// Enforce whose proxy interface is missing: new flows
				// drop (fail closed), established ones go on.
				h.must(h.delIPCache(host))
				h.l7Policy(5, PolicyAllow, 0, nil, svc)
				dropped(41006, pkt.SYN, DropPolicyMissing, "enforce without a proxy interface")
				redirected(41000, pkt.ACK, "an established flow while the proxy interface is missing")

				// Enforce being turned off (the header first has no L7):
				// new flows take the mode's path.
				h.policy(sid, 10, 6, PolicyAllow, 0, nil)
				translated(41004, pkt.SYN, "a header without enforce")
				// No header at all: fail closed.
				h.must(h.objs.FluxvmSpol.Delete(PolicyKey{Id: sid, Identity: PolicyHeader}))
				dropped(41005, pkt.SYN, DropPolicyMissing, "no header")
				h.flowSampling(0)
			})
		}
	}
}
