// Package idpool hands out the datapath's small integer ids (service and
// backend ids) and holds a released id in quarantine until a conntrack GC
// has scanned the flows that may still name it (Pool).
//
// A Pool belongs to the services component (fluxvm/internal/services),
// and the facade's GC releases its quarantine: both with the dataplane's
// lock held. It has no lock of its own and starts no goroutine.
package idpool
