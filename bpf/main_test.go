package bpf

import (
	"os"
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/cgtest"
)

// TestMain lets cgtest run this test binary as the socket-driving child
// of the socket LB tests (sock_test.go), and TestPinRootUnderIPNetnsExec
// run it as the child it starts under `ip netns exec` (bpffs_test.go).
func TestMain(m *testing.M) {
	if mode := os.Getenv(pinRootChildEnv); mode != "" {
		os.Exit(pinRootChild(mode))
	}
	cgtest.Main(m)
}
