package bpf

import (
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/cgtest"
)

// TestMain lets cgtest run this test binary as the socket-driving child
// of the socket LB tests (sock_test.go).
func TestMain(m *testing.M) { cgtest.Main(m) }
