// Package bpffs finds and mounts the BPF filesystem that pinned maps and
// programs live on. It works on Linux; elsewhere IsBPFFS and Ensure fail
// with an error wrapping errors.ErrUnsupported.
package bpffs

import "errors"

// DefaultRoot is where bpffs is conventionally mounted.
const DefaultRoot = "/sys/fs/bpf"

// ErrNotBPFFS reports a path that exists but is not on a BPF filesystem.
var ErrNotBPFFS = errors.New("not on a bpf filesystem")

// Namespace says how the calling thread's mount namespace relates to the
// host's (PID 1's), for the advice of an error or a warning about a
// missing BPF filesystem.
type Namespace struct {
	// Private: the thread runs in a mount namespace that is not PID 1's.
	// A BPF filesystem mounted there, and every pin under it, vanishes
	// when the last process in it exits. False also when it cannot be
	// told (PID 1's namespace unreadable).
	Private bool
	// IPNetnsExec: Private, and /sys is another sysfs than PID 1's: what
	// `ip netns exec` does (a private mount namespace, /sys mounted again
	// for the network namespace), which hides the host's /sys/fs/bpf.
	IPNetnsExec bool
	// NetNS is the name under /run/netns of the thread's network
	// namespace, when one names it.
	NetNS string
}
