// Package ethtool reads and sets the offload features of a network
// interface, what `ethtool -k` shows and `ethtool -K` changes, by the
// kernel's ethtool ioctl, without the ethtool binary. Features are named
// as the kernel names them ("rx-vlan-hw-parse", "tx-checksum-ip-generic",
// ...), not by ethtool's short aliases ("rxvlan", "tx").
//
// It works on Linux, in the calling thread's network namespace; elsewhere
// every call fails with an error wrapping errors.ErrUnsupported.
package ethtool

import "errors"

// Feature is the state of one feature of an interface.
type Feature struct {
	// Active: the feature is in force.
	Active bool
	// Requested: it was asked for (ethtool -K); a requested feature
	// may stay inactive while another one it depends on is off.
	Requested bool
	// Fixed: the driver cannot change it ("[fixed]" in ethtool -k).
	Fixed bool
}

// ErrUnknownFeature reports a feature name the interface's kernel does
// not know.
var ErrUnknownFeature = errors.New("unknown feature")
