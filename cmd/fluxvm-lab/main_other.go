//go:build !linux

// Command fluxvm-lab needs Linux: its lab is network namespaces, veth pairs
// and the real BPF datapath.
package main

import (
	"fmt"
	"os"
	"runtime"
)

func main() {
	fmt.Fprintf(os.Stderr, "fluxvm-lab: needs Linux (network namespaces, veths, eBPF); this is %s\n", runtime.GOOS)
	os.Exit(1)
}
