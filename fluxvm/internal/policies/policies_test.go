package policies

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/policy"
)

// fakeWriter is the policy maps as a Writer leaves them: the ipcache, and
// the header of each datapath service (the policy it names). It checks
// the order package policy asks for: a frontend's flag never without its
// header, a header never removed under a flag.
type fakeWriter struct {
	t      *testing.T
	svc    *fakeServices
	ipc    []intent.IPCacheEntry
	heads  map[uint32]policy.Compiled
	writes int // map changes
	// failAttach fails the Attach of that datapath service id (0: none);
	// failIPCache fails SetIPCache.
	failAttach  uint32
	failIPCache bool
}

func (w *fakeWriter) IPCacheChanges(p *policy.Program) bool {
	return !slices.Equal(w.ipc, slices.Concat(p.IPv4, p.IPv6))
}

func (w *fakeWriter) SetIPCache(p *policy.Program) error {
	if w.failIPCache {
		return errors.New("ipcache write failed")
	}
	if !w.IPCacheChanges(p) {
		return nil
	}
	// Every frontend enforcing a policy, before or after, has its guard
	// closed meanwhile.
	for _, fe := range w.svc.fes {
		if fe.Flags&bpf.SvcFlagPolicy != 0 && !w.svc.closed[fe.SID] {
			w.t.Errorf("ipcache written while frontend %d of %s enforces a policy with its guard open", fe.SID, fe.Service)
		}
	}
	w.ipc = slices.Concat(p.IPv4, p.IPv6)
	w.writes++
	return nil
}

func (w *fakeWriter) Attach(c *policy.Compiled, sids []uint32) error {
	for _, sid := range sids {
		if sid == w.failAttach {
			return fmt.Errorf("header of service %d: write failed", sid)
		}
		if old, ok := w.heads[sid]; !ok || old.Revision != c.Revision || old.ID != c.ID || old.ProxyIfindex != c.ProxyIfindex {
			w.heads[sid] = *c
			w.writes++
		}
	}
	return nil
}

func (w *fakeWriter) Detach(sids []uint32) error {
	for _, sid := range sids {
		if _, ok := w.heads[sid]; !ok {
			continue
		}
		if fe := w.svc.frontend(sid); fe != nil && fe.Flags&bpf.SvcFlagPolicy != 0 {
			w.t.Errorf("header of frontend %d removed while its flag is on", sid)
		}
		delete(w.heads, sid)
		w.writes++
	}
	return nil
}

func (w *fakeWriter) Prune(_ *policy.Program, keep func(uint32) bool) error {
	for sid := range w.heads {
		if !keep(sid) {
			if err := w.Detach([]uint32{sid}); err != nil {
				return err
			}
		}
	}
	return nil
}

// fakeServices is the services and their live frontends; hook, when set,
// runs inside every call the Enforcer makes (a facade callback).
type fakeServices struct {
	t      *testing.T
	w      *fakeWriter
	svcs   map[string]*intent.Service
	fes    []*Frontend
	closed map[uint32]bool // guards closed now
	hook   func()
	// vmedge are the attached VM-edge interfaces; devices the devices'
	// indexes in the namespace.
	vmedge  map[string]int
	devices map[string]uint32
}

func (s *fakeServices) call() {
	if s.hook != nil {
		s.hook()
	}
}

func (s *fakeServices) frontend(sid uint32) *Frontend {
	for _, fe := range s.fes {
		if fe.SID == sid {
			return fe
		}
	}
	return nil
}

func (s *fakeServices) Service(name string) *intent.Service {
	s.call()
	return s.svcs[name]
}

func (s *fakeServices) Frontends() []Frontend {
	s.call()
	var out []Frontend
	for _, fe := range s.fes {
		out = append(out, *fe)
	}
	return out
}

func (s *fakeServices) SetPolicyFlags(service string, sid uint32, on uint32) error {
	s.call()
	fe := s.frontend(sid)
	if fe == nil || fe.Service != service {
		return fmt.Errorf("no frontend %d of %s", sid, service)
	}
	if on&bpf.SvcFlagPolicy != 0 {
		if _, ok := s.w.heads[sid]; !ok {
			s.t.Errorf("flag of frontend %d set before its header", sid)
		}
	}
	fe.Flags = fe.Flags&^(bpf.SvcFlagPolicy|bpf.SvcFlagL7) | on
	return nil
}

func (s *fakeServices) CloseGuards(services []string) (func() error, error) {
	s.call()
	var closed []uint32
	for _, fe := range s.fes {
		if slices.Contains(services, fe.Service) {
			s.closed[fe.SID] = true
			closed = append(closed, fe.SID)
		}
	}
	return func() error {
		for _, sid := range closed {
			delete(s.closed, sid)
		}
		return nil
	}, nil
}

func (s *fakeServices) VMEdge(name string) (int, bool) {
	s.call()
	i, ok := s.vmedge[name]
	return i, ok
}

func (s *fakeServices) device(name string) (uint32, error) {
	s.call()
	i, ok := s.devices[name]
	if !ok {
		return 0, fmt.Errorf("interface %q: no such device", name)
	}
	return i, nil
}

// rig is an Enforcer over fakes: services "web" (frontends 1, 2) and "db"
// (frontend 3), the proxy veth "fxproxy0" attached under index 7.
type rig struct {
	e       *Enforcer
	w       *fakeWriter
	s       *fakeServices
	journal []*State
	jerr    error
}

func newRig(t *testing.T) *rig {
	t.Helper()
	tcp := []intent.ServicePort{{Port: 80, Protocol: intent.TCP}}
	s := &fakeServices{t: t, closed: map[uint32]bool{},
		svcs:   map[string]*intent.Service{"web": {Name: "web", Ports: tcp}, "db": {Name: "db", Ports: tcp}},
		fes:    []*Frontend{{Service: "web", SID: 1, Flags: bpf.SvcFlagRevStored}, {Service: "web", SID: 2}, {Service: "db", SID: 3}},
		vmedge: map[string]int{"fxproxy0": 7}, devices: map[string]uint32{"fxproxy0": 7}}
	w := &fakeWriter{t: t, svc: s, heads: map[uint32]policy.Compiled{}}
	s.w = w
	r := &rig{w: w, s: s}
	e, err := New(Config{Services: 16, PolicyEntries: 16 + 2*intent.MaxPolicyIdentities + 64},
		Deps{Writer: w, Services: s, Interfaces: s, Device: s.device, Journal: func(st *State) (uint64, error) {
			if r.jerr != nil {
				return 0, r.jerr
			}
			r.journal = append(r.journal, st)
			return uint64(len(r.journal)), nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	r.e = e
	return r
}

var ipc = intent.IPCache{Entries: []intent.IPCacheEntry{
	{Prefix: netip.MustParsePrefix("10.40.0.0/24"), Identity: 1001},
	{Prefix: netip.MustParsePrefix("fd00:40::/64"), Identity: 2001},
}}

// reconcile is a Change that sets the ipcache and the policies.
func (r *rig) reconcile(c intent.IPCache, pols ...intent.Policy) (uint64, error) {
	return r.e.Change(func(st *State) error {
		st.IPCache, st.Policies = c, pols
		return nil
	}, nil)
}

// revs are the revision each header names.
func (r *rig) revs() map[uint32]uint32 {
	out := map[uint32]uint32{}
	for sid, c := range r.w.heads {
		out[sid] = c.Revision
	}
	return out
}

// flags are each frontend's policy flags.
func (r *rig) flags() map[uint32]uint32 {
	out := map[uint32]uint32{}
	for _, fe := range r.s.fes {
		out[fe.SID] = fe.Flags & (bpf.SvcFlagPolicy | bpf.SvcFlagL7)
	}
	return out
}

// heads are the policy (service) each header names, and its proxy index.
func (r *rig) heads() map[uint32]string {
	out := map[uint32]string{}
	for sid, c := range r.w.heads {
		out[sid] = fmt.Sprintf("%s/%d", c.Service, c.ProxyIfindex)
	}
	return out
}

var l7enforce = &intent.L7Policy{Mode: intent.L7Enforce, Protocol: intent.L7HTTP, ProxyInterface: "fxproxy0"}

// TestChangeWrites: a change compiles the policies and writes them:
// the ipcache, each enforced policy's header on every live frontend of
// its service before its flags (the fake checks the order), and the
// journal gets the state with the policies' ids.
func TestChangeWrites(t *testing.T) {
	off := false
	for _, tc := range []struct {
		name      string
		pols      []intent.Policy
		wantFlags map[uint32]uint32
		wantHeads map[uint32]string
		wantRules map[string]int
	}{
		{name: "allow list", pols: []intent.Policy{{Service: "web", DefaultAction: intent.PolicyDeny, AllowIdentities: []intent.Identity{1001, 3001}}},
			wantFlags: map[uint32]uint32{1: bpf.SvcFlagPolicy, 2: bpf.SvcFlagPolicy, 3: 0},
			wantHeads: map[uint32]string{1: "web/0", 2: "web/0"}, wantRules: map[string]int{"web": 2}},
		{name: "two services", pols: []intent.Policy{
			{Service: "web", DefaultAction: intent.PolicyAllow, DenyIdentities: []intent.Identity{1001}},
			{Service: "db", DefaultAction: intent.PolicyDeny}},
			wantFlags: map[uint32]uint32{1: bpf.SvcFlagPolicy, 2: bpf.SvcFlagPolicy, 3: bpf.SvcFlagPolicy},
			wantHeads: map[uint32]string{1: "web/0", 2: "web/0", 3: "db/0"}, wantRules: map[string]int{"web": 1, "db": 0}},
		{name: "L7 enforce", pols: []intent.Policy{{Service: "web", DefaultAction: intent.PolicyAllow, L7: l7enforce}},
			wantFlags: map[uint32]uint32{1: bpf.SvcFlagPolicy | bpf.SvcFlagL7, 2: bpf.SvcFlagPolicy | bpf.SvcFlagL7, 3: 0},
			wantHeads: map[uint32]string{1: "web/7", 2: "web/7"}, wantRules: map[string]int{"web": 0}},
		{name: "L7 observe", pols: []intent.Policy{{Service: "web", DefaultAction: intent.PolicyAllow,
			L7: &intent.L7Policy{Mode: intent.L7Observe, Protocol: intent.L7HTTP}}},
			wantFlags: map[uint32]uint32{1: bpf.SvcFlagPolicy, 2: bpf.SvcFlagPolicy, 3: 0},
			wantHeads: map[uint32]string{1: "web/0", 2: "web/0"}, wantRules: map[string]int{"web": 0}},
		{name: "disabled", pols: []intent.Policy{{Service: "web", DefaultAction: intent.PolicyDeny, Enabled: &off}},
			wantFlags: map[uint32]uint32{1: 0, 2: 0, 3: 0}, wantHeads: map[uint32]string{}, wantRules: map[string]int{"web": 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			seq, err := r.reconcile(ipc, tc.pols...)
			if err != nil {
				t.Fatal(err)
			}
			if got := r.flags(); !mapsEqual(got, tc.wantFlags) {
				t.Errorf("flags %v, want %v", got, tc.wantFlags)
			}
			if got := r.heads(); !mapsEqual(got, tc.wantHeads) {
				t.Errorf("headers %v, want %v", got, tc.wantHeads)
			}
			if r.s.fes[0].Flags&bpf.SvcFlagRevStored == 0 {
				t.Error("a change of the policy flags lost another flag of the frontend")
			}
			if len(r.w.ipc) != 2 || len(r.s.closed) != 0 {
				t.Errorf("ipcache %v, guards left closed %v", r.w.ipc, r.s.closed)
			}
			if seq != 1 || len(r.journal) != 1 || len(r.journal[0].Policies) != len(tc.pols) || len(r.journal[0].IDs) != len(tc.pols) {
				t.Fatalf("seq %d, journal %+v", seq, r.journal)
			}
			st := r.e.Status()
			for _, p := range st.Policies {
				if p.Rules != tc.wantRules[p.Service] {
					t.Errorf("%s: %d rules, want %d", p.Service, p.Rules, tc.wantRules[p.Service])
				}
				want := 0
				for sid, f := range tc.wantFlags {
					if f != 0 && r.s.frontend(sid).Service == p.Service {
						want++
					}
				}
				if p.Frontends != want {
					t.Errorf("%s: %d frontends enforce it, want %d", p.Service, p.Frontends, want)
				}
			}
			if st.IPCachePrefixes != 2 || len(st.Policies) != len(tc.pols) {
				t.Errorf("status %+v", st)
			}
		})
	}
}

func mapsEqual[K comparable, V comparable](a, b map[K]V) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestIPCacheChangeRecompiles: a new ipcache moves the revision of every
// policy, rewrites their headers (the guards closed meanwhile: the fake
// checks) and resolves identities again; an unchanged one writes nothing.
func TestIPCacheChangeRecompiles(t *testing.T) {
	r := newRig(t)
	pol := intent.Policy{Service: "web", DefaultAction: intent.PolicyDeny, AllowIdentities: []intent.Identity{1001, 3001}}
	if _, err := r.reconcile(ipc, pol); err != nil {
		t.Fatal(err)
	}
	before := r.e.Status().Policies[0]
	if !slices.Equal(before.Unresolved, []intent.Identity{3001}) {
		t.Fatalf("unresolved %v, want [3001]", before.Unresolved)
	}
	writes := r.w.writes
	setIPC := func(c intent.IPCache) {
		t.Helper()
		if _, err := r.e.Change(func(st *State) error { st.IPCache = c; return nil }, nil); err != nil {
			t.Fatal(err)
		}
	}
	setIPC(ipc)
	if r.w.writes != writes {
		t.Errorf("the same ipcache again made %d map changes", r.w.writes-writes)
	}
	more := intent.IPCache{Entries: append(slices.Clone(ipc.Entries), intent.IPCacheEntry{Prefix: netip.MustParsePrefix("10.50.0.0/16"), Identity: 3001})}
	setIPC(more)
	after := r.e.Status().Policies[0]
	if after.Revision == before.Revision || len(after.Unresolved) != 0 {
		t.Errorf("after the ipcache change: revision %d (was %d), unresolved %v", after.Revision, before.Revision, after.Unresolved)
	}
	for _, sid := range []uint32{1, 2} {
		if r.w.heads[sid].Revision != after.Revision {
			t.Errorf("header of %d has revision %d, want %d", sid, r.w.heads[sid].Revision, after.Revision)
		}
	}
	if v4, v6 := r.e.IPCacheSizes(); v4 != 2 || v6 != 1 || len(r.s.closed) != 0 {
		t.Errorf("ipcache %d/%d entries, guards left closed %v", v4, v6, r.s.closed)
	}
}

// TestDelete: deleting a policy (an edit, or Drop after its service went)
// clears its frontends' flags before their headers go, and journals the
// state without it; Drop of a service without one changes nothing.
func TestDelete(t *testing.T) {
	for _, tc := range []struct {
		name string
		del  func(r *rig) error
	}{
		{name: "edit", del: func(r *rig) error {
			_, err := r.e.Change(func(st *State) error {
				st.Policies = slices.DeleteFunc(st.Policies, func(p intent.Policy) bool { return p.Service == "web" })
				return nil
			}, nil)
			return err
		}},
		{name: "drop with the service", del: func(r *rig) error {
			delete(r.s.svcs, "web")
			r.s.fes = r.s.fes[2:]
			_, err := r.e.Drop("web")
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			if _, err := r.reconcile(ipc, intent.Policy{Service: "web", DefaultAction: intent.PolicyDeny, L7: l7enforce},
				intent.Policy{Service: "db", DefaultAction: intent.PolicyDeny}); err != nil {
				t.Fatal(err)
			}
			if err := tc.del(r); err != nil {
				t.Fatal(err)
			}
			if got, want := r.heads(), map[uint32]string{3: "db/0"}; !mapsEqual(got, want) {
				t.Errorf("headers %v, want %v", got, want)
			}
			for _, fe := range r.s.fes {
				if fe.Service == "web" && fe.Flags&(bpf.SvcFlagPolicy|bpf.SvcFlagL7) != 0 {
					t.Errorf("frontend %d keeps flags %#x", fe.SID, fe.Flags)
				}
			}
			if len(r.journal) != 2 {
				t.Fatalf("%d journal records, want 2", len(r.journal))
			}
			last := r.journal[1]
			if len(last.Policies) != 1 || last.Policies[0].Service != "db" || r.e.Has("web") || len(r.e.ProxyNames()) != 0 {
				t.Errorf("journal %+v, has web %v, proxies %v", last, r.e.Has("web"), r.e.ProxyNames())
			}
		})
	}
}

// TestL7ProxySelection: the proxy interface of an enforce policy a change
// adds or names must be an attached VM-edge interface under the index
// its device has; a kept one that went resolves to 0 (its new flows
// drop) without blocking other changes, and Stale says when the index in
// force is not the interface's any more.
func TestL7ProxySelection(t *testing.T) {
	web := intent.Policy{Service: "web", DefaultAction: intent.PolicyAllow, L7: l7enforce}
	for _, tc := range []struct {
		name    string
		vmedge  map[string]int
		devices map[string]uint32
		wantErr error
	}{
		{name: "not attached", vmedge: map[string]int{}, devices: map[string]uint32{"fxproxy0": 7}, wantErr: intent.ErrPrerequisite},
		{name: "attached under another index", vmedge: map[string]int{"fxproxy0": 5}, devices: map[string]uint32{"fxproxy0": 7}, wantErr: intent.ErrPrerequisite},
		{name: "no device", vmedge: map[string]int{"fxproxy0": 7}, devices: map[string]uint32{}, wantErr: policy.ErrNoInterface},
		{name: "attached", vmedge: map[string]int{"fxproxy0": 7}, devices: map[string]uint32{"fxproxy0": 7}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			r.s.vmedge, r.s.devices = tc.vmedge, tc.devices
			_, err := r.reconcile(ipc, web)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), "fxproxy0") {
					t.Fatalf("err %v, want %v naming the interface", err, tc.wantErr)
				}
				if len(r.w.heads) != 0 || len(r.journal) != 0 || r.e.Has("web") {
					t.Errorf("a refused change left headers %v, journal %v", r.heads(), r.journal)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := r.e.ProxyNames(); !slices.Equal(got, []string{"fxproxy0"}) || r.e.Stale("fxproxy0") {
				t.Fatalf("proxies %v, stale %v", got, r.e.Stale("fxproxy0"))
			}
			// The veth is recreated: a new index, not attached again.
			r.s.devices["fxproxy0"] = 9
			if !r.e.Stale("fxproxy0") || r.e.Stale("eth0") {
				t.Fatal("a proxy interface under a new index is not stale")
			}
			// A change that keeps the policy as it is goes through; the
			// header names 0 (fail closed).
			if _, err := r.e.Change(func(st *State) error {
				st.Policies = append(st.Policies, intent.Policy{Service: "db", DefaultAction: intent.PolicyDeny})
				return nil
			}, nil); err != nil {
				t.Fatal(err)
			}
			if got := r.heads(); got[1] != "web/0" || got[3] != "db/0" {
				t.Errorf("headers %v, want web's to name 0", got)
			}
			// Naming web resolves its proxy strictly again.
			if _, err := r.e.Change(func(*State) error { return nil }, []string{"web"}); !errors.Is(err, intent.ErrPrerequisite) {
				t.Errorf("a change naming web: %v, want ErrPrerequisite", err)
			}
			// Attached again under the new index: no longer stale once
			// a change writes it.
			r.s.vmedge["fxproxy0"] = 9
			if !r.e.Stale("fxproxy0") {
				t.Fatal("not stale before the refresh")
			}
			if _, err := r.e.Change(func(*State) error { return nil }, nil); err != nil {
				t.Fatal(err)
			}
			if r.heads()[1] != "web/9" || r.e.Stale("fxproxy0") {
				t.Errorf("headers %v after the refresh", r.heads())
			}
		})
	}
}

// TestErrorsChangeNothing: a change that cannot be compiled writes
// nothing; one whose writing fails puts back what was written; neither
// is journaled. A journal failure leaves the change in force, marked
// ErrUnsaved.
func TestErrorsChangeNothing(t *testing.T) {
	good := intent.Policy{Service: "web", DefaultAction: intent.PolicyDeny, AllowIdentities: []intent.Identity{1001}}
	for _, tc := range []struct {
		name  string
		setup func(r *rig)
		pols  []intent.Policy
		c     intent.IPCache
	}{
		{name: "no such service", pols: []intent.Policy{{Service: "nope", DefaultAction: intent.PolicyDeny}}, c: ipc},
		{name: "bad ipcache", pols: []intent.Policy{good}, c: intent.IPCache{Entries: []intent.IPCacheEntry{{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Identity: 0}}}},
		{name: "a header fails", setup: func(r *rig) { r.w.failAttach = 3 }, c: ipc,
			pols: []intent.Policy{{Service: "web", DefaultAction: intent.PolicyAllow}, {Service: "db", DefaultAction: intent.PolicyDeny}}},
		{name: "ipcache fails", setup: func(r *rig) { r.w.failIPCache = true }, pols: []intent.Policy{good},
			c: intent.IPCache{Entries: ipc.Entries[:1]}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			if _, err := r.reconcile(ipc, good); err != nil {
				t.Fatal(err)
			}
			heads, revs, flags, st, ipcBefore := r.heads(), r.revs(), r.flags(), r.e.Status(), slices.Clone(r.w.ipc)
			if tc.setup != nil {
				tc.setup(r)
			}
			if _, err := r.reconcile(tc.c, tc.pols...); err == nil || errors.Is(err, ErrUnsaved) {
				t.Fatalf("err %v, want a failure", err)
			}
			if got := r.heads(); !mapsEqual(got, heads) || !mapsEqual(r.revs(), revs) {
				t.Errorf("headers %v (revisions %v), want %v (%v) as before", got, r.revs(), heads, revs)
			}
			if got := r.flags(); !mapsEqual(got, flags) {
				t.Errorf("flags %v, want %v as before", got, flags)
			}
			if !slices.Equal(r.w.ipc, ipcBefore) || len(r.s.closed) != 0 {
				t.Errorf("ipcache %v (was %v), guards left closed %v", r.w.ipc, ipcBefore, r.s.closed)
			}
			if got := r.e.Status(); got.IPCacheRevision != st.IPCacheRevision || len(got.Policies) != 1 || len(r.journal) != 1 {
				t.Errorf("status %+v, journal %d records", got, len(r.journal))
			}
		})
	}
	t.Run("journal fails", func(t *testing.T) {
		r := newRig(t)
		r.jerr = errors.New("disk full")
		if _, err := r.reconcile(ipc, good); !errors.Is(err, ErrUnsaved) {
			t.Fatalf("err %v, want ErrUnsaved", err)
		}
		if !r.e.Has("web") || r.flags()[1] != bpf.SvcFlagPolicy || r.e.Saved() == nil {
			t.Errorf("the change is not in force: flags %v", r.flags())
		}
	})
}

// TestRestore: the recorded state compiles again with its ids, a policy
// whose service is gone is dropped, a proxy interface resolves by its
// device alone (0 when it has none); only the ipcache is written until
// Write.
func TestRestore(t *testing.T) {
	r := newRig(t)
	r.s.vmedge = map[string]int{} // not attached yet
	st := &State{IPCache: ipc, IDs: map[string]uint32{"web": 5, "gone": 1, "db": 2},
		Policies: []intent.Policy{{Service: "db", DefaultAction: intent.PolicyDeny, L7: &intent.L7Policy{Mode: intent.L7Enforce, Protocol: intent.L7HTTP, ProxyInterface: "nodev"}},
			{Service: "gone", DefaultAction: intent.PolicyDeny}, {Service: "web", DefaultAction: intent.PolicyAllow, L7: l7enforce}}}
	if err := r.e.Restore(st); err != nil {
		t.Fatal(err)
	}
	if len(r.w.heads) != 0 || len(r.w.ipc) != 2 {
		t.Fatalf("restore wrote headers %v, ipcache %v", r.heads(), r.w.ipc)
	}
	saved := r.e.Saved()
	if !mapsEqual(saved.IDs, map[string]uint32{"web": 5, "db": 2}) || len(saved.Policies) != 2 {
		t.Errorf("saved %+v", saved)
	}
	if err := r.e.Write(); err != nil {
		t.Fatal(err)
	}
	if got, want := r.heads(), map[uint32]string{1: "web/7", 2: "web/7", 3: "db/0"}; !mapsEqual(got, want) {
		t.Errorf("headers %v, want %v", got, want)
	}
	if flags, err := r.e.Attach("web", 4); err != nil || flags != bpf.SvcFlagPolicy|bpf.SvcFlagL7 || r.w.heads[4].Service != "web" {
		t.Errorf("attach of a new frontend: flags %#x, %v", flags, err)
	}
	if err := r.e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.e.Attach("web", 4); err == nil {
		t.Error("attach after Close succeeded")
	}
}

// TestCallbacksDoNotDeadlock: every Deps call runs without the
// component's state lock, so a callback may read the component (as a
// facade callback that reports status would) without deadlocking.
func TestCallbacksDoNotDeadlock(t *testing.T) {
	r := newRig(t)
	calls := 0
	r.s.hook = func() {
		calls++
		_ = r.e.Status() // Status calls Frontends: the hook must not recurse
		_, _ = r.e.IPCacheSizes()
		_ = r.e.ProxyNames()
		_ = r.e.Saved()
		_ = r.e.Has("web")
		_ = r.e.Check(&intent.Service{Name: "web"})
	}
	hook := r.s.hook
	r.s.hook = func() {
		h := r.s.hook
		r.s.hook = nil // no recursion through Status's own calls
		hook()
		r.s.hook = h
	}
	done := make(chan error, 1)
	go func() {
		_, err := r.reconcile(ipc, intent.Policy{Service: "web", DefaultAction: intent.PolicyDeny, L7: l7enforce})
		if err == nil {
			_, err = r.e.Change(func(st *State) error { st.IPCache = intent.IPCache{}; return nil }, []string{"web"})
		}
		if err == nil {
			r.e.Stale("fxproxy0")
			_, err = r.e.Drop("web")
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a callback that reads the component deadlocked")
	}
	if calls == 0 {
		t.Fatal("no callback ran")
	}
}
