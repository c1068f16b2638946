//go:build !linux

package bpf

import "errors"

// Elsewhere than on Linux there is no XDP (see cls_other.go).
func xdpOnInterface(int) (uint32, XDPMode, error) { return 0, XDPOff, errors.ErrUnsupported }
