// Package services is the services' programming of the fluxvm dataplane,
// moved out of package fluxvm one coherent part at a time (issue 35).
// It holds, so far:
//
//   - IDs (ids.go): the pools of datapath service and backend ids, with
//     the quarantine a released id waits in until a conntrack GC has
//     scanned the flows that may still name it;
//   - ReverseIndex (reverse.go): the reverse translation index, which
//     frontends list a backend endpoint in fluxvm_be2fe, in a stable slot
//     order, and which frontends are past the map's slots and so need
//     SvcFlagRevStored in their frontend entries.
//
// Both are plain data structures owned by the dataplane (the facade) and
// used only under its lock (d.mu): they are called with the facade's
// lock held, have no lock of their own and start no goroutine, so they
// need no Start or Close. What they write goes through the small
// interfaces they declare (Map, Frontends): the facade passes its bpf
// maps; the tests pass fakes and need no root. They never call back into
// the facade beyond those interfaces.
package services
