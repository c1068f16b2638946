//go:build !linux

package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// Elsewhere than on Linux there is no TC to attach to: these fail with an
// error matching errors.ErrUnsupported (as Open already does, the kernel
// being what loads BPF programs).

func attachClsBPF(index int, hook Hook, _ *ebpf.Program, _ string) (bool, error) {
	return false, fmt.Errorf("bpf: attach %s on %d (cls_bpf): %w", hook, index, errors.ErrUnsupported)
}

func ourClsFilterOf(index int, hook Hook, _ string) (bool, error) {
	return false, fmt.Errorf("bpf: attach %s on %d (cls_bpf): %w", hook, index, errors.ErrUnsupported)
}

func detachClsBPF(index int, hook Hook, name string) error {
	return fmt.Errorf("bpf: detach %s from %s (cls_bpf): %w", hook, name, errors.ErrUnsupported)
}

func clsBPFAttachments() ([]Attachment, error) { return nil, nil }

func removeClsBPF() error { return nil }
