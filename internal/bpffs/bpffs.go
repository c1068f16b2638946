// Package bpffs finds and mounts the BPF filesystem that pinned maps and
// programs live on. It works on Linux; elsewhere IsBPFFS and Ensure fail
// with an error wrapping errors.ErrUnsupported.
package bpffs

import "errors"

// DefaultRoot is where bpffs is conventionally mounted.
const DefaultRoot = "/sys/fs/bpf"

// ErrNotBPFFS reports a path that exists but is not on a BPF filesystem.
var ErrNotBPFFS = errors.New("not on a bpf filesystem")
