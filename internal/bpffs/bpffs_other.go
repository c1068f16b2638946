//go:build !linux

package bpffs

import (
	"errors"
	"fmt"
	"runtime"
)

var errNoBPFFS = fmt.Errorf("bpffs: there is no BPF filesystem on %s: %w", runtime.GOOS, errors.ErrUnsupported)

// IsBPFFS reports whether path lies on a mounted BPF filesystem: only
// Linux has one.
func IsBPFFS(path string) (bool, error) { return false, errNoBPFFS }

// Ensure mounts a BPF filesystem on Linux; elsewhere it fails.
func Ensure(root string) (mounted bool, err error) { return false, errNoBPFFS }

// MountNamespace reports nothing outside Linux.
func MountNamespace() Namespace { return Namespace{} }
