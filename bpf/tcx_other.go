//go:build !linux

package bpf

// HaveTCX reports whether the kernel attaches TC programs by TCX links:
// never off Linux.
func HaveTCX() bool { return false }
