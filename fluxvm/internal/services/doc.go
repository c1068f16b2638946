// Package services is the services' programming of the fluxvm dataplane:
// the Programmer writes each service's frontends, backends and Maglev
// tables into the datapath and keeps what it wrote (the frontends with
// their ids, the VIP markers, the reverse translation index, the
// frontends closed for repair).
//
// A change runs in steps that keep the maps consistent for every packet:
// Prepare (ids, backends, index slots), BuildTables (no lock: new inner
// maps), CommitUnlocked (tables swapped in whole without the lock, then
// entries, markers and guards; dropped backends and frontends last).
// Program runs them all with the lock held; UnprogramUnlocked removes a
// service. The order and its reasons are docs/architecture.md's "Apply
// path".
//
// Lock: the Programmer's state is guarded by the dataplane's lock (the
// facade's d.mu, Deps.Lock), which every caller holds; CommitUnlocked and
// RemoveUnlocked release it while they wait for RCU grace periods (the
// facade keeps the service's other writers off meanwhile: NameLocks and
// its count of changes under way). The Programmer never takes another
// lock of the facade; the components it calls (Deps.Policy, Pacing,
// State) take their own, after it.
//
// The rest of the dataplane reads the frontends through their methods
// (Frontend.ID, Live, Backends...), a read-only view; the identity policy
// component changes their flags and guards only through SetPolicyFlags
// and CloseGuards.
//
// Its parts: the id pools (fluxvm/internal/idpool), the reverse
// translation index (fluxvm/internal/revindex), and the EDT entry rules
// (fluxvm/internal/edt). What it writes goes through Maps; the facade
// passes the loaded datapath's, the tests pass fakes and need no root.
package services
