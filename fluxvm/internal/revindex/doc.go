// Package revindex is the reverse translation index of the fluxvm
// dataplane: which frontends list each backend endpoint in fluxvm_be2fe,
// in a stable slot order, and which frontends are past the map's slots
// and so need SvcFlagRevStored in their frontend entries (index.go has
// the rules; docs/architecture.md, "Reverse translation index").
//
// Index is a data structure of the services component
// (fluxvm/internal/services), which calls it with the dataplane's lock
// held: it has no lock of its own, starts no goroutine, and needs no
// Start or Close. What it writes goes through the small interfaces it
// declares (Map, Frontends); the services component passes the loaded
// datapath's maps, the tests pass fakes and need no root.
package revindex
