// Package policy compiles FluxVM's identity-aware service policies.
//
// The ipcache (intent.IPCache: prefix -> identity, longest prefix wins)
// and the services' policies (intent.Policy) go into a Compiler, which
// checks everything, resolves each policy into the rules the datapath
// applies (the deny list wins over the allow list, then the default
// action) and returns a Program: deterministic for its input, applied to
// the datapath's maps as one reconcile. Identities a policy lists but the
// ipcache lacks are reported as unresolved, never dropped in silence.
//
// Identity 0 (intent.IdentityUnknown) is the identity of a source no
// ipcache prefix covers; policies cannot list it, their default action
// decides for it.
//
// Every compiled policy has a Revision that changes whenever anything
// deciding its flows changes, the ipcache included; the datapath keeps
// the revision a flow was admitted under and decides the flow again at
// its next packet when they differ, so a revoked identity loses its open
// connections too.
package policy
